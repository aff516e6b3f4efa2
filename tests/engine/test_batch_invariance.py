"""A seeded request draws the same tokens alone and in a busy step on the float32 fast path of AVX2 builds (the
default there): many-token steps run the float32 panel GEMM, whose outputs do not depend on the rows around
them, few-token steps the checkpoint's blocks as panels with the same sums (model/quant.py), and attention
cuts every context at fixed partitions and reads every prompt on the paged kernel (KVPAGE_BATCH_INVARIANT), so
the logits are bit-identical, and so is every draw from them."""

from __future__ import annotations

import pytest

from kvpage.engine.llm import LLM
from kvpage.sampling_params import SamplingParams

WORDS = ["the", "cache", "block", "table", "of", "pages", "holds", "keys", "and", "values", "for", "every",
         "token", "in", "a", "sequence", "while", "decode"]


def prompt(i: int, n: int) -> str:
    return " ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(n))


def same_logprobs(a, b) -> bool:
    """Every reported logprob equal, not merely close: bit-identical logits."""
    return [{t: lp.logprob for t, lp in step.items()} for step in a.logprobs] == \
        [{t: lp.logprob for t, lp in step.items()} for step in b.logprobs]


def test_seeded_and_greedy_requests_are_the_same_alone_and_in_a_busy_batch():
    """Alone, each probe's decode steps are one-token steps (the panels); in the batch, steps of many tokens."""
    llm = LLM(kv_cache_memory="64MiB", max_model_len=256)
    ops = llm.engine.worker.runner.model.fast_ops
    if ops is None or not ops.f32_gemm_ok:
        pytest.skip("the batch-independent product is the float32 panel GEMM of AVX2 builds")
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=520, max_tokens=16, logprobs=2, ignore_eos=True)
    greedy = SamplingParams(temperature=0, max_tokens=16, logprobs=2, ignore_eos=True)
    probes = [(prompt(0, 40), seeded), (prompt(1, 9), greedy)]
    # others of every length and setting around them: prompts chunked with theirs, n > 1, no seed
    others = [(prompt(i, 8 + 37 * i), SamplingParams(n=1 + i % 3, max_tokens=10 + 3 * i, top_k=40))
              for i in range(2, 7)]
    mixed = others[:2] + probes[:1] + others[2:] + probes[1:]
    busy = llm.generate([p for p, _ in mixed], [s for _, s in mixed], use_tqdm=False)
    got = {mixed[i][0]: busy[i].outputs[0] for i in range(len(mixed))}
    for text, params in probes:
        alone = llm.generate([text], [params], use_tqdm=False)[0].outputs[0]
        assert alone.token_ids == got[text].token_ids
        assert same_logprobs(alone, got[text])
    kv = llm.engine.kv
    kv.check_invariants()
    assert kv.num_free_blocks == kv.num_blocks


def test_long_prompts_are_the_same_bits_in_any_chunks_alone_or_busy():
    """A prompt past one 512-key partition: whole and alone (its decode then one stream, which the threads would
    otherwise share by cutting its context), in 96-token chunks among other requests (chunk edges wherever
    the budget falls), and again after that with its blocks found in the prefix cache: the same logits."""
    ids = [(i * 37) % 30000 + 200 for i in range(600)]
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=6, logprobs=1, ignore_eos=True)
    whole = LLM(kv_cache_memory="64MiB", max_model_len=1024, enable_prefix_caching=False)
    if not whole.engine.worker.runner.model.fast_ops.batch_invariant:
        pytest.skip("batch-invariant attention is the default of AVX2 builds (KVPAGE_BATCH_INVARIANT=auto)")
    alone = whole.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].outputs[0]
    chunked = LLM(kv_cache_memory="64MiB", max_model_len=1024, max_num_batched_tokens=96)
    others = [{"prompt_token_ids": [500 + 3 * i + j for j in range(40 + 50 * i)]} for i in range(3)]
    busy = chunked.generate([others[0], {"prompt_token_ids": ids}, *others[1:]],
                            [SamplingParams(max_tokens=12, ignore_eos=True), params,
                             *[SamplingParams(n=2, max_tokens=9, ignore_eos=True)] * 2], use_tqdm=False)
    hit = chunked.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
    assert hit.num_cached_tokens >= 576
    for out in (busy[1].outputs[0], hit.outputs[0]):
        assert out.token_ids == alone.token_ids and same_logprobs(out, alone)
