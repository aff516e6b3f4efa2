"""Attention of whole fresh prompts: kvpage's kernel vs torch's SDPA as the engine called it before (one call
per prompt, enable_gqa, the qkv views as they are). kvpage's kernel is the AMX prompt kernel
(prefill_attention) where the CPU has AMX, else the paged kernel over the bf16 cache that the step has just
written, in the engine's layout here (packed on Intel CPUs, rows on AMD's: KVPAGE_KV_LAYOUT; paged_attention;
the write is not timed, the engine makes it on either path).

SmolLM2's shape (9 query heads over 3 KV heads, head size 64), bf16 (--dtype float32: float32 queries over a
float32 row cache, what AVX2-only CPUs run; the paged kernel, whatever the CPU), one prompt per call at each length and
one call for a step's worth of ShareGPT-like prompts (lognormal lengths, median ~160, capped at 1024, as in
benchmarks/throughput.py); medians of alternating rounds.

Second table (AMX CPUs): prompt chunks after cached keys (a prefix-cache hit, or the later chunks of a chunked
prefill), their keys in the packed paged cache (16-token blocks, randomly placed): the paged kernel
(paged_attention, which served them before) vs the prompt kernel reading the cache (prefill_attention_paged);
with --window W both under a sliding window of W positions (Gemma 3's local layers: --gemma --window 512).

    python benchmarks/prefill.py [--lengths 64 160 220 400 1000] [--rounds 15] [--gemma] [--window W]
                                 [--dtype bfloat16|float32]
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import platform
import random
import time

import torch
import torch.nn.functional as F

from _common import alternating_medians
from kvpage.ops import PARTITION_SIZE, load_kernels, pack_kv_rows
from kvpage.ops.kernels import kernels
from kvpage.worker.kv_cache import as_block_major

HEADS, KV_HEADS, D = 9, 3, 64


def views(total: int, seed: int, dtype: torch.dtype = torch.bfloat16):
    qkv = torch.randn(total, (HEADS + 2 * KV_HEADS) * D, generator=torch.Generator().manual_seed(seed)).to(dtype)
    q = qkv[:, : HEADS * D].view(total, HEADS, D)
    k = qkv[:, HEADS * D : (HEADS + KV_HEADS) * D].view(total, KV_HEADS, D)
    v = qkv[:, (HEADS + KV_HEADS) * D :].view(total, KV_HEADS, D)
    return q, k, v


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[64, 160, 220, 400, 1000])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--gemma", action="store_true", help="Gemma 3's shape instead: 4 query heads / 1 KV head of "
                    "size 256")
    ap.add_argument("--window", type=int, default=0, help="a sliding window for the chunks after cached keys")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="queries and cache: float32 is what AVX2-only CPUs run (the paged kernel over float32 rows)")
    args = ap.parse_args()
    global HEADS, KV_HEADS, D
    if args.gemma:
        HEADS, KV_HEADS, D = 4, 1, 256
    bf16 = args.dtype == "bfloat16"
    ops = load_kernels()
    if ops is None:
        raise SystemExit("needs the compiled kernels")
    if bf16 and not (ops.prefill_amx_available() or ops.has_packed_layout()):
        raise SystemExit("bf16 needs the compiled kernels with AMX tile products or the packed bf16 layout "
                         "(--dtype float32 runs anywhere)")
    amx = bf16 and ops.prefill_amx_available()
    packed = bf16 and kernels().packed_layout  # the engine's layout here (rows on AMD CPUs)
    rng = random.Random(0)
    step = []  # one step's prompts, up to 2048 tokens (the engine's max_num_batched_tokens)
    while True:
        n = min(1024, max(64, int(math.exp(rng.gauss(math.log(160), 0.8)))))
        if sum(step) + n > 2048:
            break
        step.append(n)
    cases = [(f"{n}", [n]) for n in args.lengths] + [(f"step of {len(step)} prompts ({sum(step)} tokens)", step)]
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; {HEADS} query heads / {KV_HEADS} KV heads, head size {D}, {args.dtype}")
    kernel = "prefill_attention (AMX)" if amx else f"paged_attention ({'packed' if packed else 'row'} cache)"
    print(f"| prompt tokens | SDPA per prompt (us) | {kernel} (us) | SDPA / kvpage | kvpage TFLOP/s |")
    print("|---|---:|---:|---:|---:|")
    for name, lengths in cases:
        starts = [sum(lengths[:i]) for i in range(len(lengths))]
        q, k, v = views(sum(lengths), seed=len(lengths), dtype=getattr(torch, args.dtype))
        out = torch.empty_like(q)
        paged = None if amx else paged_prompts(k, v, lengths, packed)

        def sdpa(q=q, k=k, v=v, out=out, starts=starts, lengths=lengths) -> float:
            t = time.perf_counter()
            for s, n in zip(starts, lengths, strict=True):
                qs, ks, vs = (x[s : s + n].transpose(0, 1)[None] for x in (q, k, v))
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=D**-0.5, enable_gqa=True)
                out[s : s + n] = o[0].transpose(0, 1)
            return time.perf_counter() - t

        def kvpage(q=q, k=k, v=v, out=out, starts=starts, lengths=lengths, paged=paged) -> float:
            t = time.perf_counter()
            if paged is None:
                ops.prefill_attention(q, k, v, out, starts, lengths, D**-0.5)
            else:
                ops.paged_attention(q, *paged, D**-0.5, PARTITION_SIZE, packed)
            return time.perf_counter() - t

        a, b = alternating_medians(sdpa, kvpage, args.rounds, warmup=3)
        flops = sum(2 * 2 * HEADS * D * n * (n + 1) / 2 for n in lengths)  # causal q.k and p.v
        print(f"| {name} | {a * 1e6:.0f} | {b * 1e6:.0f} | {a / b:.2f}x | {flops / b / 1e12:.2f} |", flush=True)
    if amx:
        chunks_after_cached_keys(ops, args.rounds, args.window)


def paged_prompts(k: torch.Tensor, v: torch.Tensor, lengths: list[int], packed: bool, bs: int = 16):
    """The prompts' keys and values in a paged cache (16-token blocks, randomly placed; packed or rows), with
    the block tables, query starts and lengths that paged_attention takes for them."""
    per = [-(-n // bs) for n in lengths]
    perm = torch.randperm(sum(per), generator=torch.Generator().manual_seed(1))
    rows = torch.zeros(2, sum(per), bs, KV_HEADS, D, dtype=k.dtype)
    tables = torch.zeros(len(lengths), max(per), dtype=torch.int64)
    b = s = 0
    for i, (n, nb) in enumerate(zip(lengths, per, strict=True)):
        ids = perm[b : b + nb]
        flat = torch.zeros(2, nb * bs, KV_HEADS, D, dtype=k.dtype)
        flat[0, :n], flat[1, :n] = k[s : s + n], v[s : s + n]
        rows[:, ids] = flat.view(2, nb, bs, KV_HEADS, D)
        tables[i, :nb] = ids
        b, s = b + nb, s + n
    qsl = torch.tensor([0, *itertools.accumulate(lengths)])
    return as_block_major(pack_kv_rows(rows) if packed else rows), tables, qsl, torch.tensor(lengths)


def chunks_after_cached_keys(ops, rounds: int, window: int) -> None:
    print(f"\n{'window ' + str(window) if window else 'no window'}:")
    print("| cached keys | chunk tokens | paged_attention (us) | prefill_attention_paged (us) "
          "| paged / prompt kernel | prompt kernel TFLOP/s |")
    print("|---:|---:|---:|---:|---:|---:|")
    g = torch.Generator().manual_seed(0)
    for cached, n in [(500, 8), (500, 16), (2000, 16), (500, 64), (160, 160), (1000, 200), (249, 725), (2048, 2048)]:
        ctx, bs = cached + n, 16
        nblk = -(-ctx // bs)
        perm = torch.randperm(nblk, generator=g)
        rows = torch.randn(2, nblk, bs, KV_HEADS, D, generator=g).bfloat16()
        cache = torch.empty_like(rows)
        cache[:, perm] = rows
        cache = as_block_major(pack_kv_rows(cache))  # the engine's storage order
        table = perm.view(1, nblk)
        q = torch.randn(n, HEADS, D, generator=g).bfloat16()
        out = torch.empty_like(q)
        qsl, lens = torch.tensor([0, n]), torch.tensor([ctx])
        plan = ops.plan_attention(table, qsl, lens, HEADS, nblk, bs, PARTITION_SIZE, True, window)

        def paged(q=q, cache=cache, plan=plan) -> float:
            t = time.perf_counter()
            ops.paged_attention_planned(q, cache, plan, D**-0.5, True, True, False)
            return time.perf_counter() - t

        def prompt(q=q, cache=cache, table=table, out=out, n=n, ctx=ctx) -> float:
            t = time.perf_counter()
            ops.prefill_attention_paged(q, cache, table, out, [0], [n], [ctx], [0], D**-0.5, 64 << 20, window)
            return time.perf_counter() - t

        a, b = alternating_medians(paged, prompt, rounds, warmup=2)
        seen = sum(min(cached + r + 1, window or ctx) for r in range(n))  # keys each query row sees
        flops = 2 * 2 * HEADS * D * seen
        print(f"| {cached} | {n} | {a * 1e6:.0f} | {b * 1e6:.0f} | {a / b:.2f}x | {flops / b / 1e12:.2f} |", flush=True)


if __name__ == "__main__":
    main()
