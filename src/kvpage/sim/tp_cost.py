"""Step time under tensor parallelism: one rank's share of the work plus the communication between ranks.

Each rank multiplies its slice of every projection (query heads, KV heads or their replicas, MLP columns)
and of the lm head's vocabulary, and reads its KV shard, as kvpage's ranks do. Two all-reduces per layer
(after the attention output and after the MLP's down projection) sum [tokens, hidden] activations; a ring
all-reduce over N ranks moves 2 (N - 1) / N of the buffer through each link and takes 2 (N - 1) hops:

    t_allreduce(bytes) = 2 (N - 1) * latency + 2 (N - 1) / N * bytes / bandwidth

and rank 0 gathers the other ranks' logits slices once per step, (N - 1) / N of [rows, vocab]:

    t_gather(bytes) = (N - 1) * latency + (N - 1) / N * bytes / bandwidth

The step is the per-rank roofline (kvpage.sim.cost) of the sharded model plus that communication, with no
overlap between the two (kvpage's ranks wait at each collective).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvpage.capacity import kv_heads_per_rank
from kvpage.core.step import StepFeatures
from kvpage.sim.cost import ModelSpec, RooflineCost


@dataclass(frozen=True)
class LinkSpec:
    """The links between ranks: per-direction bandwidth an all-reduce achieves, and latency per hop."""

    bandwidth: float  # bytes/s
    latency: float  # seconds per hop
    name: str = "link"


# loopback: gloo between processes on one host, fitted by benchmarks/tp.py on a 2-core AMD EPYC (Zen 5),
# 2026-11-26 (1.3-1.8 GB/s, 170-280 us per hop, noisy from run to run on two shared cores); nvlink3: one node
# of eight A100 SXM GPUs, modeled (not measured: no GPU here) from NCCL's ~230 GB/s all-reduce bus bandwidth.
LINKS: dict[str, LinkSpec] = {
    "loopback": LinkSpec(1.5e9, 200e-6, "loopback TCP (gloo)"),
    "nvlink3": LinkSpec(230e9, 5e-6, "NVLink 3 (8x A100 SXM)"),
}


def rank_spec(model: ModelSpec, size: int) -> ModelSpec:
    """One rank's share of the model: its query heads, its KV heads (all of them where they do not divide),
    its MLP columns, its slice of the vocabulary."""
    kv, _ = kv_heads_per_rank(model.num_kv_heads, size)
    kv_bytes = model.kv_bytes_per_token * kv / model.num_kv_heads
    kv_bytes = int(kv_bytes) if kv_bytes == int(kv_bytes) else kv_bytes  # whole bytes but for keys per channel
    return replace(model, num_attention_heads=model.num_attention_heads // size, num_kv_heads=kv,
                   intermediate_size=model.intermediate_size // size, kv_bytes_per_token=kv_bytes,
                   vocab_size=-(-model.vocab_size // size))


def allreduce_seconds(nbytes: float, size: int, link: LinkSpec) -> float:
    if size == 1:
        return 0.0
    return 2 * (size - 1) * link.latency + 2 * (size - 1) / size * nbytes / link.bandwidth


def gather_seconds(nbytes: float, size: int, link: LinkSpec) -> float:
    if size == 1:
        return 0.0
    return (size - 1) * link.latency + (size - 1) / size * nbytes / link.bandwidth


@dataclass(frozen=True)
class TensorParallelCost:
    rank: RooflineCost  # the roofline of one rank's share (rank_spec): hidden size and dtype as the model's
    size: int
    link: LinkSpec
    vocab_size: int  # the whole vocabulary (the rank's spec holds its slice)

    def parts(self, f: StepFeatures) -> dict[str, float]:
        parts = self.rank.parts(f)
        m = self.rank.model
        per_call = f.num_tokens * m.hidden_size * m.dtype_bytes
        parts["allreduce"] = 2 * m.num_layers * allreduce_seconds(per_call, self.size, self.link)
        parts["gather"] = gather_seconds(f.logit_rows * self.vocab_size * m.dtype_bytes, self.size,
                                         self.link) if f.logit_rows else 0.0
        return parts

    def step_seconds(self, f: StepFeatures) -> float:
        return sum(self.parts(f).values())

    def describe(self) -> str:
        return (f"tensor parallel x{self.size} over {self.link.name} ({self.link.bandwidth / 1e9:.0f} GB/s, "
                f"{self.link.latency * 1e6:.0f} us/hop); per rank: {self.rank.describe()}")


def tensor_parallel_cost(model: ModelSpec, machine, block_size: int, size: int, link: LinkSpec) -> TensorParallelCost:
    return TensorParallelCost(RooflineCost(rank_spec(model, size), machine, block_size), size, link, model.vocab_size)
