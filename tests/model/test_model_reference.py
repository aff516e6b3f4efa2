"""The embedded model on the paged cache, token for token against transformers (fp32), and the paging
variations that must never change a token: block size, batching, chunked prefill, prefix-cache hits,
copy-on-write forks and swapping."""

from __future__ import annotations

import itertools

import pytest
import torch

from kvpage.envs import KernelConfig
from kvpage.kv import KVSequence
from kvpage.worker.model_runner import ScheduledSeq
from tests.helpers.fast_forms import FORM_PARAMS, FORMS, check_form, teacher_forced_decode
from tests.helpers.kernels import amx_ops
from tests.helpers.marks import slow
from tests.helpers.paged_driver import PagedGreedy, generate
from tests.helpers.prompts import MAX_NEW


def test_prompts_cover_the_required_shapes(prompts):
    lens = {k: len(v) for k, v in prompts.items()}
    assert len(prompts) >= 8
    assert lens["short"] < 16 and lens["story"] > 16 and lens["long"] > 16 * 16
    assert any(ord(c) > 127 for c in "東京")


@pytest.mark.slow
def test_stored_reference_is_what_transformers_generates(hf_smol, smol_fp32, prompts):
    """The stored outputs the default run compares against are transformers' own, prompt for prompt: the same
    tokens, and beam scores within what transformers' float32 scores move from one CPU to another."""
    import json

    from tests.helpers.reference import STORED, assert_same_beams, generate_reference

    stored = json.loads(STORED.read_text())
    fresh = generate_reference(hf_smol, prompts, list(smol_fp32.tokenizer.eos_token_ids))
    assert fresh["greedy"] == stored["greedy"]
    assert fresh["beams"].keys() == stored["beams"].keys()
    for key, entry in fresh["beams"].items():
        want = stored["beams"][key]
        assert entry["prompt_digest"] == want["prompt_digest"], key
        assert_same_beams(entry["beams"], want["beams"])


def test_greedy_matches_transformers(smol_fp32, prompts, hf_greedy):
    names = list(prompts)
    ours = generate(smol_fp32, [prompts[n] for n in names], MAX_NEW)
    mismatched = [n for n, o in zip(names, ours, strict=True) if o != hf_greedy[n]]
    assert not mismatched, {n: (hf_greedy[n], ours[names.index(n)]) for n in mismatched}
    assert all(len(o) > 0 for o in ours)


@pytest.mark.parametrize("block_size", [1, slow(16), slow(32)])  # 16: every other test's
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


@pytest.mark.parametrize("chunk", [1, 7, slow(64)])
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


def teacher_forced_agreement(a, b, prompts, hf_greedy) -> tuple[int, int, float]:
    """Two models teacher-forced over every prompt and its reference continuation: (positions whose argmax
    agree, positions, largest logit difference)."""
    agree = total = 0
    worst = 0.0
    for name, ids in prompts.items():
        seq = ids + hf_greedy[name]
        got = [teacher_forced_logits(lm, seq) for lm in (a, b)]
        agree += int((got[0].argmax(-1) == got[1].argmax(-1)).sum())
        total += len(seq)
        worst = max(worst, float((got[0] - got[1]).abs().max()))
    return agree, total, worst


@pytest.mark.slow
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


