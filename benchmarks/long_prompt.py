"""Long prompts and shared prefixes end to end: prompt chunks after cached keys on the AMX prompt kernel
(prefill_attention_paged) vs on the paged decode kernel (KVPAGE_PREFILL_CACHED=0, how kvpage ran them before),
each in its own process, alternating, medians.

1. Time to first token of one prompt of 1000 / 3000 / 6000 random tokens (max_num_batched_tokens 2048: the
   later chunks of the longer ones follow 2048 / 4096 cached keys), prefix caching off.
2. A shared system prompt: 47 requests of the same 1000 tokens + 40 of their own, 32 output tokens each,
   prefix caching on (the shared part computed once, by a first request, before timing): output tok/s.

    python benchmarks/long_prompt.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time

LENGTHS = (1000, 3000, 6000)


def measure() -> dict[str, float]:
    from kvpage.engine.llm import LLM
    from kvpage.sampling_params import SamplingParams

    out: dict[str, float] = {}
    rng = random.Random(0)
    llm = LLM(kv_cache_memory="2GiB", max_model_len=8192, max_num_batched_tokens=2048, kv_prefault=True,
              enable_prefix_caching=False)
    vocab = llm.engine.worker.lm.config.vocab_size
    one = SamplingParams(temperature=0, max_tokens=1)
    llm.generate([{"prompt_token_ids": [rng.randrange(100, vocab - 100) for _ in range(300)]}], one, use_tqdm=False)
    for n in LENGTHS:
        prompt = {"prompt_token_ids": [rng.randrange(100, vocab - 100) for _ in range(n)]}
        times = []
        for _ in range(3):
            t = time.perf_counter()
            llm.generate([prompt], one, use_tqdm=False)
            times.append(time.perf_counter() - t)
        out[f"ttft_{n}"] = statistics.median(times)
    del llm
    llm = LLM(kv_cache_memory="2GiB", max_model_len=8192, enable_prefix_caching=True, kv_prefault=True)
    system = [rng.randrange(100, vocab - 100) for _ in range(1000)]
    reqs = [{"prompt_token_ids": system + [rng.randrange(100, vocab - 100) for _ in range(40)]} for _ in range(48)]
    llm.generate(reqs[:1], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    t = time.perf_counter()
    outs = llm.generate(reqs[1:], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    out["shared_prefix_tok_s"] = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure()))
        return
    runs: dict[str, list[dict[str, float]]] = {"paged kernel": [], "prompt kernel": []}
    for _ in range(args.rounds):
        for label, flag in (("paged kernel", "0"), ("prompt kernel", "1")):
            env = dict(os.environ, KVPAGE_PREFILL_CACHED=flag)
            res = subprocess.run([sys.executable, __file__, "--child"], env=env, capture_output=True, text=True,
                                 check=True)
            runs[label].append(json.loads(res.stdout.strip().splitlines()[-1]))
    med = {label: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for label, rs in runs.items()}
    old, new = med["paged kernel"], med["prompt kernel"]
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores; SmolLM2-135M-Instruct bf16, medians of "
          f"{args.rounds} alternating processes")
    print("| measure | chunks after cached keys on the paged kernel | on the prompt kernel | ratio |")
    print("|---|---:|---:|---:|")
    for n in LENGTHS:
        a, b = old[f"ttft_{n}"], new[f"ttft_{n}"]
        print(f"| time to first token, {n}-token prompt | {a * 1e3:.0f} ms | {b * 1e3:.0f} ms | {a / b:.2f}x |")
    a, b = old["shared_prefix_tok_s"], new["shared_prefix_tok_s"]
    print(f"| 47 requests sharing a 1000-token prefix, output tok/s | {a:.1f} | {b:.1f} | {b / a:.2f}x |")


if __name__ == "__main__":
    main()
