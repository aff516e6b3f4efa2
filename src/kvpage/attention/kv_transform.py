"""Exact per-layer transforms that make a quantized cache's rows easier to round: keys centred and smoothed,
values centred and rotated.

A row of int8 or fp8 codes shares one scale (attention/kv_quant.py), so what a row loses is set by its
largest entry. Gemma 3's keys carry a large component that is the same at every position (about half to
nine tenths of a key's norm), and channels whose spread differs from the queries'; per-row scales spend their
codes on both. Changes of basis that are exact in real arithmetic remove that:

* keys minus a constant ``c_k`` per layer and KV head: every score of one query moves by the same ``q . c_k``,
  which the softmax cancels;
* keys divided and queries multiplied by per-channel powers of two ``s``: ``(q s) . (k / s) = q . k``. With
  the keys' rotation the rounding error is about the same in every channel of ``k / s``, so a score's error
  is smallest at ``s^2 = rms(k) / rms(q)`` per channel (Cauchy-Schwarz); ``s`` is shared by each RoPE pair and
  rounded to a power of two, so the multiplications are exact;
* values minus a constant ``c_v`` and rotated by the keys' Walsh-Hadamard matrix H: softmax weights sum to
  one, so the output is ``(attention over the stored rows) H + c_v``;
* keys rounded channel by channel, each channel's rounding error passed on to the later ones through the
  queries' statistics (``feedback``, attention/kv_quant.py keys_feedback): not a change of basis but of which
  codes a key row gets, so the kernels read the pages as they read any others.

The constants come from the model's own queries, keys and values over a fixed text, and which parts a model
keeps for a cache dtype is measured there too (worker/kv_calibration.py): a part that does not lower the
model's error end to end is left out. Float caches never see a transform.

Each mapping is one ``affine_rows`` call (the compiled backend's ``kv_affine_rows``: one pass over the rows,
the rotation as butterflies; as ~14 torch operators a layer they took 9% of Gemma 3's offline run on int8
pages).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch

from kvpage.attention.kv_quant import hadamard

Forward = Callable[..., torch.Tensor]
Tensor = torch.Tensor
RowsFn = Callable[[Tensor, Tensor | None, Tensor | None, bool, Tensor | None], Tensor]


def affine_rows(x: Tensor, sub: Tensor | None, mul: Tensor | None, rotate: bool, add: Tensor | None) -> Tensor:
    """``x`` ``[tokens, heads, D]`` mapped row by row in float32: ``(x - sub) * mul``, then the keys' Walsh-Hadamard
    rotation if ``rotate``, then ``+ add`` (each ``[heads, D]`` float32, optional), rounded once to x's dtype.
    The oracle of the compiled ``kv_affine_rows``, which gives the same bits."""
    y = x.float()
    if sub is not None:
        y = y - sub
    if mul is not None:
        y = y * mul
    if rotate:
        y = hadamard(y)
    if add is not None:
        y = y + add
    return y.to(x.dtype)


@dataclass(frozen=True)
class KeyTransform:
    """Keys minus ``center`` times ``inv_scale`` ([kv_heads, D]); queries times ``query_scale`` ([heads, D];
    powers of two, so exact in any activation dtype). All float32."""

    center: torch.Tensor
    inv_scale: torch.Tensor
    query_scale: torch.Tensor


@dataclass(frozen=True)
class ValueTransform:
    """Values minus ``center`` ([kv_heads, D]), rotated by the keys' Walsh-Hadamard matrix (symmetric and its own
    inverse); the output rotated back plus ``center_q`` ([heads, D]). Float32."""

    center: torch.Tensor
    center_q: torch.Tensor


@dataclass(frozen=True)
class KVTransform:
    """One layer's transform for one cache dtype; a part is None where the model does without it (a model
    that keeps none holds None instead of a transform). ``feedback``: the keys' rounding feedback
    ``[kv_heads, D, D]`` for queries as the key part leaves them (keys_feedback)."""

    keys: KeyTransform | None
    values: ValueTransform | None
    feedback: torch.Tensor | None = None

    @classmethod
    def from_samples(cls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> KVTransform:
        """Both parts, from a text's queries ``[tokens, heads, D]``, keys and values ``[tokens, kv_heads, D]``
        (post-RoPE)."""
        q, k, v = q.float(), k.float(), v.float()
        heads, kv_heads, d = q.shape[1], k.shape[1], k.shape[2]
        group = heads // kv_heads
        key_center = k.mean(0)
        k_ms = (k - key_center).pow(2).mean(0)  # [kv_heads, D]: mean squares
        q_ms = q.pow(2).mean(0).view(kv_heads, group, d).mean(1)
        if d % 2 == 0:  # the RoPE pair (i, i + D/2) shares its scale: rotation mixes the two channels
            h = d // 2
            k_ms = ((k_ms[:, :h] + k_ms[:, h:]) / 2).repeat(1, 2)
            q_ms = ((q_ms[:, :h] + q_ms[:, h:]) / 2).repeat(1, 2)
        # silent channels keep s near 1, never 0 or inf
        ratio = k_ms.clamp_min(1e-12 * float(k_ms.max().clamp_min(1e-30))) / q_ms.clamp_min(
            1e-12 * float(q_ms.max().clamp_min(1e-30)))
        scale = torch.exp2(torch.round(torch.log2(ratio) / 4).clamp(-20, 20))  # (rms ratio)^(1/2) as a power of 2
        keys = KeyTransform(key_center, 1.0 / scale, scale.repeat_interleave(group, 0).contiguous())
        value_center = v.mean(0)
        values = ValueTransform(value_center, value_center.repeat_interleave(group, 0).contiguous())
        return cls(keys, values)

    def parts(self, keys: bool, values: bool, feedback: torch.Tensor | None = None) -> KVTransform | None:
        """The transform with only the chosen parts and ``feedback``; None for none (the plain call, the
        compiled stack)."""
        if not (keys or values) and feedback is None:
            return None
        return KVTransform(self.keys if keys else None, self.values if values else None, feedback)

    def fingerprint(self) -> str:
        """A short digest of the constants: KV written under one transform is read only under the same one."""
        h = hashlib.sha256()
        for part in (self.keys, self.values):
            h.update(b"-" if part is None else b"+")
            for f in () if part is None else fields(part):
                h.update(getattr(part, f.name).contiguous().view(torch.uint8).numpy().tobytes())  # any dtype
        if self.feedback is not None:  # absent: the digest of a transform without it, as before it existed
            h.update(b"f" + self.feedback.contiguous().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()[:16]


class LayerAttend:
    """A layer's call into its attention backend (``backend.forward``'s signature). Caches of a dtype with a
    transform in ``transforms`` get the transformed queries, keys and values and the output is mapped back (a
    dtype mapped to None is calibrated and keeps nothing); with
    ``capture`` set (calibration), each call's query, key and value rows are appended to it."""

    __slots__ = ("capture", "forward", "rows", "transforms")

    def __init__(self, forward: Forward, rows: RowsFn = affine_rows) -> None:
        self.forward = forward
        self.rows = rows  # affine_rows or the backend's compiled equal
        self.transforms: dict[torch.dtype, KVTransform | None] = {}
        self.capture: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None

    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 meta: Any, scale: float) -> torch.Tensor:
        if self.capture is not None:
            self.capture.append((query.float(), key.float(), value.float()))
        t = self.transforms.get(kv_cache.dtype) if self.transforms else None
        if t is None:
            return self.forward(query, key, value, kv_cache, meta, scale)
        return self.transformed(t, query, key, value, kv_cache, meta, scale)

    def active(self, dtype: torch.dtype) -> KVTransform | None:
        """The transform caches of ``dtype`` go through, if any."""
        return self.transforms.get(dtype)

    def transformed(self, t: KVTransform, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    kv_cache: torch.Tensor, meta: Any, scale: float) -> torch.Tensor:
        """Attention through ``t``, on any cache (equal to the plain call up to rounding)."""
        q, k, v, rows = query, key, value, self.rows
        fb = {} if t.feedback is None else {"key_feedback": t.feedback}
        if t.keys is not None:
            q = rows(query, None, t.keys.query_scale, False, None)  # powers of two: exact
            k = rows(key, t.keys.center, t.keys.inv_scale, False, None)
        if t.values is None:
            return self.forward(q, k, v, kv_cache, meta, scale, **fb)
        v = rows(value, t.values.center, None, True, None)
        out = self.forward(q, k, v, kv_cache, meta, scale, **fb)
        return rows(out, None, None, True, t.values.center_q)


def transforms_fingerprint(attends: list[LayerAttend], dtype: torch.dtype) -> str | None:
    """One digest of every layer's transform for ``dtype``; None when no layer has a part."""
    prints = [t.fingerprint() for a in attends if (t := a.active(dtype)) is not None]
    return hashlib.sha256("".join(prints).encode()).hexdigest()[:16] if prints else None
