"""Products straight from GGUF-quantized blocks: repacking is exact, the kernel matches the dequantized matrix,
and the bf16 model's few-token steps (which use it) agree with the float32 reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from kvpage.envs import KernelConfig
from kvpage.model.dequant import dequantize
from kvpage.model.quant import QuantWeight, concat, from_gguf
from kvpage.ops import load_kernels
from tests.helpers.kernels import have_cxx

needs_kernels = pytest.mark.skipif(not have_cxx(), reason="no C++ compiler: kernels cannot be built")
BLOCK_BYTES = {Q.Q4_0: 18, Q.Q4_1: 20, Q.Q8_0: 34}


def random_gguf_blocks(qtype: Q, n: int, k: int, seed: int) -> np.ndarray:
    """Raw GGUF bytes of an [n, k] matrix with random codes and small finite float16 scales."""
    rng = np.random.default_rng(seed)
    size = BLOCK_BYTES[qtype]
    raw = rng.integers(0, 256, size=(n * k // 32, size), dtype=np.uint8)
    heads = 4 if qtype == Q.Q4_1 else 2
    scales = (rng.standard_normal((n * k // 32, heads // 2)) * 0.02).astype(np.float16)
    raw[:, :heads] = scales.view(np.uint8).reshape(-1, heads)
    return raw.reshape(-1)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
def test_repacked_blocks_decode_to_the_same_weights(qtype):
    raw = random_gguf_blocks(qtype, 24, 96, seed=1)
    qw = from_gguf(raw, qtype, (24, 96))
    assert qw is not None and qw.shape == (24, 96)
    assert qw.kind == ("q8" if qtype == Q.Q8_0 else "q4")
    assert torch.equal(qw.dequantize(), dequantize(raw, qtype, (24, 96)))
    assert qw.nbytes == raw.nbytes + (24 * 3 * 2 if qtype == Q.Q4_0 else 0)  # Q4_0 gains an explicit min


def test_unsupported_formats_and_shapes_are_not_kept():
    raw = random_gguf_blocks(Q.Q8_0, 4, 64, seed=2)
    assert from_gguf(raw, Q.F16, (4, 64)) is None
    assert from_gguf(raw, Q.Q8_0, (256,)) is None
    a = from_gguf(random_gguf_blocks(Q.Q4_1, 8, 64, 3), Q.Q4_1, (8, 64))
    b = from_gguf(random_gguf_blocks(Q.Q8_0, 8, 64, 4), Q.Q8_0, (8, 64))
    assert concat([a, None]) is None and concat([a, from_gguf(raw, Q.Q8_0, (4, 64))]) is not None
    mixed = concat([a, b])  # Q4 and Q8: one code per weight (U8), read by the int8 GEMM only
    assert mixed.kind == "u8" and not mixed.few_token_ok
    assert torch.equal(mixed.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    both = concat([a, a])
    assert both is not None and torch.equal(both.dequantize(), torch.cat([a.dequantize(), a.dequantize()]))


@needs_kernels
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
@pytest.mark.parametrize(("n", "k"), [(40, 576), (17, 96), (33, 32)])  # even, odd and single block counts
@pytest.mark.parametrize("tokens", [1, 3, 8, 11])
def test_kernel_matches_the_dequantized_matrix(qtype, n, k, tokens):
    ops = load_kernels()
    qw = from_gguf(random_gguf_blocks(qtype, n, k, seed=n + k), qtype, (n, k))
    w = qw.dequantize().double()
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, k, generator=g)
    out = ops.quant_linear(x, qw.qs, qw.d, qw.m, True)
    assert out.dtype == torch.float32 and out.shape == (tokens, n)
    ref = x.double() @ w.T
    assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    xb = x.bfloat16()  # bf16 activations (the fast path's): exact products, float32 sums
    ref_b = xb.double() @ w.T
    out_f = ops.quant_linear(xb, qw.qs, qw.d, qw.m, True)
    assert torch.allclose(out_f.double(), ref_b, rtol=1e-5, atol=1e-5 * ref_b.abs().max().item())
    out_b = ops.quant_linear(xb, qw.qs, qw.d, qw.m)  # bf16 output: the float32 result rounded once
    assert out_b.dtype == torch.bfloat16
    assert torch.equal(out_b, out_f.bfloat16()) or (out_b.float() - out_f).abs().max() <= out_f.abs().max() / 128


@needs_kernels
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
@pytest.mark.parametrize(("n", "k"), [(40, 576), (17, 96), (33, 32)])
@pytest.mark.parametrize("x_kind", ["normal", "outliers", "zero_blocks"])
def test_int16_activations_stay_within_their_rounding_bound(qtype, n, k, x_kind):
    """int16=True (one token row, AVX2 builds): each activation is rounded to a 16-bit code of its block's
    max|x| / 32767, so |out - exact| <= sum |w| * max|x|_block / 65534 (+ float32 summation slack)."""
    ops = load_kernels()
    qw = from_gguf(random_gguf_blocks(qtype, n, k, seed=7 * n + k), qtype, (n, k))
    w = qw.dequantize().double()
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(n))
    if x_kind == "outliers":  # one large value per block, as in a real model's residual channels
        x[0, ::32] *= 200.0
    elif x_kind == "zero_blocks":
        x[0, : k // 2] = 0.0
    out = ops.quant_linear(x, qw.qs, qw.d, qw.m, True, True)
    ref = x.double() @ w.T
    amax = x.double().view(1, -1, 32).abs().amax(-1, keepdim=True).expand(1, -1, 32).reshape(1, k)
    bound = (w.abs() * (amax / 65534)).sum(-1)
    slack = 1e-5 * ref.abs().max().item() + 1e-6
    assert ((out.double() - ref).abs() <= bound * 1.001 + slack).all()
    if ops.quant_int16_available() and x_kind != "zero_blocks":
        assert not torch.equal(out, ops.quant_linear(x, qw.qs, qw.d, qw.m, True, False))  # really a second path
    many = torch.cat([x, x, x])  # several rows keep the float path (faster there): same result as int16=False
    assert torch.equal(ops.quant_linear(many, qw.qs, qw.d, qw.m, True, True),
                       ops.quant_linear(many, qw.qs, qw.d, qw.m, True, False))


@needs_kernels
@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0])
@pytest.mark.parametrize("tokens", [1, 2, 4, 9])
@pytest.mark.parametrize("int16", [False, True])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_gated_epilogue_equals_silu_mul_of_the_product(qtype, tokens, int16, x_dtype):
    """gated=True (the MLP's [gate; up] product) returns silu_mul of the plain product, computed in the same
    pass: [tokens, N / 2], equal to the separate kernels up to float rounding of the activation."""
    ops = load_kernels()
    n, k = 2 * 52, 96  # 52 = not a multiple of the 8 / 16 lanes of the epilogue
    qw = from_gguf(random_gguf_blocks(qtype, n, k, seed=tokens), qtype, (n, k))
    x = torch.randn(tokens, k, generator=torch.Generator().manual_seed(3)).to(x_dtype)
    plain = ops.quant_linear(x, qw.qs, qw.d, qw.m, True, int16)
    got = ops.quant_linear(x, qw.qs, qw.d, qw.m, True, int16, True)
    assert got.shape == (tokens, n // 2) and got.dtype == torch.float32
    want = ops.silu_mul(plain)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    ref = torch.nn.functional.silu(plain[:, : n // 2].double()) * plain[:, n // 2 :].double()
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-6)
    if x_dtype == torch.bfloat16:  # bf16 output: the float32 result rounded once
        out_b = ops.quant_linear(x, qw.qs, qw.d, qw.m, False, int16, True)
        assert out_b.dtype == torch.bfloat16 and torch.equal(out_b, got.bfloat16())
    with pytest.raises(RuntimeError, match="even number of rows"):
        ops.quant_linear(x, qw.qs[1:], qw.d[1:], None if qw.m is None else qw.m[1:], True, int16, True)


@needs_kernels
def test_kernel_rejects_bad_input():
    ops = load_kernels()
    qw = from_gguf(random_gguf_blocks(Q.Q4_1, 8, 64, 5), Q.Q4_1, (8, 64))
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ops.quant_linear(torch.randn(1, 48), qw.qs, qw.d, qw.m)
    with pytest.raises(RuntimeError, match="bytes per row"):
        ops.quant_linear(torch.randn(1, 96), qw.qs, qw.d, qw.m)
    with pytest.raises(RuntimeError, match="need m"):
        ops.quant_linear(torch.randn(1, 64), qw.qs, qw.d, None)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.quant_linear(torch.randn(1, 64).half(), qw.qs, qw.d, qw.m)
    assert ops.quant_linear(torch.randn(0, 64), qw.qs, qw.d, qw.m).shape == (0, 8)


@pytest.fixture(scope="module")
def smol_bf16():
    from kvpage.model.loader import load_model

    return load_model(dtype="bfloat16")


@needs_kernels
def test_default_model_keeps_its_gguf_blocks_for_few_token_steps(smol_bf16):
    model = smol_bf16.model
    if model.fast_ops is None:
        pytest.skip("bf16 fast path unavailable here")
    plan = model.fast.plan
    assert len(plan) == smol_bf16.config.num_layers
    layer = model.layers[0]
    assert layer.self_attn.qkv.quant.kind == "q4" and layer.mlp.down.quant.kind == "q4"  # Q4_1 in the file
    assert model.fast.lm_quant is not None and model.fast.lm_quant.kind == "q8"  # token_embd is Q8_0
    # the fused q|k|v blocks decode to the (unpermuted) dense weights the bf16 GEMM uses, up to bf16 rounding
    dense = layer.self_attn.qkv.quant.dequantize()
    packed_in = torch.eye(dense.shape[1], dtype=torch.bfloat16)
    assert packed_in.shape[0] > layer.self_attn.qkv.quant_max_tokens  # a GEMM-sized step, not the blocks
    with torch.no_grad():
        via_gemm = layer.self_attn.qkv(packed_in).float().T
    assert torch.allclose(via_gemm, dense, rtol=1 / 128, atol=1e-6)


TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
        "movable metal type, oil-based ink and a wooden press adapted from wine making. Within fifty years, "
        "presses were running in more than two hundred cities across Europe, and the price of books fell.")


@needs_kernels
def test_few_token_steps_agree_with_float32_and_the_dense_bf16_path(smol_bf16):
    """Teacher-forced one token per step (the decode shape): the quantized kernels (exact weights) pick the
    float32 model's next token nearly everywhere, and their logits are closer to float32's than the bf16 GEMM's
    (bf16-rounded weights) are. Both round activations to bf16, so near-ties may still flip either way."""
    from kvpage.model import loader
    from kvpage.model.loader import load_model
    from kvpage.worker.kv_cache import KVCache
    from kvpage.worker.model_runner import ModelRunner, ScheduledSeq

    if smol_bf16.model.fast_ops is None:
        pytest.skip("bf16 fast path unavailable here")
    ids = smol_bf16.tokenizer.encode(TEXT)
    table = list(range(8))
    fp32 = load_model(dtype="float32")
    ref = ModelRunner(fp32.model, KVCache(fp32.config, 8, 16, torch.float32)).execute(
        [ScheduledSeq("s", ids, 0, table, all_logits=True)])["s"]
    logits = {}
    before = set(loader._LOADED)
    try:
        for max_tokens in (0, 4):
            lm = load_model(dtype="bfloat16", kernel_config=KernelConfig(quant_max_tokens=max_tokens))
            runner = ModelRunner(lm.model, KVCache(lm.config, 8, 16, torch.bfloat16))
            logits[max_tokens] = torch.stack(
                [runner.execute([ScheduledSeq("s", [tok], pos, table)])["s"] for pos, tok in enumerate(ids)])
    finally:
        for key in set(loader._LOADED) - before:
            loader._LOADED.pop(key)
    top = ref.argmax(-1)
    dense, quant = (logits[0].argmax(-1) == top).float().mean(), (logits[4].argmax(-1) == top).float().mean()
    print(f"top-1 agreement with float32 over {len(ids)} steps: quantized {quant:.2%}, dense bf16 {dense:.2%}")
    assert quant >= 0.97
    err_quant = (logits[4] - ref).abs().max().item()
    err_dense = (logits[0] - ref).abs().max().item()
    assert 0 < err_quant < err_dense, (err_quant, err_dense)  # really a different path, and the closer one


def test_quant_weight_shapes_for_the_kernel():
    qw = QuantWeight(torch.zeros(4, 32, dtype=torch.uint8), torch.zeros(4, 2, dtype=torch.float16),
                     torch.zeros(4, 2, dtype=torch.float16))
    assert qw.shape == (4, 64) and qw.kind == "q4" and qw.nbytes == 4 * 32 + 2 * 4 * 2 * 2
