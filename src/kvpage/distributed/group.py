"""The ranks' torch.distributed group (gloo on CPU) and the all-reduce after each row-parallel projection."""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
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
        try:
            dist.destroy_process_group()
        except Exception:  # a group whose peers are gone cannot say goodbye
            pass


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
