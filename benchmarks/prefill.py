"""Attention of whole fresh prompts: kvpage's AMX kernel (prefill_attention) vs torch's SDPA as the engine
called it before (one call per prompt, enable_gqa, the qkv views as they are).

SmolLM2's shape (9 query heads over 3 KV heads, head size 64), bf16, one prompt per call at each length and
one call for a step's worth of ShareGPT-like prompts (lognormal lengths, median ~160, capped at 1024, as in
benchmarks/throughput.py); medians of alternating rounds.

    python benchmarks/prefill.py [--lengths 64 160 220 400 1000] [--rounds 15]
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import random
import statistics
import time

import torch
import torch.nn.functional as F

from kvpage.attention.backends.cpu_kernels import load_kernels

HEADS, KV_HEADS, D = 9, 3, 64


def views(total: int, seed: int):
    qkv = torch.randn(total, (HEADS + 2 * KV_HEADS) * D, generator=torch.Generator().manual_seed(seed)).bfloat16()
    q = qkv[:, : HEADS * D].view(total, HEADS, D)
    k = qkv[:, HEADS * D : (HEADS + KV_HEADS) * D].view(total, KV_HEADS, D)
    v = qkv[:, (HEADS + KV_HEADS) * D :].view(total, KV_HEADS, D)
    return q, k, v


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[64, 160, 220, 400, 1000])
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    ops = load_kernels()
    if ops is None or not ops.prefill_amx_available():
        raise SystemExit("needs the compiled kernels and AMX tile products (CPU with AMX-BF16, Linux >= 5.16)")
    rng = random.Random(0)
    step = []  # one step's prompts, up to 2048 tokens (the engine's max_num_batched_tokens)
    while True:
        n = min(1024, max(64, int(math.exp(rng.gauss(math.log(160), 0.8)))))
        if sum(step) + n > 2048:
            break
        step.append(n)
    cases = [(f"{n}", [n]) for n in args.lengths] + [(f"step of {len(step)} prompts ({sum(step)} tokens)", step)]
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; {HEADS} query heads / {KV_HEADS} KV heads, head size {D}, bf16")
    print("| prompt tokens | SDPA per prompt (us) | prefill_attention (us) | SDPA / kvpage | kvpage TFLOP/s |")
    print("|---|---:|---:|---:|---:|")
    for name, lengths in cases:
        starts = [sum(lengths[:i]) for i in range(len(lengths))]
        q, k, v = views(sum(lengths), seed=len(lengths))
        out = torch.empty(q.shape, dtype=torch.bfloat16)

        def sdpa(q=q, k=k, v=v, out=out, starts=starts, lengths=lengths) -> float:
            t = time.perf_counter()
            for s, n in zip(starts, lengths, strict=True):
                qs, ks, vs = (x[s : s + n].transpose(0, 1)[None] for x in (q, k, v))
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=D**-0.5, enable_gqa=True)
                out[s : s + n] = o[0].transpose(0, 1)
            return time.perf_counter() - t

        def amx(q=q, k=k, v=v, out=out, starts=starts, lengths=lengths) -> float:
            t = time.perf_counter()
            ops.prefill_attention(q, k, v, out, starts, lengths, D**-0.5)
            return time.perf_counter() - t

        for _ in range(3):
            sdpa(), amx()
        a_times, b_times = [], []
        for _ in range(args.rounds):
            a_times.append(sdpa())
            b_times.append(amx())
        a, b = statistics.median(a_times), statistics.median(b_times)
        flops = sum(2 * 2 * HEADS * D * n * (n + 1) / 2 for n in lengths)  # causal q.k and p.v
        print(f"| {name} | {a * 1e6:.0f} | {b * 1e6:.0f} | {a / b:.2f}x | {flops / b / 1e12:.2f} |", flush=True)


if __name__ == "__main__":
    main()
