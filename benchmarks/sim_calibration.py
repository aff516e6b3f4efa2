"""Calibrate and check the simulator's step-time model against real kvpage runs on this machine.

1. Measures the machine numbers the roofline uses, for the dtype the engine runs here: the projection GEMM
   rate, the paged kernel's KV read bandwidth, the streaming read bandwidth.
2. Runs the real engine on two request streams made by ``kvpage.sim.workloads`` (random token ids of the
   same lengths), recording every step's shape and wall time (``LLMEngine.step_log``).
3. Writes the first run's step log as a calibration file (``kvpage simulate --calibrate FILE``).
4. Fits the roofline's two overheads on the first run with the measured rates: this machine's profile,
   written with --machine-out for ``kvpage simulate --machine FILE``.
5. Simulates both streams with the same pool and scheduler settings, under the default profile (xeon-amx),
   this machine's refitted profile and the linear calibration, and prints predicted vs measured makespan and
   throughput. The second stream is not used for fitting, so its error is an honest out-of-sample check.

    python benchmarks/sim_calibration.py [--out /tmp/kvpage_calibration.json] [--machine-out machine.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
from dataclasses import replace

from _common import cpu_model, drive, engine_gemm_tflops, median_seconds
from kvpage.config import resolve_dtype
from kvpage.entrypoints.cli import build_parser
from kvpage.entrypoints.simulate import build_config, build_cost, build_model
from kvpage.sim.cost import (
    RooflineCost,
    fit_roofline_overheads,
    load_calibration,
    machine_profile,
    step_log_sample,
)
from kvpage.sim.simulator import Simulator
from kvpage.sim.workloads import WorkloadSpec, generate


def machine_numbers(dtype: str) -> dict[str, float]:
    """The rates of the kernels the engine runs (not of generic torch ops): its projection GEMM for ``dtype``
    (``PackedLinear``: AMX tiles for bf16 where the CPU has them, kvpage's panel GEMM for float32 on AVX2
    builds, oneDNN otherwise) at a 256-row batch with the weight in cache, its paged decode attention reading a
    KV cache that does not fit in cache, and a plain streaming read (weights)."""
    import torch

    from kernels import run_case
    from kvpage.attention.backends.cpu import CpuPagedAttention
    from kvpage.ops import kernels, load_kernels

    out = {"gemm_tflops": engine_gemm_tflops(dtype)}
    ops = load_kernels()
    dt = getattr(torch, dtype)
    if ops is not None:  # 256 sequences x 1024 tokens of SmolLM2's KV heads, read from memory
        b, ctx, hq, hkv, d = 256, 1024, 9, 3, 64
        packed = CpuPagedAttention(kernels()).packed_layout(torch.zeros(2, 1, 16, hkv, d, dtype=dt), dt)  # the engine's
        paged_ms, _ = run_case(ops, b, ctx, hq, hkv, d, 16, 5, packed=packed, dtype=dt)
        out["kv_read_gb_s"] = 2 * b * ctx * hkv * d * dt.itemsize / (paged_ms * 1e-3) / 1e9
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
    ap.add_argument("--machine-out", help="write this machine's roofline profile (measured rates + fitted "
                                          "overheads) as JSON for `kvpage simulate --machine FILE`")
    ap.add_argument("--machine-name", default=platform.node() or "this-machine")
    args = ap.parse_args()
    dtype = resolve_dtype("auto")  # what the engine runs here, and so what the simulator must model
    print(f"machine: {cpu_model()}, {platform.python_version()}, dtype {dtype}")
    measured = machine_numbers(dtype)
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
    sim_args = build_parser().parse_args(["simulate", "--kv-memory", args.kv_memory, "--dtype", dtype,
                                          "--max-model-len", str(args.max_model_len)])
    model = build_model(sim_args)
    config = build_config(sim_args, model)
    roofline = build_cost(sim_args, model)
    samples = [step_log_sample(s) for s in real[fit_name]["steps"]]
    # The rates measured above (where measured) with the two overheads fitted to the recorded steps: what the
    # defaults in kvpage.sim.cost.MachineSpec should say for this machine.
    rates = {"gemm_flops": measured["gemm_tflops"] * 1e12, "copy_bandwidth": measured["read_gb_s"] * 1e9,
             "name": args.machine_name}
    if "kv_read_gb_s" in measured:
        rates["mem_bandwidth"] = measured["kv_read_gb_s"] * 1e9
    fitted = fit_roofline_overheads(RooflineCost(model, replace(roofline.machine, **rates), roofline.block_size),
                                    samples)
    print(f"measured rates + overheads fitted on {fit_name} (refit): GEMM {fitted.gemm_flops / 1e12:.2f} TFLOP/s, "
          f"KV read {fitted.mem_bandwidth / 1e9:.1f} GB/s, weights {fitted.copy_bandwidth / 1e9:.1f} GB/s, "
          f"{fitted.step_overhead * 1e3:.2f} ms/step + {fitted.seq_overhead * 1e3:.3f} ms/seq; defaults: "
          f"{roofline.describe()}")
    refit = RooflineCost(model, fitted, roofline.block_size)
    if args.machine_out:
        profile = machine_profile(fitted, model.dtype_bytes, measured_on=cpu_model(),
                                  fitted_on=fit_name, command="python benchmarks/sim_calibration.py")
        with open(args.machine_out, "w") as f:
            json.dump(profile, f, indent=1)
        print(f"wrote {args.machine_out}: use it with `kvpage simulate --machine {args.machine_out}`")
    print(f"\n{'stream':<18} {'model':<10} {'makespan s':>10} {'tok/s':>8} {'steps':>6} {'preempt':>7} {'error':>7}")
    for name, reqs in streams.items():
        r = real[name]
        print(f"{name:<18} {'measured':<10} {r['seconds']:>10.1f} {r['tok_s']:>8.1f} {len(r['steps']):>6} "
              f"{r['preemptions']:>7} {'':>7}")
        for label, cost in ((roofline.machine.name, roofline), ("refit", refit), ("calibrated", calib)):
            s = Simulator(config, reqs, cost).run().summary()
            err = s["makespan_s"] / r["seconds"] - 1
            print(f"{'':<18} {label:<10} {s['makespan_s']:>10.1f} {s['throughput_tok_s']:>8.1f} {s['steps']:>6} "
                  f"{s['preemptions']:>7} {err:>+7.1%}")


if __name__ == "__main__":
    main()
