"""Admission with room for the growth running requests are certain of, against plain admission, in one process.

    python benchmarks/admission.py [--requests 200] [--prompt-len 256] [--output-len 128] [--kv-memory 2GiB]
                                   [--max-num-seqs 128] [--rounds 2] [--sampling greedy|sampled] [--model M]

The online benchmark's requests (vLLM's random dataset shape: random prompt tokens, `ignore_eos`, every output
`--output-len` long), all at once, through `LLM.generate` on two engines that differ only in
`reserve_certain_growth` (core/admission.py; `kvpage serve --no-reserve-certain-growth` is the other one). With
`kvpage serve`'s default 2 GiB of KV memory and float32 pages (AVX2-only machines) 121 such requests fit at full
length, so plain admission lets 128 in on their prompts and preempts the last ones near the end of their outputs.
Both engines stay loaded (their KV prefaulted, as the server's), each round gives both the same fresh prompts
(no prefix hits across rounds) in alternating order, and the ratio is taken round by round.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from kvpage.config import DEFAULT_MODEL
from kvpage.engine.llm import LLM
from kvpage.sampling_params import SamplingParams


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> dict:
    before = llm.engine.stats()["preemptions"]
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - t
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {"tok_s": tokens / seconds, "seconds": seconds, "tokens": tokens,
            "preemptions": llm.engine.stats()["preemptions"] - before}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--kv-memory", default="2GiB", help="each engine's KV memory (kvpage serve's default)")
    ap.add_argument("--max-num-seqs", type=int, default=128, help="kvpage serve's default")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--sampling", default="greedy", choices=["greedy", "sampled"])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    params = SamplingParams(temperature=0.0 if args.sampling == "greedy" else 1.0, max_tokens=args.output_len,
                            ignore_eos=True)
    engines = {name: LLM(args.model, kv_cache_memory=args.kv_memory, max_num_seqs=args.max_num_seqs,
                         kv_prefault=True, reserve_certain_growth=(name == "reserve"))
               for name in ("reserve", "plain")}
    rows: list[dict] = []
    for r in range(args.rounds):
        rng = random.Random(1000 + r)
        prompts = [[rng.randrange(100, 40000) for _ in range(args.prompt_len)]  # ids both models have
                   for _ in range(args.requests)]
        order = ["reserve", "plain"] if r % 2 == 0 else ["plain", "reserve"]
        got = {name: run(engines[name], prompts, params) for name in order}
        rows.append({"round": r, "order": order, **{name: got[name] for name in ("reserve", "plain")},
                     "ratio": got["reserve"]["tok_s"] / got["plain"]["tok_s"]})
        print(f"round {r} ({' then '.join(order)}): "
              + ", ".join(f"{n} {got[n]['tok_s']:.1f} tok/s in {got[n]['seconds']:.1f} s, "
                          f"{got[n]['preemptions']} preemptions" for n in ("reserve", "plain"))
              + f"; ratio {rows[-1]['ratio']:.3f}", flush=True)
    med = {n: statistics.median(row[n]["tok_s"] for row in rows) for n in ("reserve", "plain")}
    ratio = statistics.median(row["ratio"] for row in rows)
    print(f"medians: reserve {med['reserve']:.1f} tok/s, plain {med['plain']:.1f} tok/s; "
          f"median of the rounds' ratios {ratio:.3f}")
    if args.json:
        print(json.dumps({"rounds": rows, "medians": med, "ratio": ratio}))


if __name__ == "__main__":
    main()
