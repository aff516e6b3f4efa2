"""The ranks' torch.distributed group (gloo on CPU) and the all-reduce after each row-parallel projection."""

from __future__ import annotations

import contextlib
import datetime
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from kvpage.distributed.config import ParallelConfig


@dataclass
class CommStats:
    """What the all-reduces of this rank cost: their count, bytes and seconds (for benchmarks/tp.py)."""

    calls: int = 0
    bytes: int = 0
    seconds: float = 0.0

    def reset(self) -> None:
        self.calls, self.bytes, self.seconds = 0, 0, 0.0


def open_store(config: ParallelConfig, rank: int) -> dist.TCPStore:
    """The rendezvous store at master_addr:master_port: rank 0 hosts it, the others connect (waiting up to
    the timeout for it to come up)."""
    return dist.TCPStore(config.master_addr, config.master_port, config.tensor_parallel_size, rank == 0,
                         timeout=datetime.timedelta(seconds=config.timeout_s), wait_for_workers=False)


def init_group(config: ParallelConfig, rank: int, store: dist.Store) -> None:
    """Join the ranks' group over ``store``; every collective after this fails instead of waiting longer than
    the config's timeout (a hung or lost rank)."""
    if dist.is_initialized():
        raise RuntimeError("this process already belongs to a torch.distributed group")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=config.tensor_parallel_size,
                            timeout=datetime.timedelta(seconds=config.timeout_s))


def leave_group() -> None:
    if dist.is_initialized():
        with contextlib.suppress(Exception):  # a group whose peers are gone cannot say goodbye
            dist.destroy_process_group()


class AllReduceLinear(nn.Module):
    """A row-parallel projection: this rank's columns, then the sum over the ranks."""

    def __init__(self, linear: nn.Linear, stats: CommStats) -> None:
        super().__init__()
        self.linear = linear
        self.stats = stats

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        t = time.perf_counter()
        dist.all_reduce(y)
        st = self.stats
        st.seconds += time.perf_counter() - t
        st.calls += 1
        st.bytes += y.numel() * y.element_size()
        return y


def make_row_parallel(model: nn.Module, stats: CommStats) -> int:
    """Wrap every layer's output and down projections (the row-parallel ones); returns how many."""
    n = 0
    for layer in model.layers:
        layer.self_attn.o_proj = AllReduceLinear(layer.self_attn.o_proj, stats)
        layer.mlp.down_proj = AllReduceLinear(layer.mlp.down_proj, stats)
        n += 2
    return n


class VocabParallelHead:
    """The lm head split by vocabulary: each rank multiplies its slice of the rows, rank 0 gathers the slices
    into the whole [rows, vocab] logits (the other ranks get None). Called as ``F.linear(x, weight)`` is."""

    def __init__(self, weight: torch.Tensor, rank: int, size: int, stats: CommStats,
                 product: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.linear) -> None:
        self.product = product  # the slice's product (the worker's: in a few row counts, for oneDNN's sake)
        vocab = weight.shape[0]
        per = -(-vocab // size)
        self.widths = [max(0, min(vocab, (r + 1) * per) - min(vocab, r * per)) for r in range(size)]
        start = min(vocab, rank * per)
        self.slice = weight[start : start + self.widths[rank]]
        self.rank, self.stats = rank, stats

    def __call__(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor | None:
        part = self.product(x, self.slice)
        t = time.perf_counter()
        if self.rank == 0:
            parts = [part] + [torch.empty(x.shape[0], w, dtype=part.dtype) for w in self.widths[1:]]
            dist.gather(part, parts, dst=0)
            out = torch.cat(parts, dim=1)
        else:
            dist.gather(part, None, dst=0)
            out = None
        st = self.stats
        st.seconds += time.perf_counter() - t
        st.calls += 1
        st.bytes += x.shape[0] * sum(self.widths[1:]) * part.element_size()
        return out
