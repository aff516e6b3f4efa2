"""The KV tensors and the byte movements the KV manager plans.

The model's KV layout (kv/specs.py) says how many tensors there are: one per layer of a KV group
(``layers_per_group``), each shared by one layer of every group, so a pool block is the same bytes in every
tensor; a model of one group keeps one tensor per layer. Each tensor is ``[2, num_blocks, block_size,
num_kv_heads, head_dim]`` (index 0 = keys, 1 = values). A token's K/V lives at
``[:, slot // block_size, slot % block_size]`` (the row layout). The tensor is a view of block-major storage
``[num_blocks, 2, block_size, ...]``: a block's K and V are one contiguous stretch (12 KiB per layer for
SmolLM2 at 16 tokens): where a sequence's blocks are scattered over the pool, the decode kernel streams that
up to ~1.35x faster from memory than two stretches of half the size (docs/benchmarks/history.md,
2026-11-23). The compiled backend stores bf16 caches in its packed layout instead (same shape, a block's
interior rearranged for the dot-product instructions; docs/model.md): only whole blocks are moved here, so
this module works for both. The host (swap) tier has the same layout with its own block count. int8 pages
with keys per channel (``KVPAGE_INT8_KEYS=channel``, attention/kv_channel.py) are not rows: each tensor is
``[num_blocks, page_bytes]`` bytes, a block's keys of every head in their format and then its value rows.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from kvpage import dtypes
from kvpage.attention.kv_channel import is_channel_pages, page_bytes
from kvpage.attention.kv_quant import cache_row_width
from kvpage.capacity import KVShape
from kvpage.kv.specs import KVLayout, group_layers, with_residual_keys
from kvpage.model.config import ModelConfig
from kvpage.pages import advise_huge_pages, prefault_pages

logger = logging.getLogger(__name__)


def model_layout(cfg: ModelConfig, channel_keys: bool = False) -> KVLayout:
    """The model's KV groups: its layers by window; with ``channel_keys`` (int8 pages whose keys are rounded per
    channel) each group's residual-key group too."""
    layout = group_layers([cfg.layer_window(i) for i in range(cfg.num_layers)])
    return with_residual_keys(layout) if channel_keys else layout


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype, layout: KVLayout | None = None,
                       channel_keys: bool = False) -> int:
    """The planner's formula (capacity.KVShape) for the layers one pool block spans (a KV group's), so
    `kvpage plan`, the simulator and the engine size pools alike."""
    shape = KVShape(cfg.name, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, kv_dtype_name(dtype),
                    v_head_dim=cfg.v_head_dim, int8_keys="channel" if channel_keys else "rows")
    return shape.bytes_per_block(block_size, num_layers=(layout or model_layout(cfg)).layers_per_group)


def kv_torch_dtype(name: str) -> torch.dtype:
    """The torch dtype a KV cache of dtype ``name`` (or alias) is stored in: int8 and fp8 pages as their codes."""
    d = dtypes.lookup(name)
    if not d.kv_cache:
        raise ValueError(f"{d.name} is not a KV cache dtype: choose one of {', '.join(dtypes.KV_CACHE_DTYPES[1:])}")
    return getattr(torch, d.storage or d.name)


def kv_dtype_name(dtype: torch.dtype) -> str:
    """The dtype table's name of a cache stored in ``dtype``."""
    return dtypes.lookup(str(dtype).removeprefix("torch.")).name


