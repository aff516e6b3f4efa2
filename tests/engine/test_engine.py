"""The engine on the embedded model: preemption never changes greedy output, n > 1 forks share blocks,
every sampling parameter behaves as specified, aborts and rejections leave nothing behind."""

from __future__ import annotations

import pytest

from kvpage.engine.llm import LLM
from kvpage.sampling_params import SamplingParams
from tests.helpers.marks import slow

PROMPTS = ["The capital of France is", "Once upon a time,", "def add(a, b):", "List three fruits:",
           "東京は", "The KV cache", "In 1969,", "Why is the sky blue?"]
BLOCK_BYTES_FP32 = 30 * 8 * 3 * 128 * 4  # SmolLM2: layers x block 8 x KV heads x (K+V dims) x 4 bytes
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(kv_cache_memory="128MiB", max_model_len=1024, dtype="float32")


@pytest.fixture(scope="module")
def baseline(llm) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def assert_drained(llm: LLM) -> None:
    kv = llm.engine.kv
    kv.check_invariants()
    assert kv.num_free_blocks == kv.num_blocks, "blocks leaked"
    assert kv.num_free_swap_blocks == kv.num_swap_blocks, "host blocks leaked"
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize(("mode", "caching"), [("recompute", True), slow("recompute", False),
                                             ("swap", False)])
def test_greedy_under_forced_preemption_equals_unpressured(baseline, mode, caching):
    tight = LLM(kv_cache_memory=12 * BLOCK_BYTES_FP32, block_size=8, max_model_len=64, preemption_mode=mode,
                dtype="float32", swap_space=64 * BLOCK_BYTES_FP32, enable_prefix_caching=caching,
                reserve_certain_growth=False)  # admission into room the outputs' known lengths need: preemptions
    assert tight.engine.kv.num_blocks == 12
    outs = tight.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == baseline
    stats = tight.engine.stats()
    assert stats["preemptions"] > 0
    if mode == "swap":
        assert stats["swap_preemptions"] > 0
    assert sum(o.metrics.num_preemptions for o in outs) == stats["preemptions"]
    assert_drained(tight)


def test_n4_forks_share_the_prompt_and_copy_on_write(llm):
    eng = llm.engine
    prompt = llm.get_tokenizer().encode("Write four different names for a small grey cat, one per line:")
    assert len(prompt) % 16 != 0
    params = SamplingParams(n=4, temperature=1.0, seed=123, max_tokens=8, ignore_eos=True)
    eng.add_request("fork", prompt, params)
    eng.step()  # prefill once, sample 4 first tokens, fork
    req = eng.requests["fork"]
    assert len(req.seqs) == 4
    tables = [eng.kv.block_table(s.seq_id) for s in req.seqs]
    assert all(t == tables[0] for t in tables)
    assert [eng.kv.ref_count(b) for b in tables[0]] == [4] * len(tables[0])
    assert eng.kv.stats().used_blocks == len(tables[0]) == -(-len(prompt) // 16)
    cow = eng.kv.stats().cow_copies
    eng.step()  # each writes its first token into the shared partial block: 3 copies, the last in place
    assert eng.kv.stats().cow_copies - cow == 3
    while eng.has_unfinished_requests():
        outs = eng.step()
    first = {c.index: c.token_ids for c in outs[0].outputs}
    assert len({tuple(v) for v in first.values()}) > 1, "samples at temperature 1 should differ"
    again = llm.generate([prompt], params, use_tqdm=False)[0]
    assert {c.index: c.token_ids for c in again.outputs} == first, "a seeded request must reproduce"
    assert_drained(llm)


def test_stop_strings_are_found_across_tokens_and_cut(llm, baseline):
    text = llm.get_tokenizer().decode(baseline[0])
    assert "answer is" in text
    p = SamplingParams(temperature=0, max_tokens=24, stop=["answer is", "never-there"])
    out = llm.generate(PROMPTS[0], p, use_tqdm=False)[0].outputs[0]
    assert out.text == text[: text.index("answer is")] and out.finish_reason == "stop"
    assert out.stop_reason == "answer is"
    p = SamplingParams(temperature=0, max_tokens=24, stop="answer is", include_stop_str_in_output=True)
    out = llm.generate(PROMPTS[0], p, use_tqdm=False)[0].outputs[0]
    assert out.text == text[: text.index("answer is") + len("answer is")]


def test_stop_token_ids_max_tokens(llm, baseline):
    ids = baseline[0]
    stop_id = ids[3]
    k = ids.index(stop_id)
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_id]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ids[: k + 1] and out.finish_reason == "stop" and out.stop_reason == stop_id
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ids[:5] and out.finish_reason == "length"


