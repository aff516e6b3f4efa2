"""The packed bf16 KV layout (csrc/attention/packed_kv.h), converted to and from the row layout in torch.

Inside every block, groups of 16 keys per KV head hold K as [dim pairs][16 keys][2] and V as
[key pairs][dim][2], the operand order of the dot-product instructions, so the attention kernels read them as
they are. The tensor's shape is the row layout's. The engine only writes and reads through the kernels; these
conversions are for tests and inspection.
"""

from __future__ import annotations

import torch


def pack_kv_rows(rows: torch.Tensor) -> torch.Tensor:
    """A row-layout cache [2, blocks, block_size, kv_heads, D] in the packed layout (a new tensor)."""
    _, nb, bs, kvh, d = rows.shape
    k = rows[0].reshape(nb, bs // 16, 16, kvh, d // 2, 2).permute(0, 1, 3, 4, 2, 5)
    v = rows[1].reshape(nb, bs // 16, 8, 2, kvh, d).permute(0, 1, 4, 2, 5, 3)
    return torch.stack([k.reshape(nb, bs, kvh, d), v.reshape(nb, bs, kvh, d)])


def unpack_kv_rows(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_kv_rows."""
    _, nb, bs, kvh, d = packed.shape
    k = packed[0].reshape(nb, bs // 16, kvh, d // 2, 16, 2).permute(0, 1, 4, 2, 3, 5)
    v = packed[1].reshape(nb, bs // 16, kvh, 8, d, 2).permute(0, 1, 3, 5, 2, 4)
    return torch.stack([k.reshape(nb, bs, kvh, d), v.reshape(nb, bs, kvh, d)])


