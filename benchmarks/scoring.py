"""Scoring throughput: what a harness such as lm-eval's loglikelihood tasks asks of an engine. Every request is a
prompt whose every token's logprob comes back (``prompt_logprobs``, one top logprob each, as lm-eval's
``logprobs: 1``), with one generated token; the figure is prompt tokens scored per second. Offline, each engine in
its own process, side by side: kvpage's ``LLM`` and, with --vllm-python / --vllm-model, vLLM's CPU build with the
same settings (its prompt-logprobs requests skip the prefix cache, as kvpage's do); ``kvpage-plain`` is kvpage on
the same prompts without prompt logprobs (what scoring adds to plain prompt processing).

    python benchmarks/scoring.py [--requests 64] [--min-len 64] [--max-len 512] [--engines kvpage kvpage-plain vllm]
                                 [--vllm-python /root/peers/vllm/bin/python --vllm-model /root/peers/smollm2-hf]
                                 [--vllm-dtype float32] [--rounds 1]

The prompts are windows of the pinned text (benchmarks/data/kv_quant_text.txt) at seeded offsets and lengths.
Besides the speed, the engines' per-request sums of prompt logprobs are compared (what a loglikelihood task
ranks its choices by): the mean and largest difference between kvpage and the peer.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
from pathlib import Path

from _common import cpu_model, run_python

TEXT = Path(__file__).parent / "data" / "kv_quant_text.txt"

KVPAGE = r"""
import json, os, sys, time
from kvpage.engine.llm import LLM
from kvpage.sampling_params import SamplingParams
reqs = json.load(sys.stdin)
llm = LLM(kv_cache_memory="4GiB", max_model_len=2048, max_num_seqs=256, max_num_batched_tokens=2048)
plain = os.environ.get("KVPAGE_BENCH_PLAIN") == "1"  # the same prompts without prompt logprobs
params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=None if plain else 1)
llm.generate([reqs[0]], params, use_tqdm=False)  # warm-up
llm.engine.reset_prefix_cache()  # plain requests would otherwise hit the warm-up's blocks
t = time.perf_counter()
outs = llm.generate(reqs, params, use_tqdm=False)
dt = time.perf_counter() - t
sums = [0.0 if plain else sum(e[tok].logprob for e, tok in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:]))
        for o in outs]
print(json.dumps({"seconds": dt, "tokens": sum(len(r) for r in reqs), "sums": sums,
                  "dtype": str(llm.engine.worker.lm.dtype)}))
"""

VLLM = r"""
import json, os, sys, time
from vllm import LLM, SamplingParams
reqs = json.load(sys.stdin)
dtype = os.environ["KVPAGE_PEER_DTYPE"]
llm = LLM(model=os.environ["KVPAGE_VLLM_MODEL"], dtype=dtype, max_model_len=2048, max_num_seqs=256)
params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
llm.generate([{"prompt_token_ids": reqs[0]}], params, use_tqdm=False)  # warm-up
t = time.perf_counter()
outs = llm.generate([{"prompt_token_ids": r} for r in reqs], params, use_tqdm=False)
dt = time.perf_counter() - t
sums = [sum(e[tok].logprob for e, tok in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:])) for o in outs]
print(json.dumps({"seconds": dt, "tokens": sum(len(r) for r in reqs), "sums": sums, "dtype": dtype}), flush=True)
"""


def make_requests(n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    from kvpage.model.registry import default_model_path
    from kvpage.model.tokenizer import KVTokenizer

    ids = KVTokenizer.from_gguf(default_model_path()).encode(TEXT.read_text())
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(lo, hi)
        start = rng.randrange(0, len(ids) - length)
        out.append(ids[start : start + length])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--min-len", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--engines", nargs="+", default=["kvpage", "vllm"], choices=["kvpage", "kvpage-plain", "vllm"])
    ap.add_argument("--vllm-python", default=os.environ.get("KVPAGE_VLLM_PYTHON"))
    ap.add_argument("--vllm-model", default=os.environ.get("KVPAGE_VLLM_MODEL"))
    ap.add_argument("--vllm-dtype", default="bfloat16")
    ap.add_argument("--rounds", type=int, default=1, help="engines alternate; medians reported")
    args = ap.parse_args()
    reqs = make_requests(args.requests, args.min_len, args.max_len)
    print(f"machine: {cpu_model()}, {os.cpu_count()} cores; {len(reqs)} prompts of {args.min_len}-{args.max_len} "
          f"tokens ({sum(map(len, reqs))} in all), prompt_logprobs=1, max_tokens=1")
    runs: dict[str, list[dict]] = {e: [] for e in args.engines}
    for _ in range(args.rounds):
        for eng in args.engines:
            if eng.startswith("kvpage"):
                runs[eng].append(run_python(sys.executable, KVPAGE, reqs,
                                            {"KVPAGE_BENCH_PLAIN": "1" if eng == "kvpage-plain" else "0"}))
            elif args.vllm_python and args.vllm_model:
                runs[eng].append(run_python(args.vllm_python, VLLM, reqs, {
                    "KVPAGE_VLLM_MODEL": args.vllm_model, "VLLM_CPU_KVCACHE_SPACE": "4",
                    "KVPAGE_PEER_DTYPE": args.vllm_dtype, "VLLM_CPU_OMP_THREADS_BIND": f"0-{os.cpu_count() - 1}"}))
            else:
                print(f"{eng}: skipped (set --vllm-python and --vllm-model)")
    print("| engine | dtype | scored tokens/s (median) | rounds |")
    print("|---|---|---:|---|")
    rate = {}
    for eng, rs in runs.items():
        if not rs:
            continue
        rates = [r["tokens"] / r["seconds"] for r in rs]
        rate[eng] = statistics.median(rates)
        print(f"| {eng} | {rs[0]['dtype']} | {rate[eng]:.1f} | {', '.join(f'{x:.1f}' for x in rates)} |")
    if "kvpage" in rate and "kvpage-plain" in rate:
        print(f"kvpage with prompt logprobs / without: {rate['kvpage'] / rate['kvpage-plain']:.2f}x")
    if "kvpage" in rate and "vllm" in rate:
        print(f"kvpage / vllm: {rate['kvpage'] / rate['vllm']:.2f}x")
        a, b = runs["kvpage"][0]["sums"], runs["vllm"][0]["sums"]
        diffs = [abs(x - y) for x, y in zip(a, b, strict=True)]
        print(f"per-request sum of prompt logprobs, kvpage against vllm: mean |diff| {statistics.mean(diffs):.4f}, "
              f"largest {max(diffs):.4f} (sums {statistics.mean(map(abs, a)):.1f} on average)")
    print(json.dumps({e: [{k: v for k, v in r.items() if k != "sums"} for r in rs] for e, rs in runs.items()}))


if __name__ == "__main__":
    main()
