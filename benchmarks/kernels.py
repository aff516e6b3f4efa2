"""Fused paged decode attention vs contiguous SDPA on the same keys and values.

For each (batch, context): the K/V of every sequence is laid out twice, contiguously for
torch.nn.functional.scaled_dot_product_attention and scattered over randomly permuted 16-token blocks for
kvpage's paged kernel (in the KV layout the engine uses here, packed where the CPU has AVX512-BF16; --layout
picks one); one query token per sequence (decode), SmolLM2's shape (9 query heads, 3 KV heads,
head dim 64), in the engine's dtype here (--dtype: bf16 with AVX512_BF16, else float32). Reported: median
time of each, their ratio (target: paged <= 1.05x contiguous), and the effective KV read bandwidth next to
this machine's measured copy bandwidth. --kv-dtype gives the paged cache a dtype apart from the queries' (a
16-bit cache under float32 queries, as `--kv-cache-dtype` does in the engine); each side's GB/s then counts
the bytes it reads (SDPA reads the same rounded values in the query dtype).

    python benchmarks/kernels.py [--batches 1 16 64 256] [--contexts 128 1024 8192] [--threads N]
                                 [--dtype auto|bfloat16|float32] [--kv-dtype same|bfloat16|float16|float32]
                                 [--vllm-python <venv>/bin/python [--vllm-block-size 128]] [--fold-blocks N]

With --vllm-python (or $KVPAGE_VLLM_PYTHON), vLLM CPU's own paged decode op runs the same shapes in that
interpreter, in the same invocation (benchmarks/_vllm_attention.py: its cache layout, its block size, blocks
permuted alike), and the table gains its time, bandwidth and kvpage/vLLM ratio. A missing vLLM is reported as
skipped.

Small shapes stay in L2 between repetitions; large ones stream from memory. ``--threads 1`` separates what
one core can do from what the memory system gives both.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
from pathlib import Path

import torch
import torch.nn.functional as F

from _common import median_seconds
from kvpage.attention.backends.cpu import CpuPagedAttention
from kvpage.config import resolve_dtype
from kvpage.ops import PARTITION_SIZE, kernels, load_kernels, pack_kv_rows
from kvpage.worker.kv_cache import as_block_major


def median_ms(fn, reps: int) -> float:
    return median_seconds(fn, reps) * 1e3


def copy_bandwidth_gbs() -> float:
    a = torch.ones(256 * 1024 * 1024 // 4)
    b = torch.empty_like(a)
    ms = median_ms(lambda: b.copy_(a), 5)
    return 2 * a.numel() * 4 / (ms / 1e3) / 1e9


def read_bandwidth_gbs() -> float:
    """A plain float32 sum over 2 GiB: what streaming reads reach on this machine now."""
    a = torch.ones(512 * 1024 * 1024)
    ms = median_ms(a.sum, 3)
    return a.numel() * 4 / (ms / 1e3) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 1024, 8192])
    ap.add_argument("--max-kv-gib", type=float, default=3.0, help="skip cases whose K/V would exceed this")
    ap.add_argument("--threads", type=int, default=None, help="torch / OpenMP threads (default: all cores)")
    ap.add_argument("--layout", choices=["engine", "packed", "rows"], default="engine",
                    help="kvpage's bf16 KV layout: the one the engine uses here (default), or either")
    ap.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto",
                    help="Q/K/V dtype (auto: the engine's here, bf16 with AVX512_BF16, else float32)")
    ap.add_argument("--kv-dtype", choices=["same", "bfloat16", "float16", "float32"], default="same",
                    help="the paged cache's dtype apart from the queries' (same: --dtype); SDPA reads the same "
                         "rounded K/V in the query dtype")
    ap.add_argument("--vllm-python", default=os.environ.get("KVPAGE_VLLM_PYTHON"),
                    help="a Python with vLLM's CPU build: time its paged decode op on the same shapes")
    ap.add_argument("--vllm-block-size", type=int, default=128,
                    help="vLLM's block size (its CPU engine's default here; AMX needs a multiple of 32)")
    ap.add_argument("--fold-blocks", type=int, default=0,
                    help="also time the paged kernel with every block id folded into the first N (in cache)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ops = load_kernels()
    if ops is None:
        raise SystemExit("compiled kernels unavailable on this machine")
    hq, hkv, d, bs = 9, 3, 64, 16
    dtype = getattr(torch, resolve_dtype(args.dtype))
    kv_dtype = dtype if args.kv_dtype == "same" else getattr(torch, args.kv_dtype)
    esize, dense_esize = torch.finfo(kv_dtype).bits // 8, torch.finfo(dtype).bits // 8
    probe = torch.zeros(2, 1, bs, hkv, d, dtype=kv_dtype)
    packed = CpuPagedAttention(kernels()).packed_layout(probe, dtype) if args.layout == "engine" else (
        args.layout == "packed")
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}; "
          f"copy bandwidth {copy_bandwidth_gbs():.1f} GB/s (read+write), "
          f"read bandwidth {read_bandwidth_gbs():.1f} GB/s (2 GiB sum); kvpage KV layout: "
          f"{'packed' if packed else 'rows'}, {kv_dtype} cache, {dtype} queries")
    cases = [(b, ctx) for b in args.batches for ctx in args.contexts
             if 2 * b * ctx * hkv * d * esize <= args.max_kv_gib * 2**30]
    vllm = (run_vllm(args.vllm_python, cases, args.vllm_block_size, (hq, hkv, d), torch.get_num_threads())
            if dtype == kv_dtype == torch.bfloat16 else "its op is timed in bf16 only")
    if isinstance(vllm, str):
        print(f"vLLM: skipped ({vllm})")
        vllm = {}
    else:
        print(f"vLLM: its CPU paged decode op (isa {vllm.pop('isa')}), block size {args.vllm_block_size}")
    header = (f"{'batch':>5} {'context':>7} {'paged ms':>9} {'SDPA ms':>8} {'paged/SDPA':>10} {'paged GB/s':>10} "
              f"{'SDPA GB/s':>9}")
    print(header + (f" {'vLLM ms':>8} {'vLLM GB/s':>9} {'paged/vLLM':>10}" if vllm else "")
          + (f" {'folded ms':>9}" if args.fold_blocks else ""))
    for b in args.batches:
        for ctx in args.contexts:
            kv_bytes = 2 * b * ctx * hkv * d * esize
            if (b, ctx) not in cases:
                print(f"{b:>5} {ctx:>7}  skipped (K/V {kv_bytes / 2**30:.1f} GiB > --max-kv-gib)")
                continue
            paged, dense, folded = run_case(ops, b, ctx, hq, hkv, d, bs, 20 if kv_bytes < 2**28 else 5, packed,
                                            dtype, kv_dtype, args.fold_blocks)
            dense_bytes = kv_bytes // esize * dense_esize
            line = (f"{b:>5} {ctx:>7} {paged:9.3f} {dense:8.3f} {paged / dense:10.2f} "
                    f"{kv_bytes / paged / 1e6:10.1f} {dense_bytes / dense / 1e6:9.1f}")
            if (b, ctx) in vllm:
                peer = vllm[(b, ctx)]
                line += f" {peer:8.3f} {kv_bytes / peer / 1e6:9.1f} {paged / peer:10.2f}"
            if folded is not None:
                line += f" {folded:9.3f}"
            print(line)


def run_vllm(python: str | None, cases: list[tuple[int, int]], block_size: int, heads: tuple[int, int, int],
             threads: int) -> dict | str:
    """{(batch, context): median ms, "isa": ...} from vLLM's op in its own interpreter, or why it did not run."""
    if not python:
        return "no --vllm-python / $KVPAGE_VLLM_PYTHON given"
    if not Path(python).exists():
        return f"{python} does not exist"
    job = json.dumps({"cases": cases, "block_size": block_size, "heads": list(heads), "threads": threads})
    script = Path(__file__).resolve().parent / "_vllm_attention.py"
    # -I: the script directory holds a kernels.py, which transformers (imported by vLLM) would take for the
    # "kernels" package
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0-1"}
    proc = subprocess.run([python, "-I", str(script)], input=job, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        return f"vLLM's op failed: {proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else proc.returncode}"
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"isa": out["isa"], **{(b, ctx): ms for b, ctx, ms in out["results"]}}


