"""Offline generation throughput: kvpage side by side with the engines people use, same weights and dtype.

Workloads (fixed seed, EOS ignored, output tokens counted as requested):
  chat64    64 chat-templated short questions x 128 output tokens
  chat128   the same with 128 questions (128 sequences decoding at once)
  chat16, chat32  the same with 16 / 32 questions (a moderately loaded server's decode steps)
  sharegpt  256 requests; prompt / output lengths lognormal, medians ~160 / ~200, capped at 1024 / 512
  essays64  64 plain-text prompts x 128 output tokens (for base models without a chat template)
  random256 200 prompts of 256 random tokens x 128 output tokens (`vllm bench serve`'s random dataset in
            benchmarks/online.py, offline)

--model picks kvpage's model (default: the embedded SmolLM2; e.g. gemma-3-270m); --vllm-model must then be the
same weights converted for vLLM (../shared/PEERS.md). The transformers and llama.cpp peers run SmolLM2 only.

Sampling (--sampling, one or both, each a separate measurement): greedy (temperature 0), or sampled
(temperature 1.0, top-p 0.95, top-k 50: what chat clients typically send), the same settings for every engine.

Engines, each in its own process, one after another in this invocation:
  kvpage                 this engine (dtype auto: bf16 where the CPU has AVX512_BF16, else float32; the
                         transformers and vLLM peers run the same dtype)
  hf-generate            transformers generate() in static, left-padded batches (--hf-batch)
  hf-generate-batch      transformers' own continuous batching (generate_batch)
  vllm                   vLLM's CPU build, if a Python with vllm is given (--vllm-python / $KVPAGE_VLLM_PYTHON)
                         and a converted HF directory (--vllm-model / $KVPAGE_VLLM_MODEL); see ../shared/PEERS.md
  llama.cpp              llama-server --parallel N with continuous batching, if --llama-server is given
  kvpage-baseline        kvpage from another checkout's sources (--baseline-src), e.g. before a refactor
  kvpage:<kv dtype>      kvpage with another KV cache dtype (kvpage:bfloat16, kvpage:int8, kvpage:fp8, ...)
  kvpage-4k              kvpage with its KV cache on 4 KiB pages (--no-kv-huge-pages), to measure what 2 MiB pages give
  kvpage-onednn          kvpage with KVPAGE_I8_GEMM=0: oneDNN's bf16 GEMM instead of the int8 GEMM on the quantized
                         blocks (what that GEMM gives, on AVX-512 VNNI CPUs without AMX)
  kvpage-i8              kvpage with KVPAGE_I8_GEMM=1: the int8 GEMM even where `auto` keeps oneDNN (AMD CPUs)
  kvpage+VAR=VALUE[+...]  kvpage with kernel switches from docs/envs.md set, e.g. kvpage+KVPAGE_PAGED_PROMPTS=0;
                         with a KV dtype too: kvpage:int8+KVPAGE_INT8_KEYS=channel
A peer that is not installed is reported as skipped, never estimated.

Startup is outside the timed region for every engine. kvpage faults its KV pages in at startup there
(``kv_prefault``, as vLLM zero-fills its KV cache when it starts); KVPAGE_BENCH_PREFAULT=0 turns that off.

    python benchmarks/throughput.py --workloads chat64 sharegpt --engines kvpage hf-generate
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _common import run_python, variant_env

ROOT = Path(__file__).resolve().parent.parent
CHATS = {"chat16": 16, "chat32": 32, "chat64": 64, "chat128": 128}  # chat workloads: questions at once


def build_workload(name: str, seed: int = 0, model: str | None = None) -> list[dict]:
    """Requests as token ids (prompt_token_ids, max_tokens), identical for every engine."""
    from kvpage.model.loader import load_model
    from kvpage.model.registry import DEFAULT_MODEL

    tk = load_model(model or DEFAULT_MODEL).tokenizer
    rng = random.Random(seed)
    special = set(tk.special_ids)
    vocab = [t for t in range(100, tk.vocab_size) if t not in special]  # random prompts' tokens
    reqs = []
    if name in CHATS:
        topics = ["the moon", "rivers", "bread", "volcanoes", "owls", "trains", "tea", "glaciers", "chess",
                  "bees", "maps", "clocks", "salt", "wind", "paper", "copper"]
        for i in range(CHATS[name]):
            q = f"In two sentences, what is interesting about {topics[i % len(topics)]}? (question {i})"
            ids = tk.encode(tk.apply_chat_template([{"role": "user", "content": q}]))
            reqs.append({"prompt_token_ids": ids, "max_tokens": 128})
    elif name == "essays64":
        topics = ["the moon", "rivers", "bread", "volcanoes", "owls", "trains", "tea", "glaciers"]
        for i in range(64):
            ids = tk.encode(f"Here is a short essay about {topics[i % len(topics)]} (part {i}):")
            reqs.append({"prompt_token_ids": ids, "max_tokens": 128})
    elif name == "sharegpt":
        for _ in range(256):
            p = min(1024, max(4, int(math.exp(rng.gauss(math.log(160), 0.8)))))
            o = min(512, max(4, int(math.exp(rng.gauss(math.log(200), 0.8)))))
            reqs.append({"prompt_token_ids": [rng.choice(vocab) for _ in range(p)], "max_tokens": o})
    elif name == "random256":
        for _ in range(200):
            reqs.append({"prompt_token_ids": [rng.choice(vocab) for _ in range(256)], "max_tokens": 128})
    else:
        raise ValueError(f"unknown workload {name!r}")
    return reqs


SAMPLING = {"greedy": {"temperature": 0.0}, "sampled": {"temperature": 1.0, "top_p": 0.95, "top_k": 50}}

# kvpage's engine settings for every throughput run (same_process.py loads its engines with them too)
ENGINE_ARGS = {"kv_cache_memory": "4GiB", "max_model_len": 2048, "max_num_seqs": 256, "max_num_batched_tokens": 2048}

# Each runner reads the workload JSON on stdin and prints {"seconds": ..., "tokens": ...} as its last line;
# $KVPAGE_BENCH_SAMPLING holds the sampling settings as JSON.
KVPAGE = r"""
import json, os, sys, time
from kvpage.engine.llm import LLM
from kvpage.sampling_params import SamplingParams
reqs = json.load(sys.stdin)
sampling = json.loads(os.environ["KVPAGE_BENCH_SAMPLING"])
llm = LLM(model=os.environ.get("KVPAGE_BENCH_MODEL") or "SmolLM2-135M-Instruct", **__ENGINE_ARGS__,
          kv_cache_dtype=os.environ.get("KVPAGE_BENCH_KV_DTYPE") or "auto",
          kv_prefault=os.environ.get("KVPAGE_BENCH_PREFAULT", "1") != "0",
          kv_huge_pages=None if os.environ.get("KVPAGE_BENCH_HUGE_PAGES", "1") != "0" else False)
