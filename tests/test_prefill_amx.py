"""Causal attention of whole fresh prompts with AMX tiles (csrc/prefill_amx.cpp): matches a float32 reference
for ragged prompt lengths (partial 16-row and 32-key blocks), GQA ratios and prompts packed at any offset of a
step's batch read through strided views of one qkv tensor; leaves rows outside the prompts alone; refuses what
it cannot take."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import amx_ops


def _ops():
    return amx_ops("prefill_amx_available")


def _batch(heads, kv_heads, lengths, seed, gap=3):
    g = torch.Generator().manual_seed(seed)
    starts, pos = [], gap
    for n in lengths:
        starts.append(pos)
        pos += n + gap
    qkv = (torch.randn(pos, (heads + 2 * kv_heads) * 64, generator=g) * 2).bfloat16()
    q = qkv[:, : heads * 64].view(pos, heads, 64)
    k = qkv[:, heads * 64 : (heads + kv_heads) * 64].view(pos, kv_heads, 64)
    v = qkv[:, (heads + kv_heads) * 64 :].view(pos, kv_heads, 64)
    return q, k, v, starts


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4), (8, 2), (6, 1)])
def test_matches_float32_causal_attention(heads, kv_heads):
    ops = _ops()
    lengths = [1, 15, 16, 17, 31, 33, 100, 257]
    q, k, v, starts = _batch(heads, kv_heads, lengths, seed=heads * 10 + kv_heads)
    out = torch.full(q.shape, 7.0, dtype=torch.bfloat16)
    ops.prefill_attention(q, k, v, out, starts, lengths, 0.125)
    covered = torch.zeros(q.shape[0], dtype=torch.bool)
    for s, n in zip(starts, lengths, strict=True):
        sl = slice(s, s + n)
        ref = F.scaled_dot_product_attention(q[sl].transpose(0, 1)[None].float(), k[sl].transpose(0, 1)[None].float(),
                                             v[sl].transpose(0, 1)[None].float(), is_causal=True, scale=0.125,
                                             enable_gqa=True)[0].transpose(0, 1)
        # bf16 weights and output: a few bf16 ulps of the output's magnitude
        assert (out[sl].float() - ref).abs().max() <= 0.02 * ref.abs().max() + 1e-3, (s, n)
        covered[sl] = True
    assert (out[~covered] == 7.0).all()  # rows between prompts untouched


def test_one_token_prompt_is_its_own_value():
    ops = _ops()
    q, k, v, starts = _batch(4, 2, [1], seed=3)
    out = torch.zeros(q.shape, dtype=torch.bfloat16)
    ops.prefill_attention(q, k, v, out, starts, [1], 0.125)
    s = starts[0]
    assert torch.equal(out[s], v[s].repeat_interleave(2, 0))


def test_refuses_bad_input():
    ops = _ops()
    q, k, v, starts = _batch(4, 2, [20], seed=1)
    out = torch.zeros(q.shape, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="outside the batch"):
        ops.prefill_attention(q, k, v, out, [q.shape[0] - 5], [20], 0.125)
    with pytest.raises(RuntimeError, match="head size"):
        ops.prefill_attention(q[..., :32], k[..., :32], v[..., :32], out[..., :32], starts, [20], 0.125)
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        ops.prefill_attention(q[:, :3], k, v, out[:, :3], starts, [20], 0.125)
    with pytest.raises(RuntimeError, match="bfloat16"):
        ops.prefill_attention(q.float(), k, v, out, starts, [20], 0.125)
