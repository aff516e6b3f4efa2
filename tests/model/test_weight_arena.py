"""The fast path gathers its packed weights into one arena on 2 MiB pages (KernelConfig.weight_huge_pages, on by
default): every projection's operands and the lm head's live there, and the model computes the same bits as
with the weights where packing left them. Its lm head, alone of the projections, writes its output around the
cache (stream_out), the same bits."""

from __future__ import annotations

import pytest
import torch

from kvpage.envs import KernelConfig
from tests.model.test_model_reference import teacher_forced_logits


@pytest.fixture(scope="module")
def pair():
    """(arena model, model without the arena), both bf16 on the fast path, loaded for this module only."""
    from kvpage.model import loader

    before = set(loader._LOADED)
    try:
        yield tuple(loader.load_model("SmolLM2-135M-Instruct", dtype="bfloat16", fast=True,
                                      kernel_config=KernelConfig(weight_huge_pages=on)) for on in (True, False))
    finally:
        for key in set(loader._LOADED) - before:
            loader._LOADED.pop(key)


def _operands(lm) -> list[torch.Tensor]:
    fast = lm.model.fast
    if fast is None:
        pytest.skip("no compiled kernels here: no fast path")
    linears = [w for layer in lm.model.layers for w in (layer.self_attn.qkv, layer.self_attn.o_packed,
                                                         layer.mlp.gate_up, layer.mlp.down)] + [fast.lm_packed]
    out = []
    for lin in linears:
        out += [t for t in (lin.amx, lin.f32, *(lin.i8 or ())) if t is not None]
        if lin.quant is not None:
            out += [t for t in (lin.quant.qs, lin.quant.d, lin.quant.m) if t is not None]
    return out


def test_every_streamed_operand_is_in_one_arena(pair):
    on, off = pair
    ops_on, ops_off = _operands(on), _operands(off)
    assert ops_on and len(ops_on) == len(ops_off)
    assert len({t.untyped_storage().data_ptr() for t in ops_on}) == 1
    assert len({t.untyped_storage().data_ptr() for t in ops_off}) > 1
    for a, b in zip(ops_on, ops_off, strict=True):
        assert torch.equal(a, b)
    # the few-token projections bound by the fast path read the arena's blocks
    plan = on.model.fast.plan[0]
    if plan.decode is not None:
        bound = plan.decode[0].__closure__
        ptrs = {c.cell_contents.data_ptr() for c in bound if isinstance(c.cell_contents, torch.Tensor)}
        assert on.model.layers[0].self_attn.qkv.quant.qs.data_ptr() in ptrs


@pytest.mark.parametrize("length", [3, 40])  # few-token steps on the quantized blocks, many-row on the GEMM
def test_same_logits_with_and_without_the_arena(pair, length):
    on, off = pair
    seq = [(7 * i + 11) % 4000 + 10 for i in range(length)]
    assert torch.equal(teacher_forced_logits(on, seq), teacher_forced_logits(off, seq))


def test_only_the_lm_head_streams_its_output(pair):
    on, _ = pair
    fast = on.model.fast
    if fast is None:
        pytest.skip("no compiled kernels here: no fast path")
    assert fast.lm_packed.stream_out
    assert not any(w.stream_out for layer in on.model.layers for w in (layer.self_attn.qkv, layer.self_attn.o_packed,
                                                                       layer.mlp.gate_up, layer.mlp.down))
    hidden = torch.randn(200, fast.lm_weight.shape[1], generator=torch.Generator().manual_seed(5))
    streamed = fast.compute_logits_ex(hidden)
    fast.lm_packed.stream_out = False
    try:
        plain = fast.compute_logits_ex(hidden)
    finally:
        fast.lm_packed.stream_out = True
    assert torch.equal(streamed.logits, plain.logits) and torch.equal(streamed.argmax, plain.argmax)