llm.generate([reqs[0]["prompt_token_ids"]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
params = [SamplingParams(max_tokens=r["max_tokens"], ignore_eos=True, **sampling) for r in reqs]
t = time.perf_counter()
outs = llm.generate([{"prompt_token_ids": r["prompt_token_ids"]} for r in reqs], params, use_tqdm=False)
dt = time.perf_counter() - t
print(json.dumps({"seconds": dt, "tokens": sum(len(o.outputs[0].token_ids) for o in outs),
                  "dtype": str(llm.engine.worker.lm.dtype), "stats": llm.engine.stats()}))
""".replace("__ENGINE_ARGS__", repr(ENGINE_ARGS))

HF_COMMON = r"""
import json, os, sys, time
os.environ["HF_HUB_OFFLINE"] = "1"
import torch
from transformers import AutoModelForCausalLM
from transformers.utils import logging
logging.set_verbosity_error(); logging.disable_progress_bar()
from kvpage.config import resolve_dtype
from kvpage.model.registry import default_model_path
reqs = json.load(sys.stdin)
p = default_model_path()
dtype = getattr(torch, resolve_dtype("auto"))
model = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=dtype, attn_implementation="sdpa")
model.eval()
"""

HF_GENERATE = HF_COMMON + r"""
B = int(os.environ.get("HF_BATCH", "32"))
pad = 2
def run(batch):
    n = max(len(r["prompt_token_ids"]) for r in batch)
    ids = torch.tensor([[pad] * (n - len(r["prompt_token_ids"])) + r["prompt_token_ids"] for r in batch])
    mask = (torch.arange(n)[None, :] >= torch.tensor([n - len(r["prompt_token_ids"]) for r in batch])[:, None]).long()
    m = max(r["max_tokens"] for r in batch)
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, max_new_tokens=m, min_new_tokens=m, do_sample=False, pad_token_id=pad)
run(reqs[:2] if len(reqs) > 1 else reqs)
order = sorted(range(len(reqs)), key=lambda i: len(reqs[i]["prompt_token_ids"]))  # fewer pads: kinder to it
t = time.perf_counter()
for s in range(0, len(order), B):
    run([reqs[i] for i in order[s:s + B]])
dt = time.perf_counter() - t
print(json.dumps({"seconds": dt, "tokens": sum(r["max_tokens"] for r in reqs), "dtype": str(dtype)}))
"""

HF_GENERATE_BATCH = HF_COMMON + r"""
from transformers import GenerationConfig
model.set_attn_implementation("sdpa") if hasattr(model, "set_attn_implementation") else None
def run(rs):
    m = max(r["max_tokens"] for r in rs)
    cfg = GenerationConfig(max_new_tokens=m, do_sample=False, eos_token_id=-1, pad_token_id=2)
    with torch.no_grad():
        return model.generate_batch([r["prompt_token_ids"] for r in rs], generation_config=cfg)
