"""Q4 / Q8 blocks as panels (QuantWeight.as_panels): the same weights, and few-token products bit-identical to
the float32 panel GEMM's on the loader's dequantized matrix, for any number of rows, with a bias and gated."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from kvpage.envs import KernelConfig
from kvpage.model.dequant import dequantize
from kvpage.model.quant import from_gguf
from kvpage.ops import kernels
from tests.ops.test_quant_linear import random_gguf_blocks

TYPES = [Q.Q4_0, Q.Q4_1, Q.Q8_0]


@pytest.mark.parametrize("qtype", TYPES)
def test_panels_hold_the_same_weights(qtype):
    raw = random_gguf_blocks(qtype, 48, 96, seed=3)
    qw = from_gguf(raw, qtype, (48, 96))
    panels = qw.as_panels()
    assert panels.kind == ("q8p" if qtype == Q.Q8_0 else "q4p") and panels.few_token_ok
    assert panels.shape == (48, 96) and panels.qs.shape == (3, 96, 16 if qtype == Q.Q8_0 else 8)
    assert torch.equal(panels.dequantize(), dequantize(raw, qtype, (48, 96)))
    assert panels.nbytes == qw.nbytes  # the same bytes, reordered
    assert from_gguf(random_gguf_blocks(qtype, 40, 96, seed=4), qtype, (40, 96)).as_panels() is None  # 40 % 16


@pytest.fixture(scope="module")
def ops():
    ops = kernels(KernelConfig())
    if ops is None or not ops.f32_gemm_ok:
        pytest.skip("panels belong to the float32 panel GEMM of AVX2 builds")
    return ops


@pytest.mark.parametrize("qtype", TYPES)
def test_few_token_products_equal_the_panel_gemm_bit_for_bit(ops, qtype):
    n, k = 96, 192
    raw = random_gguf_blocks(qtype, n, k, seed=5)
    panels = from_gguf(raw, qtype, (n, k)).as_panels()
    weight = dequantize(raw, qtype, (n, k))  # what the loader gives the float32 model
    packed = ops.f32_pack_weight(weight)
    bias = torch.randn(n)
    g = torch.Generator().manual_seed(6)
    for rows in (1, 2, 3, 4, 5, 9):
        x = torch.randn(rows, k, generator=g) * 3
        got = ops.quant_linear(x, panels.qs, panels.d, panels.m, True)
        assert torch.equal(got, ops.f32_linear(x, packed, n, None)), rows
        assert torch.equal(got + bias, ops.f32_linear(x, packed, n, bias)), rows  # the bias added last, as there
        gated = ops.quant_linear(x, panels.qs, panels.d, panels.m, False, True)
        assert torch.equal(gated, ops.silu_mul(ops.f32_linear(x, packed, n, None))), rows


def test_bad_panels_are_refused_by_name(ops):
    raw = random_gguf_blocks(Q.Q4_1, 32, 64, seed=7)
    p = from_gguf(raw, Q.Q4_1, (32, 64)).as_panels()
    with pytest.raises(RuntimeError, match="x has 32 features"):
        ops.quant_linear(torch.randn(1, 32), p.qs, p.d, p.m, True)
    with pytest.raises(RuntimeError, match="Q4 panels need m"):
        ops.quant_linear(torch.randn(1, 64), p.qs, p.d, None, True)
    with pytest.raises(RuntimeError, match="float32 activations"):
        ops.quant_linear(torch.randn(1, 64).bfloat16(), p.qs, p.d, p.m, True)


def test_the_default_models_panels_rebuild_its_float32_weights_exactly(ops):
    """Every few-token matrix of SmolLM2's float32 fast path (fused q|k|v and gate|up with the loader's row
    order, the Q8_0 lm head) rebuilds bit for bit the weights its panel GEMM holds: the premise of the equality
    above, on the real model."""
    from kvpage.model.loader import load_model

    model = load_model("SmolLM2-135M-Instruct", dtype="float32", fast=True).model
    linears = [lin for layer in model.layers for lin in (layer.self_attn.qkv, layer.self_attn.o_packed,
                                                         layer.mlp.gate_up, layer.mlp.down)]
    linears.append(model.fast.lm_packed)
    for lin in linears:
        assert lin.quant.kind in ("q4p", "q8p")
        n, k = lin.quant.shape
        held = lin.f32.transpose(1, 2).reshape(-1, k)[:n]  # the panel GEMM's [N/16, K, 16] back to [N, K]
        assert torch.equal(lin.quant.dequantize(), held)
