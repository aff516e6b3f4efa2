"""Paged KV vs static max-length reservation inside kvpage, at the same KV budget.

The budget holds exactly --static-slots reservations of max_model_len (default 16 x 2048 tokens). Both runs use
the same engine, model, scheduler and ShareGPT-like requests; only the KV policy differs. Reported: peak and
mean concurrency (running sequences per step), throughput, and KV utilization (live tokens / allocated slots)
sampled at every step. Both runs fault the pool's pages in at startup (``kv_prefault``, as
benchmarks/throughput.py does and as vLLM zero-fills its cache); KVPAGE_BENCH_PREFAULT=0 turns that off.

Targets (issue #5): concurrency >= 3x, throughput >= 2x, paged utilization >= 97%.

--phases also prints where each run's time goes (its steps by size, from the step log) and the compute floor:
the workload's arithmetic (the static run's steps, where every token is computed once: linear layers, QK^T
and P.V over the scored pairs, the lm head; ``ModelSpec.step_flops``) at the engine's own best GEMM rate,
measured in the same invocation (``engine_gemm_tflops``: 256 rows, weight in cache). No engine can run this
workload faster on this machine with these products, so static's measured time over that floor is the
highest paged/static ratio reachable.

    python benchmarks/paged_vs_static.py [--requests 256] [--phases] [--kv-cache-dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import statistics

from _common import drive, engine_gemm_tflops
from kvpage.dtypes import KV_CACHE_CHOICES
from kvpage.engine.llm import LLM
from kvpage.sampling_params import SamplingParams
from kvpage.sim.cost import ModelSpec, step_log_sample


def workload(n: int, max_len: int, vocab: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p = min(1024, max(4, int(math.exp(rng.gauss(math.log(160), 0.8)))))
        o = min(512, max(4, int(math.exp(rng.gauss(math.log(200), 0.8)))))
        o = min(o, max_len - p)
        out.append(([rng.randrange(100, vocab - 100) for _ in range(p)], o))
    return out


def run(policy: str, reqs, budget: int, max_len: int, phases: bool = False, kv_dtype: str = "auto") -> dict:
    llm = LLM(kv_cache_memory=budget, max_model_len=max_len, kv_policy=policy, max_num_seqs=256,
              kv_cache_dtype=kv_dtype, enable_prefix_caching=False,
              kv_prefault=os.environ.get("KVPAGE_BENCH_PREFAULT", "1") != "0")
    eng = llm.engine
    eng.add_request("warm", reqs[0][0][:8], SamplingParams(temperature=0, max_tokens=2))
    while eng.has_unfinished_requests():
        eng.step()
    for i, (prompt, out_len) in enumerate(reqs):
        eng.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True))
    running, util = [], []
    if phases:
        eng.step_log = []  # per step: its shape (sequences, tokens, prompt tokens) and wall time

    def sample() -> None:
        s = eng.kv.stats()
        running.append(s.num_seqs)
        if s.allocated_slots:
            util.append(s.utilization)

    tokens, dt = drive(eng, sample)
    return {"policy": policy, "num_blocks": eng.kv.num_blocks, "peak_running": max(running),
            "mean_running": statistics.mean(running), "tok_per_s": tokens / dt, "seconds": dt, "tokens": tokens,
            "mean_kv_utilization": statistics.mean(util), "preemptions": eng.stats()["preemptions"],
            "steps": eng.step_log or []}


def print_phases(r: dict) -> None:
    """Where a run's time goes: its steps bucketed by sequences computing, decode-only vs with prompt tokens."""
    print(f"\n{r['policy']}: {len(r['steps'])} steps, {sum(s['seconds'] for s in r['steps']):.1f} s")
    print("| sequences | decode-only steps | their time | tokens / ms per step | steps with prompt tokens | "
          "their time | tokens / ms per step |")
    print("|---|---:|---:|---|---:|---:|---|")
    for lo, hi in ((1, 16), (16, 32), (32, 64), (64, 96), (96, 1 << 30)):
        cells = []
        for prompt in (False, True):
            sel = [s for s in r["steps"] if lo <= s["num_seqs"] < hi and (s["prefill_tokens"] > 0) == prompt]
            if not sel:
                cells.append("0 | | ")
                continue
            t = sum(s["seconds"] for s in sel)
            cells.append(f"{len(sel)} | {t:.1f} s | {statistics.mean(s['num_tokens'] for s in sel):.0f} / "
                         f"{t / len(sel) * 1e3:.1f}")
        label = f"{lo}-{hi - 1}" if hi < 1 << 30 else f">= {lo}"
        print(f"| {label} | {cells[0]} | {cells[1]} |")


