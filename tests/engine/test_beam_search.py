"""Beam search inside the engine against transformers' ``generate(num_beams=k)`` (float32, the independent
reference, its outputs as tests/helpers/reference.py stores them): the same beams, in the same order, with the
same cumulative log-probabilities, on shared blocks, under forced preemption and at block sizes 1 and 16; and the
KV bookkeeping a beam group leaves behind."""

from __future__ import annotations

import pytest

from kvpage.core.beam import BeamGroup
from kvpage.engine.llm import LLM
from kvpage.sampling_params import BeamSearchParams
from tests.engine.test_engine import BLOCK_BYTES_FP32, assert_drained
from tests.helpers.marks import slow
from tests.helpers.reference import BEAM_LENGTH as LENGTH
from tests.helpers.reference import FINISHED_PROMPTS, FIXED_PROMPTS, BeamCase, assert_same_beams, stored_beams


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(kv_cache_memory="256MiB", max_model_len=1024, dtype="float32")


@pytest.fixture(scope="module")
def chat_ids(prompts) -> dict[str, list[int]]:
    return {name: prompts[name] for name in FIXED_PROMPTS}


def ours(llm: LLM, ids: list[int], params: BeamSearchParams) -> list[tuple[list[int], float]]:
    out = llm.beam_search([{"prompt_token_ids": ids}], params)[0]
    return [(s.output_token_ids, s.cum_logprob) for s in out.sequences]


@pytest.mark.parametrize("k", [2, slow(4), slow(8)])
def test_fixed_length_beams_equal_transformers(llm, chat_ids, k):
    params = BeamSearchParams(beam_width=k, max_tokens=LENGTH, min_tokens=LENGTH, length_penalty=0.0)
    for name, ids in chat_ids.items():
        assert_same_beams(ours(llm, ids, params), stored_beams(BeamCase(name, k, 0.0, True), ids))
    assert_drained(llm)


@pytest.mark.parametrize("early_stopping", [slow(False), True, slow("never")])
def test_finished_set_with_eos_and_length_penalty_equals_transformers(llm, prompts, early_stopping):
    params = BeamSearchParams(beam_width=4, max_tokens=LENGTH, length_penalty=1.0, early_stopping=early_stopping)
    for name in FINISHED_PROMPTS:
        ids = prompts[name]
        got = llm.beam_search([{"prompt_token_ids": ids}], params)[0].sequences
        want = stored_beams(BeamCase(name, 4, 1.0, False, early_stopping), ids)
        assert [s.output_token_ids for s in got] == [t for t, _ in want]
        for s, (toks, score) in zip(got, want, strict=True):
            assert abs(s.cum_logprob / len(toks) - score) < 1e-4
    assert_drained(llm)


@pytest.mark.parametrize(("block_size", "mode"), [slow(1, "recompute"),
                                                  slow(16, "recompute"), (16, "swap")])