def test_bad_words_are_never_completed(llm, baseline):
    tok = llm.get_tokenizer()
    ids = baseline[0]
    # a word of the greedy output that is one token after a space: banning it changes the output right there
    at = next(i for i, t in enumerate(ids) if (w := tok.decode([t])).startswith(" ") and w[1:].isalpha()
              and tok.encode(w, add_special_tokens=False) == [t])
    word = tok.decode([ids[at]]).strip()
    p = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, bad_words=[word, "of the"])
    out = llm.generate(PROMPTS[0], p, use_tqdm=False)[0].outputs[0].token_ids
    assert [ids[at]] in p.bad_words_token_ids
    assert out[:at] == ids[:at] and out[at] != ids[at]
    sampled = llm.generate(PROMPTS[:3], SamplingParams(max_tokens=24, n=3, seed=1, bad_words=[word, "of the"]),
                           use_tqdm=False)
    for o in [out] + [c.token_ids for r in sampled for c in r.outputs]:
        for banned in p.bad_words_token_ids:
            assert not any(o[i : i + len(banned)] == banned for i in range(len(o)))
    assert_drained(llm)


def test_eos_min_tokens_and_ignore_eos(llm):
    chat = [{"role": "user", "content": "Reply with exactly one word: yes."}]
    natural = llm.chat(chat, SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)[0].outputs[0]
    assert natural.finish_reason == "stop" and natural.stop_reason is None and len(natural.token_ids) < 58
    eos = llm.get_tokenizer().eos_token_id
    assert natural.token_ids[-1] == eos and "<|im_end|>" not in natural.text
    n = len(natural.token_ids) + 5
    held = llm.chat(chat, SamplingParams(temperature=0, max_tokens=64, min_tokens=n), use_tqdm=False)[0].outputs[0]
    assert len(held.token_ids) >= n and eos not in held.token_ids[: n - 1]
    forced = llm.chat(chat, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)[0]
    assert len(forced.outputs[0].token_ids) == 30 and forced.outputs[0].finish_reason == "length"


def test_logprobs(llm, baseline):
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=6, logprobs=3),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == baseline[0][:6] and len(out.logprobs) == 6
    total = 0.0
    for tok, entry in zip(out.token_ids, out.logprobs, strict=True):
        assert len(entry) >= 3 and tok in entry
        assert entry[tok].rank == 1 and entry[tok].logprob == max(e.logprob for e in entry.values()) <= 0
        assert sorted(e.rank for e in entry.values())[:3] == [1, 2, 3]
        total += entry[tok].logprob
    assert out.cumulative_logprob == pytest.approx(total)
    sampled = llm.generate(PROMPTS[1], SamplingParams(temperature=1.5, seed=7, max_tokens=12, logprobs=0),
                           use_tqdm=False)[0].outputs[0]
    assert all(len(e) == 1 for e in sampled.logprobs)
    assert any(next(iter(e.values())).rank > 1 for e in sampled.logprobs), "hot sampling picks non-top tokens"


