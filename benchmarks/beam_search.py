"""Beam search on copy-on-write blocks: memory per request, and speed against vLLM's ``LLM.beam_search``.

1. Memory: one beam search of width 8 over a 1,000-token prompt (64 generated tokens, 16-token blocks), the KV
   blocks it holds at every step, against (a) the prompt's full blocks + 8 tails (each beam's blocks after the
   shared ones), (b) static reservation of 8 copies of prompt + max_tokens (seed 004's figure), and (c) what
   ``kvpage simulate --workload beam`` predicts for the same request (the simulator's beam-like workload).
2. Speed: the same prompts (chat-like, 24 by default) through ``LLM.beam_search`` at beam width 4, every prompt
   at once, EOS ignored so both engines generate max_tokens per beam: requests/s, kvpage against vLLM's CPU
   build in its own process (--vllm-python, --vllm-model; ../shared/PEERS.md), alternating rounds, medians.

    python benchmarks/beam_search.py [--vllm-python P --vllm-model DIR] [--prompts 24] [--rounds 2]
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
import tempfile

from _common import cpu_model, run_python

BLOCK = 16
TOPICS = ["a lighthouse keeper", "the water cycle", "a chess opening", "bread baking", "a train journey",
          "the moons of Jupiter", "a garden in winter", "how a compiler works", "a market at dawn", "bees",
          "a violin maker", "the history of maps"]


def prompts(n: int, tokenizer) -> list[list[int]]:
    out = []
    for i in range(n):
        msgs = [{"role": "user", "content": f"Write a short paragraph about {TOPICS[i % len(TOPICS)]}, part {i + 1}."}]
        out.append(tokenizer.encode(tokenizer.apply_chat_template(msgs), add_special_tokens=False))
    return out


def simulated_peak_blocks(width: int, prompt_len: int, max_tokens: int) -> int:
    """``kvpage simulate`` on a trace of this one request (its beam-like workload: the prompt's blocks shared,
    width beams forked after it, some pruned and re-forked each step): the peak of allocated blocks."""
    with tempfile.TemporaryDirectory() as d:
        trace = os.path.join(d, "beam.jsonl")
        with open(trace, "w") as f:
            f.write(json.dumps({"arrival": 0, "prompt_len": prompt_len, "output_len": max_tokens,
                                "beam_width": width}) + "\n")
        proc = subprocess.run([sys.executable, "-c", "import sys; from kvpage.entrypoints.cli import main; "
                               "sys.exit(main())", "simulate", "--trace", trace, "--block-size", str(BLOCK),
                               "--kv-memory", "512MiB", "--max-model-len", "2048", "--json"],
                              capture_output=True, text=True, check=True)
    report = json.loads(proc.stdout)
    return round(report["summary"]["peak_kv_usage"] * report["config"]["num_blocks"])


def memory(llm, width: int = 8, prompt_len: int = 1000, max_tokens: int = 64) -> dict:
    from kvpage.sampling_params import BeamSearchParams

    eng = llm.engine
    rng = random.Random(0)
    ids = [rng.randrange(100, 40000) for _ in range(prompt_len)]
    eng.add_request("beam", ids, BeamSearchParams(beam_width=width, max_tokens=max_tokens, min_tokens=max_tokens))
    used = []
    while eng.has_unfinished_requests():
        eng.step()
        req = eng.requests.get("beam")
        if req is not None and len([s for s in req.seqs if not s.finished]) == width:
            used.append(eng.kv.num_blocks - eng.kv.num_free_blocks)
    full = prompt_len // BLOCK
    tails = -(-(prompt_len % BLOCK + max_tokens) // BLOCK)
    return {"width": width, "prompt_len": prompt_len, "max_tokens": max_tokens, "peak_blocks": max(used),
            "mean_blocks": statistics.mean(used), "prompt_plus_tails": full + width * tails,
            "static_blocks": width * -(-(prompt_len + max_tokens) // BLOCK),
            "simulated_peak_blocks": simulated_peak_blocks(width, prompt_len, max_tokens),
            "cow_copies": eng.stats()["cow_copies"]}


KVPAGE = r"""
import json, sys, time
from kvpage.engine.llm import LLM
from kvpage.sampling_params import BeamSearchParams
reqs = json.load(sys.stdin)
import os
llm = LLM(kv_cache_memory="4GiB", max_model_len=2048, kv_prefault=True, dtype=os.environ["KVPAGE_PEER_DTYPE"])
params = BeamSearchParams(beam_width=reqs["width"], max_tokens=reqs["max_tokens"], ignore_eos=True)
llm.beam_search([{"prompt_token_ids": reqs["prompts"][0]}], BeamSearchParams(beam_width=2, max_tokens=4))
t = time.perf_counter()
outs = llm.beam_search([{"prompt_token_ids": p} for p in reqs["prompts"]], params)
dt = time.perf_counter() - t
print(json.dumps({"seconds": dt, "requests": len(outs), "best": [o.sequences[0].output_token_ids for o in outs]}))
"""

VLLM = r"""
import json, os, sys, time
from vllm import LLM
from vllm.sampling_params import BeamSearchParams
reqs = json.load(sys.stdin)
llm = LLM(model=os.environ["KVPAGE_VLLM_MODEL"], dtype=os.environ["KVPAGE_PEER_DTYPE"], max_model_len=2048,
          max_num_seqs=256)
