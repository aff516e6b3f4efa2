"""Engine settings shared by ``LLM``, ``kvpage generate`` and the server, with vLLM's flag names."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from typing import Any

from kvpage.config import DEFAULT_KV_CACHE_MEMORY, DEFAULT_MODEL, CacheConfig, ModelRunConfig
from kvpage.core.scheduler import PreemptionMode, SchedulerConfig, SchedulingPolicy
from kvpage.distributed.config import DEFAULT_TIMEOUT_S, ParallelConfig
from kvpage.dtypes import KV_CACHE_CHOICES, RUN_DTYPES
from kvpage.envs import KernelConfig
from kvpage.kv import ALLOCATORS, DEFAULT_BLOCK_SIZE
from kvpage.units import parse_size


def size_gib_default(text: str | int) -> int:
    """A size with units; a bare number means GiB (as vLLM's --swap-space)."""
    if isinstance(text, str) and text.strip().replace(".", "", 1).isdigit():
        return int(float(text) * 1024**3)
    return parse_size(text)


@dataclass
class EngineArgs:
    model: str = DEFAULT_MODEL
    dtype: str = "auto"
    max_model_len: int | None = None
    block_size: int = DEFAULT_BLOCK_SIZE
    kv_cache_memory: str | int = DEFAULT_KV_CACHE_MEMORY
    kv_cache_dtype: str = "auto"
    swap_space: str | int = 0
    kv_prefault: bool = False
    kv_huge_pages: bool | None = None  # None: with kv_prefault
    # tiers below the pool for evicted prefix blocks (docs/kv_offload.md)
    kv_offload_memory: str | int = 0
    kv_offload_dir: str | None = None
    kv_offload_disk: str | int | None = None
    # KV events for routers: a ZeroMQ PUB endpoint, and/or a callable taking each step's list of events
    kv_events_endpoint: str | None = None
    kv_events_callback: Any = None
    enable_prefix_caching: bool = True
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # default: 2048 with chunked prefill, else max_model_len
    enable_chunked_prefill: bool = True
    preemption_mode: PreemptionMode = "recompute"
    scheduling_policy: SchedulingPolicy = "fcfs"
    reserve_certain_growth: bool = True  # admission keeps room for growth running requests are certain of
    watermark: float = 0.01
    seed: int = 0
    attention_backend: str = "auto"
    kv_policy: str = "paged"  # or "static": max-length reservations, the baseline paging is measured against
    kernels: KernelConfig | None = None  # the kernel paths (kvpage.envs); None = the environment's
    # tensor parallelism (kvpage.distributed): ranks, and where they meet when they span hosts
    tensor_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    tp_timeout: float = DEFAULT_TIMEOUT_S

    def model_config(self) -> ModelRunConfig:
        return ModelRunConfig(model=self.model, dtype=self.dtype, max_model_len=self.max_model_len,
                              attention_backend=self.attention_backend, kernels=self.kernels)

    def parallel_config(self) -> ParallelConfig | None:
        """None on one rank; under torchrun its environment decides where this process stands."""
        if self.tensor_parallel_size == 1 and self.nnodes == 1:
            return None
        launched = ParallelConfig.from_torchrun(self.tensor_parallel_size, timeout_s=self.tp_timeout)
        if launched is not None:
            return launched
        return ParallelConfig(self.tensor_parallel_size, self.nnodes, self.node_rank, self.master_addr,
                              self.master_port, self.tp_timeout)

    def scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        """With the model's context length resolved (the worker knows it): without chunked prefill a step must
        hold a whole prompt, so the token budget defaults to max_model_len."""
        batched = self.max_num_batched_tokens
        if batched is None:
            batched = 2048 if self.enable_chunked_prefill else max_model_len
        return SchedulerConfig(max_model_len=max_model_len, max_num_batched_tokens=batched,
                               max_num_seqs=self.max_num_seqs, enable_chunked_prefill=self.enable_chunked_prefill,
                               preemption_mode=self.preemption_mode, policy=self.scheduling_policy,
                               reserve_certain_growth=self.reserve_certain_growth)

    def cache_config(self) -> CacheConfig:
        return CacheConfig(block_size=self.block_size, kv_cache_memory=size_gib_default(self.kv_cache_memory),
                           kv_cache_dtype=self.kv_cache_dtype, swap_space=size_gib_default(self.swap_space),
                           enable_prefix_caching=self.enable_prefix_caching, watermark=self.watermark,
                           kv_prefault=self.kv_prefault, kv_huge_pages=self.kv_huge_pages,
                           kv_offload_memory=size_gib_default(self.kv_offload_memory),
                           kv_offload_dir=self.kv_offload_dir,
                           kv_offload_disk=None if self.kv_offload_disk is None else
                           size_gib_default(self.kv_offload_disk))

    @staticmethod
    def add_cli_args(p: argparse.ArgumentParser) -> None:
        d = EngineArgs()  # every flag's default is the field's
        g = p.add_argument_group("engine")
        g.add_argument("--model", default=d.model, help="default name, .gguf file or Hugging Face directory")
        g.add_argument("--dtype", default=d.dtype, choices=RUN_DTYPES,
                       help="auto = bfloat16 where the CPU has AVX512_BF16, else float32, both on the fast path "
                            "(packed and quantized products, fused kernels); float32 = the exact step-by-step path")
        g.add_argument("--max-model-len", type=int, help="longest sequence (default: the model's context length)")
        g.add_argument("--block-size", type=int, default=d.block_size,
                       help=f"tokens per KV block (default {d.block_size})")
        g.add_argument("--kv-cache-memory", default=d.kv_cache_memory,
                       help=f"KV cache size, with units (a bare number is GiB; default {d.kv_cache_memory})")
        g.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype, choices=KV_CACHE_CHOICES,
                       help="KV cache dtype (default auto = the model's); int8 and fp8 (= fp8_e4m3), fp8_e5m2 store "
                            "one byte per value and a bfloat16 scale per row: ~1.94x the tokens of bfloat16")
        g.add_argument("--swap-space", default=str(d.swap_space),
                       help="host memory for swapped blocks (bare number = GiB)")
        g.add_argument("--kv-prefault", action=argparse.BooleanOptionalAction, default=d.kv_prefault,
                       help="fault the KV cache's pages in at startup (slower start, no page faults mid-run; "
                            "`kvpage serve` does by default)")
        g.add_argument("--kv-huge-pages", action=argparse.BooleanOptionalAction, default=d.kv_huge_pages,
                       help="back the KV cache with 2 MiB pages where the OS allows (fewer TLB misses on "
                            "scattered blocks; default: when --kv-prefault is on, as for `kvpage serve`)")
        g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                       default=d.enable_prefix_caching)
        o = p.add_argument_group("KV tiers below the pool (prefix blocks the pool evicts)")
        o.add_argument("--kv-offload-memory", default=str(d.kv_offload_memory),
                       help="host memory for evicted prefix blocks, shared with --swap-space (bare number = GiB)")
        o.add_argument("--kv-offload-dir", help="directory of evicted prefix blocks: survives restarts of an engine "
                                                "with the same model, KV dtype and block size")
        o.add_argument("--kv-offload-disk", help="most disk this engine's blocks may use in the directory (bare "
                                                 "number = GiB; default 8GiB)")
        o.add_argument("--kv-events-endpoint",
                       help="publish KV events (BlockStored, BlockRemoved, AllBlocksCleared) on this ZeroMQ PUB "
                            "endpoint, e.g. tcp://*:5557 (vLLM's format)")
        g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs,
                       help=f"most sequences in one step (default {d.max_num_seqs}; 128 for `kvpage serve`)")
        g.add_argument("--max-num-batched-tokens", type=int,
                       help="token budget of one step (default: 2048 with chunked prefill, else max_model_len)")
        g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                       default=d.enable_chunked_prefill)
        g.add_argument("--preemption-mode", default=d.preemption_mode, choices=["recompute", "swap"])
        g.add_argument("--scheduling-policy", default=d.scheduling_policy, choices=["fcfs", "priority"])
        g.add_argument("--reserve-certain-growth", action=argparse.BooleanOptionalAction,
                       default=d.reserve_certain_growth,
                       help="admit a request only where the KV pool also holds what running requests will "
                            "certainly still take (the rest of a prompt, min_tokens, max_tokens under ignore_eos "
                            "without stops), instead of admitting into room a preemption must win back later")
        g.add_argument("--seed", type=int, default=d.seed, help="seed for requests that do not set their own")
        g.add_argument("--kv-policy", default=d.kv_policy, choices=ALLOCATORS,
                       help="static = reserve max_model_len per request (baseline for comparisons)")
        g.add_argument("--attention-backend", default=d.attention_backend, choices=["auto", "cpu", "reference"],
                       help="auto = compiled CPU kernels when they build, else the reference backend")
        t = p.add_argument_group("tensor parallelism (torch.distributed, gloo on CPU)")
        t.add_argument("--tensor-parallel-size", "-tp", type=int, default=d.tensor_parallel_size,
                       help="ranks that split the attention heads, KV heads and MLP (default 1); "
                            "--kv-cache-memory is then per rank")
        t.add_argument("--nnodes", type=int, default=d.nnodes, help="hosts the ranks span (default 1)")
        t.add_argument("--node-rank", type=int, default=d.node_rank,
                       help="this host's index; node 0 runs the scheduler and the API, the others only follow")
        t.add_argument("--master-addr", default=d.master_addr, help="node 0's address for the rendezvous")
        t.add_argument("--master-port", type=int, help="the rendezvous port (default: a free one, one node only)")
        t.add_argument("--tp-timeout", type=float, default=d.tp_timeout,
                       help=f"seconds a rank may stay silent before its requests fail (default {d.tp_timeout:.0f})")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names and v is not None})