def run_case(ops, b: int, ctx: int, hq: int, hkv: int, d: int, bs: int, reps: int,
             packed: bool, dtype: torch.dtype = torch.bfloat16, kv_dtype: torch.dtype | None = None,
             fold: int = 0) -> tuple[float, float, float | None]:
    """Median ms of the paged kernel and of contiguous SDPA on the same K/V (checked to agree), and with fold
    > 0 of the paged kernel with every block id folded into the first `fold` blocks (the same work on K/V that
    stays in cache). A kv_dtype other than dtype rounds K/V to it first; SDPA then reads those values in dtype."""
    kv_dtype = kv_dtype or dtype
    k = torch.randn(b, hkv, ctx, d).to(kv_dtype).to(dtype)
    v = torch.randn(b, hkv, ctx, d).to(kv_dtype).to(dtype)
    q = torch.randn(b, hq, 1, d).to(dtype)
    nblk = -(-ctx // bs)
    perm = torch.randperm(b * nblk)
    cache = torch.zeros(2, b * nblk, bs, hkv, d, dtype=kv_dtype)
    pad = nblk * bs - ctx
    for idx, src in ((0, k), (1, v)):
        cache[idx, perm] = F.pad(src.transpose(1, 2), (0, 0, 0, 0, 0, pad)).reshape(b * nblk, bs, hkv, d).to(kv_dtype)
    if packed:
        cache = pack_kv_rows(cache)
    cache = as_block_major(cache)  # the engine's storage order: a block's K and V adjacent
    tables = perm.view(b, nblk)
    qsl = torch.arange(b + 1)
    lens = torch.full((b,), ctx)
    qflat = q[:, :, 0, :].contiguous()

    def paged_call(tables=tables):
        return ops.paged_attention(qflat, cache, tables, qsl, lens, d**-0.5, PARTITION_SIZE, packed)

    def dense_call():
        return F.scaled_dot_product_attention(q, k, v, scale=d**-0.5, enable_gqa=True)

    assert (paged_call().float() - dense_call()[:, :, 0, :].float()).abs().max() < 5e-2, "paged != contiguous"
    folded = median_ms(lambda: paged_call(tables % fold), reps) if fold else None
    return median_ms(paged_call, reps), median_ms(dense_call, reps), folded

if __name__ == "__main__":
    main()