@pytest.mark.slow  # the opt-out form since the panels; its kernel's tests (tests/ops/test_quant_linear.py) stay
def test_int16_decode_agrees_with_fp32(smol_fp32, load_fast, prompts, hf_greedy, record_property):
    """One-token decode steps with 16-bit integer activation codes (KernelConfig.quant_int16 on rows of blocks:
    KVPAGE_QUANT_PANELS=0 on AVX2 builds), teacher-forced over prompt + transformers' continuation: the argmax
    equals the exact float32 path's at every position and no logit moves by more than 0.05 (measured: 0.007;
    llama.cpp-style 8-bit codes moved them by up to 3.5 and agreed at 93%)."""
    smol_fp32_fast = load_fast(FORMS["int16"])
    if not smol_fp32_fast.model.fast_ops.quant_int16_available():
        pytest.skip("this build has no 16-bit integer quantized product (AVX2 builds only)")
    assert smol_fp32_fast.model.layers[0].mlp.gate_up.quant.kind == "q4"
    agree = total = 0
    worst = 0.0
    for ids, cont in ((prompts[n], hf_greedy[n]) for n in prompts):
        seq = ids + cont
        exact = teacher_forced_logits(smol_fp32, seq)[len(ids) - 1 : -1]
        got = teacher_forced_decode(smol_fp32_fast, seq, len(ids))
        assert got.shape == exact.shape
        agree += int((got.argmax(-1) == exact.argmax(-1)).sum())
        total += got.shape[0]
        worst = max(worst, float((got - exact).abs().max()))
    record_property("int16_decode_max_logit_diff", worst)
    print(f"int16 decode: argmax agreement {agree}/{total}, max |logit diff| {worst:.4f}")
    assert agree == total
    assert worst < 0.05


@pytest.mark.parametrize("form", FORM_PARAMS)
def test_fp32_fast_path_generates_transformers_tokens(smol_fp32, smol_fp32_fast, load_fast, prompts, hf_greedy,
                                                      form):
    """float32 on the fast path, as dtype auto runs it without AVX512_BF16: decode steps from the checkpoint's
    quantized blocks (the exact weights: as panels with the panel GEMM's sums by default on AVX2 builds, or rows
    of blocks with float32 sums in another order or 16-bit activation codes), prompts through the float32 panel
    GEMM (oneDNN's packed product on other builds), fused norms / RoPE / SiLU. Greedy tokens
    equal transformers' float32 ones; one prompt at a time, so every decode step is a one-token step on the
    quantized blocks. Each form of the blocks."""
    check_form(smol_fp32_fast, form)
    assert smol_fp32_fast is not smol_fp32 and smol_fp32.model.fast_ops is None  # the exact path stays as it was
    lm = load_fast(FORMS[form])
    assert lm.model.layers[0].mlp.gate_up.quant is not None and lm.model.fast.lm_quant is not None
    for name, ids in prompts.items():
        assert generate(lm, [ids], MAX_NEW)[0] == hf_greedy[name], name


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, slow(torch.float16)])
def test_fp32_weights_with_a_half_size_cache_on_the_fast_path(smol_fp32, smol_fp32_fast, prompts, hf_greedy,
                                                             record_property, kv_dtype):
    """`--kv-cache-dtype bfloat16` (or float16) under float32 weights (half the KV bytes: twice the tokens in
    the same pool): the fast path (batched, so prompts and decode share steps) generates the same greedy tokens
    as the exact path on the same cache dtype, which computes attention from the same rounded keys and values.
    Both run the compiled kernels, the decode layer stack included (on AVX2 builds the row kernel widens the
    16-bit values in registers: named avx2-bf16 / avx2-f16). Agreement with transformers' float32-cache tokens
    is recorded, not required (rounding may flip a tie)."""
    names = list(prompts)
    ids = [prompts[n] for n in names]
    exact = generate(smol_fp32, ids, MAX_NEW, kv_dtype=kv_dtype)
    fast = generate(smol_fp32_fast, ids, MAX_NEW, kv_dtype=kv_dtype)
    assert fast == exact
    ops = smol_fp32_fast.model.fast_ops
    if ops.f32_gemm_available():  # an AVX2 + FMA build without AVX-512
        assert ops.last_decode_kernel() == {torch.bfloat16: "avx2-bf16", torch.float16: "avx2-f16"}[kv_dtype]
    same = sum(a == b for n, out in zip(names, fast, strict=True) for a, b in zip(out, hf_greedy[n], strict=True))
    record_property(f"{kv_dtype}_cache_token_agreement", same / sum(len(hf_greedy[n]) for n in names))


