"""Engine-level property test: random request mixes (lengths, n, temperatures, stops, aborts) on a small
pool, under both preemption modes and with bf16 or int8 pages, always finish with every invariant held and
no block in use."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, event, given, settings

from kvpage.engine.arg_utils import EngineArgs
from kvpage.engine.llm_engine import LLMEngine
from kvpage.sampling_params import SamplingParams
from tests.helpers.tiny_models import make_hf_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-engine")
    make_hf_model(path, "llama", kv_heads=2)
    return path


request_st = st.fixed_dictionaries({
    "prompt_len": st.integers(1, 40),
    "max_tokens": st.integers(1, 16),
    "n": st.integers(1, 3),
    "temperature": st.sampled_from([0.0, 0.8]),
    "seed": st.one_of(st.none(), st.integers(0, 1000)),
    "stop": st.sampled_from([None, ["e"], ["the", "x y"]]),
    "min_tokens": st.integers(0, 3),
    "abort_after": st.one_of(st.none(), st.integers(0, 6)),
    "shared_prefix": st.booleans(),
})


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    requests=st.lists(request_st, min_size=1, max_size=10),
    mode=st.sampled_from(["recompute", "swap"]),
    block_size=st.sampled_from([4, 8]),
    budget=st.sampled_from([16, 64]),
    kv_dtype=st.sampled_from(["auto", "int8"]),
)
def test_random_request_mixes_drain_cleanly(tiny_dir, requests, mode, block_size, budget, kv_dtype):
    # layers x tokens x KV heads x (K and V rows: 16 bf16 values, or 16 int8 codes and a 2-byte scale)
    bytes_per_block = 2 * block_size * 2 * 2 * (16 * 2 if kv_dtype == "auto" else 16 + 2)
    max_len = 64
    eng = LLMEngine(EngineArgs(model=str(tiny_dir), dtype="bfloat16", max_model_len=max_len, block_size=block_size,
                               kv_cache_dtype=kv_dtype,
                               kv_cache_memory=(max_len // block_size + 2) * bytes_per_block,
                               swap_space=6 * bytes_per_block, preemption_mode=mode,
                               max_num_batched_tokens=budget, max_num_seqs=6))
    assert eng.kv.num_blocks == max_len // block_size + 2  # the pool sized with the rows' scales counted
    vocab = eng.worker.lm.config.vocab_size
    head = [(7 * i) % (vocab - 3) + 3 for i in range(24)]
    aborts: dict[str, int] = {}
    for i, r in enumerate(requests):
        body = [(13 * i + 5 * j) % (vocab - 3) + 3 for j in range(r["prompt_len"])]
        prompt = (head + body)[: max_len - 20] if r["shared_prefix"] else body
        params = SamplingParams(n=r["n"], temperature=r["temperature"], seed=r["seed"], stop=r["stop"],
                                max_tokens=r["max_tokens"], min_tokens=min(r["min_tokens"], r["max_tokens"]))
        eng.add_request(f"r{i}", prompt, params)
        if r["abort_after"] is not None:
            aborts[f"r{i}"] = r["abort_after"]
    finished: dict[str, object] = {}
    for step in range(2000):
        for rid, at in list(aborts.items()):
            if step == at:
                eng.abort_request(rid)
                del aborts[rid]
        for ro in eng.step():
            if ro.finished:
                assert ro.request_id not in finished, "a request finished twice"
                finished[ro.request_id] = ro
        eng.kv.check_invariants()
        if not eng.has_unfinished_requests():
            break
    else:
        raise AssertionError("the engine did not drain: a request is stuck")
    assert set(finished) == {f"r{i}" for i in range(len(requests))}
    for i, r in enumerate(requests):
        ro = finished[f"r{i}"]
        assert len(ro.outputs) in (1, r["n"])
        for c in ro.outputs:
            assert c.finish_reason in ("stop", "length", "abort")
            assert len(c.token_ids) <= r["max_tokens"]
            if c.finish_reason == "length":
                assert len(c.token_ids) == r["max_tokens"] or len(ro.prompt_token_ids) + len(c.token_ids) == max_len
    stats = eng.stats()
    event(f"preempted: {bool(stats['preemptions'])}; swapped: {bool(stats['swap_preemptions'])}")
    event(f"aborted: {any(c.finish_reason == 'abort' for ro in finished.values() for c in ro.outputs)}")
    assert eng.kv.num_free_blocks == eng.kv.num_blocks
    assert eng.kv.num_free_swap_blocks == eng.kv.num_swap_blocks
    assert not len(eng.scheduler.running) and not len(eng.scheduler.waiting) and not len(eng.scheduler.swapped)
