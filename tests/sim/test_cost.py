"""The simulator's step-cost models (features of a step, the roofline, fits, machine profiles) and the seeds'
qualitative results under the roofline."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest

from kvpage.core.scheduler import ScheduledWork, SchedulerOutput
from kvpage.entrypoints.cli import main
from kvpage.sim.cost import (
    LinearCost,
    MachineSpec,
    ModelSpec,
    RooflineCost,
    StepFeatures,
    fit_linear,
    fit_roofline_overheads,
    load_calibration,
    load_machine,
    machine_profile,
)
from kvpage.sim.simulator import SimConfig, Simulator
from kvpage.sim.workloads import WorkloadSpec, generate

SMOL = ModelSpec("SmolLM2-135M", 30, 576, 9, 3, 64, 1536, 49152, 2.0, 30 * 3 * 128 * 2)


# --------------------------------------------------------- the seeds' results
@pytest.mark.slow
def test_seed_results_static_20_to_40_percent_paged_over_96():
    reqs = generate(WorkloadSpec("lognormal", 512))
    cost = RooflineCost(SMOL)
    paged = Simulator(SimConfig.of(num_blocks=2912), reqs, cost).run().summary()
    static = Simulator(SimConfig.of(allocator="static", num_blocks=2912), reqs, cost).run().summary()
    pow2_cfg = SimConfig.of(allocator="static", static_reserve="pow2", num_blocks=2912)
    pow2 = Simulator(pow2_cfg, reqs, cost).run().summary()
    assert paged["utilization"] >= 0.96
    assert 0.20 <= static["utilization"] <= 0.40 and 0.20 <= pow2["utilization"] <= 0.45
    assert paged["tail_waste_per_seq_tokens"] < 16  # under one block per sequence
    assert paged["mean_concurrency"] > 3 * static["mean_concurrency"]
    assert paged["throughput_tok_s"] > static["throughput_tok_s"]


# ------------------------------------------------------------------ costs
def test_step_features_of_a_scheduled_step():
    class _Req:  # the features only read lengths
        pass

    from kvpage.core.sequence import Request, Sequence
    from kvpage.outputs import RequestMetrics
    from kvpage.sampling_params import SamplingParams

    r = Request("r", None, [1] * 10, SamplingParams(), 0, RequestMetrics(0.0))
    prompt = Sequence("r#0", r, 0, [1] * 10, 10)
    decode = Sequence("d#0", r, 0, [1] * 31, 30)
    out = SchedulerOutput(work=[ScheduledWork(prompt, 6, 4), ScheduledWork(decode, 1, 30)], copies=[(1, 2)])
    f = StepFeatures.of(out)
    assert (f.num_seqs, f.num_tokens, f.prefill_tokens, f.context_tokens) == (2, 7, 6, 10 + 31)
    assert f.attn_pairs == 6 * 4 + 21 + 30 + 1 and f.logit_rows == 2 and f.copy_blocks == 1


def test_roofline_phases_decode_reads_kv_prefill_computes():
    hw = MachineSpec(gemm_flops=1e12, mem_bandwidth=11.6e9, copy_bandwidth=24e9, step_overhead=18e-3,
                     seq_overhead=1.9e-4)
    cost = RooflineCost(SMOL, hw)
    decode = cost.parts(StepFeatures(num_seqs=16, num_tokens=16, context_tokens=16 * 500, attn_pairs=16 * 500,
                                     logit_rows=16))
    # attention is bound by reading 16 x 500 tokens of KV; the linear layers by streaming the weights
    assert decode["attention"] == pytest.approx(SMOL.kv_bytes_per_token * 16 * 500 / 11.6e9)
    assert decode["linear"] == pytest.approx(SMOL.linear_params * 2 / 24e9)
    assert decode["overhead"] == pytest.approx(18e-3 + 16 * 1.9e-4)
    prefill = cost.parts(StepFeatures(num_seqs=1, num_tokens=2048, prefill_tokens=2048, context_tokens=2048,
                                      attn_pairs=2048 * 2049 // 2, logit_rows=1))
    assert prefill["linear"] == pytest.approx(2 * SMOL.linear_params * 2048 / 1e12)
    assert cost.step_seconds(StepFeatures()) == 0.0


def test_step_flops_count_every_phase_of_a_step():
    """The arithmetic no engine can skip (the compute floor of benchmarks/paged_vs_static.py --phases): SmolLM2
    has 30 x (576 x (576 + 2 x 192) + 576 x 576 + 3 x 576 x 1536) = 106,168,320 projection weights and a
    49,152 x 576 lm head; attention costs 2 FLOPs per head dim for QK^T and 2 for P.V per scored pair."""
    assert SMOL.linear_params == 106_168_320 and SMOL.head_params == 28_311_552
    f = StepFeatures(num_seqs=2, num_tokens=7, prefill_tokens=6, context_tokens=41, attn_pairs=76, logit_rows=2)
    assert SMOL.step_flops(f) == {"linear": 2 * 106_168_320 * 7, "attention": 4 * 30 * 9 * 64 * 76,
                                  "lm_head": 2 * 28_311_552 * 2}


def test_roofline_overheads_are_recovered_from_a_step_log():
    truth = RooflineCost(SMOL, MachineSpec(step_overhead=3e-3, seq_overhead=5e-4))
    rng = random.Random(1)
    samples = []
    for _ in range(50):
        n = rng.randint(1, 200)
        f = StepFeatures(num_seqs=n, num_tokens=n, context_tokens=n * rng.randint(10, 900), logit_rows=n)
        samples.append((f, truth.step_seconds(f)))
    fitted = fit_roofline_overheads(RooflineCost(SMOL), samples)
    assert fitted.step_overhead == pytest.approx(3e-3) and fitted.seq_overhead == pytest.approx(5e-4)


def test_default_machine_is_the_xeon_profile_and_dtype_picks_its_gemm_rate():
    got, want = dataclasses.asdict(load_machine("xeon-amx", 2.0)), dataclasses.asdict(MachineSpec())
    assert got == {k: pytest.approx(v) if isinstance(v, float) else v for k, v in want.items()}
    fp32 = load_machine("xeon-amx", 4.0)
    assert fp32.gemm_flops == pytest.approx(0.3e12) and fp32.mem_bandwidth == pytest.approx(MachineSpec().mem_bandwidth)
    assert load_machine("zen3-avx2", 4.0).gemm_flops == pytest.approx(0.18e12)
    with pytest.raises(ValueError, match="zen3-avx2: no GEMM rate for bfloat16"):
        load_machine("zen3-avx2", 2.0)


def test_machine_profile_file_round_trips_and_drives_the_roofline(tmp_path, capsys):
    measured = MachineSpec(gemm_flops=0.11e12, mem_bandwidth=14e9, copy_bandwidth=19e9, step_overhead=4e-3,
                           seq_overhead=3e-4, name="zen3")
    f = tmp_path / "m.json"
    f.write_text(json.dumps(machine_profile(measured, 4.0, measured_on="test")))
    got = dataclasses.asdict(load_machine(str(f), 4.0))
    assert got == {k: pytest.approx(v) if isinstance(v, float) else v for k, v in dataclasses.asdict(measured).items()}
    # a bf16 simulation needs a bf16 rate: a float32 rate would make every step ~4x too slow on AMX
    with pytest.raises(ValueError, match=r"no GEMM rate for bfloat16 weights .*has: float32"):
        load_machine(str(f), 2.0)
    assert load_machine(str(f), 2.0, gemm_flops=1e12).gemm_flops == 1e12
    args = ["simulate", "--num-requests", "24", "--json", "--dtype", "float32"]
    assert main([*args, "--machine", str(f)]) == 0
    slow = json.loads(capsys.readouterr().out)
    assert "roofline (zen3)" in slow["cost_model"]
    assert main(args) == 0
    fast = json.loads(capsys.readouterr().out)
    # same schedule, different clock: the machine moves time, never memory
    assert slow["summary"]["steps"] == fast["summary"]["steps"]
    assert slow["summary"]["makespan_s"] != pytest.approx(fast["summary"]["makespan_s"])


@pytest.mark.parametrize("edit, message", [
    ({"kind": "kvpage-step-log"}, "not a machine profile"),
    ({"read_gb_s": None}, "read_gb_s must be a positive number"),
    ({"kv_read_gb_s": 0}, "kv_read_gb_s must be a positive number"),
    ({"gemm_tflops": 0.1}, "gemm_tflops must map float32 and/or bfloat16"),
    ({"gemm_tflops": {"fp16": 0.1, "float32": 0.1}}, "gemm_tflops must map float32 and/or bfloat16"),
    ({"gemm_tflops": {"float32": -1}}, "gemm_tflops.float32 must be a positive number"),
    ({"step_overhead_ms": "fast"}, "step_overhead_ms must be a positive number"),
])
def test_bad_machine_profiles_are_refused_by_name(tmp_path, edit, message):
    profile = machine_profile(MachineSpec(name="m"), 4.0)
    profile.update(edit)
    f = tmp_path / "m.json"
    f.write_text(json.dumps(profile))
    with pytest.raises(ValueError, match=message):
        load_machine(str(f), 4.0)
    del profile["seq_overhead_ms"]
    f.write_text(json.dumps({**profile, "kind": "kvpage-machine"}))
    with pytest.raises(ValueError, match="missing seq_overhead_ms"):
        load_machine(str(f), 4.0)


def test_fit_recovers_known_coefficients():
    true = {"const": 0.004, "num_tokens": 2e-5, "num_seqs": 1e-4, "context_tokens": 2e-6, "attn_pairs": 0.0}
    rng = random.Random(0)
    samples = []
    for _ in range(40):
        f = StepFeatures(num_seqs=rng.randint(1, 64), num_tokens=rng.randint(1, 2048),
                         context_tokens=rng.randint(0, 40000), attn_pairs=rng.randint(0, 50))
        samples.append((f, LinearCost(true).step_seconds(f)))
    coef, err = fit_linear(samples)
    for k, v in true.items():
        assert coef[k] == pytest.approx(v, rel=1e-6, abs=1e-12)
    assert err < 1e-9


def test_calibration_file_round_trip_and_errors(tmp_path):
    steps = [{"num_seqs": s, "num_tokens": s, "context_tokens": 100 * s, "seconds": 0.01 + 0.001 * s}
             for s in range(1, 20)]
    f = tmp_path / "cal.json"
    f.write_text(json.dumps({"steps": steps}))
    cal = load_calibration(f)
    assert cal.step_seconds(StepFeatures(num_seqs=10, num_tokens=10, context_tokens=1000)) == pytest.approx(0.02)
    (tmp_path / "coef.json").write_text(json.dumps({"coefficients": {"const": 0.5}}))
    assert load_calibration(tmp_path / "coef.json").step_seconds(StepFeatures(num_seqs=1)) == 0.5
    (tmp_path / "bad.json").write_text(json.dumps({"coefficients": {"flops": 1}}))
    with pytest.raises(ValueError, match="unknown coefficients"):
        load_calibration(tmp_path / "bad.json")
    (tmp_path / "junk.json").write_text("{")
    with pytest.raises(ValueError, match="not JSON"):
        load_calibration(tmp_path / "junk.json")




def test_step_features_read_only_the_window_in_sliding_layers():
    """A decode step at 8,000 tokens of context on a layout of five sliding (window 512) layers to one full
    one: each layer reads 512 or 8,000 positions, so the average is (5 x 512 + 8,000) / 6 per sequence."""
    from kvpage.core.sequence import Request, Sequence
    from kvpage.core.step import attention_reach
    from kvpage.kv.specs import group_layers
    from kvpage.outputs import RequestMetrics
    from kvpage.sampling_params import SamplingParams

    layout = group_layers([512] * 5 + [None])
    assert attention_reach(7999, 1, 512) == (512, 512)
    assert attention_reach(7999, 1) == (8000, 8000)
    assert attention_reach(0, 600, 512) == (600, 512 * 513 // 2 + 88 * 512)
    r = Request("r", None, [1] * 8000, SamplingParams(), 0, RequestMetrics(0.0))
    out = SchedulerOutput(work=[ScheduledWork(Sequence(f"r#{i}", r, 0, [1] * 8000, 7999), 1, 7999) for i in range(4)])
    full = StepFeatures.of(out)
    hybrid = StepFeatures.of(out, layout)
    assert full.context_tokens == 4 * 8000
    assert hybrid.context_tokens == round(4 * (5 * 512 + 8000) / 6)
    assert hybrid.attn_pairs == hybrid.context_tokens
