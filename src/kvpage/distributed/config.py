"""Where the tensor-parallel ranks run and how they find each other (torch.distributed's rendezvous settings).

Ranks are numbered node by node: node k hosts ranks k * per_node .. (k + 1) * per_node - 1, per_node being
tensor_parallel_size / nnodes. Rank 0 (node 0) runs the scheduler, the KV manager and the API; every other
rank follows its step plans. Under torchrun the environment (RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT) says the same and each process is one rank.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, replace

DEFAULT_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None: a free port on this host (one node only)
    timeout_s: float = DEFAULT_TIMEOUT_S  # a rank silent this long fails the step (hang, lost host)
    launched_rank: int | None = None  # set under torchrun: this process is that one rank, nothing spawned

    def __post_init__(self) -> None:
        tp = self.tensor_parallel_size
        if not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {tp!r}")
        if not isinstance(self.nnodes, int) or self.nnodes < 1:
            raise ValueError(f"nnodes must be a positive integer, got {self.nnodes!r}")
        if tp % self.nnodes:
            raise ValueError(f"tensor_parallel_size={tp} does not split evenly over nnodes={self.nnodes}")
        if not isinstance(self.node_rank, int) or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in 0..{self.nnodes - 1}, got {self.node_rank!r}")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise ValueError(f"master_port must be in 1..65535, got {self.master_port}")
        if self.nnodes > 1 and self.master_port is None:
            raise ValueError("with nnodes > 1 every node needs the same --master-port")
        if not self.timeout_s > 0:
            raise ValueError(f"the rank timeout must be positive, got {self.timeout_s}")

    @property
    def per_node(self) -> int:
        return self.tensor_parallel_size // self.nnodes

    @property
    def local_ranks(self) -> list[int]:
        """The global ranks this node runs (under torchrun: this process's rank alone)."""
        if self.launched_rank is not None:
            return [self.launched_rank]
        return list(range(self.node_rank * self.per_node, (self.node_rank + 1) * self.per_node))

    @property
    def leads(self) -> bool:
        """Whether this process hosts rank 0 (the scheduler)."""
        return 0 in self.local_ranks

    def with_port(self) -> ParallelConfig:
        """A free local port filled in where none was given (one node: rank 0 hosts the store)."""
        if self.master_port is not None:
            return self
        with socket.socket() as s:
            s.bind((self.master_addr, 0))
            return replace(self, master_port=s.getsockname()[1])

    @classmethod
    def from_torchrun(cls, tensor_parallel_size: int, environ: Mapping[str, str] | None = None,
                      timeout_s: float = DEFAULT_TIMEOUT_S) -> ParallelConfig | None:
        """The settings torchrun put in the environment, or None when not launched by it."""
        env = os.environ if environ is None else environ
        if "RANK" not in env or "WORLD_SIZE" not in env:
            return None
        world = int(env["WORLD_SIZE"])
        if world != tensor_parallel_size:
            raise ValueError(f"torchrun started {world} processes, tensor_parallel_size is {tensor_parallel_size}")
        per_node = int(env.get("LOCAL_WORLD_SIZE", world))
        rank = int(env["RANK"])
        return cls(tensor_parallel_size, nnodes=world // per_node, node_rank=rank // per_node,
                   master_addr=env.get("MASTER_ADDR", "127.0.0.1"), master_port=int(env.get("MASTER_PORT", 29500)),
                   timeout_s=timeout_s, launched_rank=rank)