def test_delta_outputs_concatenate_to_the_full_text(llm, baseline):
    eng = llm.engine
    eng.add_request("delta", PROMPTS[4], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                         output_kind="delta"))
    text, ids = "", []
    while eng.has_unfinished_requests():
        for ro in eng.step():
            text += ro.outputs[0].text
            ids += ro.outputs[0].token_ids
    assert ids == baseline[4] and text == llm.get_tokenizer().decode(baseline[4])


def test_abort_frees_blocks_and_reports(llm):
    eng = llm.engine
    p = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    eng.add_request("keep", PROMPTS[1], p)
    eng.add_request("drop", PROMPTS[2], p)
    eng.step()
    eng.step()
    eng.abort_request("drop")
    eng.abort_request("no-such-request")
    done = {}
    while eng.has_unfinished_requests():
        for ro in eng.step():
            if ro.finished:
                done[ro.request_id] = ro
    assert done["drop"].outputs[0].finish_reason == "abort" and len(done["drop"].outputs[0].token_ids) == 2
    assert done["keep"].outputs[0].finish_reason == "length" and len(done["keep"].outputs[0].token_ids) == 30
    assert_drained(llm)


def test_requests_that_can_never_fit_are_rejected_and_the_queue_keeps_moving(llm):
    with pytest.raises(ValueError, match="leaves no room to generate within max_model_len=1024"):
        llm.generate([list(range(5, 1029))], SamplingParams(max_tokens=1), use_tqdm=False)
    # The worker guarantees one max_model_len sequence fits the pool, so anything under max_model_len runs;
    # a longer prompt is refused (the pool-size rule itself is tested on the scheduler).
    small = LLM(kv_cache_memory=12 * BLOCK_BYTES_FP32, block_size=8, max_model_len=64, dtype="float32")
    with pytest.raises(ValueError, match="has 64 tokens, which leaves no room"):
        small.generate(["ok", list(range(5, 69))], SamplingParams(max_tokens=60), use_tqdm=False)
    capped = small.generate([list(range(5, 45))], SamplingParams(max_tokens=60, ignore_eos=True), use_tqdm=False)
    assert len(capped[0].outputs[0].token_ids) == 24 and capped[0].outputs[0].finish_reason == "length"
    assert_drained(small)
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    with pytest.raises(ValueError, match="token ids must be integers in"):
        llm.generate([[1, 2, 10**9]], use_tqdm=False)
    with pytest.raises(ValueError, match="2 SamplingParams for 3 prompts"):
        llm.generate(["a", "b", "c"], [SamplingParams(), SamplingParams()], use_tqdm=False)
    assert_drained(llm)


def test_generate_keeps_input_order_and_prompt_forms(llm, baseline):
    tk = llm.get_tokenizer()
    prompts = [PROMPTS[2], tk.encode(PROMPTS[0]), {"prompt_token_ids": tk.encode(PROMPTS[1])}, {"prompt": PROMPTS[3]}]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [baseline[2], baseline[0], baseline[1], baseline[3]]
    assert outs[0].prompt == PROMPTS[2] and outs[1].prompt is None
    assert all(o.metrics.first_token_time >= o.metrics.arrival_time for o in outs)
    assert all(o.metrics.finished_time >= o.metrics.first_token_time for o in outs)


