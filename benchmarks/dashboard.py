"""What the dashboard costs the engine: one snapshot of the pool (kv/snapshot.py plus the engine's stats, taken on
the engine thread between two steps) against the step time, with 256 requests running.

    python benchmarks/dashboard.py [--requests 256] [--prompt 200] [--steps 30]

Target (issue #35): at 1 update per second a snapshot costs the engine < 1% of its time, i.e. it takes < 10 ms;
the live page asks for 4 per second while someone watches (none when nobody does). JSON encoding happens on the
HTTP side (reported too). Also timed: the engine's full stats (``LLMEngine.stats``, which walks every block table)
against ``LLMEngine.live_stats``, what the server publishes after every step (docs/serve.md).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import cpu_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--prompt", type=int, default=200)
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args()
    from kvpage.engine.arg_utils import EngineArgs
    from kvpage.engine.llm_engine import LLMEngine
    from kvpage.sampling_params import SamplingParams

    eng = LLMEngine(EngineArgs(model=args.model, max_num_seqs=args.requests, max_model_len=2048))
    rng = random.Random(0)
    sp = SamplingParams(max_tokens=10_000 // 8, temperature=1.0, ignore_eos=True)
    for i in range(args.requests):
        eng.add_request(f"r{i}", [rng.randrange(1000, 40000) for _ in range(args.prompt)], sp)
    while len(eng.scheduler.waiting) or any(s.num_uncomputed > 1 for s in eng.scheduler.running.items):
        eng.step()
    steps, snaps, encode, full, live = [], [], [], [], []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        eng.step()
        steps.append(time.perf_counter() - t0)
        for fn, times in ((eng.stats, full), (eng.live_stats, live)):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        frame = eng.pool_snapshot()
        snaps.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        json.dumps(frame, separators=(",", ":"))
        encode.append(time.perf_counter() - t0)
    step, snap, enc, full_ms, live_ms = (1000 * statistics.median(x) for x in (steps, snaps, encode, full, live))
    running = len(eng.scheduler.running)
    print(f"{cpu_model()}; {args.model}; {running} running, {eng.kv.num_blocks} blocks in the pool, "
          f"{eng.stats()['kv_blocks_used']} in use")
    print(f"step {step:.1f} ms (median of {args.steps}); snapshot {snap:.2f} ms on the engine thread; "
          f"JSON {enc:.2f} ms on the HTTP side ({len(json.dumps(frame)) / 1024:.0f} KiB)")
    print(f"engine time spent on snapshots: {snap / 10:.2f}% at 1 update/s, {4 * snap / 10:.2f}% at the page's "
          f"4 updates/s; one snapshot = {100 * snap / step:.1f}% of one step")
    print(f"full stats {full_ms:.3f} ms ({100 * full_ms / step:.2f}% of a step), live stats {1000 * live_ms:.1f} us")


if __name__ == "__main__":
    main()
