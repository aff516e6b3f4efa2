"""One rank's shard of the weights, read as such from the checkpoint: the rows and columns it keeps, no more.

A ``Take`` lists, per output row (and per input column), the source index or None for a zero (the padding of
a replicated-KV rank's query slots). GGUF tensors are memory maps: the kept rows are read alone, and kept
columns are cut at quantization-block boundaries before decoding. Safetensors are read slice by slice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvpage.distributed.shard import HeadShard
from kvpage.model.config import ModelConfig

Index = tuple[int | None, ...]


@dataclass(frozen=True)
class Take:
    rows: Index | None = None  # per output row: source row, None = zeros; None = every row
    cols: Index | None = None  # per output column, likewise (2-D tensors)


def _heads(slots: Sequence[int | None], head_dim: int) -> Index:
    return tuple(None if h is None else h * head_dim + i for h in slots for i in range(head_dim))


def shard_takes(cfg: ModelConfig, shard: HeadShard) -> dict[str, Take]:
    """Per parameter suffix (``self_attn.q_proj.weight`` ...), what the rank keeps; absent = replicated."""
    hd, vd = cfg.head_dim, cfg.value_head_dim
    q = _heads(shard.query_slots, hd)
    k = _heads(shard.kv_heads, hd)
    v = _heads(shard.kv_heads, vd)
    o = _heads(shard.query_slots, vd)
    a, b = shard.inter_range
    inter = tuple(range(a, b))
    takes = {
        "self_attn.q_proj.weight": Take(rows=q), "self_attn.q_proj.bias": Take(rows=q),
        "self_attn.k_proj.weight": Take(rows=k), "self_attn.k_proj.bias": Take(rows=k),
        "self_attn.v_proj.weight": Take(rows=v), "self_attn.v_proj.bias": Take(rows=v),
        "self_attn.o_proj.weight": Take(cols=o),
        "mlp.gate_proj.weight": Take(rows=inter), "mlp.up_proj.weight": Take(rows=inter),
        "mlp.down_proj.weight": Take(cols=inter),
    }
    if shard.rank != 0:  # a row-parallel bias is added once, on rank 0, before the sum
        takes["self_attn.o_proj.bias"] = Take(rows=tuple(None for _ in range(cfg.hidden_size)))
    return takes


def take_for(name: str, takes: dict[str, Take]) -> Take | None:
    if not name.startswith("layers."):
        return None
    suffix = name.split(".", 2)[2]
    return takes.get(suffix)


def _runs(index: Index) -> list[tuple[int, int]]:
    """The distinct source indices as sorted contiguous runs [start, end)."""
    src = sorted({i for i in index if i is not None})
    runs: list[tuple[int, int]] = []
    for i in src:
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def _place(part: torch.Tensor, index: Index | None, runs: list[tuple[int, int]], dim: int) -> torch.Tensor:
    """Rows (dim 0) or columns (dim 1) of ``part`` (the runs' indices, concatenated) in ``index`` order."""
    if index is None:
        return part
    pos: dict[int, int] = {}
    at = 0
    for s, e in runs:
        for i in range(s, e):
            pos[i] = at
            at += 1
    zero = part.shape[dim]
    padded = torch.cat([part, torch.zeros_like(part.narrow(dim, 0, 1))], dim=dim)
    order = torch.tensor([zero if i is None else pos[i] for i in index], dtype=torch.long)
    return padded.index_select(dim, order)


def take_gguf(data: np.ndarray, block: tuple[int, int] | None, shape: tuple[int, ...], take: Take,
              decode) -> torch.Tensor:
    """Decode only the kept rows and columns of a GGUF tensor (``data``: the file's rows, as bytes for
    quantized types, as elements for plain floats; ``block``: (elements, bytes) per quantization block, None
    for plain floats; ``decode(data, shape)`` the tensor's decoder)."""
    rows = _runs(take.rows) if take.rows is not None else [(0, shape[0])]
    if not rows:  # every row a zero
        return torch.zeros(len(take.rows or ()), *shape[1:])
    sub = np.concatenate([data[s:e] for s, e in rows]) if take.rows is not None else data
    sub_shape: tuple[int, ...] = (sum(e - s for s, e in rows), *shape[1:])
    cols = None
    if take.cols is not None:
        cols = _runs(take.cols)
        per, unit = block if block is not None else (1, 1)
        if any(s % per or e % per for s, e in cols):
            raise ValueError(f"a column shard must start and end on {per}-element quantization blocks")
        sub = np.concatenate([sub[:, (s // per) * unit:(e // per) * unit] for s, e in cols], axis=1)
        sub_shape = (sub_shape[0], sum(e - s for s, e in cols))
    out = decode(np.ascontiguousarray(sub), sub_shape)
    out = _place(out, take.rows, rows, 0) if take.rows is not None else out
    return _place(out, take.cols, cols, 1) if cols is not None else out


def take_tensor(get_slice, shape: Sequence[int], take: Take) -> torch.Tensor:
    """The kept rows and columns from a sliceable checkpoint tensor (safetensors' ``get_slice``)."""
    rows = _runs(take.rows) if take.rows is not None else [(0, shape[0])]
    if not rows:  # every row a zero
        return torch.zeros(len(take.rows or ()), *shape[1:])
    part = torch.cat([get_slice[s:e] for s, e in rows])
    part = _place(part, take.rows, rows, 0) if take.rows is not None else part
    if take.cols is not None:
        cols = _runs(take.cols)
        part = _place(torch.cat([part[:, s:e] for s, e in cols], dim=1), take.cols, cols, 1)
    return part