def test_block_sizes_and_forced_preemption_never_change_beams(llm, chat_ids, block_size, mode):
    params = BeamSearchParams(beam_width=4, max_tokens=LENGTH, min_tokens=LENGTH, length_penalty=0.0)
    want = {name: ours(llm, ids, params) for name, ids in chat_ids.items()}
    longest = max(len(ids) for ids in chat_ids.values()) + LENGTH
    # room for one beam group at a time, not three: groups preempt each other while they fork
    blocks = -(-longest // block_size) + 4 * (-(-LENGTH // block_size) + 2)
    tight = LLM(kv_cache_memory=blocks * BLOCK_BYTES_FP32 // 8 * block_size, block_size=block_size,
                max_model_len=longest, dtype="float32", preemption_mode=mode, swap_space=4 * blocks * BLOCK_BYTES_FP32)
    outs = tight.beam_search([{"prompt_token_ids": ids} for ids in chat_ids.values()], params)
    for name, out in zip(chat_ids, outs, strict=True):
        assert_same_beams([(s.output_token_ids, s.cum_logprob) for s in out.sequences], want[name])
    assert tight.engine.stats()["preemptions"] > 0
    assert_drained(tight)


def test_chunked_prefill_and_prefix_cache_hits_never_change_beams(llm, chat_ids):
    """A prompt computed in 16-token chunks under a 16-token step budget, then the same prompt again (its blocks
    found in the prefix cache): the same beams."""
    params = BeamSearchParams(beam_width=4, max_tokens=LENGTH, min_tokens=LENGTH, length_penalty=0.0)
    ids = chat_ids["chat_multi"]
    want = ours(llm, ids, params)
    small = LLM(kv_cache_memory="64MiB", max_model_len=256, dtype="float32", max_num_batched_tokens=16)
    first = small.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
    again = small.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
    for out in (first, again):
        assert_same_beams([(c.token_ids, c.cumulative_logprob) for c in out.outputs], want)
    assert first.num_cached_tokens == 0 and again.num_cached_tokens >= len(ids) // 16 * 16
    assert_drained(small)


def test_beams_share_the_prompt_blocks_and_pruned_beams_return_theirs(llm, chat_ids):
    eng = llm.engine
    ids = chat_ids["chat_multi"]
    eng.add_request("beams", ids, BeamSearchParams(beam_width=4, max_tokens=LENGTH, min_tokens=LENGTH))
    req = eng.requests["beams"]
    prompt_full = len(ids) // eng.kv.block_size
    while req.metrics.first_token_time is None:
        eng.step()
    peak = 0
    while eng.has_unfinished_requests():
        live = [s for s in req.seqs if not s.finished]
        if live and all(eng.kv.has_seq(s.seq_id) for s in live):
            tables = [eng.kv.block_table(s.seq_id) for s in live]
            assert len(live) <= 4
            assert all(t[:prompt_full] == tables[0][:prompt_full] for t in tables)  # the prompt, shared
            used = eng.kv.num_blocks - eng.kv.num_free_blocks
            peak = max(peak, used)
            stats = eng.stats()
            if len(live) > 1:
                assert stats["kv_blocks_shared"] >= prompt_full
            assert stats["kv_blocks_per_request"] == used
            # the prompt's full blocks once, plus each beam's own tail
            assert used <= prompt_full + len(live) * (-(-(len(ids) % eng.kv.block_size + LENGTH) // 16) + 1)
        eng.step()
    assert peak > prompt_full
    assert eng.stats()["cow_copies"] > 0
    assert_drained(llm)


def test_beam_width_one_is_greedy(llm, chat_ids):
    from kvpage.sampling_params import SamplingParams

    ids = chat_ids["story"]
    greedy = llm.generate([{"prompt_token_ids": ids}],
                          SamplingParams(temperature=0, max_tokens=LENGTH, min_tokens=LENGTH))[0]
    beam = llm.beam_search([{"prompt_token_ids": ids}],
                           BeamSearchParams(beam_width=1, max_tokens=LENGTH, min_tokens=LENGTH))[0]
    assert beam.sequences[0].output_token_ids == greedy.outputs[0].token_ids


def test_bad_beam_settings_are_refused_by_name(llm):
    for kw, word in [(dict(beam_width=0, max_tokens=4), "beam_width"), (dict(beam_width=2, max_tokens=0), "max_tokens"),
                     (dict(beam_width=2, max_tokens=4, n=3), "n must"),
                     (dict(beam_width=2, max_tokens=4, early_stopping="soon"), "early_stopping"),
                     (dict(beam_width=2, max_tokens=4, length_penalty=float("nan")), "length_penalty")]:
        with pytest.raises(ValueError, match=word):
            BeamSearchParams(**kw)
    small = LLM(kv_cache_memory=16 * BLOCK_BYTES_FP32, block_size=8, max_model_len=64, dtype="float32")
    from kvpage.errors import KVCapacityError

    with pytest.raises(KVCapacityError, match="beam_width"):
        small.engine.add_request("wide", [1, 2, 3], BeamSearchParams(beam_width=16, max_tokens=40))
    assert_drained(small)


def test_group_keeps_the_best_finished_and_stops_early():
    """The selection rule alone: EOS candidates in the first width ranks finish; later ones are dropped."""
    g = BeamGroup(width=2, max_tokens=5, stop_ids=(0,), eos_ids=frozenset({0}), length_penalty=1.0)
    g.start("a")
    assert g.offer("a", [(0, -0.1), (7, -0.5), (8, -0.7), (9, -2.0)])
    nxt = g.advance({"a": []}, 0)
    assert [(c.token, c.parent) for c in nxt] == [(7, "a"), (8, "a")]
    assert [h.token_ids for h in g.finished] == [(0,)]
    for c in nxt:
        g.cum[c.parent + str(c.token)] = c.cum_logprob
    assert not g.offer("a7", [(0, -0.01), (5, -3.0)])
    assert g.offer("a8", [(0, -5.0), (6, -0.01)])
    nxt = g.advance({"a7": [7], "a8": [8]}, 1)
    # ranks: a7+EOS -0.51 (finishes), a8+6 -0.71 (runs), a7+5, a8+EOS (rank 3: dropped)
    assert [h.token_ids for h in g.finished] == [(0,), (7, 0)]
    # the best running beam, -0.71 / 2, cannot beat the worst finished, -0.51 / 2: the search is over
    assert nxt == [] and g.done and not g.improvable


def test_generate_cli_prints_the_best_beams(llm, capsys):
    from kvpage.entrypoints.cli import main

    want = llm.beam_search(["The capital of France is"], BeamSearchParams(beam_width=3, n=2, max_tokens=8))[0]
    code = main(["generate", "The capital of France is", "--beam-width", "3", "-n", "2", "--max-tokens", "8",
                 "--dtype", "float32", "--kv-cache-memory", "64MiB", "--max-model-len", "256", "--json"])
    out, _ = capsys.readouterr()
    assert code == 0
    import json

    got = json.loads(out)[0]["outputs"]
    assert [c["token_ids"] for c in got] == [s.output_token_ids for s in want.sequences]
    code = main(["generate", "x", "--beam-width", "2", "--stream", "--dtype", "float32", "--kv-cache-memory", "64MiB",
                 "--max-model-len", "256"])
    assert code == 2 and "does not stream" in capsys.readouterr().err


def test_without_prefix_caching_a_group_that_cannot_come_back_fails_instead_of_hanging(llm, chat_ids):
    """Without prefix caching a preempted group's beams come back as unshared copies, which a tight pool may
    never hold together: such a request fails with an error saying so; the others finish with the right beams
    and nothing leaks."""
    params = BeamSearchParams(beam_width=4, max_tokens=LENGTH, min_tokens=LENGTH, length_penalty=0.0)
    want = {name: ours(llm, ids, params) for name, ids in chat_ids.items()}
    longest = max(len(ids) for ids in chat_ids.values()) + LENGTH
    blocks = longest + 4 * (LENGTH + 2)
    tight = LLM(kv_cache_memory=blocks * BLOCK_BYTES_FP32 // 8, block_size=1, max_model_len=longest,
                dtype="float32", enable_prefix_caching=False)
    outs = tight.generate([{"prompt_token_ids": ids} for ids in chat_ids.values()], params, use_tqdm=False)
    failed = 0
    for name, out in zip(chat_ids, outs, strict=True):
        if out.error:
            assert "cannot be scheduled" in out.error and "prefix caching" in out.error
            failed += 1
        else:
            assert_same_beams([(c.token_ids, c.cumulative_logprob) for c in out.outputs], want[name])
    assert tight.engine.stats()["preemptions"] > 0 and failed < len(outs)
    assert_drained(tight)
