"""Where kvpage's time goes on a throughput workload: cProfile over one `LLM.generate` of benchmarks/throughput.py's
requests (same engine settings), the top entries by own time.

    python benchmarks/profile_step.py [--workload sharegpt|chat64|single] [--top 25]

``single`` is latency.py's case: one stream decoding 256 tokens after a short chat prompt.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

from kvpage.engine.llm import LLM
from kvpage.sampling_params import SamplingParams
from throughput import build_workload


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="sharegpt", choices=["sharegpt", "chat64", "single"])
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--sort", default="tottime", choices=["tottime", "cumulative"])
    args = ap.parse_args()
    reqs = build_workload("chat64" if args.workload == "single" else args.workload)
    if args.workload == "single":
        reqs = [dict(reqs[0], max_tokens=256)]
    llm = LLM(kv_cache_memory="4GiB", max_model_len=2048, max_num_seqs=256, max_num_batched_tokens=2048,
              kv_prefault=True)
    llm.generate([reqs[0]["prompt_token_ids"]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    params = [SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=True) for r in reqs]
    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    outs = llm.generate([{"prompt_token_ids": r["prompt_token_ids"]} for r in reqs], params, use_tqdm=False)
    prof.disable()
    dt = time.perf_counter() - t
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"{args.workload}: {tokens} tokens in {dt:.1f} s = {tokens / dt:.1f} tok/s under the profiler, "
          f"{llm.engine.num_steps} steps")
    pstats.Stats(prof).sort_stats(args.sort).print_stats(args.top)


if __name__ == "__main__":
    main()