def test_bf16_paths_without_amx_compute_the_same_function(smol_fp32, smol_bf16, prompts, hf_greedy):
    """The fallbacks where a CPU has no AMX (oneDNN projections + silu_mul, SDPA for prompts) and the AMX
    kernels (tile GEMM with the gated epilogue, prefill_attention) differ only in bf16 rounding: teacher-forced
    argmax agreement >= 99% and logits within a small distance. The int8 GEMM, which Intel CPUs without AMX
    take instead of oneDNN, is held off here: its rounding is another one (two approximations of float32 agree
    with each other less than each agrees with float32: 642/650 on the AMX Xeon), and its own test checks it
    against float32 (tests/model/test_i8_gemm_model.py)."""
    from kvpage.model import loader

    amx_ops("amx_linear_available")  # without AMX, smol_bf16 already is the fallback: nothing to compare
    before = set(loader._LOADED)
    plain = loader.load_model("SmolLM2-135M-Instruct", dtype="bfloat16", attention_backend="cpu",
                              kernel_config=KernelConfig(amx_linear=False, amx_prefill=False, i8_gemm="0"))
    try:
        assert plain is not smol_bf16 and plain.model.layers[0].mlp.gate_up.amx is None
        agree, total, worst = teacher_forced_agreement(smol_bf16, plain, prompts, hf_greedy)
        print(f"AMX vs fallback bf16: argmax {agree}/{total}, max logit difference {worst:.3f}")
        assert agree / total >= 0.99, (agree, total)
        assert worst < 1.5, worst  # logits of magnitude ~10-30; bf16 paths drift by a few tenths at most
    finally:
        for key in set(loader._LOADED) - before:  # keep the AMX-off model out of other tests
            loader._LOADED.pop(key)


def _prompt_kernel_on(lm) -> None:
    amx_ops("prefill_amx_available")
    if not getattr(lm.model.layers[0].self_attn.backend, "prefill_cached", False):
        pytest.skip("the cache-reading prompt kernel is off (KVPAGE_AMX_PREFILL=0, KVPAGE_PREFILL_CACHED=0 or "
                    "another attention backend)")


def _last_logits(lm, seq: list[int], cuts: tuple[int, ...]) -> torch.Tensor:
    """The logits after seq's last token, its prompt computed in chunks ending at `cuts` (and len(seq))."""
    d = PagedGreedy(lm, block_size=16, num_blocks=64)
    d.m.allocate_slots(KVSequence("x", seq), len(seq))
    table = d.m.block_table("x")
    bounds = (0, *cuts, len(seq))
    for a, b in itertools.pairwise(bounds):
        out = d.runner.execute([ScheduledSeq("x", seq[a:b], a, table, need_logits=b == len(seq))])
    return out["x"]


def test_bf16_prompt_chunks_after_cached_keys_are_bit_exact(smol_bf16, prompts):
    """In bf16 the projections of >= 5 rows give a row the same bits whatever its batch, and every prompt chunk
    of >= 64 tokens, after cached keys or not, goes through the same prompt kernel with the same per-row order
    of sums: a prompt computed in chunks ends in the very logits of the prompt computed at once (the last
    row's logits depend on every earlier key and value of every layer)."""
    _prompt_kernel_on(smol_bf16)
    seq = (prompts["long"] * 2)[:330]
    whole = _last_logits(smol_bf16, seq, ())
    assert torch.equal(_last_logits(smol_bf16, seq, (128, 192)), whole)
    assert torch.equal(_last_logits(smol_bf16, seq, (100, 237)), whole)  # cached prefixes off the 16-key grid


