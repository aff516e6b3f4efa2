"""What batch-invariant attention (KVPAGE_BATCH_INVARIANT) costs, side by side in one process.

Decode: one layer's paged attention over float32 rows (SmolLM2's 9 query / 3 KV heads, head size 64, 16-token
blocks) under the invariant plan (every context cut at 512 keys, short ones never cut over the threads) and
the batch-chosen one. Prompts: a whole fresh float32 prompt on the paged kernel (what the invariant backend
sends there) against torch's SDPA (what it took before). Medians of alternating rounds.

    python benchmarks/batch_invariance.py [--rounds 21]
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kvpage.envs import KernelConfig
from kvpage.ops import kernels

H, KVH, D, BS = 9, 3, 64, 16


def timed(fns: dict, rounds: int) -> dict[str, float]:
    ts: dict[str, list[float]] = {n: [] for n in fns}
    for _ in range(rounds):
        for n, f in fns.items():
            t = time.perf_counter()
            f()
            ts[n].append(time.perf_counter() - t)
    return {n: statistics.median(v) * 1e3 for n, v in ts.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=21)
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.helpers.kernels import scatter_tables

    inv, var = kernels(KernelConfig(batch_invariant="1")), kernels(KernelConfig(batch_invariant="0"))
    if inv is None:
        raise SystemExit("needs the compiled kernels")
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} threads")
    print("| decode | invariant (ms) | batch-chosen (ms) | ratio |\n|---|---:|---:|---:|")
    for seqs, ctx in ((1, 300), (1, 480), (16, 1024), (64, 2048), (64, 8192)):
        t = decode_case(inv, var, scatter_tables, seqs, ctx, args.rounds)
        print(f"| {seqs} x {ctx} keys | {t['inv']:.3f} | {t['var']:.3f} | {t['inv'] / t['var']:.2f}x |")
    print("\n| fresh prompt | paged kernel (ms) | SDPA (ms) | ratio |\n|---|---:|---:|---:|")
    for n in (64, 128, 256, 512, 1000):
        t = prompt_case(inv, n, args.rounds)
        print(f"| {n} tokens | {t['paged']:.3f} | {t['sdpa']:.3f} | {t['paged'] / t['sdpa']:.2f}x |")


def decode_case(inv, var, scatter_tables, seqs: int, ctx: int, rounds: int) -> dict[str, float]:
    blocks = [-(-ctx // BS)] * seqs
    tables = scatter_tables(random.Random(0), blocks, list(range(sum(blocks))))
    cache = torch.randn(2, sum(blocks), BS, KVH, D)
    q = torch.randn(seqs, H, D)
    qsl, lens = torch.arange(seqs + 1), torch.full((seqs,), ctx)
    p_inv = inv.plan_attention(tables, qsl, lens, H, cache.shape[1], BS)
    p_var = var.plan_attention(tables, qsl, lens, H, cache.shape[1], BS)
    return timed({"inv": lambda: inv.paged_attention(q, cache, p_inv, 0.125, False),
                  "var": lambda: var.paged_attention(q, cache, p_var, 0.125, False)}, rounds)


def prompt_case(inv, n: int, rounds: int) -> dict[str, float]:
    q, k, v = torch.randn(n, H, D), torch.randn(n, KVH, D), torch.randn(n, KVH, D)
    nb = -(-n // BS)
    cache = torch.zeros(2, nb, BS, KVH, D)
    cache.view(2, -1, KVH, D)[0, :n], cache.view(2, -1, KVH, D)[1, :n] = k, v
    plan = inv.plan_attention(torch.arange(nb)[None], torch.tensor([0, n]), torch.tensor([n]), H, nb, BS)
    qh, kh, vh = (t.transpose(0, 1)[None] for t in (q, k, v))
    return timed({"paged": lambda: inv.paged_attention(q, cache, plan, 0.125, False),
                  "sdpa": lambda: F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=0.125,
                                                                 enable_gqa=True)}, rounds)

if __name__ == "__main__":
    main()
