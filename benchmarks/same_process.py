"""kvpage against itself with other KV cache dtypes, in one process: whole `LLM.generate` runs of
benchmarks/throughput.py's workload (the same engine settings), one engine per cache dtype, alternating round by
round, the prefix cache emptied before each run so that every run computes its prompts as a fresh process does
(or, with ``--cached-prompts``, every prompt's full blocks left cached by a first pass: decode-heavy runs).

    python benchmarks/same_process.py --kv-dtypes bfloat16 int8 --rounds 3 [--ops] [--cached-prompts]

Why: throughput.py runs each engine in its own process, one after the other, and on a shared 2-core machine whole
runs of the same engine differ by 5-10% from one to the next; when two variants differ by less than that (int8
pages against bf16 pages where the float32 projections take most of a step) the order of the runs decides the
ratio. Here both engines stay loaded (about twice one engine's memory), each round runs every engine once in a
rotating order, and the ratio is taken round by round. ``--ops`` also times every compiled kernel call
(profile_step.py's wrapper) and prints each kernel's seconds per engine, summed over the rounds: which part
moved, with the drift spread over both.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from contextlib import nullcontext
from pathlib import Path

from kvpage.config import DEFAULT_MODEL
from kvpage.engine.llm import LLM
from kvpage.sampling_params import SamplingParams
from profile_step import timed_kernels
from throughput import CHATS, ENGINE_ARGS, SAMPLING, build_workload


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="sharegpt", choices=[*CHATS, "sharegpt", "essays64", "random256"])
    ap.add_argument("--model", default=None, help="kvpage's model (default: the embedded SmolLM2)")
    ap.add_argument("--kv-dtypes", nargs="+", default=["bfloat16", "int8"],
                    help="one engine per cache dtype; ratios are against the first")
    ap.add_argument("--sampling", default="greedy", choices=list(SAMPLING))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ops", action="store_true", help="also time every compiled kernel call")
    ap.add_argument("--cached-prompts", action="store_true",
                    help="keep the prompts' blocks cached (one untimed pass first): the runs are mostly decode")
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args()
    if len(set(args.kv_dtypes)) != len(args.kv_dtypes) or len(args.kv_dtypes) < 2:
        ap.error("--kv-dtypes takes two or more different dtypes")
    reqs = build_workload(args.workload, model=args.model)
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in reqs]
    params = [SamplingParams(max_tokens=r["max_tokens"], ignore_eos=True, **SAMPLING[args.sampling]) for r in reqs]
    llms: dict[str, LLM] = {}
    for dt in args.kv_dtypes:
        llms[dt] = LLM(model=args.model or DEFAULT_MODEL, **ENGINE_ARGS, kv_cache_dtype=dt, kv_prefault=True)
        llms[dt].generate([prompts[0]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
        if args.cached_prompts:
            llms[dt].generate(prompts, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    rates: dict[str, list[float]] = {dt: [] for dt in llms}
    ops: dict[str, dict[str, list[float]]] = {dt: defaultdict(lambda: [0, 0.0]) for dt in llms}
    seconds: dict[str, float] = defaultdict(float)
    names = list(llms)
    for i in range(args.rounds):
        for dt in names[i % len(names):] + names[:i % len(names)]:  # each engine first in turn
            if not args.cached_prompts:
                llms[dt].reset_prefix_cache()
            t = time.perf_counter()
            with timed_kernels(ops[dt]) if args.ops else nullcontext():
                outs = llms[dt].generate(prompts, params, use_tqdm=False)
            dt_s = time.perf_counter() - t
            seconds[dt] += dt_s
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            rates[dt].append(tokens / dt_s)
            print(f"round {i + 1} {dt}: {tokens} tokens in {dt_s:.1f} s, {tokens / dt_s:.1f} tok/s "
                  f"({time.strftime('%H:%M:%S')})", flush=True)
    base = names[0]
    print(f"\n{args.workload}, {args.model or DEFAULT_MODEL}, {args.sampling}, {args.rounds} rounds in one process"
          + (", prompts cached" if args.cached_prompts else ""))
    result = {}
    for dt in names:
        ratios = [r / b for r, b in zip(rates[dt], rates[base], strict=True)]
        result[dt] = {"tok_per_s": statistics.median(rates[dt]), "runs": rates[dt], "ratios": ratios}
        rel = "" if dt == base else (f"  {dt}/{base} round by round {', '.join(f'{r:.3f}' for r in ratios)}, "
                                     f"median {statistics.median(ratios):.3f}x")
        print(f"  {dt:10s} {statistics.median(rates[dt]):8.1f} tok/s (median){rel}")
    if args.ops:
        keys = sorted({k for d in ops.values() for k in d}, key=lambda k: -sum(ops[d][k][1] for d in names))
        width = max(len(k) for k in keys)
        print(f"\n{'kernel (seconds over all rounds)':{width}s} " + " ".join(f"{d:>10s}" for d in names))
        for k in keys:
            print(f"{k:{width}s} " + " ".join(f"{ops[d][k][1]:10.2f}" for d in names))
        print(f"{'sum of the kernels':{width}s} " + " ".join(f"{sum(v[1] for v in ops[d].values()):10.2f}"
                                                       for d in names))
        print(f"{'whole runs':{width}s} " + " ".join(f"{seconds[d]:10.2f}" for d in names))
        for dt in names:
            result[dt]["kernel_seconds"] = {k: v[1] for k, v in ops[dt].items()}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
