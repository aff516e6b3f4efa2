"""GGUF tensor decoding into torch.

The common formats are decoded with vectorized torch code that follows ggml's float32 arithmetic exactly
(scale, then add the min), so weights are bit-identical to gguf-py's reference decoder; other formats
(K-quants and friends) fall back to gguf-py's numpy decoder.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants

# Formats decoded here; everything gguf-py can dequantize is also accepted through its numpy path.
NATIVE = {Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1}


def nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(n, 16) bytes -> (n, 32) values: the low nibbles are elements 0..15, the high ones 16..31."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=1)


def _f16(raw: torch.Tensor) -> torch.Tensor:
    return raw.contiguous().view(torch.float16).to(torch.float32)


def dequantize(data: np.ndarray, qtype: Q, shape: tuple[int, ...]) -> torch.Tensor:
    """Decode one GGUF tensor to float32 with the given (row-major, torch-order) shape."""
    with warnings.catch_warnings():  # the GGUF memory map is read-only; we only ever read it
        warnings.simplefilter("ignore", UserWarning)
        return _dequantize(data, qtype, shape)


def _dequantize(data: np.ndarray, qtype: Q, shape: tuple[int, ...]) -> torch.Tensor:
    if qtype == Q.F32:
        return torch.from_numpy(np.ascontiguousarray(data).view(np.float32).copy()).reshape(shape)
    if qtype == Q.F16:
        return torch.from_numpy(np.ascontiguousarray(data).view(np.float16).copy()).to(torch.float32).reshape(shape)
    if qtype == Q.BF16:
        raw = torch.from_numpy(np.ascontiguousarray(data).view(np.int16).copy())
        return raw.view(torch.bfloat16).to(torch.float32).reshape(shape)
    if qtype in (Q.Q8_0, Q.Q4_0, Q.Q4_1):
        raw = torch.from_numpy(np.ascontiguousarray(data).view(np.uint8).reshape(-1))
        if qtype == Q.Q8_0:  # 2-byte f16 scale + 32 int8
            blocks = raw.reshape(-1, 34)
            d = _f16(blocks[:, :2])
            out = blocks[:, 2:].contiguous().view(torch.int8).to(torch.float32).mul_(d)  # in place: one fresh copy
        elif qtype == Q.Q4_0:  # f16 scale + 16 bytes of nibbles, value = d * (q - 8)
            blocks = raw.reshape(-1, 18)
            d = _f16(blocks[:, :2])
            q = (nibbles(blocks[:, 2:]).to(torch.int8) - 8).to(torch.float32)
            out = d * q
        else:  # Q4_1: f16 scale, f16 min, 16 bytes of nibbles, value = d * q + m
            blocks = raw.reshape(-1, 20)
            d = _f16(blocks[:, :2])
            m = _f16(blocks[:, 2:4])
            out = d * nibbles(blocks[:, 4:]).to(torch.float32) + m
        return out.reshape(shape)
    try:
        decoded = quants.dequantize(data, qtype)
    except NotImplementedError as e:
        raise ValueError(f"GGUF tensor type {qtype.name} cannot be dequantized") from e
    return torch.from_numpy(np.ascontiguousarray(decoded, dtype=np.float32)).reshape(shape)
