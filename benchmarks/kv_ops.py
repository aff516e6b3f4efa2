"""Cost of one scheduling step's KV bookkeeping: N running sequences each append one token.

With prompt lengths spread uniformly, ~1/block_size of the sequences cross a block boundary each step
(1/16 at the default), taking a new block and registering the block they just filled in the prefix cache.
One step = ``allocate_slots(seq, 1)`` for every sequence (the scheduler) + ``cache_computed_blocks(seq)``
(the update after the forward pass). ``--with-slot-mapping`` adds building each token's slot, which the
model runner does.

Target (issue #2): under 1 ms per step for 256 sequences on the 2-core dev machine.

    python benchmarks/kv_ops.py [--seqs 256] [--steps 2000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import time

from _common import cpu_model
from kvpage.kv import KVCacheManager, KVSequence, make_kv_manager


def build(policy: str, num_seqs: int, steps: int, block_size: int, caching: bool, seed: int = 0):
    rng = random.Random(seed)
    prompts = [rng.randint(64, 1024) for _ in range(num_seqs)]
    max_len = max(prompts) + steps + 1
    per_seq = -(-max_len // block_size)
    m: KVCacheManager = make_kv_manager(
        policy, num_seqs * per_seq + 16, block_size, max_model_len=max_len, watermark=0.0,
        enable_prefix_caching=caching,
    )
    seqs = []
    for i, n in enumerate(prompts):
        s = KVSequence(f"s{i}", [rng.randrange(50_000) for _ in range(n)])
        assert m.allocate_slots(s, n) is not None
        m.cache_computed_blocks(s)
        seqs.append(s)
    return m, seqs, rng


def run_steps(m: KVCacheManager, seqs: list[KVSequence], steps: int, slot_mapping: bool,
              rng: random.Random) -> tuple[list[float], int]:
    times = []
    crossings = 0
    bs = m.block_size
    for _ in range(steps):
        new_tokens = [rng.randrange(50_000) for _ in seqs]  # sampled outside the timed region
        t0 = time.perf_counter()
        for s, tok in zip(seqs, new_tokens, strict=True):
            s.token_ids.append(tok)
            if m.allocate_slots(s, 1) is None:
                raise RuntimeError("pool too small for the benchmark")
        if slot_mapping:
            for s in seqs:
                m.slot_mapping(s.seq_id, len(s.token_ids) - 1, 1)
        for s in seqs:
            m.cache_computed_blocks(s)
        times.append(time.perf_counter() - t0)
        crossings += sum(1 for s in seqs if len(s.token_ids) % bs == 1)
    return times, crossings


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5,
                    help="interleaved rounds; the median of round medians is reported")
    args = ap.parse_args()

    variants = [
        ("paged + prefix caching", "paged", True, False),
        ("paged, no prefix caching", "paged", False, False),
        ("paged + prefix caching + slot mapping", "paged", True, True),
        ("static reservation", "static", False, False),
    ]
    medians: dict[str, list[float]] = {v[0]: [] for v in variants}
    p90s: dict[str, list[float]] = {v[0]: [] for v in variants}
    cross_rate = 0.0
    for r in range(args.repeats):
        for name, policy, caching, slots in variants:  # interleaved so machine noise hits all alike
            m, seqs, rng = build(policy, args.seqs, args.steps, args.block_size, caching, seed=r)
            times, crossings = run_steps(m, seqs, args.steps, slots, rng)
            m.check_invariants()
            medians[name].append(statistics.median(times))
            p90s[name].append(statistics.quantiles(times, n=10)[-1])
            if name == variants[0][0]:
                cross_rate = crossings / (args.steps * args.seqs)

    print(f"machine: {cpu_model()} ({os.cpu_count()} cores), Python {platform.python_version()}, "
          f"{args.seqs} sequences, block size {args.block_size}, {args.steps} steps x {args.repeats} rounds")
    print(f"block-boundary crossings per sequence-step: {cross_rate:.4f} (1/{1 / cross_rate:.1f})")
    base = statistics.median(medians[variants[0][0]])
    print(f"{'variant':<40} {'median ms/step':>15} {'p90 ms/step':>12} {'vs first':>9}")
    for name, *_ in variants:
        med = statistics.median(medians[name])
        print(f"{name:<40} {med * 1e3:>15.3f} {statistics.median(p90s[name]) * 1e3:>12.3f} {med / base:>8.2f}x")
    verdict = "meets" if base < 1e-3 else "MISSES"
    print(f"target: < 1 ms per step for 256 sequences -> {verdict} ({base * 1e3:.3f} ms)")


if __name__ == "__main__":
    main()