run(reqs[:2])
t = time.perf_counter()
run(reqs)
dt = time.perf_counter() - t
print(json.dumps({"seconds": dt, "tokens": sum(max(r["max_tokens"] for r in reqs) for r in reqs),
                  "dtype": str(dtype), "note": "generate_batch takes one max_new_tokens for all requests"}))
"""

VLLM = r"""
import json, os, sys, time
reqs = json.load(sys.stdin)
sampling = json.loads(os.environ["KVPAGE_BENCH_SAMPLING"])
from vllm import LLM, SamplingParams
dtype = os.environ["KVPAGE_PEER_DTYPE"]
llm = LLM(model=os.environ["KVPAGE_VLLM_MODEL"], dtype=dtype, max_model_len=2048, max_num_seqs=256)
params = [SamplingParams(max_tokens=r["max_tokens"], ignore_eos=True, **sampling) for r in reqs]
llm.generate([{"prompt_token_ids": reqs[0]["prompt_token_ids"]}], SamplingParams(max_tokens=4), use_tqdm=False)
t = time.perf_counter()
outs = llm.generate([{"prompt_token_ids": r["prompt_token_ids"]} for r in reqs], params, use_tqdm=False)
dt = time.perf_counter() - t
print(json.dumps({"seconds": dt, "tokens": sum(len(o.outputs[0].token_ids) for o in outs), "dtype": dtype}))
"""


def run_llama_server(binary: str, reqs: list[dict], parallel: int, port: int = 8099) -> dict:
    """llama.cpp's server on loopback with N slots and continuous batching; requests sent concurrently."""
    import concurrent.futures
    import urllib.request

    from kvpage.model.registry import default_model_path

    ctx = parallel * 2048
    server = subprocess.Popen([binary, "-m", str(default_model_path()), "-np", str(parallel), "-c", str(ctx), "-cb",
                               "--host", "127.0.0.1", "--port", str(port), "-t", str(os.cpu_count())],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(120):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except Exception:
                time.sleep(1)

        def one(r):
            body = json.dumps({"prompt": r["prompt_token_ids"], "n_predict": r["max_tokens"], "ignore_eos": True,
                               "cache_prompt": False, "temperature": 0,
                               **json.loads(os.environ["KVPAGE_BENCH_SAMPLING"])}).encode()
            req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", body,
                                         {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=3600) as resp:
                return json.loads(resp.read())["tokens_predicted"]

        t = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(parallel) as ex:
            tokens = sum(ex.map(one, reqs))
        return {"seconds": time.perf_counter() - t, "tokens": tokens, "dtype": "Q4_1 (GGUF as is)"}
    finally:
        server.terminate()
        server.wait(timeout=30)


class Skipped(Exception):
    """The engine is not installed or not configured here: reported, never estimated."""


def run_engine(eng: str, reqs: list[dict], args: argparse.Namespace, dtype: str) -> dict:
    if eng == "kvpage":
        return run_python(sys.executable, KVPAGE, reqs)
    if eng == "kvpage-4k":
        return run_python(sys.executable, KVPAGE, reqs, {"KVPAGE_BENCH_HUGE_PAGES": "0"})
    if eng == "kvpage-onednn":
        return run_python(sys.executable, KVPAGE, reqs, {"KVPAGE_I8_GEMM": "0"})
    if eng == "kvpage-i8":
        return run_python(sys.executable, KVPAGE, reqs, {"KVPAGE_I8_GEMM": "1"})
    if eng.startswith(("kvpage+", "kvpage:")):  # another KV cache dtype and/or kernel switches (docs/envs.md)
        head, env = variant_env(eng)
        if head.startswith("kvpage:"):  # same KV memory: a quantized cache holds more tokens
            env["KVPAGE_BENCH_KV_DTYPE"] = head.split(":", 1)[1]
        return run_python(sys.executable, KVPAGE, reqs, env)
    if eng == "kvpage-baseline":  # another checkout's sources, same Python and packages
        if not args.baseline_src:
            raise Skipped("no --baseline-src given")
        return run_python(sys.executable, KVPAGE, reqs, {"PYTHONPATH": str(Path(args.baseline_src) / "src")})
    if eng == "hf-generate":
        return run_python(sys.executable, HF_GENERATE, reqs, {"HF_BATCH": str(args.hf_batch)})
    if eng == "hf-generate-batch":
        return run_python(sys.executable, HF_GENERATE_BATCH, reqs)
    if eng == "vllm":
        if not (args.vllm_python and args.vllm_model):
            raise Skipped("not installed (set --vllm-python and --vllm-model)")
        return run_python(args.vllm_python, VLLM, reqs, {
            "KVPAGE_VLLM_MODEL": args.vllm_model, "VLLM_CPU_KVCACHE_SPACE": "4", "KVPAGE_PEER_DTYPE": dtype,
            "VLLM_CPU_OMP_THREADS_BIND": f"0-{os.cpu_count() - 1}"})
    if eng == "llama.cpp":
        if not args.llama_server:
            raise Skipped("not installed (set --llama-server)")
        return run_llama_server(args.llama_server, reqs, args.llama_parallel)
    raise Skipped("unknown engine")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", nargs="+", default=["chat64", "sharegpt"],
                    choices=[*CHATS, "sharegpt", "essays64", "random256"])
    ap.add_argument("--model", help="kvpage's model (default: the embedded SmolLM2), e.g. gemma-3-270m")
    ap.add_argument("--sampling", nargs="+", default=["greedy"], choices=list(SAMPLING))
    ap.add_argument("--engines", nargs="+",
                    default=["kvpage", "hf-generate", "hf-generate-batch", "vllm", "llama.cpp"])
    ap.add_argument("--rounds", type=int, default=1, help="alternating rounds; the median is reported")
    ap.add_argument("--baseline-src", help="another kvpage checkout (e.g. a git worktree of an earlier commit): "
                                           "adds the engine kvpage-baseline, run from its sources side by side")
    ap.add_argument("--hf-batch", type=int, default=32, help="static batch size for hf-generate")
    ap.add_argument("--vllm-python", default=os.environ.get("KVPAGE_VLLM_PYTHON"))
    ap.add_argument("--vllm-model", default=os.environ.get("KVPAGE_VLLM_MODEL"))
    ap.add_argument("--llama-server", default=os.environ.get("KVPAGE_LLAMA_SERVER"))
    ap.add_argument("--llama-parallel", type=int, default=32)
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args()
    from kvpage.config import resolve_dtype

    engines = list(args.engines)
    if args.baseline_src and "kvpage-baseline" not in engines:
        engines.insert(engines.index("kvpage") + 1 if "kvpage" in engines else 0, "kvpage-baseline")
    results: dict[str, dict[str, dict]] = {}
    for wl, mode in [(w, m) for w in args.workloads for m in args.sampling]:
        reqs = build_workload(wl, model=args.model)
        if args.model:
            os.environ["KVPAGE_BENCH_MODEL"] = args.model
        os.environ["KVPAGE_BENCH_SAMPLING"] = json.dumps(SAMPLING[mode])
        key = wl if args.sampling == ["greedy"] else f"{wl} {mode}"
        runs: dict[str, list[dict]] = {eng: [] for eng in engines}
        why: dict[str, str] = {}
        if mode != "greedy":
            why.update({eng: "its runner is greedy only" for eng in engines if eng.startswith("hf-")})
        for _ in range(args.rounds):  # the engines alternate within each round (the machines drift)
            for eng in engines:
                if eng in why:
                    continue
                try:
                    runs[eng].append(run_engine(eng, reqs, args, resolve_dtype("auto")))
                except Skipped as e:
                    why[eng] = str(e)
                except Exception as e:  # report, never fake
                    why[eng] = f"failed: {e}"
        results[key] = {}
        for eng in engines:
            if runs[eng] and eng not in why:
                tps = [r["tokens"] / r["seconds"] for r in runs[eng]]
                results[key][eng] = {"tok_per_s": statistics.median(tps), "runs": runs[eng]}
            else:
                results[key][eng] = {"skipped": why.get(eng, "no run")}
            r = results[key][eng]
            shown = f"{r['tok_per_s']:.1f} tok/s" if "tok_per_s" in r else f"skipped ({r['skipped']})"
            print(f"[{key}] {eng}: {shown}", file=sys.stderr)

    print(f"machine: {platform.machine()}, {os.cpu_count()} cores; model {args.model or 'SmolLM2-135M-Instruct'}; "
          "EOS ignored; "
          + "; ".join(f"{m}: {SAMPLING[m]}" for m in args.sampling))
    for wl, res in results.items():
        base = res.get("kvpage", {}).get("tok_per_s")
        print(f"\n{wl}")
        width = max(18, *(len(eng) for eng in res))
        for eng, r in res.items():
            if "skipped" in r:
                print(f"  {eng:<{width}} skipped: {r['skipped']}")
            else:
                ratio = f"kvpage/{eng} = {base / r['tok_per_s']:.2f}x" if base and eng != "kvpage" else ""
                print(f"  {eng:<{width}} {r['tok_per_s']:8.1f} tok/s  {ratio}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    main()