def compute_floor(model: ModelSpec, steps: list[dict], gemm_flops: float) -> dict[str, float]:
    """FLOPs of a run's steps by phase, and the seconds they take at ``gemm_flops`` (every part at the GEMM
    rate, memory and overheads free: a lower bound on any engine's time for the same work)."""
    total = {"linear": 0.0, "attention": 0.0, "lm_head": 0.0}
    for s in steps:
        for part, flops in model.step_flops(step_log_sample(s)[0]).items():
            total[part] += flops
    flops = sum(total.values())
    return {**total, "flops": flops, "seconds": flops / gemm_flops}


def sim_model(dtype: str) -> ModelSpec:
    """The default model's numbers as the simulator sees them (``kvpage simulate``'s own construction)."""
    from kvpage.entrypoints.cli import build_parser
    from kvpage.entrypoints.simulate import build_model

    return build_model(build_parser().parse_args(["simulate", "--dtype", dtype]))


def print_floor(model: ModelSpec, static: dict, paged: dict, dtype: str) -> None:
    gemm = engine_gemm_tflops(dtype) * 1e12
    work = compute_floor(model, static["steps"], gemm)  # every token once: static never preempts
    own = compute_floor(model, paged["steps"], gemm)  # with what preemption made it recompute
    shares = ", ".join(f"{k} {work[k] / work['flops']:.0%}" for k in ("linear", "attention", "lm_head"))
    best = static["tokens"] / work["seconds"]
    print(f"\ncompute floor: the workload is {work['flops'] / 1e12:.2f} TFLOP ({shares}; the paged run's steps "
          f"{own['flops'] / 1e12:.2f} with recomputation); at the engine's {dtype} GEMM rate here "
          f"({gemm / 1e12:.3f} TFLOP/s, 256 rows, measured now) that is {work['seconds']:.1f} s "
          f"(paged's steps {own['seconds']:.1f} s, {own['seconds'] / paged['seconds']:.0%} of its "
          f"{paged['seconds']:.1f} s)")
    print(f"  best possible throughput {best:.1f} tok/s: at most {best / static['tok_per_s']:.2f}x static's "
          f"measured {static['tok_per_s']:.1f} tok/s (target 2x)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--static-slots", type=int, default=16, help="reservations the budget holds")
    ap.add_argument("--json")
    ap.add_argument("--phases", action="store_true", help="also print each run's steps by size (step log)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_CHOICES,
                    help="both runs' cache dtype (the budget stays --static-slots reservations, in its bytes)")
    args = ap.parse_args()
    probe = LLM(kv_cache_memory="128MiB", max_model_len=args.max_model_len,  # one sequence even in float32
                kv_cache_dtype=args.kv_cache_dtype)
    bpb = probe.engine.worker.bytes_per_block
    vocab = probe.engine.worker.lm.config.vocab_size
    blocks = args.static_slots * -(-args.max_model_len // 16)
    budget = blocks * bpb
    reqs = workload(args.requests, args.max_model_len, vocab)
    probe_kv = str(probe.engine.worker.kv_dtype).removeprefix("torch.")
    run_dtype = str(probe.engine.worker.lm.dtype).removeprefix("torch.")
    del probe
    static = run("static", reqs, budget, args.max_model_len, args.phases, args.kv_cache_dtype)
    paged = run("paged", reqs, budget, args.max_model_len, args.phases, args.kv_cache_dtype)
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores; SmolLM2-135M-Instruct, {args.requests} "
          f"ShareGPT-like requests, KV budget {blocks} blocks x 16 tokens = {args.static_slots} reservations of "
          f"{args.max_model_len} ({probe_kv}, {budget / 2**20:.0f} MiB)")
    for r in (static, paged):
        print(f"  {r['policy']:<7} peak running {r['peak_running']:4d}  mean running {r['mean_running']:6.1f}  "
              f"{r['tok_per_s']:7.1f} tok/s  KV utilization {r['mean_kv_utilization']:.1%}  "
              f"preemptions {r['preemptions']}")
    print(f"  paged/static: peak concurrency {paged['peak_running'] / static['peak_running']:.2f}x, "
          f"mean concurrency {paged['mean_running'] / static['mean_running']:.2f}x, "
          f"throughput {paged['tok_per_s'] / static['tok_per_s']:.2f}x")
    if args.phases:
        for r in (static, paged):
            print_phases(r)
        print_floor(sim_model(run_dtype), static, paged, run_dtype)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"static": static, "paged": paged}, f, indent=2)


if __name__ == "__main__":
    main()
