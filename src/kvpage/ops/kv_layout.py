"""The packed KV layouts (csrc/attention/packed_kv.h for bf16, packed_int8.h and packed_fp8.h for int8 and fp8
pages), converted to and from the row layout in torch.

Inside every block, groups of 16 keys per KV head hold K and V in the operand order of the dot-product
instructions, so the attention kernels read them as they are: bf16 K as [dim pairs][16 keys][2] and V as
[key pairs][dim][2]; int8 K codes (plus 128) as [dim quads][16 keys][4] and V codes as [key quads][dim][4],
each followed by the group's 16 bfloat16 scales; fp8 codes as int8's, with each quad's four codes in the order
0, 2, 1, 3 (the low bytes of a 32-bit lane are one bf16 pair, its high bytes the next). The tensor's shape is
the row layout's. The engine only writes and reads through the kernels; these conversions are for tests and
inspection.
"""

from __future__ import annotations

import torch


def pack_kv_rows(rows: torch.Tensor) -> torch.Tensor:
    """A row-layout cache [2, blocks, block_size, kv_heads, D] in the packed layout (a new tensor)."""
    if rows.dtype in _CODES:
        return _pack_codes(rows)
    _, nb, bs, kvh, d = rows.shape
    k = rows[0].reshape(nb, bs // 16, 16, kvh, d // 2, 2).permute(0, 1, 3, 4, 2, 5)
    v = rows[1].reshape(nb, bs // 16, 8, 2, kvh, d).permute(0, 1, 4, 2, 5, 3)
    return torch.stack([k.reshape(nb, bs, kvh, d), v.reshape(nb, bs, kvh, d)])


def unpack_kv_rows(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_kv_rows."""
    if packed.dtype in _CODES:
        return _unpack_codes(packed)
    _, nb, bs, kvh, d = packed.shape
    k = packed[0].reshape(nb, bs // 16, kvh, d // 2, 16, 2).permute(0, 1, 4, 2, 3, 5)
    v = packed[1].reshape(nb, bs // 16, kvh, 8, d, 2).permute(0, 1, 3, 5, 2, 4)
    return torch.stack([k.reshape(nb, bs, kvh, d), v.reshape(nb, bs, kvh, d)])



_CODES = (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)
_FP8_QUAD = [0, 2, 1, 3]  # fp8: a quad's element j lies at byte _FP8_QUAD[j] of its lane (an involution)


def _pack_codes(rows: torch.Tensor) -> torch.Tensor:
    """int8 and fp8 pages: rows of D codes + 2 scale bytes -> per (16-key group, head) codes, then the 16 scales."""
    _, nb, bs, kvh, w = rows.shape
    d = w - 2
    raw = rows.view(torch.uint8)
    r = raw.reshape(2, nb, bs // 16, 16, kvh, w).permute(0, 1, 2, 4, 3, 5)  # [2, nb, groups, kvh, 16 keys, w]
    codes, scales = r[..., :d], r[..., d:]
    k = codes[0] ^ 0x80 if rows.dtype == torch.int8 else codes[0]
    k = k.reshape(nb, bs // 16, kvh, 16, d // 4, 4).transpose(3, 4)  # [dim quads][16 keys][4]
    v = codes[1].reshape(nb, bs // 16, kvh, 4, 4, d).transpose(4, 5)  # [key quads][dim][4]
    if rows.dtype != torch.int8:
        k, v = k[..., _FP8_QUAD], v[..., _FP8_QUAD]
    k = torch.cat([k.reshape(nb, bs // 16, kvh, 16 * d), scales[0].reshape(nb, bs // 16, kvh, 32)], -1)
    v = torch.cat([v.reshape(nb, bs // 16, kvh, 16 * d), scales[1].reshape(nb, bs // 16, kvh, 32)], -1)
    return torch.stack([k.reshape(nb, bs, kvh, w), v.reshape(nb, bs, kvh, w)]).view(rows.dtype)


def _unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    _, nb, bs, kvh, w = packed.shape
    d = w - 2
    g = packed.contiguous().view(torch.uint8).reshape(2, nb, bs // 16, kvh, 16 * w)
    codes, scales = g[..., : 16 * d], g[..., 16 * d :].reshape(2, nb, bs // 16, kvh, 16, 2)
    k = codes[0].reshape(nb, bs // 16, kvh, d // 4, 16, 4)
    v = codes[1].reshape(nb, bs // 16, kvh, 4, d, 4)
    if packed.dtype != torch.int8:
        k, v = k[..., _FP8_QUAD], v[..., _FP8_QUAD]
    k = k.transpose(3, 4).reshape(nb, bs // 16, kvh, 16, d)
    if packed.dtype == torch.int8:
        k = k ^ 0x80
    v = v.transpose(4, 5).reshape(nb, bs // 16, kvh, 16, d)
    rows = torch.cat([torch.stack([k, v]), scales], -1)  # [2, nb, groups, kvh, 16, w]
    return rows.permute(0, 1, 2, 4, 3, 5).reshape(2, nb, bs, kvh, w).contiguous().view(packed.dtype)
