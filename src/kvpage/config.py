"""User-facing engine settings, validated at construction (errors name the value and the allowed range)."""

from __future__ import annotations

from dataclasses import dataclass

from kvpage.cpuinfo import cpu_flags
from kvpage.dtypes import RUN_DTYPES, kv_cache_name
from kvpage.envs import KernelConfig
from kvpage.kv import DEFAULT_BLOCK_SIZE
from kvpage.units import parse_size

DEFAULT_KV_CACHE_MEMORY = "2GiB"
DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_KV_OFFLOAD_DISK = "8GiB"


def cpu_has_bf16() -> bool:
    """AVX512_BF16 (or AMX-BF16) present: bf16 matrix products are native and about 4x faster than fp32."""
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


def resolve_dtype(dtype: str) -> str:
    """``auto``: bfloat16 where the CPU computes it natively, float32 otherwise."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if cpu_has_bf16() else "float32"


def fast_path(dtype: str) -> bool:
    """Whether the model runs on the fast path (packed projections, fused kernels, the checkpoint's quantized
    blocks for few-token steps): ``auto`` and ``bfloat16`` do; an explicit ``float32`` keeps the step-by-step
    transformers arithmetic, the exactness reference. So on a CPU without AVX512_BF16, ``auto`` is float32 on
    the fast path: there a decode step is bound by reading the weights, and float32 ones are 7x the bytes of
    the checkpoint's 4.5-bit blocks."""
    return dtype in ("auto", "bfloat16")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = DEFAULT_BLOCK_SIZE
    kv_cache_memory: int | str = DEFAULT_KV_CACHE_MEMORY  # bytes, or a size such as "4GiB"
    kv_cache_dtype: str = "auto"  # auto = the model's run dtype
    swap_space: int | str = 0  # host memory for swapped-out blocks
    enable_prefix_caching: bool = True
    watermark: float = 0.01
    # Fault every KV page in at startup (as an engine that zero-fills its cache does) instead of on first
    # write during generation: slower start, steadier steps. Off by default: it costs cold start.
    kv_prefault: bool = False
    # Ask Linux for 2 MiB pages under the device KV tensors (madvise MADV_HUGEPAGE, where transparent huge
    # pages are "madvise" or "always"): a sequence's blocks lie scattered over the pool, and with 4 KiB pages
    # nearly every block read is a TLB miss (bf16 decode attention at 64 x 8K on a Zen 3: 1.42x faster). None =
    # with kv_prefault only: a huge page faulted in mid-run can stall a step (measured on a Xeon, 2026-11-23).
    kv_huge_pages: bool | None = None
    # Tiers below the pool for evicted prefix blocks (kv/offload.py, docs/kv_offload.md): host memory (shared
    # with swap_space), and a directory of block files bounded by kv_offload_disk that outlives the engine.
    kv_offload_memory: int | str = 0
    kv_offload_dir: str | None = None
    kv_offload_disk: int | str | None = None  # default with a directory: DEFAULT_KV_OFFLOAD_DISK

    @property
    def offload(self) -> bool:
        return bool(self.kv_offload_memory) or self.kv_offload_dir is not None

    @property
    def huge_pages(self) -> bool:
        return self.kv_prefault if self.kv_huge_pages is None else self.kv_huge_pages

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or not 1 <= self.block_size <= 1024:
            raise ValueError(f"block_size must be an integer in [1, 1024], got {self.block_size!r}")
        object.__setattr__(self, "kv_cache_memory", parse_size(self.kv_cache_memory))
        object.__setattr__(self, "swap_space", parse_size(self.swap_space))
        object.__setattr__(self, "kv_offload_memory", parse_size(self.kv_offload_memory))
        if self.kv_offload_disk is not None and self.kv_offload_dir is None:
            raise ValueError("kv_offload_disk bounds the disk tier: give its directory too (kv_offload_dir)")
        if self.kv_offload_dir is not None:
            if not str(self.kv_offload_dir).strip():
                raise ValueError("kv_offload_dir is empty: give a directory for the disk tier")
            disk = parse_size(DEFAULT_KV_OFFLOAD_DISK if self.kv_offload_disk is None else self.kv_offload_disk)
            if disk <= 0:
                raise ValueError(f"kv_offload_disk must be positive, got {self.kv_offload_disk}")
            object.__setattr__(self, "kv_offload_disk", disk)
        if self.offload and not self.enable_prefix_caching:
            raise ValueError("the KV offload tiers hold prefix-cache blocks: they need prefix caching enabled")
        if self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory}")
        object.__setattr__(self, "kv_cache_dtype", kv_cache_name(str(self.kv_cache_dtype)))
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be a fraction in [0, 1), got {self.watermark}")


@dataclass(frozen=True)
class ModelRunConfig:
    model: str = DEFAULT_MODEL
    dtype: str = "auto"  # bfloat16 where the CPU has AVX512_BF16, else float32; both on the fast path
    max_model_len: int | None = None  # default: the model's context length
    attention_backend: str = "auto"
    kernels: KernelConfig | None = None  # the kernel paths; None = the environment's (kvpage.envs)

    def __post_init__(self) -> None:
        if self.dtype not in RUN_DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(RUN_DTYPES)}, got {self.dtype!r}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
