"""Where kvpage's time goes on a throughput workload: one `LLM.generate` of benchmarks/throughput.py's requests
(same engine settings), either under cProfile (the top entries by own time) or, with ``--ops``, with every
compiled kernel call timed by the wall clock (calls, seconds and share of the run per kernel; paged attention
split by the cache's dtype and by decode-sized (at most 1,024 rows) or larger calls).

    python benchmarks/profile_step.py [--workload sharegpt|chat64|random256|single] [--top 25]
    python benchmarks/profile_step.py --model gemma-3-270m --kv-dtype int8 --ops

``single`` is latency.py's case: one stream decoding 256 tokens after a short chat prompt. ``--ops`` answers
"what does a quantized cache add" directly (compare ``--kv-dtype int8`` with ``bfloat16``); a sampling profiler
attributes a C call's time to whichever Python frame is on top when it samples, which misled once (a 9% share
for the quantized caches' row transforms that the wall clock put at 1.4%).
"""

from __future__ import annotations

import argparse
import cProfile
import inspect
import pstats
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from kvpage.config import DEFAULT_MODEL
from kvpage.engine.llm import LLM
from kvpage.ops.kernels import Kernels
from kvpage.sampling_params import SamplingParams
from throughput import build_workload

DECODE_ROWS = 1024  # paged-attention and linear calls of at most this many rows count as decode-sized


def _key(name: str, args: tuple[Any, ...]) -> str:
    if name == "paged_attention" and len(args) >= 3:
        query, cache = args[1], args[2]
        size = "decode-sized" if query.shape[0] <= DECODE_ROWS else "larger"
        return f"paged_attention [{str(cache.dtype).removeprefix('torch.')} cache, {size}]"
    if name.endswith("_linear") and len(args) >= 2 and hasattr(args[1], "shape"):
        return f"{name} [{'decode-sized' if args[1].shape[0] <= DECODE_ROWS else 'larger'}]"
    return name


@contextmanager
def timed_kernels(acc: dict[str, list[float]]) -> Iterator[None]:
    """Every public method of ``Kernels`` timed (calls, seconds) into ``acc`` while inside; restored after."""
    saved = {n: f for n, f in vars(Kernels).items() if inspect.isfunction(f) and not n.startswith("_")}

    def wrap(name: str, f: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return f(*args, **kwargs)
            finally:
                a = acc[_key(name, args)]
                a[0] += 1
                a[1] += time.perf_counter() - t
        return timed

    for n, f in saved.items():
        setattr(Kernels, n, wrap(n, f))
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(Kernels, n, f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="sharegpt", choices=["sharegpt", "chat64", "random256", "single"])
    ap.add_argument("--model", default=None, help="kvpage's model (default: the embedded SmolLM2)")
    ap.add_argument("--kv-dtype", default="auto", help="KV cache dtype (auto, bfloat16, int8, fp8_e4m3, ...)")
    ap.add_argument("--ops", action="store_true", help="time each compiled kernel call instead of cProfile")
    ap.add_argument("--max-num-seqs", type=int, default=256,
                    help="sequences at once (256 as throughput.py; `kvpage serve` and `vllm serve` hold 128)")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--sort", default="tottime", choices=["tottime", "cumulative"])
    args = ap.parse_args()
    reqs = build_workload("chat64" if args.workload == "single" else args.workload, model=args.model)
    if args.workload == "single":
        reqs = [dict(reqs[0], max_tokens=256)]
    llm = LLM(model=args.model or DEFAULT_MODEL, kv_cache_memory="4GiB", max_model_len=2048,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=2048, kv_cache_dtype=args.kv_dtype,
              kv_prefault=True)
    llm.generate([reqs[0]["prompt_token_ids"]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    params = [SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=True) for r in reqs]
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in reqs]
    acc: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    steps = llm.engine.num_steps
    t = time.perf_counter()
    if args.ops:
        head = llm.engine.worker.runner.forward  # the lm head and its logits pass, all Python around it included
        head_call = head.compute_logits_ex

        def timed_head(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return head_call(*a, **kw)
            finally:
                a = acc["lm head (compute_logits_ex, whole)"]
                a[0] += 1
                a[1] += time.perf_counter() - t0

        head.compute_logits_ex = timed_head
        try:
            with timed_kernels(acc):
                outs = llm.generate(prompts, params, use_tqdm=False)
        finally:
            del head.compute_logits_ex
    else:
        prof = cProfile.Profile()
        prof.enable()
        outs = llm.generate(prompts, params, use_tqdm=False)
        prof.disable()
    dt = time.perf_counter() - t
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"{args.workload}, {args.model or DEFAULT_MODEL}, KV {args.kv_dtype}: {tokens} tokens in "
          f"{dt:.1f} s = {tokens / dt:.1f} tok/s {'with the kernels timed' if args.ops else 'under the profiler'}, "
          f"{llm.engine.num_steps - steps} steps")
    if not args.ops:
        pstats.Stats(prof).sort_stats(args.sort).print_stats(args.top)
        return
    width = max(len(k) for k in acc) if acc else 10
    print(f"{'kernel':{width}s} {'calls':>8s} {'seconds':>8s} {'share':>6s}")
    for name, (calls, secs) in sorted(acc.items(), key=lambda kv: -kv[1][1])[: args.top]:
        print(f"{name:{width}s} {int(calls):8d} {secs:8.2f} {100 * secs / dt:5.1f}%")


if __name__ == "__main__":
    main()