def _mixed_step(lm, prompts):
    """One step holding a prompt chunk after cached keys (a), a decode (b) and a fresh prompt (c), in that
    scheduler order; returns each sequence's logits."""
    a = (prompts["long"] * 2)[:200]  # 100 cached + a 100-token chunk
    b = prompts["story"] + [13]  # a decode after its prompt
    c = (prompts["long"] * 2)[5:105]  # a fresh 100-token prompt
    d = PagedGreedy(lm, block_size=16, num_blocks=128)
    for sid, s in (("a", a), ("b", b), ("c", c)):
        d.m.allocate_slots(KVSequence(sid, s), len(s))
    tab = {sid: d.m.block_table(sid) for sid in "abc"}
    d.runner.execute([ScheduledSeq("a", a[:100], 0, tab["a"]), ScheduledSeq("b", b[:-1], 0, tab["b"])])
    got = d.runner.execute([ScheduledSeq("a", a[100:], 100, tab["a"], need_logits=True),
                            ScheduledSeq("b", b[-1:], len(b) - 1, tab["b"], need_logits=True),
                            ScheduledSeq("c", c, 0, tab["c"], need_logits=True)])
    return got, a, b, c


def test_bf16_step_mixing_decode_cached_chunk_and_fresh_prompt(smol_bf16, prompts):
    """The runner regroups a mixed step for the kernels and every sequence gets its own logits back: a and c
    bit-equal to their prompts computed at once (the same prompt kernel)."""
    _prompt_kernel_on(smol_bf16)
    got, a, b, c = _mixed_step(smol_bf16, prompts)
    assert torch.equal(got["a"], _last_logits(smol_bf16, a, ()))
    assert torch.equal(got["c"], _last_logits(smol_bf16, c, ()))
    # b alone decodes one row, which takes the few-row projections (another rounding): close, same argmax
    alone = _last_logits(smol_bf16, b, (len(b) - 1,))
    assert got["b"].argmax() == alone.argmax() and (got["b"] - alone).abs().max() < 1.0


def test_bf16_mixed_step_without_the_prompt_kernel(load_fast, prompts):
    """Without the prompt kernel the chunk after cached keys goes to the paged kernel over its own slice of the
    batch (rows after the decode's): the same logits as that chunk computed in a step of its own."""
    lm = load_fast(KernelConfig(amx_prefill=False, prefill_cached=False, paged_prompts=False), dtype="bfloat16")
    backend = lm.model.layers[0].self_attn.backend
    if not hasattr(backend, "prefill_cached"):
        pytest.skip("needs the compiled CPU attention backend")
    assert not backend.amx_prefill and not backend.prefill_cached
    got, a, _, c = _mixed_step(lm, prompts)
    assert torch.equal(got["a"], _last_logits(lm, a, (100,)))
    assert torch.equal(got["c"], _last_logits(lm, c, ()))


def test_bf16_fresh_prompts_on_the_paged_kernel_without_amx(load_fast, prompts, hf_greedy):
    """Without the AMX prompt kernel, bf16 caches send whole fresh prompts to the paged kernel (no SDPA
    group at all); teacher-forced over every test prompt, it agrees with SDPA (paged_prompts=False) on the
    argmax >= 99% with logits a bf16 rounding apart, and a mixed step still returns each sequence's logits."""
    paged = load_fast(KernelConfig(amx_prefill=False, prefill_cached=False), dtype="bfloat16")
    backend = paged.model.layers[0].self_attn.backend
    if not getattr(backend, "paged_prompts", False):
        pytest.skip("the paged kernel takes fresh prompts on AVX512_BF16 builds of the CPU backend only")
    cache = torch.empty(2, 4, 16, 3, 64, dtype=torch.bfloat16)
    assert backend.metadata_builder(cache, torch.bfloat16, 9).prefill_min is None
    sdpa = load_fast(KernelConfig(amx_prefill=False, prefill_cached=False, paged_prompts=False), dtype="bfloat16")
    assert sdpa.model.layers[0].self_attn.backend.metadata_builder(cache, torch.bfloat16, 9).prefill_min == 64
    agree, total, worst = teacher_forced_agreement(paged, sdpa, prompts, hf_greedy)
    assert agree / total >= 0.99, (agree, total)
    assert worst < 1.5, worst
    got, _, _, c = _mixed_step(paged, prompts)
    alone = _last_logits(paged, c, ())
    assert got["c"].argmax() == alone.argmax() and (got["c"] - alone).abs().max() < 1.0
