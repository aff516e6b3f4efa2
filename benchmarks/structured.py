"""What structured outputs cost: offline generation of the chat64 workload (64 chat questions decoding at once,
sampled at temperature 1.0) free, and held to a regex and to a JSON schema, in kvpage and, side by side, in
vLLM's CPU build (its own structured-output backend) when it is given.

    python benchmarks/structured.py [--vllm-python PY --vllm-model DIR] [--rounds 1] [--max-tokens 128]

Every form runs the same 64 requests with min_tokens = max_tokens, so EOS cannot end a sequence early; the regex
admits any run of lower-case words and the JSON schema an object holding one string of at least 2,000 characters:
neither can complete within the tokens asked for, so every form generates the same count. Throughput counts the
tokens each engine generated. Each engine runs all forms in one process (startup outside the timed region), forms
in the same order.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import cpu_model, memory_read_gbps, run_python
from throughput import build_workload

FORMS = {
    "free": None,
    "regex": {"regex": "[a-z]+( [a-z]+)*"},
    "json": {"json": {"type": "object", "properties": {"story": {"type": "string", "minLength": 2000}},
                      "required": ["story"]}},
}

KVPAGE = r"""
import json, os, sys, time
from kvpage.engine.llm import LLM
from kvpage.sampling_params import SamplingParams, StructuredOutputsParams
job = json.load(sys.stdin)
llm = LLM(kv_cache_memory="4GiB", max_model_len=2048, max_num_seqs=256, max_num_batched_tokens=2048)
llm.generate([job["reqs"][0]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
res = {}
for name, form in job["forms"]:
    so = StructuredOutputsParams(**form) if form else None
    if so is not None:
        llm.engine.grammars.compile(so)  # as the server does before it submits (tokenizer view built once)
    params = SamplingParams(max_tokens=job["max_tokens"], min_tokens=job["max_tokens"], structured_outputs=so)
    t = time.perf_counter()
    outs = llm.generate(job["reqs"], params, use_tqdm=False)
    dt = time.perf_counter() - t
    res[name] = {"seconds": dt, "tokens": sum(len(o.outputs[0].token_ids) for o in outs)}
print(json.dumps({"seconds": 0, "forms": res}))
"""

VLLM = r"""
import json, os, sys, time
job = json.load(sys.stdin)
from vllm import LLM, SamplingParams
from vllm.sampling_params import StructuredOutputsParams
llm = LLM(model=os.environ["KVPAGE_VLLM_MODEL"], dtype="auto", max_model_len=2048, max_num_seqs=256)
llm.generate([{"prompt_token_ids": job["reqs"][0]}], SamplingParams(max_tokens=4), use_tqdm=False)
res = {}
for name, form in job["forms"]:
    so = StructuredOutputsParams(**form) if form else None
    if so is not None:  # its grammar compiled once before the timed run, as kvpage's
        llm.generate([{"prompt_token_ids": job["reqs"][0]}], SamplingParams(max_tokens=2, structured_outputs=so),
                     use_tqdm=False)
    params = SamplingParams(max_tokens=job["max_tokens"], min_tokens=job["max_tokens"], structured_outputs=so)
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": r} for r in job["reqs"]], params, use_tqdm=False)
    dt = time.perf_counter() - t
    res[name] = {"seconds": dt, "tokens": sum(len(o.outputs[0].token_ids) for o in outs)}
print(json.dumps({"seconds": 0, "forms": res}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-python", default=os.environ.get("KVPAGE_VLLM_PYTHON"))
    ap.add_argument("--vllm-model", default=os.environ.get("KVPAGE_VLLM_MODEL"))
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=128)
    a = ap.parse_args()
    reqs = [r["prompt_token_ids"] for r in build_workload("chat64")]
    job = {"reqs": reqs, "forms": list(FORMS.items()), "max_tokens": a.max_tokens}
    runs: dict[str, list[dict]] = {"kvpage": [], "vllm": []}
    memory = memory_read_gbps()  # this hour's memory speed, which moves every figure below
    for _ in range(a.rounds):
        runs["kvpage"].append(run_python(sys.executable, KVPAGE, job)["forms"])
        if a.vllm_python and a.vllm_model:
            runs["vllm"].append(run_python(a.vllm_python, VLLM, job, {
                "KVPAGE_VLLM_MODEL": a.vllm_model, "VLLM_CPU_KVCACHE_SPACE": "4",
                "VLLM_CPU_OMP_THREADS_BIND": f"0-{os.cpu_count() - 1}"})["forms"])
    print(f"machine: {cpu_model()}, {os.cpu_count()} cores; chat64, sampled (temperature 1.0), {a.max_tokens} tokens "
          f"each; medians of {a.rounds} round(s); memory read {memory:.1f} GB/s before the runs (float32 sum, 1 GiB)")
    print("| form | kvpage tok/s | kvpage vs free | vLLM tok/s | vLLM vs free | kvpage / vLLM |")
    print("|---|---|---|---|---|---|")
    rate = {eng: {f: statistics.median(r[f]["tokens"] / r[f]["seconds"] for r in rs) for f in FORMS}
            for eng, rs in runs.items() if rs}
    for f in FORMS:
        k = rate["kvpage"][f]
        v = rate.get("vllm", {}).get(f)
        cells = [f"{k:.1f}", f"{k / rate['kvpage']['free']:.2f}x"]
        cells += [f"{v:.1f}", f"{v / rate['vllm']['free']:.2f}x", f"**{k / v:.2f}x**"] if v else ["-", "-", "-"]
        print(f"| {f} | " + " | ".join(cells) + " |")
    if not a.vllm_python:
        print("vLLM: skipped (give --vllm-python and --vllm-model, ../shared/PEERS.md)")
    print(json.dumps(runs))


if __name__ == "__main__":
    main()
