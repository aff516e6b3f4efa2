"""The disk tier under tensor parallelism: one file per block holds every rank's shard of it, in rank order.

Rank 0 alone owns the directory (it schedules, so it alone looks prefixes up and decides what is evicted).
A block going to disk is read by every rank from its own KV tensors and gathered to rank 0, which writes the
joined bytes; a block coming back is read (and its checksum verified) once, by rank 0's lookup, and travels
whole in the step's plan, each rank keeping its own slice. Every rank therefore loads the bytes of one
verified file, and the ranks can never disagree on which loads succeeded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class BlockShards:
    """This rank's place in a disk-tier block: ``nbytes`` is one rank's share (equal on every rank: KV heads
    either split evenly or are replicated, distributed/shard.py). An engine of one rank has (0, 1, its block)."""

    rank: int
    size: int
    nbytes: int

    @property
    def block_bytes(self) -> int:
        """What one disk-tier file carries: every rank's share."""
        return self.nbytes * self.size

    def gather(self, payloads: Sequence[bytes]) -> list[bytes] | None:
        """Called by every rank with its own bytes of the same blocks (the step's plan names them): rank 0 gets
        each block's joined bytes, the other ranks None. One rank: the bytes as they are."""
        if self.size == 1:
            return list(payloads)
        n, blocks = self.nbytes, len(payloads)
        if any(len(p) != n for p in payloads):
            raise ValueError(f"a rank's share of a block is {n} bytes here, got {[len(p) for p in payloads]}")
        local = torch.frombuffer(bytearray(b"".join(payloads)), dtype=torch.uint8)
        if self.rank != 0:
            dist.gather(local, None, dst=0)
            return None
        parts = [local] + [torch.empty_like(local) for _ in range(self.size - 1)]
        dist.gather(local, parts, dst=0)
        joined = torch.stack([p.view(blocks, n) for p in parts], dim=1).reshape(blocks, self.block_bytes)
        return [row.numpy().tobytes() for row in joined]

    def mine(self, payload: bytes) -> bytes:
        """This rank's slice of a block's joined bytes (one rank: all of them)."""
        if len(payload) != self.block_bytes:
            raise ValueError(f"a disk-tier block is {self.block_bytes} bytes under {self.size} ranks, "
                             f"got {len(payload)}")
        return payload[self.rank * self.nbytes : (self.rank + 1) * self.nbytes]
