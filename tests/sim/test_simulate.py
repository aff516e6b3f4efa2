"""The simulator: its reports' arithmetic on small hand-computed traces, trace loading and the ``kvpage
simulate`` command."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import random

import pytest

from kvpage.entrypoints.cli import main
from kvpage.sim.cost import LinearCost
from kvpage.sim.simulator import SimConfig, Simulator
from kvpage.sim.workloads import SimRequest, WorkloadSpec, generate, load_trace, write_trace

ONE_SECOND = LinearCost({"const": 1.0})  # every step takes 1 s: times are step counts


def run(requests, cost=ONE_SECOND, **kw):
    cfg = SimConfig.of(**{"watermark": 0.0, "check_invariants": True, **kw})
    sim = Simulator(cfg, requests, cost)
    res = sim.run()
    assert sim.kv.num_free_blocks == sim.kv.num_blocks, "blocks leaked"
    return res


def req(rid, prompt, output, arrival=0.0, **kw):
    return SimRequest(rid, arrival, prompt, output, **kw)


# ------------------------------------------------------------ hand-computed
def test_paged_two_requests_step_by_step():
    # block 4: A = 6 prompt + 3 out, B = 3 prompt + 2 out.
    # step 1: A 6 tokens in 2 blocks, B 3 in 1: 12 slots, 9 live, tail 2 + 1
    # step 2: A 7 / B 4 tokens, same blocks: 12 slots, 11 live, tail 1; B finishes after it
    # step 3: A 8 tokens, 2 blocks: 8 slots, 8 live; A finishes
    res = run([req("A", 6, 3), req("B", 3, 2)], block_size=4, num_blocks=8, max_model_len=32)
    assert [(s.allocated_slots, s.live_slots, s.tail_slots, s.running) for s in res.steps] == [
        (12, 9, 3, 2), (12, 11, 1, 2), (8, 8, 0, 1)]
    s = res.summary()
    assert s["utilization"] == pytest.approx(28 / 32)
    assert s["waste_tail"] == pytest.approx(4 / 32)
    assert s["waste_reserved_unused"] == 0 and s["waste_external"] == 0
    assert s["tail_waste_per_seq_tokens"] == pytest.approx(4 / 5)
    assert (s["peak_concurrency"], s["mean_concurrency"]) == (2, pytest.approx(5 / 3))
    assert (s["makespan_s"], s["output_tokens"]) == (3.0, 5)
    assert s["throughput_tok_s"] == pytest.approx(5 / 3)
    lat = {r.request_id: (r.ttft, r.latency) for r in res.requests}
    assert lat == {"A": (1.0, 3.0), "B": (1.0, 2.0)}


def test_static_max_reservation_splits_waste_into_tail_and_reserved():
    # max_model_len 12 -> every request reserves 3 blocks of 4 up front
    res = run([req("A", 6, 3), req("B", 3, 2)], allocator="static", block_size=4, num_blocks=8, max_model_len=12)
    assert [(s.allocated_slots, s.live_slots, s.tail_slots, s.reserved_slots) for s in res.steps] == [
        (24, 9, 3, 12), (24, 11, 1, 12), (12, 8, 0, 4)]
    s = res.summary()
    assert s["utilization"] == pytest.approx(28 / 60)
    assert s["waste_tail"] == pytest.approx(4 / 60) and s["waste_reserved_unused"] == pytest.approx(28 / 60)


def test_static_oracle_reservations_fragment_the_pool():
    # 10 blocks of 4. Oracle reservations: A 4+2 -> 2 blocks [0,1], B 12+6 -> 5 [2..6], C 4+2 -> 2 [7,8],
    # D 20+4 -> 6 blocks: waits. Steps 1-2: one free block (too short) is stranded. A and C finish after
    # step 2: runs [0,1] and [7..9] hold 5 blocks, none a run of 6: 5 blocks stranded until B finishes
    # after step 6; D runs from step 7.
    reqs = [req("A", 4, 2), req("B", 12, 6), req("C", 4, 2), req("D", 20, 4)]
    res = run(reqs, allocator="static", static_reserve="oracle", block_size=4, num_blocks=10, max_model_len=32)
    assert [s.external_slots for s in res.steps] == [4, 4, 20, 20, 20, 20, 0, 0, 0, 0]
    s = res.summary()
    held = sum(x.allocated_slots + x.external_slots for x in res.steps)
    assert s["waste_external"] == pytest.approx(88 / held)
    d = next(r for r in res.requests if r.request_id == "D")
    assert d.ttft == 7.0


def test_paged_admits_d_at_once_where_oracle_fragments():
    reqs = [req("A", 4, 2), req("B", 12, 6), req("C", 4, 2), req("D", 20, 4)]
    res = run(reqs, block_size=4, num_blocks=10, max_model_len=32)
    d = next(r for r in res.requests if r.request_id == "D")
    assert d.ttft < 7.0 and res.summary()["waste_external"] == 0


def test_parallel_samples_share_full_prompt_blocks():
    # prompt 8 = two full blocks shared by both samples; each sample then grows its own block
    res = run([req("A", 8, 3, n=2)], block_size=4, num_blocks=8, max_model_len=32, enable_prefix_caching=False)
    assert [(s.allocated_slots, s.live_slots, s.logical_slots) for s in res.steps] == [
        (8, 8, 8), (16, 10, 18), (16, 12, 20)]
    s = res.summary()
    assert s["output_tokens"] == 6 and s["cow_copies"] == 0
    assert s["sharing_saved_fraction"] == pytest.approx(1 - 30 / 46)


def test_parallel_samples_copy_a_shared_partial_block_on_write():
    res = run([req("A", 6, 3, n=2)], block_size=4, num_blocks=8, max_model_len=32)
    assert res.summary()["cow_copies"] == 1


def test_shared_prefix_saves_99_percent_of_prefix_blocks():
    # The seeds' example: 100 requests with the same 1000-token system prompt (62 full blocks of 16).
    reqs = generate(WorkloadSpec("shared-prefix", 100, prefix_len=1000))
    s = run(reqs, num_blocks=4096).summary()
    assert s["prefix_blocks_total"] == 100 * 62
    # the first step (2048 tokens) admits two requests before the prefix is computed: both miss
    assert s["prefix_blocks_saved"] == 98 * 62
    s = run(reqs, num_blocks=4096, max_num_batched_tokens=1024).summary()
    assert s["prefix_blocks_saved"] == 99 * 62  # a smaller chunk: only the very first request misses


def test_prefix_isolation_between_distinct_prefixes():
    reqs = generate(WorkloadSpec("shared-prefix", 20, prefix_len=64, num_prefixes=20))
    s = run(reqs, num_blocks=2048).summary()
    assert s["prefix_blocks_total"] == 20 * 4 and s["prefix_blocks_saved"] == 0


def test_host_tier_brings_back_what_a_small_pool_evicts():
    """Rotating system prompts over a pool that holds a few: the host tier (--kv-offload-memory) turns the
    evicted ones into hits, its copies are charged as swaps, and every block still comes back."""
    reqs = [req(f"r{i}", 1000 + 16, 4, arrival=float(i), prefix_id=i % 10, prefix_len=1000) for i in range(60)]
    base = run(reqs, num_blocks=300, max_num_seqs=4).summary()
    tier = run(reqs, num_blocks=300, max_num_seqs=4, offload_blocks=800).summary()
    assert base["prefix_hit_rate"] < 0.1 < 0.75 < tier["prefix_hit_rate"]
    assert tier["host_tier_hit_rate"] > 0.7 and base["host_tier_hit_rate"] == 0


def test_beam_forks_copy_on_write_and_return_every_block():
    reqs = generate(WorkloadSpec("beam", 12, beam_width=4, max_output=40))
    s = run(reqs, num_blocks=512, beam_prune=0.5).summary()
    assert s["finished"] == 12 and s["cow_copies"] > 0 and s["sharing_saved_fraction"] > 0


def test_swap_preemption_under_pressure_finishes_everything():
    reqs = generate(WorkloadSpec("lognormal", 40, seed=3))
    s = run(reqs, num_blocks=200, preemption_mode="swap", num_swap_blocks=400).summary()
    assert s["finished"] == 40 and s["preemptions"] > 0 and s["swap_preemptions"] > 0


def test_requests_that_cannot_fit_are_rejected_not_stalled():
    res = run([req("big", 40, 8), req("ok", 4, 2)], block_size=4, num_blocks=6, max_model_len=32)
    assert [r for r, _ in res.rejected] == ["big"]
    assert res.summary()["finished"] == 1


def test_arrivals_leave_idle_time():
    res = run([req("A", 4, 2), req("B", 4, 2, arrival=10.0)], block_size=4, num_blocks=8, max_model_len=32)
    b = next(r for r in res.requests if r.request_id == "B")
    assert (b.ttft, b.latency) == (1.0, 2.0) and res.summary()["makespan_s"] == 12.0


# ------------------------------------------------------------------ traces
def test_trace_round_trip_and_default_prefix_len(tmp_path):
    f = tmp_path / "t.jsonl"
    f.write_text('{"arrival": 0.5, "prompt_len": 30, "output_len": 5, "prefix_id": "sys"}\n'
                 '{"arrival": 0, "prompt_len": 20, "output_len": 5, "prefix_id": "sys", "n": 2}\n\n')
    reqs = load_trace(f)
    assert [(r.arrival, r.prefix_len, r.n) for r in reqs] == [(0.0, 20, 2), (0.5, 20, 1)]
    reqs = generate(WorkloadSpec("shared-prefix", 5, prefix_len=32, rate=2.0))
    write_trace(reqs, tmp_path / "w.jsonl")
    again = load_trace(tmp_path / "w.jsonl")
    assert [(r.arrival, r.prompt_len, r.output_len, r.prefix_id, r.prefix_len) for r in again] == [
        (r.arrival, r.prompt_len, r.output_len, r.prefix_id, r.prefix_len) for r in reqs]
    assert all(b.arrival > a.arrival for a, b in itertools.pairwise(reqs))


@pytest.mark.parametrize("line, message", [
    ('{"arrival": 0, "prompt_len": 3}', "missing 'output_len'"),
    ('{"arrival": 0, "prompt_len": 3.5, "output_len": 2}', "prompt_len must be an integer"),
    ('{"arrival": 0, "prompt_len": 0, "output_len": 2}', "prompt_len must be >= 1"),
    ('{"arrival": 0, "prompt_len": 3, "output_len": 2, "colour": 1}', "unknown fields"),
    ('{"arrival": -1, "prompt_len": 3, "output_len": 2}', "arrival must be"),
    ('[1, 2]', "JSON object"),
    ('nope', "not JSON"),
])
def test_bad_trace_lines_are_named(tmp_path, line, message):
    f = tmp_path / "t.jsonl"
    f.write_text(line + "\n")
    with pytest.raises(ValueError, match=message) as e:
        load_trace(f)
    assert "t.jsonl:1" in str(e.value)


# --------------------------------------------------------------------- CLI
def test_cli_json_report(capsys):
    assert main(["simulate", "--num-requests", "40", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    s = rep["summary"]
    assert s["finished"] == 40 and s["utilization"] > 0.9 and rep["kv_bytes_per_token"] == 23040
    assert rep["config"]["num_blocks"] == 2**30 // (23040 * 16)


def test_cli_kv_cache_dtype_apart_from_the_weights(capsys):
    """As the engine's flag: float32 weights (their GEMM rate) with a bf16 cache (half the bytes per token, so
    the same GiB holds twice the blocks); an unknown dtype is named."""
    base = ["simulate", "--num-requests", "40", "--json", "--dtype", "float32", "--machine", "zen3-avx2"]
    assert main(base) == 0
    f32 = json.loads(capsys.readouterr().out)
    assert main([*base, "--kv-cache-dtype", "bfloat16"]) == 0
    bf16 = json.loads(capsys.readouterr().out)
    assert f32["kv_bytes_per_token"] == 2 * bf16["kv_bytes_per_token"] == 46080
    assert bf16["config"]["num_blocks"] == 2 * f32["config"]["num_blocks"]
    assert "GEMM 0.18 TFLOP/s" in bf16["cost_model"]  # still the float32 weights' rate
    assert main([*base, "--kv-cache-dtype", "int3"]) == 2
    assert "unknown KV dtype 'int3'" in capsys.readouterr().err


def test_cli_sweep_table(capsys):
    argv = ["simulate", "--num-requests", "30", "--sweep", "block-size=8,32", "--sweep", "allocator=paged,static"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.strip().startswith(("8 ", "32 "))]
    assert [r[:2] for r in rows] == [["8", "paged"], ["8", "static"], ["32", "paged"], ["32", "static"]]


@pytest.mark.parametrize("argv, message", [
    (["--sweep", "colour=1,2"], "cannot sweep 'colour'"),
    (["--sweep", "block-size=8,x"], "bad value 'x'"),
    (["--sweep", "allocator=paged,buddy"], "not one of"),
    (["--kv-memory", "1KiB"], "holds no block"),
    (["--preemption", "swap"], "needs a host pool"),
    (["--trace", "/nonexistent.jsonl"], "trace file not found"),
    (["--calibrate", "/nonexistent.json"], "calibration file not found"),
    (["--model", "no-such-model"], "not found"),
    (["--machine", "/nonexistent.json"], "neither a profile (xeon-amx, zen3-avx2"),
    (["--machine", "zen3-avx2"], "simulate with --dtype float32, or pass --gemm-tflops"),
])
def test_cli_errors_name_the_problem(capsys, argv, message):
    assert main(["simulate", "--num-requests", "5", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("kvpage simulate: error:")


@pytest.mark.slow
def test_cli_pictures(tmp_path, capsys):
    assert main(["simulate", "--num-requests", "24", "--png", str(tmp_path)]) == 0
    for name in ("memory_over_time.png", "waste_vs_block_size.png", "prefix_hit_vs_sharing.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"


def test_workload_spec_validation():
    with pytest.raises(ValueError, match="unknown workload"):
        WorkloadSpec("zipf")
    with pytest.raises(ValueError, match="rate"):
        WorkloadSpec(rate=0)
    assert math.isinf(WorkloadSpec().rate)


@pytest.mark.parametrize("reserve", [False, True])
def test_simulator_schedules_exactly_like_the_engine(reserve):
    """The same requests on the same pool: the real engine (embedded model) and the simulator take the
    same steps, batch the same number of tokens in each, and preempt the same number of times; with admission
    keeping room for the outputs' known lengths (ignore_eos), neither preempts."""
    from kvpage.engine.llm import LLM
    from kvpage.sampling_params import SamplingParams

    reqs = generate(WorkloadSpec("lognormal", 16, seed=5, prompt_median=40, output_median=24, max_prompt=120,
                                 max_output=60))
    reqs = [dataclasses.replace(r, ignore_eos=True) for r in reqs]
    llm = LLM(kv_cache_memory=40 * 16 * 23040, max_model_len=256, max_num_batched_tokens=128,
              reserve_certain_growth=reserve)
    eng = llm.engine
    rng = random.Random(0)
    eng.step_log = []
    for r in reqs:
        ids = [rng.randrange(100, 40000) for _ in range(r.prompt_len)]
        eng.add_request(r.request_id, ids, SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()
    real = [s["num_tokens"] for s in eng.step_log]
    cfg = SimConfig.of(num_blocks=eng.kv.num_blocks, max_model_len=256, max_num_batched_tokens=128,
                       check_invariants=True, reserve_certain_growth=reserve)
    res = Simulator(cfg, reqs, ONE_SECOND).run()
    if reserve:
        assert eng.stats()["preemptions"] == 0
    else:
        assert eng.stats()["preemptions"] > 0, "the pool should be tight enough to preempt"
    assert [s.num_tokens for s in res.steps] == real
    assert res.num_preemptions == eng.stats()["preemptions"]


def test_sweep_shows_samples_the_static_policy_could_not_fork(capsys):
    argv = ["simulate", "--workload", "parallel", "--num-requests", "8", "--num-blocks", "300",
            "--sweep", "allocator=paged,static"]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    head = next(line for line in lines if "forks refused" in line)
    static = next(line for line in lines if line.strip().startswith("static"))
    paged = next(line for line in lines if line.strip().startswith("paged"))
    assert head and paged.split()[-1] == "0" and int(static.split()[-1]) > 0


def test_the_simulator_runs_the_engines_loop_with_every_engine_knob():
    """One step loop (core.engine_core.EngineCore) for both; the scheduling policy and chunked prefill are
    simulator knobs as they are engine knobs."""
    from kvpage.core.engine_core import EngineCore

    reqs = [req("A", 8, 2, priority=1), req("B", 8, 2, priority=0)]
    fcfs = Simulator(SimConfig.of(block_size=4, num_blocks=16, max_model_len=32, max_num_seqs=1), reqs, ONE_SECOND)
    assert isinstance(fcfs.core, EngineCore)
    by_id = {r.request_id: r for r in fcfs.run().requests}
    assert by_id["A"].ttft < by_id["B"].ttft
    prio = run(reqs, block_size=4, num_blocks=16, max_model_len=32, max_num_seqs=1, scheduling_policy="priority")
    by_id = {r.request_id: r for r in prio.requests}
    assert by_id["B"].ttft < by_id["A"].ttft
    # without chunked prefill a 20-token prompt needs a 20-token budget in one step
    whole = run([req("L", 20, 1)], block_size=4, num_blocks=16, max_model_len=32, max_num_batched_tokens=32,
                enable_chunked_prefill=False)
    assert [s.num_tokens for s in whole.steps] == [20]
    chunked = run([req("L", 20, 1)], block_size=4, num_blocks=16, max_model_len=32, max_num_batched_tokens=8)
    assert [s.num_tokens for s in chunked.steps] == [8, 8, 4]
    assert SimConfig.of(scheduling_policy="priority").flat()["scheduling_policy"] == "priority"


def test_trace_priorities_round_trip(tmp_path):
    f = tmp_path / "t.jsonl"
    f.write_text('{"arrival": 0, "prompt_len": 4, "output_len": 2, "priority": 3}\n'
                 '{"arrival": 0, "prompt_len": 4, "output_len": 2}\n')
    assert [r.priority for r in load_trace(f)] == [3, 0]
    f.write_text('{"arrival": 0, "prompt_len": 4, "output_len": 2, "priority": "high"}\n')
    with pytest.raises(ValueError, match="priority must be an integer"):
        load_trace(f)
