"""Decode over long contexts through the engine, per KV cache dtype and layout: where the pages' bytes, not the
projections, set a step's time (the case quantized pages are for).

Each variant runs in its own process: `--seqs` prompts of `--context` random tokens are computed first (one
output token each, prefix caching on), then the same prompts again with `--tokens` output tokens each, timed:
their prompts come from the prefix cache, so the timed part is decode steps over ~`--context` keys per
sequence. Variants are `<kv dtype>` or `<kv dtype>+<ENV>=<value>`, e.g.

    python benchmarks/long_decode.py --variants bfloat16 int8 int8+KVPAGE_KV_LAYOUT=rows --rounds 2
    python benchmarks/long_decode.py --model gemma-3-270m --variants bfloat16 int8

With a sliding-window model (Gemma 3) only its global layers read the whole context; the others read their window.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys

from _common import variant_env
from kvpage.config import DEFAULT_MODEL


def measure(kv_dtype: str, seqs: int, context: int, tokens: int, model: str | None = None) -> float:
    """Output tokens per second of the timed pass (see the module doc)."""
    import random
    import time

    from kvpage.engine.llm import LLM
    from kvpage.sampling_params import SamplingParams

    llm = LLM(model=model or DEFAULT_MODEL, kv_cache_dtype=kv_dtype, max_model_len=context + tokens + 16,
              kv_cache_memory="6GiB", enable_prefix_caching=True)
    vocab = llm.engine.worker.lm.config.vocab_size
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(100, vocab - 100) for _ in range(context)]} for _ in range(seqs)]
    llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True), use_tqdm=False)
    t = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True), use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t)


def run(variant: str, a: argparse.Namespace) -> float:
    kv_dtype, switches = variant_env(variant)
    env = {**os.environ, **switches}
    cmd = [sys.executable, __file__, "--child", kv_dtype, "--seqs", str(a.seqs), "--context", str(a.context),
           "--tokens", str(a.tokens)] + (["--model", a.model] if a.model else [])
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    return float(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="kvpage's model (default: the embedded SmolLM2)")
    ap.add_argument("--variants", nargs="+", default=["bfloat16", "int8", "int8+KVPAGE_KV_LAYOUT=rows"])
    ap.add_argument("--seqs", type=int, default=32)
    ap.add_argument("--context", type=int, default=3000, help="prompt tokens per sequence")
    ap.add_argument("--tokens", type=int, default=65, help="output tokens per sequence in the timed pass")
    ap.add_argument("--rounds", type=int, default=1, help="alternating rounds; the median is reported")
    ap.add_argument("--json")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(measure(a.child, a.seqs, a.context, a.tokens, a.model))
        return
    for v in a.variants:  # every variant's switches checked before the first run
        variant_env(v)
    results: dict[str, list[float]] = {v: [] for v in a.variants}
    for r in range(a.rounds):
        for v in a.variants if r % 2 == 0 else a.variants[::-1]:
            results[v].append(run(v, a))
            print(f"round {r + 1}: {v}: {results[v][-1]:.1f} tok/s", flush=True)
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores; {a.model or DEFAULT_MODEL}; "
          f"{a.seqs} sequences x {a.context} prompt tokens, "
          f"{a.tokens} output tokens each (prompts cached)")
    base = statistics.median(results[a.variants[0]])
    for v, t in results.items():
        print(f"  {v:<36} {statistics.median(t):8.1f} tok/s  {statistics.median(t) / base:.2f}x {a.variants[0]}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