def block_major(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized ``[2, num_blocks, ...]`` cache tensor whose storage is ``[num_blocks, 2, ...]``."""
    two, num_blocks, *block = shape
    return torch.empty((num_blocks, two, *block), dtype=dtype).transpose(0, 1)


def as_block_major(cache: torch.Tensor, huge_pages: bool = False) -> torch.Tensor:
    """A copy of a ``[2, num_blocks, ...]`` cache tensor in the engine's block-major storage (tests, benchmarks),
    on 2 MiB pages if asked, as a prefaulted pool is."""
    if not huge_pages:
        return cache.transpose(0, 1).contiguous().transpose(0, 1)
    out = block_major(tuple(cache.shape), cache.dtype)
    advise_huge_pages([out])
    return out.copy_(cache)


def _block_rows(t: torch.Tensor) -> torch.Tensor:
    """A ``[2, num_blocks, ...]`` cache tensor's block-major storage as ``[num_blocks, bytes]`` (a view); pages
    of int8 keys per channel are that already."""
    if is_channel_pages(t):
        return t
    return t.transpose(0, 1).reshape(t.shape[1], -1).view(torch.uint8)


class KVCache:
    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 num_host_blocks: int = 0, layout: KVLayout | None = None, huge_pages: bool = False,
                 channel_keys: bool = False) -> None:
        """``channel_keys``: int8 pages whose keys are rounded per channel (attention/kv_channel.py), each tensor
        ``[num_blocks, page_bytes]`` uint8, beside a layout with residual-key groups."""
        if num_blocks <= 0:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        if cfg.value_head_dim != cfg.head_dim:
            raise ValueError("kvpage's KV layout needs equal key and value head sizes")
        if channel_keys and dtype != torch.int8:
            raise ValueError(f"keys per channel are a format of int8 pages, not of {dtype}")
        if channel_keys and not (layout or model_layout(cfg)).residual_of:
            raise ValueError("int8 pages with keys per channel need a layout with residual-key groups")
        width = cache_row_width(cfg.head_dim, dtype)  # a quantized row ends in its scale
        page = page_bytes(block_size, cfg.num_kv_heads, cfg.head_dim)

        def make(blocks: int) -> torch.Tensor:
            if channel_keys:
                return torch.empty((blocks, page), dtype=torch.uint8)
            return block_major((2, blocks, block_size, cfg.num_kv_heads, width), dtype)

        self.channel_keys = channel_keys
        # Not zeroed: every slot is written before any read (attention reads only positions < seq_len, and
        # block copies move whole blocks). Zeroing 2 GiB costs ~3 s at startup; the price is
        # one page fault per fresh 4 KiB the first time the engine writes it.
        self.layout = layout = layout or model_layout(cfg)
        n = layout.layers_per_group
        self.tensors = [make(num_blocks) for _ in range(n)]
        self.huge_page_bytes = advise_huge_pages(self.tensors) if huge_pages else 0
        # the tensor each layer writes and reads (layers of different groups share one)
        self.layers = [self.tensors[layout.slot(i)] for i in range(cfg.num_layers)]
        self.host_tensors = [make(num_host_blocks) for _ in range(n if num_host_blocks else 0)]
        self.num_blocks, self.num_host_blocks = num_blocks, num_host_blocks
        self.block_size, self.dtype = block_size, dtype

    def prefault(self) -> None:
        """Fault the device KV pages in before serving (the engine's kv_prefault option)."""
        t0 = time.perf_counter()
        how = prefault_pages(self.tensors)
        nbytes = sum(t.numel() * t.element_size() for t in self.tensors)
        logger.info("KV pages faulted in (%s): %.1f GiB in %.1f s", how, nbytes / 2**30, time.perf_counter() - t0)

    @staticmethod
    def _move(src_layers: list[torch.Tensor], dst_layers: list[torch.Tensor], pairs: Sequence[tuple[int, int]]) -> None:
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], dtype=torch.long)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.long)
        for s_layer, d_layer in zip(src_layers, dst_layers, strict=True):
            # whole blocks of the block-major storage, as rows of bytes: one contiguous stretch per block
            s_rows, d_rows = _block_rows(s_layer), _block_rows(d_layer)
            d_rows.index_copy_(0, dst, s_rows.index_select(0, src))  # every source read before any write

    @property
    def block_nbytes(self) -> int:
        """The bytes of one pool block over every tensor: what a disk-tier file carries."""
        return sum(_block_rows(t).shape[1] for t in self.tensors)

    def read_blocks(self, blocks: Sequence[int]) -> list[bytes]:
        """Device blocks' bytes (every tensor, in order) for the disk tier."""
        if not blocks:
            return []
        ids = torch.tensor(list(blocks), dtype=torch.long)
        parts = [_block_rows(t).index_select(0, ids).numpy() for t in self.tensors]
        return [b"".join(p[i].tobytes() for p in parts) for i in range(len(blocks))]

    def write_blocks(self, items: Sequence[tuple[bytes, int]]) -> None:
        """Fill device blocks from ``read_blocks``' bytes: (payload, block) pairs."""
        if not items:
            return
        n = self.block_nbytes
        rows = [_block_rows(t) for t in self.tensors]
        for payload, block in items:
            if len(payload) != n:
                raise ValueError(f"a block is {n} bytes here, got {len(payload)}")
            src = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            off = 0
            for r in rows:
                width = r.shape[1]
                r[block].copy_(src[off: off + width])
                off += width


    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy-on-write: device block src -> device block dst (in every tensor: the block's group's layers)."""
        self._move(self.tensors, self.tensors, pairs)

    def swap_out(self, pairs: Sequence[tuple[int, int]]) -> None:
        """(device, host) pairs: device -> host."""
        if pairs and not self.host_tensors:
            raise RuntimeError("swap-out requested but the KV cache has no host tier (swap space 0)")
        self._move(self.tensors, self.host_tensors, pairs)

    def swap_in(self, pairs: Sequence[tuple[int, int]]) -> None:
        """(host, device) pairs: host -> device."""
        if pairs and not self.host_tensors:
            raise RuntimeError("swap-in requested but the KV cache has no host tier (swap space 0)")
        self._move(self.host_tensors, self.tensors, pairs)
