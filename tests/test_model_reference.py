"""The embedded model on the paged cache, token for token against transformers (fp32), and the paging
variations that must never change a token: block size, batching, chunked prefill, prefix-cache hits,
copy-on-write forks and swapping."""

from __future__ import annotations

import pytest
import torch

from kvpage.kv import KVSequence
from kvpage.worker.model_runner import ScheduledSeq
from tests.conftest import MAX_NEW
from tests.paged_driver import PagedGreedy, generate


def test_prompts_cover_the_required_shapes(prompts):
    lens = {k: len(v) for k, v in prompts.items()}
    assert len(prompts) >= 8
    assert lens["short"] < 16 and lens["story"] > 16 and lens["long"] > 16 * 16
    assert any(ord(c) > 127 for c in "東京")


def test_greedy_matches_transformers(smol_fp32, prompts, hf_greedy):
    names = list(prompts)
    ours = generate(smol_fp32, [prompts[n] for n in names], MAX_NEW)
    mismatched = [n for n, o in zip(names, ours, strict=True) if o != hf_greedy[n]]
    assert not mismatched, {n: (hf_greedy[n], ours[names.index(n)]) for n in mismatched}
    assert all(len(o) > 0 for o in ours)


@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_block_size_never_changes_tokens(smol_fp32, prompts, hf_greedy, block_size):
    names = ["short", "story", "long", "chat"]
    num_blocks = 4096 if block_size == 1 else 8192 // block_size
    ours = generate(smol_fp32, [prompts[n] for n in names], MAX_NEW, block_size=block_size, num_blocks=num_blocks)
    assert ours == [hf_greedy[n] for n in names]


def test_alone_equals_batched(smol_fp32, prompts, hf_greedy):
    names = ["fact", "non_ascii", "code", "chat_multi"]
    alone = [generate(smol_fp32, [prompts[n]], MAX_NEW)[0] for n in names]
    batched = generate(smol_fp32, [prompts[n] for n in names], MAX_NEW)
    assert alone == batched == [hf_greedy[n] for n in names]


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_prefill_never_changes_tokens(smol_fp32, prompts, hf_greedy, chunk):
    names = ["story", "long"] if chunk > 1 else ["story"]
    ours = generate(smol_fp32, [prompts[n] for n in names], MAX_NEW, chunk=chunk)
    assert ours == [hf_greedy[n] for n in names]


def test_prefix_cache_hit_never_changes_tokens(smol_fp32, prompts, hf_greedy):
    d = PagedGreedy(smol_fp32)
    first = d.add(prompts["long"], MAX_NEW)
    d.run()
    again = d.add(prompts["long"], MAX_NEW)
    assert d.cached_tokens[again] >= 256, "the second run must reuse the cached prefix"
    out = d.run()
    assert out[first] == out[again] == hf_greedy["long"]
    assert d.m.stats().prefix_hit_tokens == d.cached_tokens[again]


def test_shared_system_prompt_hits_across_requests(smol_fp32):
    """Different user turns after one long system prompt: the shared head is reused, outputs unchanged."""
    tk = smol_fp32.tokenizer
    system = {"role": "system", "content": "You are the support assistant of a bookshop. " * 6}
    a, b = (tk.encode(tk.apply_chat_template([system, {"role": "user", "content": q}]))
            for q in ("Do you sell maps?", "When do you open on Sundays?"))
    d = PagedGreedy(smol_fp32, block_size=8)
    d.add(a, MAX_NEW)
    d.run()
    sid = d.add(b, MAX_NEW)
    assert d.cached_tokens[sid] >= 40
    with_hit = d.run()[sid]
    assert with_hit == generate(smol_fp32, [b], MAX_NEW, prefix_caching=False)[0]


def test_fork_with_copy_on_write_keeps_both_branches_exact(smol_fp32, prompts, hf_greedy):
    d = PagedGreedy(smol_fp32, block_size=16)
    parent = d.add(prompts["story"], MAX_NEW)
    for _ in range(6):  # prefill + 5 decode steps: the last block is partial and gets shared
        d.step()
    assert d.m.num_tokens(parent) % 16 != 0
    d.fork(parent, "child")
    out = d.run()
    assert d.m.stats().cow_copies >= 1
    assert out[parent] == out["child"] == hf_greedy["story"]


