"""Prompt logprobs (``SamplingParams.prompt_logprobs``, what scoring harnesses such as lm-eval's loglikelihood
read): every prompt token's logprob, rank and top-k under the model at the position before it, whatever the
chunking, prefix-cache state, preemption or number of samples; checked against the teacher-forced logits of
the same model (worker/scoring.py) and, in the slow test, against transformers in float32."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvpage.engine.llm import LLM
from kvpage.sampling_params import SamplingParams
from kvpage.worker.model_runner import SCORE_SLICE_BYTES, PreparedBatch, ScheduledSeq, score_slices
from kvpage.worker.scoring import chunked_logits

TEXT = ("The KV cache, not compute, caps how many requests a server holds. Blocks are handed out on demand "
        "through block tables and shared between requests that start alike. ") * 2
BLOCK_BYTES_FP32 = 30 * 16 * 3 * 128 * 4  # SmolLM2: layers x block 16 x KV heads x (K+V dims) x 4 bytes


@pytest.fixture(scope="module")
def llm() -> LLM:
    # 32-token steps: a prompt of ~70 tokens is scored over three chunks
    return LLM(kv_cache_memory="128MiB", max_model_len=512, dtype="float32", max_num_batched_tokens=32)


@pytest.fixture(scope="module")
def reference(llm) -> tuple[list[int], torch.Tensor]:
    """(prompt ids, log-softmax of the teacher-forced logits at every prompt position)."""
    ids = llm.get_tokenizer().encode(TEXT)
    logits = chunked_logits(llm.engine.worker.lm, ids, torch.float32)
    return ids, logits.log_softmax(dim=-1)


def check(pl, ids: list[int], lsm: torch.Tensor, k: int) -> None:
    assert len(pl) == len(ids) and pl[0] is None
    for p in range(len(ids) - 1):
        entry, tok, row = pl[p + 1], ids[p + 1], lsm[p]
        assert entry[tok].logprob == pytest.approx(row[tok].item(), abs=2e-3)
        assert entry[tok].rank == int((row > row[tok]).sum()) + 1 or abs(entry[tok].logprob - row.max().item()) < 2e-3
        top = [t for t, lp in entry.items() if lp.rank <= k]
        assert len(top) == k
        want = row.topk(k).indices.tolist()
        assert set(top) == set(want) or k == 0 or max(abs(row[a] - row[b]).item() for a, b in zip(
            sorted(top, key=lambda t: -row[t]), want, strict=True)) < 2e-3  # near ties may swap
        assert len(entry) in (k, k + 1)  # the top k, plus the token itself when outside them


def test_prompt_logprobs_match_teacher_forced_logits(llm, reference):
    ids, lsm = reference
    out = llm.generate(TEXT, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3), use_tqdm=False)[0]
    assert out.prompt_token_ids == ids
    check(out.prompt_logprobs, ids, lsm, 3)
    # the same prompt again: its blocks are cached now, but a scoring request computes its whole prompt
    again = llm.generate(TEXT, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0), use_tqdm=False)[0]
    assert again.num_cached_tokens == 0
    check(again.prompt_logprobs, ids, lsm, 0)
    assert [e[t].logprob for e, t in zip(again.prompt_logprobs[1:], ids[1:], strict=True)] == \
           [e[t].logprob for e, t in zip(out.prompt_logprobs[1:], ids[1:], strict=True)]
    # ... while a request without them still takes the hit
    plain = llm.generate(TEXT, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
    assert plain.num_cached_tokens > 0 and plain.prompt_logprobs is None
    assert plain.outputs[0].token_ids == out.outputs[0].token_ids
    kv = llm.engine.kv
    assert kv.num_free_blocks == kv.num_blocks


def test_n_samples_streamed_and_tiny_prompts(llm, reference):
    ids, lsm = reference
    eng = llm.engine
    eng.add_request("n3", TEXT, SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=3, prompt_logprobs=1,
                                               output_kind="delta"))
    seen = []
    while eng.has_unfinished_requests():
        seen += [o for o in eng.step() if o.request_id == "n3"]
    carried = [o.prompt_logprobs for o in seen if o.prompt_logprobs is not None]
    assert len(carried) == 1  # a delta stream carries them once
    check(carried[0], ids, lsm, 1)
    assert len({c.index for o in seen for c in o.outputs}) == 3
    one = llm.generate([[ids[0]]], SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]
    assert one.prompt_logprobs == [None]
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)


def test_recompute_preemption_scores_each_position_once(reference):
    ids, lsm = reference
    tight = LLM(kv_cache_memory=12 * BLOCK_BYTES_FP32, max_model_len=192, dtype="float32", block_size=16,
                max_num_batched_tokens=32, preemption_mode="recompute", reserve_certain_growth=False)
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, prompt_logprobs=2 if i % 2 else None)
              for i in range(4)]
    outs = tight.generate([TEXT] * 4, params, use_tqdm=False)
    assert tight.engine.stats()["preemptions"] > 0
    for i, o in enumerate(outs):
        if i % 2:
            check(o.prompt_logprobs, ids, lsm, 2)
        else:
            assert o.prompt_logprobs is None
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    kv = tight.engine.kv
    assert kv.num_free_blocks == kv.num_blocks


def test_score_slices_cover_every_row_in_order():
    seq = ScheduledSeq("s", list(range(40)), 0, [0, 1, 2], scores=(3, list(range(100, 130)), 0))
    prepared = PreparedBatch(torch.zeros(0), torch.zeros(0), [], [], torch.zeros(0), {}, [(seq, 10)])
    one_row = score_slices(prepared, SCORE_SLICE_BYTES // 4)  # a vocabulary so large each slice is one row
    assert [r.tolist() for _, r, _ in one_row] == [[10 + i] for i in range(30)]
    assert [t for _, _, part in one_row for t in part] == list(range(100, 130))
    whole = score_slices(prepared, 1000)
    assert len(whole) == 1 and whole[0][1].tolist() == list(range(10, 40))


@pytest.mark.slow
def test_prompt_logprobs_match_transformers(llm):
    from tests.helpers.reference import load_hf_gguf

    out = llm.generate(TEXT, SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
    ids = out.prompt_token_ids
    hf = load_hf_gguf(Path(llm.engine.worker.lm.path))
    with torch.no_grad():
        lsm = hf(torch.tensor([ids])).logits[0].float().log_softmax(dim=-1)
    got = torch.tensor([out.prompt_logprobs[p + 1][ids[p + 1]].logprob for p in range(len(ids) - 1)])
    want = lsm[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    assert (got - want).abs().max().item() < 2e-3
