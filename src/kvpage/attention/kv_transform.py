"""Exact per-layer transforms that make a quantized cache's rows easier to round: keys centred and smoothed,
values centred.

A row of int8 or fp8 codes shares one scale (attention/kv_quant.py), so what a row loses is set by its
largest entry. Gemma 3's keys carry a large component that is the same at every position (about half to
nine tenths of a key's norm), and a few channels whose range is wide where the queries are small; per-row
scales spend their codes on both. Three changes of basis remove that, each exact in real arithmetic:

* keys minus a constant ``c_k`` per layer and KV head: every score of one query moves by the same ``q . c_k``,
  which the softmax cancels;
* keys divided and queries multiplied by per-channel powers of two ``s`` (SmoothQuant's balance of the two
  ranges, ``s = sqrt(max|k| / max|q|)`` per channel, shared by the RoPE pair of each channel so that it holds
  as positions rotate): ``(q s) . (k / s) = q . k``, and a power of two multiplies without rounding;
* values minus a constant ``c_v``: softmax weights sum to one, so the output moves by exactly ``c_v``, which is
  added back.

The constants come from the model's own keys, queries and values over a fixed text (worker/kv_calibration.py)
and are applied only to layers whose cache is quantized; float caches see the model's tensors unchanged.
Measured on Gemma 3 270M with int8 pages (teacher-forced top-1 agreement with the float32 cache over four
800-token windows of benchmarks/kv_quant.py's text, float32 weights): 97.09% as the keys come, 97.97% centred,
98.41% centred and smoothed; fp8_e4m3 87.88% -> 95.28%.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvpage.attention.kv_quant import QMAX

Forward = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class KVTransform:
    """One layer's constants, float32: per KV head ``[kv_heads, head_dim]`` and per query head (the KV head's
    row repeated for its query heads) ``[heads, head_dim]``."""

    key_center: torch.Tensor
    key_inv_scale: torch.Tensor  # 1 / s: keys are multiplied by it
    value_center: torch.Tensor
    query_scale: torch.Tensor  # s, per query head
    value_center_q: torch.Tensor  # c_v, per query head

    @classmethod
    def from_samples(cls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> KVTransform:
        """From a text's queries ``[tokens, heads, D]``, keys and values ``[tokens, kv_heads, D]`` (post-RoPE)."""
        q, k, v = q.float(), k.float(), v.float()
        heads, kv_heads, d = q.shape[1], k.shape[1], k.shape[2]
        group = heads // kv_heads
        key_center, value_center = k.mean(0), v.mean(0)
        k_range = (k - key_center).abs().amax(0)  # [kv_heads, D]
        q_range = q.abs().amax(0).view(kv_heads, group, d).amax(1)
        if d % 2 == 0:  # the RoPE pair (i, i + D/2) shares its scale: rotation mixes the two channels
            h = d // 2
            k_range = torch.maximum(k_range[:, :h], k_range[:, h:]).repeat(1, 2)
            q_range = torch.maximum(q_range[:, :h], q_range[:, h:]).repeat(1, 2)
        floor = 1e-6 * float(k_range.max().clamp_min(1e-30))  # silent channels keep s near 1, never 0 or inf
        ratio = k_range.clamp_min(floor) / q_range.clamp_min(1e-6 * float(q_range.max().clamp_min(1e-30)))
        scale = torch.exp2(torch.round(torch.log2(ratio) / 2).clamp(-20, 20))  # sqrt, rounded to a power of two
        return cls(key_center, 1.0 / scale, value_center, scale.repeat_interleave(group, 0),
                   value_center.repeat_interleave(group, 0))

    def fingerprint(self) -> str:
        """A short digest of the constants: KV written under one transform is read only under the same one."""
        h = hashlib.sha256()
        for t in (self.key_center, self.key_inv_scale, self.value_center):
            h.update(t.contiguous().numpy().tobytes())
        return h.hexdigest()[:16]


class LayerAttend:
    """A layer's call into its attention backend (``backend.forward``'s signature). With a transform, caches
    of a quantized dtype get the transformed queries, keys and values and the output is mapped back; with
    ``capture`` set (calibration), each call's query, key and value rows are appended to it."""

    __slots__ = ("capture", "forward", "transform")

    def __init__(self, forward: Forward) -> None:
        self.forward = forward
        self.transform: KVTransform | None = None
        self.capture: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None

    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 meta: Any, scale: float) -> torch.Tensor:
        t = self.transform
        if self.capture is not None:
            self.capture.append((query.float(), key.float(), value.float()))
        if t is None or kv_cache.dtype not in QMAX:
            return self.forward(query, key, value, kv_cache, meta, scale)
        return self.transformed(query, key, value, kv_cache, meta, scale)

    def transformed(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                    meta: Any, scale: float) -> torch.Tensor:
        """Attention through the transform, on any cache (equal to the plain call up to rounding)."""
        t = self.transform
        assert t is not None
        q = query * t.query_scale.to(query.dtype)  # powers of two: exact in any float dtype
        k = ((key.float() - t.key_center) * t.key_inv_scale).to(key.dtype)
        v = (value.float() - t.value_center).to(value.dtype)
        out = self.forward(q, k, v, kv_cache, meta, scale)
        return (out.float() + t.value_center_q).to(out.dtype)


def transforms_fingerprint(attends: list[LayerAttend]) -> str | None:
    """One digest of every layer's transform; None when no layer has one."""
    prints = [a.transform.fingerprint() for a in attends if a.transform is not None]
    return hashlib.sha256("".join(prints).encode()).hexdigest()[:16] if prints else None
