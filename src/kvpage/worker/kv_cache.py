"""The KV tensors and the byte movements the KV manager plans.

Layout, per layer: one tensor ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (index 0 = keys,
1 = values). A token's K/V lives at ``[:, slot // block_size, slot % block_size]``; viewed flat as
``[2, num_blocks * block_size, num_kv_heads, head_dim]`` it is simply row ``slot``. The host (swap) tier
has the same layout with its own block count.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import threading
from collections.abc import Sequence

import torch

from kvpage.capacity import KVShape
from kvpage.model.config import ModelConfig

logger = logging.getLogger(__name__)


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """The planner's formula (capacity.KVShape), so `kvpage plan` and the engine size pools alike."""
    shape = KVShape(cfg.name, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, str(dtype).removeprefix("torch."),
                    v_head_dim=cfg.v_head_dim)
    return shape.bytes_per_token() * block_size


_MADV_POPULATE_WRITE = 23  # Linux >= 5.14: fault pages in without changing their contents
_PAGE = 4096


def populate_in_background(tensors: Sequence[torch.Tensor]) -> threading.Thread | None:
    """Fault the tensors' pages in from a daemon thread, so the first decode steps do not pay one page fault
    per 4 KiB of fresh KV (3.8 s over a 4 GiB ShareGPT run). Safe while the engine writes the same memory:
    populating never changes a byte. A kernel without the call just keeps the lazy behaviour."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    spans = []
    for t in tensors:
        start = t.data_ptr() // _PAGE * _PAGE
        spans.append((start, t.data_ptr() + t.numel() * t.element_size() - start))

    def run() -> None:
        with contextlib.suppress(OSError, AttributeError):  # niceness is per thread on Linux: yield the cores
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        for start, length in spans:
            if madvise(start, length, _MADV_POPULATE_WRITE) != 0:
                return  # EINVAL on older kernels: nothing to do

    th = threading.Thread(target=run, name="kvpage-kv-populate", daemon=True)
    th.start()
    return th


class KVCache:
    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 num_host_blocks: int = 0) -> None:
        if num_blocks <= 0:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        if cfg.value_head_dim != cfg.head_dim:
            raise ValueError("kvpage's KV layout needs equal key and value head sizes")
        shape = (2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        # Not zeroed: every slot is written before any read (attention reads only positions < seq_len, and
        # block copies move whole blocks). Zeroing 2 GiB costs ~3 s at startup; the pages
        # are faulted in by a background thread instead (populate_in_background).
        self.layers = [torch.empty(shape, dtype=dtype) for _ in range(cfg.num_layers)]
        host_shape = (2, num_host_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        n_host_layers = cfg.num_layers if num_host_blocks else 0
        self.host_layers = [torch.empty(host_shape, dtype=dtype) for _ in range(n_host_layers)]
        self.num_blocks, self.num_host_blocks = num_blocks, num_host_blocks
        self.block_size, self.dtype = block_size, dtype
        self.populate_thread: threading.Thread | None = None

    def populate(self) -> None:
        """Fault the device KV pages in from a background thread (once). The engine calls this after its
        first step, so it does not compete with model loading and the first token (cold start)."""
        if self.populate_thread is None:
            # The tensors stay referenced by self.layers for the cache's life, so the spans stay valid.
            self.populate_thread = populate_in_background(self.layers)

    @staticmethod
    def _move(src_layers: list[torch.Tensor], dst_layers: list[torch.Tensor], pairs: Sequence[tuple[int, int]]) -> None:
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], dtype=torch.long)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.long)
        for s_layer, d_layer in zip(src_layers, dst_layers, strict=True):
            d_layer[:, dst] = s_layer[:, src]  # the gather copies every source before any write

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy-on-write: device block src -> device block dst."""
        self._move(self.layers, self.layers, pairs)

    def swap_out(self, pairs: Sequence[tuple[int, int]]) -> None:
        """(device, host) pairs: device -> host."""
        if pairs and not self.host_layers:
            raise RuntimeError("swap-out requested but the KV cache has no host tier (swap space 0)")
        self._move(self.layers, self.host_layers, pairs)

    def swap_in(self, pairs: Sequence[tuple[int, int]]) -> None:
        """(host, device) pairs: host -> device."""
        if pairs and not self.host_layers:
            raise RuntimeError("swap-in requested but the KV cache has no host tier (swap space 0)")
        self._move(self.host_layers, self.layers, pairs)