params = BeamSearchParams(beam_width=reqs["width"], max_tokens=reqs["max_tokens"], ignore_eos=True)
llm.beam_search([{"prompt_token_ids": reqs["prompts"][0]}], BeamSearchParams(beam_width=2, max_tokens=4))
t = time.perf_counter()
outs = llm.beam_search([{"prompt_token_ids": p} for p in reqs["prompts"]], params)
dt = time.perf_counter() - t
print(json.dumps({"seconds": dt, "requests": len(outs),
                  "best": [o.sequences[0].tokens[len(p):] for o, p in zip(outs, reqs["prompts"])]}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-python", default=os.environ.get("KVPAGE_VLLM_PYTHON"))
    ap.add_argument("--vllm-model", default=os.environ.get("KVPAGE_VLLM_MODEL"))
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--skip", nargs="*", default=[], choices=["memory", "speed"])
    ap.add_argument("--dtype", default="auto", help="both engines' dtype (auto: bf16 where the CPU has AVX512_BF16, "
                    "else float32); float32 shows both searches picking the same beams")
    args = ap.parse_args()
    print(f"machine: {cpu_model()} ({platform.machine()}), {os.cpu_count()} cores")
    from kvpage.engine.llm import LLM

    llm = LLM(kv_cache_memory="512MiB", max_model_len=2048, block_size=BLOCK)
    if "memory" not in args.skip:
        m = memory(llm)
        print(f"\nbeam width {m['width']}, {m['prompt_len']}-token prompt, {m['max_tokens']} tokens, {BLOCK}-token "
              f"blocks: peak {m['peak_blocks']} blocks (mean {m['mean_blocks']:.1f} while {m['width']} beams live); "
              f"prompt's full blocks + {m['width']} tails = {m['prompt_plus_tails']}; static reservation of "
              f"{m['width']} copies = {m['static_blocks']} ({m['static_blocks'] / m['peak_blocks']:.2f}x the peak); "
              f"kvpage simulate predicts a peak of {m['simulated_peak_blocks']}; copy-on-write copies "
              f"{m['cow_copies']}", flush=True)
    if "speed" in args.skip:
        return
    from kvpage.config import resolve_dtype

    payload = {"prompts": prompts(args.prompts, llm.get_tokenizer()), "width": args.width,
               "max_tokens": args.max_tokens}
    del llm
    dtype = str(resolve_dtype(args.dtype)).replace("torch.", "")
    times: dict[str, list[float]] = {"kvpage": [], "vllm": []}
    best: dict[str, list] = {}
    for _ in range(args.rounds):
        r = run_python(sys.executable, KVPAGE, payload, {"KVPAGE_PEER_DTYPE": dtype})
        times["kvpage"].append(r["seconds"])
        best["kvpage"] = r["best"]
        if args.vllm_python and args.vllm_model:
            r = run_python(args.vllm_python, VLLM, payload, {
                "KVPAGE_VLLM_MODEL": args.vllm_model, "KVPAGE_PEER_DTYPE": dtype, "VLLM_CPU_KVCACHE_SPACE": "4",
                "VLLM_CPU_OMP_THREADS_BIND": f"0-{os.cpu_count() - 1}"})
            times["vllm"].append(r["seconds"])
            best["vllm"] = r["best"]
    n = len(payload["prompts"])
    print(f"\nbeam width {args.width}, {n} prompts, {args.max_tokens} tokens per beam, EOS ignored, {dtype}, "
          f"medians of {args.rounds}:")
    rates = {}
    for eng, ts in times.items():
        if ts:
            rates[eng] = n / statistics.median(ts)
            print(f"  {eng:<8} {rates[eng]:.3f} requests/s ({statistics.median(ts):.1f} s)")
    if "vllm" in rates:
        same = sum(a == b for a, b in zip(best["kvpage"], best["vllm"], strict=True))
        print(f"  kvpage / vLLM = {rates['kvpage'] / rates['vllm']:.2f}x; best beams identical in {same} of {n} "
              "(in bf16 the engines' roundings differ; near-ties flip)")


if __name__ == "__main__":
    main()
