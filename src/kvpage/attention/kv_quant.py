"""Quantized KV pages (int8, fp8_e4m3, fp8_e5m2) in plain torch: the oracle the compiled kernels are tested
against, and the reference backend's way of reading and writing them.

A quantized cache keeps the engine's shape ``[2, num_blocks, block_size, kv_heads, head_dim + 2]``: each
(token, KV head) row holds ``head_dim`` one-byte codes and then its bfloat16 scale in the last two bytes.
The scale lives in the page, next to its values, so copy-on-write, swap and prefix-cache reuse (which move
whole blocks) carry it without knowing it exists.

Why one scale per row (per token and head), not per block: a block that is still filling would otherwise
have to requantize its earlier tokens whenever a later one widens the block's range (or clip it); a row's
scale is fixed the moment the row is written. The price is 2 bytes per 64-value row (3%), and the
capacity gain stays above 1.9x bf16's at head size 64 (128 / 66 = 1.94x) and 256 (512 / 258 = 1.98x).

Keys are stored in a rotated basis: k @ Hb, Hb the orthonormal Walsh-Hadamard matrix on blocks of b dims (b the
largest power of two dividing head_dim: 64 for SmolLM2, 256 for Gemma 3). A rotation spreads the few large
channels of RoPE'd keys over the whole row, so one scale per row fits every value (on SmolLM2 with an int8
cache, teacher-forced top-1 agreement with the float32 cache: 98.2% unrotated, 99.2% rotated, over 600
positions). Scores are unchanged because the kernels rotate each query the same way: (q Hb) . (k Hb) = q . k.
Values are stored as they are (rotating them gained nothing measurable and would cost an output rotation).

Quantization: scale = absmax(row) / qmax rounded up to a bfloat16 (so no value lands past qmax, and scales of
any magnitude are representable: a float16 scale underflows for fp8 e5m2's qmax), code =
round_nearest_even(clamp(x / scale, -qmax, qmax)) in the format (int8: qmax 127; e4m3: 448; e5m2: 57344);
value = code x scale. A zero row has scale 0 and codes 0.
"""

from __future__ import annotations

import torch

SCALE_BYTES = 2
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in QMAX


def head_dim_of(kv_cache: torch.Tensor) -> int:
    """The head size of a cache tensor (a quantized row also carries its scale)."""
    d = kv_cache.shape[-1]
    return d - SCALE_BYTES if is_quantized(kv_cache.dtype) else d


def cache_row_width(head_dim: int, dtype: torch.dtype) -> int:
    return head_dim + SCALE_BYTES if is_quantized(dtype) else head_dim


