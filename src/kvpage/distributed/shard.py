"""Which heads and which slice of the MLP one tensor-parallel rank holds (pure arithmetic, no torch).

Query heads split evenly over the ranks. KV heads split with them where they divide over the ranks; where
they do not, every rank stores all of them (replicated, as ``kvpage plan -tp`` prices it). A rank's attention
then runs with a padded query layout: for each stored KV head, ``group`` query slots, filled with the rank's
own query heads that read that KV head and padded with empty slots (zero weights in and out), so that the
kernels see an even grouped-query ratio. Column-parallel projections (QKV, gate/up) keep the rank's rows,
row-parallel ones (output, down) the matching columns, and an all-reduce sums the ranks' partial outputs.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpage.capacity import kv_heads_per_rank


@dataclass(frozen=True)
class HeadShard:
    rank: int
    size: int
    num_heads: int  # the model's query heads
    num_kv_heads: int  # the model's KV heads
    intermediate_size: int
    layout: str  # "sharded" | "replicated"
    kv_heads: tuple[int, ...]  # the model's KV heads this rank stores, in cache order
    query_slots: tuple[int | None, ...]  # per local query slot: the model's query head, or None (padding)

    @property
    def local_heads(self) -> int:
        return len(self.query_slots)

    @property
    def local_kv_heads(self) -> int:
        return len(self.kv_heads)

    @property
    def inter_range(self) -> tuple[int, int]:
        """The rank's rows of gate/up and columns of down."""
        per = self.intermediate_size // self.size
        return self.rank * per, (self.rank + 1) * per


def check_tensor_parallel(num_heads: int, num_kv_heads: int, intermediate_size: int, size: int,
                          model: str = "the model") -> None:
    """Refuse, by name, a tensor-parallel size the model cannot take."""
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {size!r}")
    if num_heads % size:
        raise ValueError(f"tensor_parallel_size={size}: {model}'s {num_heads} attention heads do not divide over "
                         f"{size} ranks (choose a divisor of {num_heads})")
    if intermediate_size % size:
        raise ValueError(f"tensor_parallel_size={size}: {model}'s MLP width {intermediate_size} does not divide "
                         f"over {size} ranks")


def head_shard(rank: int, size: int, num_heads: int, num_kv_heads: int, intermediate_size: int) -> HeadShard:
    check_tensor_parallel(num_heads, num_kv_heads, intermediate_size, size)
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} outside 0..{size - 1}")
    group = num_heads // num_kv_heads  # query heads per KV head in the model
    per = num_heads // size
    mine = range(rank * per, (rank + 1) * per)
    stored, layout = kv_heads_per_rank(num_kv_heads, size)
    if layout == "sharded":
        kv = tuple(range(rank * stored, (rank + 1) * stored))
        slots: tuple[int | None, ...] = tuple(mine)  # contiguous: the rank's heads read its KV heads in order
        return HeadShard(rank, size, num_heads, num_kv_heads, intermediate_size, layout, kv, slots)
    kv = tuple(range(num_kv_heads))
    # the fewest query slots per KV head that hold every own head: its largest count on one KV head
    counts = [sum(1 for q in mine if q // group == h) for h in kv]
    width = max(counts)
    padded: list[int | None] = []
    for h in kv:
        own = [q for q in mine if q // group == h]
        padded.extend(own + [None] * (width - len(own)))
    return HeadShard(rank, size, num_heads, num_kv_heads, intermediate_size, layout, kv, tuple(padded))
