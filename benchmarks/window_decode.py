"""One sliding-window layer's paged decode attention in Gemma 3's shape (4 query / 1 KV head of 256, window
512): the bf16 cache as rows (the AVX-512 row loop), packed on the AVX-512 loop, and packed on AMX tiles
(where the CPU and OS grant them), side by side in one process on the same keys and values, scattered over
randomly permuted 16-token blocks; medians of --reps calls, and the KV read speed of each.

    python benchmarks/window_decode.py [--batch 256] [--context 600] [--window 512] [--reps 30]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from kvpage.ops import load_kernels, pack_kv_rows
from kvpage.worker.kv_cache import as_block_major


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=600)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    ops = load_kernels()
    if ops is None or not ops.has_packed_layout():
        raise SystemExit("needs the compiled kernels with the packed bf16 layout (AVX512-BF16)")
    torch.manual_seed(0)
    b, ctx, bs, hq, hkv, d = args.batch, args.context, 16, 4, 1, 256
    nblk = -(-ctx // bs)
    cache = torch.randn(2, b * nblk + 1, bs, hkv, d).bfloat16()
    tables = (torch.randperm(b * nblk) + 1).view(b, nblk)
    q = torch.randn(b, hq, d).bfloat16()
    qsl, lens = torch.arange(b + 1), torch.full((b,), ctx)
    plan = ops.plan_attention(tables, qsl, lens, hq, cache.shape[1], bs, 512, True, args.window)
    caches = {"rows": (as_block_major(cache), False, True), "packed, AVX-512": (as_block_major(pack_kv_rows(cache)),
              True, False), "packed, AMX": (as_block_major(pack_kv_rows(cache)), True, True)}
    read = b * min(ctx, args.window + bs) * hkv * d * 2 * 2  # bytes of K and V the window covers
    print(f"machine: {platform.machine()}; {b} sequences x {ctx} keys, window {args.window}, heads {hq}/{hkv} of {d}")
    ref = None
    for name, (c, packed, amx) in caches.items():
        def call(c=c, packed=packed, amx=amx):
            return ops.paged_attention_planned(q, c, plan, d**-0.5, packed, amx, False)
        out = call()
        ref = out if ref is None else ref
        assert (out.float() - ref.float()).abs().max() < 2e-2, f"{name} disagrees with rows"
        ts = []
        for _ in range(args.reps):
            t = time.perf_counter()
            call()
            ts.append(time.perf_counter() - t)
        ms = statistics.median(ts) * 1e3
        print(f"  {name:16s} {ops.last_decode_kernel():14s} {ms:8.3f} ms  {read / ms / 1e6:6.1f} GB/s")


if __name__ == "__main__":
    main()