def rotation_block(head_dim: int) -> int:
    """The Walsh-Hadamard block of a head size: its largest power-of-two divisor."""
    return head_dim & -head_dim


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """x @ Hb on the last dim, float32, by butterflies (the same additions, in the same order, as the kernels'
    fwht, so both round alike); Hb is symmetric and its own inverse."""
    d = x.shape[-1]
    b = rotation_block(d)
    y = x.float().reshape(*x.shape[:-1], d // b, b)
    h = 1
    while h < b:
        y = y.reshape(*y.shape[:-1], b // (2 * h), 2, h)
        lo, hi = y[..., 0, :], y[..., 1, :]
        y = torch.stack((lo + hi, lo - hi), dim=-2).reshape(*x.shape[:-1], d // b, b)
        h *= 2
    return (y * (1.0 / b**0.5)).reshape(x.shape)


def quantize_rows(x: torch.Tensor, dtype: torch.dtype, feedback: torch.Tensor | None = None) -> torch.Tensor:
    """Rows ``[..., head_dim]`` of any float dtype -> ``[..., head_dim + 2]`` of ``dtype`` (codes, then the
    bfloat16 scale's two bytes). ``feedback`` ``[heads, head_dim, head_dim]`` (x ``[..., heads, head_dim]``):
    each row's channels are rounded in order and channel i's rounding error r moves the later channels j by
    ``- r * feedback[h, i, j]`` before they are rounded (keys_feedback's rule: the error a row's queries see is
    smaller than independent rounding's); the scale stays the one of the row as it came."""
    qmax = QMAX[dtype]
    xf = x.float()
    bits = (xf.abs().amax(dim=-1, keepdim=True) / qmax).view(torch.int32)
    scale = ((bits + 0xFFFF) >> 16).to(torch.int16).view(torch.bfloat16)  # rounded up to a bfloat16
    s = scale.float()
    safe = torch.where(s > 0, s, torch.ones_like(s))

    def code(v: torch.Tensor) -> torch.Tensor:
        q = torch.where(s > 0, v / safe, torch.zeros_like(v)).clamp(-qmax, qmax)
        return torch.round(q).to(torch.int8) if dtype == torch.int8 else q.to(dtype)

    if feedback is None:
        codes = code(xf)
    else:  # channel by channel, the same float32 operations as the compiled write (a product, then a difference)
        y = xf.clone()
        codes = torch.empty(xf.shape, dtype=dtype)
        for i in range(xf.shape[-1]):
            c = code(y[..., i : i + 1])
            codes[..., i : i + 1] = c
            r = y[..., i : i + 1] - c.float() * s
            y[..., i + 1 :] -= r * feedback[:, i, i + 1 :]
    scale_bytes = scale.contiguous().view(torch.uint8).view(*scale.shape[:-1], SCALE_BYTES)
    return torch.cat([codes.view(torch.uint8), scale_bytes], dim=-1).view(dtype)


def keys_feedback(query: torch.Tensor, kv_heads: int, damp: float = 0.1) -> torch.Tensor:
    """The feedback matrices ``[kv_heads, D, D]`` for key rows read by queries like ``query`` ``[tokens, heads,
    D]`` (in the keys' stored basis, before the rotation): a key's rounding error e moves a score by q . e, whose
    mean square over the queries is e^T C e, C their second moment in the rotated basis. Rounding channel by
    channel with each error passed on through C's inverse Cholesky factor (GPTQ's rule, C in the Hessian's
    place) makes that smaller than rounding each channel alone, by up to C's eigenvalues' arithmetic over
    geometric mean (4-6 for SmolLM2's layers). ``damp``: a share of C's mean diagonal added to it, so that
    directions few queries took keep a weight: C comes from one text, and another text's queries differ (over
    3,200 positions of the pinned text, teacher-forced int8 pages, mean KL from the float32 cache: SmolLM2
    (feedback alone) 1.30e-4 / 1.29e-4 / 1.45e-4 at 0.01 / 0.1 / 1, Gemma 3 (with both parts) 1.73e-4 /
    1.64e-4 / 1.58e-4; without feedback 2.45e-4 / 2.01e-4). Row i holds U[i, j] / U[i, i] for j > i (U upper,
    U^T U = C^-1), zeros elsewhere."""
    return gptq_feedback(query_moment(hadamard(query.float()), kv_heads), damp)


def query_moment(query: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The second moment ``[kv_heads, D, D]`` (float64) of queries ``[tokens, heads, D]``, pooled over each KV
    head's query heads."""
    tokens, heads, d = query.shape
    x = query.view(tokens, kv_heads, heads // kv_heads, d).transpose(0, 1).reshape(kv_heads, -1, d).double()
    return x.mT @ x / x.shape[1]


def gptq_feedback(c: torch.Tensor, damp: float = 0.1) -> torch.Tensor:
    """GPTQ's rounding feedback ``[heads, D, D]`` for error weights ``c`` ``[heads, D, D]`` (float64; a row's
    error e costs e^T c e), ``damp`` times c's mean diagonal added first: row i holds U[i, j] / U[i, i] for j > i
    (U upper, U^T U = (c + damp)^-1), zeros elsewhere."""
    eye = torch.eye(c.shape[-1], dtype=torch.float64)
    c = c + damp * c.diagonal(dim1=-2, dim2=-1).mean(-1).clamp_min(1e-30)[:, None, None] * eye
    u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(c)), upper=True)
    return torch.triu(u / u.diagonal(dim1=-2, dim2=-1)[..., None], diagonal=1).float().contiguous()


def dequantize_rows(rows: torch.Tensor) -> torch.Tensor:
    """``[..., head_dim + 2]`` quantized rows -> float32 ``[..., head_dim]``."""
    raw = rows.view(torch.uint8)
    codes = raw[..., :-SCALE_BYTES].contiguous().view(rows.dtype)
    scale = raw[..., -SCALE_BYTES:].contiguous().view(torch.bfloat16).float()
    return codes.float() * scale


def read_keys(rows: torch.Tensor) -> torch.Tensor:
    """Stored key rows -> float32 keys in the model's basis (dequantized, rotated back)."""
    return hadamard(dequantize_rows(rows))


def write_rows(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
               key_feedback: torch.Tensor | None = None) -> None:
    """Quantize each new token's K and V rows and store them at its slot (the torch reshape_and_cache);
    ``key_feedback``: the keys' rounding feedback (quantize_rows)."""
    bs = kv_cache.shape[2]
    blocks, offs = slot_mapping // bs, slot_mapping % bs
    raw = kv_cache.view(torch.uint8)
    raw[0, blocks, offs] = quantize_rows(hadamard(key), kv_cache.dtype, key_feedback).view(torch.uint8)
    raw[1, blocks, offs] = quantize_rows(value, kv_cache.dtype).view(torch.uint8)
