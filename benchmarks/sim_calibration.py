"""Calibrate and check the simulator's step-time model against real kvpage runs on this machine.

1. Measures the machine numbers the default roofline uses (bf16/fp32 GEMM rate, read bandwidth).
2. Runs the real engine on two request streams made by ``kvpage.sim.workloads`` (random token ids of the
   same lengths), recording every step's shape and wall time (``LLMEngine.step_log``).
3. Writes the first run's step log as a calibration file (``kvpage simulate --calibrate FILE``).
4. Simulates both streams with the same pool and scheduler settings, under the default roofline and under
   the calibration, and prints predicted vs measured makespan and throughput. The second stream is not
   used for fitting, so its error is an honest out-of-sample check.

    python benchmarks/sim_calibration.py [--out /tmp/kvpage_calibration.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
from dataclasses import replace

from _common import drive, median_seconds
from kvpage.entrypoints.cli import build_parser
from kvpage.entrypoints.simulate import build_config, build_cost, build_model
from kvpage.sim.cost import RooflineCost, StepFeatures, fit_roofline_overheads, load_calibration
from kvpage.sim.simulator import Simulator
from kvpage.sim.workloads import WorkloadSpec, generate


def machine_numbers() -> dict[str, float]:
    """The rates of the kernels the engine runs (not of generic torch ops): its bf16 projection GEMM at a
    256-row batch with the weight in cache, its paged decode attention reading a KV cache that does not fit in
    cache, and a plain streaming read (weights)."""
    import torch

    from kernels import run_case
    from kvpage.attention.backends.cpu_kernels import load_kernels

    out = {}
    ops = load_kernels()
    a = torch.randn(256, 576).bfloat16()
    w = torch.randn(1536, 576).bfloat16()
    if ops is not None and ops.amx_linear_available():
        wp = ops.amx_pack_weight(w)
        gemm = median_seconds(lambda: ops.amx_linear(a, wp, None, False), 15)
    else:
        gemm = median_seconds(lambda: a @ w.t(), 15)
    out["gemm_bf16_tflops"] = 2 * 256 * 576 * 1536 / gemm / 1e12
    if ops is not None:  # 256 sequences x 1024 tokens of SmolLM2's KV heads: 200 MB, read from memory
        b, ctx, hq, hkv, d = 256, 1024, 9, 3, 64
        paged_ms, _ = run_case(ops, b, ctx, hq, hkv, d, 16, 5, packed=True)
        out["kv_read_gb_s"] = 2 * b * ctx * hkv * d * 2 / (paged_ms * 1e-3) / 1e9
    x = torch.ones(128 * 1024 * 1024, dtype=torch.float32)
    out["read_gb_s"] = x.numel() * 4 / median_seconds(x.sum, 7) / 1e9
    return out


def real_run(requests, kv_memory: str, max_model_len: int) -> dict:
    from kvpage.engine.llm import LLM
    from kvpage.sampling_params import SamplingParams

    llm = LLM(kv_cache_memory=kv_memory, max_model_len=max_model_len, max_num_seqs=256,
              max_num_batched_tokens=2048)
    eng = llm.engine
    vocab = eng.worker.lm.config.vocab_size
    rng = random.Random(0)
    eng.add_request("warm", [rng.randrange(100, vocab - 100) for _ in range(8)], SamplingParams(max_tokens=2))
    while eng.has_unfinished_requests():
        eng.step()
    eng.step_log = []
    for r in requests:
        ids = [rng.randrange(100, vocab - 100) for _ in range(r.prompt_len)]
        eng.add_request(r.request_id, ids, SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True))
    tokens, dt = drive(eng)
    return {"seconds": dt, "tokens": tokens, "tok_s": tokens / dt, "steps": eng.step_log,
            "preemptions": eng.stats()["preemptions"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="/tmp/kvpage_calibration.json")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--kv-memory", default="1GiB")
    ap.add_argument("--max-model-len", type=int, default=2048)
    args = ap.parse_args()
    print(f"machine: {platform.processor() or platform.machine()}, {platform.python_version()}")
    measured = machine_numbers()
    print("measured:", {k: round(v, 2) for k, v in measured.items()})
    streams = {
        "sharegpt (fit)": generate(WorkloadSpec("sharegpt", args.requests, seed=1)),
        "lognormal (check)": generate(WorkloadSpec("lognormal", args.requests, seed=2)),
    }
    real = {name: real_run(reqs, args.kv_memory, args.max_model_len) for name, reqs in streams.items()}
    fit_name = next(iter(streams))
    with open(args.out, "w") as f:
        json.dump({"kind": "kvpage-step-log", "machine": platform.processor(), "workload": fit_name,
                   "steps": real[fit_name]["steps"]}, f)
    calib = load_calibration(args.out)
    print(f"wrote {args.out}: {calib.describe()}")
    sim_args = build_parser().parse_args(["simulate", "--kv-memory", args.kv_memory,
                                          "--max-model-len", str(args.max_model_len)])
    model = build_model(sim_args)
    config = build_config(sim_args, model)
    roofline = build_cost(sim_args, model)
    samples = [(StepFeatures(**{k: v for k, v in s.items() if k != "seconds"}), s["seconds"])
               for s in real[fit_name]["steps"]]
    # The rates measured above (where measured) with the two overheads fitted to the recorded steps: what the
    # defaults in kvpage.sim.cost.MachineSpec should say for this machine.
    rates = {"gemm_flops": measured["gemm_bf16_tflops"] * 1e12, "copy_bandwidth": measured["read_gb_s"] * 1e9}
    if "kv_read_gb_s" in measured:
        rates["mem_bandwidth"] = measured["kv_read_gb_s"] * 1e9
    fitted = fit_roofline_overheads(RooflineCost(model, replace(roofline.machine, **rates), roofline.block_size),
                                    samples)
    print(f"measured rates + overheads fitted on {fit_name} (refit): GEMM {fitted.gemm_flops / 1e12:.2f} TFLOP/s, "
          f"KV read {fitted.mem_bandwidth / 1e9:.1f} GB/s, weights {fitted.copy_bandwidth / 1e9:.1f} GB/s, "
          f"{fitted.step_overhead * 1e3:.2f} ms/step + {fitted.seq_overhead * 1e3:.3f} ms/seq; defaults: "
          f"{roofline.describe()}")
    refit = RooflineCost(model, fitted, roofline.block_size)
    print(f"\n{'stream':<18} {'model':<10} {'makespan s':>10} {'tok/s':>8} {'steps':>6} {'preempt':>7} {'error':>7}")
    for name, reqs in streams.items():
        r = real[name]
        print(f"{name:<18} {'measured':<10} {r['seconds']:>10.1f} {r['tok_s']:>8.1f} {len(r['steps']):>6} "
              f"{r['preemptions']:>7} {'':>7}")
        for label, cost in (("roofline", roofline), ("refit", refit), ("calibrated", calib)):
            s = Simulator(config, reqs, cost).run().summary()
            err = s["makespan_s"] / r["seconds"] - 1
            print(f"{'':<18} {label:<10} {s['makespan_s']:>10.1f} {s['throughput_tok_s']:>8.1f} {s['steps']:>6} "
                  f"{s['preemptions']:>7} {err:>+7.1%}")


if __name__ == "__main__":
    main()