def test_swap_out_and_in_keeps_tokens_exact(smol_fp32, prompts, hf_greedy):
    d = PagedGreedy(smol_fp32, block_size=16, swap_blocks=64, prefix_caching=False)
    a = d.add(prompts["long"], MAX_NEW)
    b = d.add(prompts["fact"], MAX_NEW)
    for _ in range(4):
        d.step()
    before = d.m.block_table(a)
    d.swap_out(a)
    d.step()
    d.step()
    filler = d.add(prompts["story"], 4)  # takes A's old blocks while it is away
    d.step()
    d.swap_in(a)
    assert d.m.block_table(a) != before, "swap-in should land in different device blocks"
    out = d.run()
    assert out[a] == hf_greedy["long"] and out[b] == hf_greedy["fact"]
    assert out[filler] == hf_greedy["story"][:4]


def teacher_forced_logits(lm, seq: list[int]) -> torch.Tensor:
    """Logits at every position of seq, computed in one prefill on a fresh paged cache."""
    d = PagedGreedy(lm, block_size=16, num_blocks=64)
    d.m.allocate_slots(KVSequence("x", seq), len(seq))
    return d.runner.execute([ScheduledSeq("x", seq, 0, d.m.block_table("x"), all_logits=True)])["x"]


def test_bf16_top1_agreement_with_fp32(smol_fp32, smol_bf16, prompts, hf_greedy, record_property):
    """Teacher-forced over prompt + fp32 continuation: bf16's argmax equals fp32's at >= 99% of positions."""
    agree = total = 0
    for name, ids in prompts.items():
        seq = ids + hf_greedy[name]
        tops = [torch.argmax(teacher_forced_logits(lm, seq), dim=-1) for lm in (smol_fp32, smol_bf16)]
        agree += int((tops[0] == tops[1]).sum())
        total += len(seq)
    rate = agree / total
    record_property("bf16_top1_agreement", rate)
    print(f"bf16 top-1 agreement with fp32: {agree}/{total} = {rate:.2%}")
    assert rate >= 0.99


def test_bf16_paths_without_amx_compute_the_same_function(smol_fp32, smol_bf16, prompts, hf_greedy, monkeypatch):
    """The fallbacks where a CPU has no AMX (oneDNN projections + silu_mul, SDPA for prompts) and the AMX
    kernels (tile GEMM with the gated epilogue, prefill_attention) differ only in bf16 rounding: teacher-forced
    argmax agreement >= 99% and logits within a small distance."""
    from kvpage.model import loader

    monkeypatch.setenv("KVPAGE_AMX_LINEAR", "0")
    monkeypatch.setenv("KVPAGE_AMX_PREFILL", "0")
    before = set(loader._LOADED)
    plain = loader.load_model("SmolLM2-135M-Instruct", dtype="bfloat16", attention_backend="cpu")
    try:
        assert plain is not smol_bf16 and plain.model.layers[0].mlp.gate_up.amx is None
        agree = total = 0
        worst = 0.0
        for name, ids in prompts.items():
            seq = ids + hf_greedy[name]
            got = [teacher_forced_logits(lm, seq) for lm in (smol_bf16, plain)]
            agree += int((got[0].argmax(-1) == got[1].argmax(-1)).sum())
            total += len(seq)
            worst = max(worst, float((got[0] - got[1]).abs().max()))
        print(f"AMX vs fallback bf16: argmax {agree}/{total}, max logit difference {worst:.3f}")
        assert agree / total >= 0.99, (agree, total)
        assert worst < 1.5, worst  # logits of magnitude ~10-30; bf16 paths drift by a few tenths at most
    finally:
        for key in set(loader._LOADED) - before:  # keep the AMX-off model out of other tests
            loader._LOADED.pop(key)