def test_prefix_cache_hit_is_reported(llm):
    long = "Paged attention stores keys and values in fixed-size blocks. " * 8
    llm.generate(long + "First", SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    out = llm.generate(long + "Second", SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
    assert out.num_cached_tokens >= 64
    assert llm.engine.stats()["prefix_cache_hit_rate"] > 0


def test_default_engine_is_on_the_fast_path():
    from kvpage.config import cpu_has_bf16
    from kvpage.model.layers.linear import packing_available

    llm = LLM(kv_cache_memory="64MiB", max_model_len=512)
    model = llm.engine.worker.lm.model
    from kvpage.ops import load_kernels

    # bf16 where the CPU has AVX512_BF16, float32 elsewhere; the fast path either way (given the kernels)
    assert llm.engine.worker.lm.dtype.itemsize == (2 if cpu_has_bf16() else 4)
    assert (model.fast_ops is not None) == (load_kernels() is not None and packing_available(model.norm.weight.dtype))
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0]
    assert "Paris" in out.text
    # plain greedy steps compute only argmaxes; asking for logprobs takes the full logits path: same tokens
    plain = llm.generate(PROMPTS[:4], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    full = llm.generate(PROMPTS[:4], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1),
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in plain] == [o.outputs[0].token_ids for o in full]
    assert plain[0].outputs[0].cumulative_logprob is None and full[0].outputs[0].cumulative_logprob < 0
    assert_drained(llm)


@pytest.mark.slow  # the static policy's default-run case: tests/model/test_gemma3.py (with KV groups)
def test_static_policy_engine_runs_and_admits_fewer(baseline):
    static = LLM(kv_cache_memory=24 * BLOCK_BYTES_FP32, block_size=8, max_model_len=64, dtype="float32",
                 kv_policy="static")
    outs = static.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == baseline  # same tokens, just less concurrency
    forks = static.generate(PROMPTS[0], SamplingParams(n=2, temperature=0, max_tokens=6), use_tqdm=False)[0]
    assert [c.token_ids for c in forks.outputs] == [baseline[0][:6]] * 2  # forks copy under this policy
    assert_drained(static)


def test_step_log_records_each_steps_shape_for_the_simulator(llm):
    eng = llm.engine
    prompts = [[7000 + i for i in range(37)], [9000 + i for i in range(5)]]
    eng.step_log = []
    steps_before = eng.num_steps
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
        log = eng.step_log
    finally:
        eng.step_log = None
    assert len(log) == eng.num_steps - steps_before
    # every prompt token and every generated token but the last passes through the model once
    assert sum(s["num_tokens"] for s in log) == 37 + 5 + 2 * (6 - 1)
    assert sum(s["logit_rows"] for s in log) == sum(len(o.outputs[0].token_ids) for o in outs) == 12
    assert all(s["seconds"] > 0 for s in log) and log[0]["prefill_tokens"] == 42


def test_tokens_drawn_in_the_logits_pass_equal_draws_from_the_logits(monkeypatch):
    """Steps whose requests are all plain (greedy or temperature / top-k / top-p / min-p, no logprobs, no
    penalties) draw each row's token inside the logits pass; the same seeds give the same tokens when the
    worker draws from the step's logits instead, and steps with a request that needs its logits take that path."""
    import kvpage.worker.worker as worker_mod

    llm = LLM(kv_cache_memory="64MiB", max_model_len=256)
    settings = [dict(temperature=1.0), dict(temperature=0.7, top_p=0.9), dict(temperature=1.0, top_k=50, top_p=0.95),
                dict(temperature=0.0), dict(temperature=1.2, min_p=0.05), dict(temperature=0.9, top_k=1)]

    def params(extra: dict | None = None) -> list[SamplingParams]:
        return [SamplingParams(max_tokens=12, seed=100 + i, ignore_eos=True, **settings[i % len(settings)],
                               **(extra if extra is not None and i == 3 else {})) for i in range(len(PROMPTS))]

    fused = []
    plan = worker_mod.logits_pass_draws

    def counting(reqs, vocab):
        out = plan(reqs, vocab)
        fused.append(out is not None)
        return out

    monkeypatch.setattr(worker_mod, "logits_pass_draws", counting)
    in_pass = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params(), use_tqdm=False)]
    assert fused and all(fused)
    fused.clear()
    with_logprobs = llm.generate(PROMPTS, params({"logprobs": 1}), use_tqdm=False)
    assert fused and not any(fused)
    monkeypatch.setattr(worker_mod, "logits_pass_draws", lambda reqs, vocab: None)
    from_logits = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params(), use_tqdm=False)]
    assert in_pass == from_logits
    assert [o.outputs[0].token_ids for o in with_logprobs] == from_logits  # logprobs change no draw
    assert_drained(llm)
