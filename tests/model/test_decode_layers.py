"""The compiled decoder layer stacks (ops/csrc/decode_layers.cpp): the same kernels in the same order as the fast
path's Python layer loop, so the same bits; few-token steps on the quantized blocks, batched decode steps on the
AMX tile GEMM."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvpage.envs import KernelConfig
from kvpage.kv import KVSequence
from kvpage.worker.model_runner import ScheduledSeq
from tests.helpers.fast_forms import FORM_PARAMS, FORMS, check_form, teacher_forced_decode
from tests.helpers.kernels import amx_ops
from tests.helpers.paged_driver import PagedGreedy, generate


@pytest.mark.parametrize("form", FORM_PARAMS)
def test_compiled_decode_layers_equal_the_python_loop(smol_fp32_fast, load_fast, prompts, hf_greedy, form):
    """Decode-only few-token steps run the layer stack in one compiled call (ops/csrc/decode_layers.cpp) with the
    same kernels in the same order as the Python layer loop (KernelConfig.decode_layers="python"): the logits
    are bit-identical, one stream (teacher-forced) and a batch of streams (greedy), each form of the blocks."""
    check_form(smol_fp32_fast, form)
    names = sorted(prompts)
    seq = prompts[names[0]] + hf_greedy[names[0]]
    lm = load_fast(FORMS[form])
    stack = lm.model.fast.decode_layers
    assert stack is not None and stack.num_layers() == len(lm.model.layers)
    compiled = teacher_forced_decode(lm, seq, len(prompts[names[0]]))
    batch_compiled = generate(lm, [prompts[n] for n in names[:3]], 12)
    loop = load_fast(dataclasses.replace(FORMS[form], decode_layers="python"))
    assert loop.model.fast.decode_layers is None
    assert torch.equal(compiled, teacher_forced_decode(loop, seq, len(prompts[names[0]])))
    assert batch_compiled == generate(loop, [prompts[n] for n in names[:3]], 12)


def test_compiled_decode_layers_reject_bad_input(smol_fp32_fast):
    """A call with the wrong number of caches is refused with the reason, before any cache is written."""
    fast = smol_fp32_fast.model.fast
    stack = fast.decode_layers
    h = torch.zeros(1, smol_fp32_fast.model.norm.weight.shape[0])
    plan = fast.ops.plan_attention(torch.zeros(1, 1, dtype=torch.long), torch.tensor([0, 1]), torch.ones(1,
                                   dtype=torch.long), fast.plan[0].num_heads, 4, 16)
    with pytest.raises(RuntimeError, match="KV caches for"):
        stack.run(h, torch.ones(1, 64), torch.zeros(1, 64), [], torch.zeros(1, dtype=torch.long), plan, False, False)


def batched_decode_logits(lm, seqs: list[list[int]], start: int) -> list[torch.Tensor]:
    """Each step's logits (sequences in order) of a batch: a prefill of every seq[:start], then one token of each
    per step from its own continuation (teacher-forced), so every step after the first is a decode-only step of
    len(seqs) rows."""
    d = PagedGreedy(lm, block_size=16, num_blocks=256)
    names = [f"s{i}" for i in range(len(seqs))]
    steps = []
    for end in range(start, min(len(s) for s in seqs)):
        batch = []
        for name, seq in zip(names, seqs, strict=True):
            begin = 0 if end == start else end - 1
            d.m.allocate_slots(KVSequence(name, seq[:end]), end - begin)
            batch.append(ScheduledSeq(name, seq[begin:end], begin, d.m.block_table(name)))
        out = d.runner.execute(batch)
        steps.append(torch.stack([out[name] for name in names]))
    return steps


def test_compiled_amx_layers_equal_the_python_loop(load_fast, prompts, hf_greedy):
    """bf16 decode-only steps of more rows than the quantized blocks take (batched decode) run the layer stack
    in one compiled call on the AMX tile GEMM (FastPath.amx_layers), with the same kernels in the same order as
    the Python layer loop: the logits of every step are bit-identical."""
    amx_ops("amx_linear_available")
    compiled = load_fast(KernelConfig(), dtype="bfloat16")
    fast = compiled.model.fast
    assert fast.amx_layers is not None and fast.amx_layers.num_layers() == len(compiled.model.layers)
    calls = []

    class Counting:  # the stack, counting the steps it runs
        def __init__(self, stack):
            self.stack = stack

        def run(self, *args):
            calls.append(args[0].shape[0])
            return self.stack.run(*args)

    fast.amx_layers = Counting(fast.amx_layers)
    names = sorted(prompts)
    seqs = [prompts[n] + hf_greedy[n] for n in names] * 2  # 2 x the prompts: more rows than quant_max_tokens
    start = min(len(prompts[n]) for n in names)
    assert len(seqs) > compiled.model.fast_ops.config.quant_max_tokens
    got = batched_decode_logits(compiled, seqs, start)
    assert calls and set(calls) == {len(seqs)}  # every decode step, and only those, on the stack
    loop = load_fast(KernelConfig(decode_layers="python"), dtype="bfloat16")
    assert loop.model.fast.amx_layers is None
    want = batched_decode_logits(loop, seqs, start)
    assert len(got) == len(want) > 1
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_compiled_amx_layers_keep_to_the_row_limit(load_fast, prompts, hf_greedy):
    """With the layers' row limit (KVPAGE_AMX_LINEAR_MAX_ROWS) below a decode step's rows, that step takes the
    Python loop, whose projections go to oneDNN above the limit; at or above it, the compiled stack."""
    amx_ops("amx_linear_available")
    names = sorted(prompts)
    seqs = [prompts[n] + hf_greedy[n] for n in names] * 2
    start = min(len(prompts[n]) for n in names)
    for limit, on_stack in ((len(seqs) - 1, False), (len(seqs), True)):
        lm = load_fast(KernelConfig(amx_linear_max_rows=limit), dtype="bfloat16")
        fast = lm.model.fast
        assert fast.amx_layers is not None and fast.amx_layers_max_rows == limit
        calls: list[int] = []

        class Counting:
            def __init__(self, stack, seen: list[int]) -> None:
                self.stack, self.seen = stack, seen

            def run(self, *args):
                self.seen.append(args[0].shape[0])
                return self.stack.run(*args)

        fast.amx_layers = Counting(fast.amx_layers, calls)
        steps = batched_decode_logits(lm, seqs, start)
        assert len(steps) > 1 and all(torch.isfinite(s).all() for s in steps)
        assert bool(calls) == on_stack


def test_compiled_decode_layers_pass_the_keys_rounding_feedback(load_fast, prompts, hf_greedy):
    """int8 pages whose transform is only the keys' rounding feedback (attention/kv_quant.py keys_feedback) keep
    the compiled stack, which hands each layer's matrices to its write: the same logits, bit for bit, as the
    Python loop, and not those of plain rounding."""
    from kvpage.attention.kv_quant import keys_feedback
    from kvpage.attention.kv_transform import KVTransform

    names = sorted(prompts)
    seq = prompts[names[0]] + hf_greedy[names[0]]
    start = len(prompts[names[0]])

    def decode(lm, feedback: bool) -> torch.Tensor:
        for i, layer in enumerate(lm.model.layers):
            attn = layer.self_attn
            g = torch.Generator().manual_seed(i)
            q = torch.randn(200, attn.num_heads, attn.head_dim, generator=g) * torch.exp(
                torch.linspace(1, -1, attn.head_dim))
            fb = keys_feedback(q, attn.num_kv_heads) if feedback else None
            attn.attend.transforms[torch.int8] = KVTransform(None, None, fb) if feedback else None
        d_rows = []
        d = PagedGreedy(lm, block_size=16, num_blocks=64, kv_dtype=torch.int8)
        d.m.allocate_slots(KVSequence("x", seq[:start]), start)
        d_rows.append(d.runner.execute([ScheduledSeq("x", seq[:start], 0, d.m.block_table("x"))])["x"])
        for i in range(start, len(seq) - 1):
            d.m.allocate_slots(KVSequence("x", seq[: i + 1]), 1)
            d_rows.append(d.runner.execute([ScheduledSeq("x", seq[i : i + 1], i, d.m.block_table("x"))])["x"])
        for layer in lm.model.layers:
            layer.self_attn.attend.transforms.pop(torch.int8, None)
        return torch.stack(d_rows)

    compiled = load_fast()
    calls = []
    stack = compiled.model.fast.decode_layers

    class Counting:  # the stack, counting the steps it runs and what it passes to the writes
        def run(self, *args):
            calls.append(len(args[-1]) if len(args) > 8 else 0)
            return stack.run(*args)

    compiled.model.fast.decode_layers = Counting()
    try:
        got = decode(compiled, True)
        plain = decode(compiled, False)
    finally:
        compiled.model.fast.decode_layers = stack
    assert calls and set(calls) == {len(compiled.model.layers), 0}  # every decode step on the stack
    loop = load_fast(KernelConfig(decode_layers="python"))
    assert torch.equal(got, decode(loop, True))
    assert not torch.equal(got, plain)
