"""The one table of dtypes kvpage knows: canonical names, the aliases users type, bytes per value, and what
each may be used for. Torch-free, so the planner and the simulator size memory with the same numbers the
engine allocates with; the loader maps a canonical name to torch's dtype of the same name."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DType:
    name: str  # canonical; torch's dtype of this name where torch has one
    bytes: float  # per value
    aliases: tuple[str, ...] = ()
    run: bool = False  # the model's weights and activations (--dtype)
    kv_cache: bool = False  # the engine's KV cache (--kv-cache-dtype)
    torch: bool = False  # torch has this dtype under ``name``
    storage: str = ""  # quantized KV: the torch dtype its pages are stored in
    scale_bytes: int = 0  # quantized KV: bytes of scale stored with each (token, KV head) row of K or of V

    @property
    def quantized(self) -> bool:
        return self.scale_bytes > 0

    def kv_row_bytes(self, head_dim: int) -> int:
        """Bytes of one token's K (or V) row for one KV head, its scale included."""
        return int(head_dim * self.bytes) + self.scale_bytes


DTYPES: tuple[DType, ...] = (
    DType("float32", 4, ("fp32", "f32"), run=True, kv_cache=True, torch=True),
    DType("bfloat16", 2, ("bf16",), run=True, kv_cache=True, torch=True),
    DType("float16", 2, ("fp16", "half", "f16"), kv_cache=True, torch=True),
    # quantized KV pages: one byte per value and a bfloat16 scale per (token, KV head) row, stored at the end of
    # the row in the page itself (attention/kv_quant.py), so every block copy or swap moves the scales along
    DType("fp8_e4m3", 1, ("fp8", "float8_e4m3fn"), kv_cache=True, storage="float8_e4m3fn", scale_bytes=2),
    DType("fp8_e5m2", 1, ("float8_e5m2",), kv_cache=True, storage="float8_e5m2", scale_bytes=2),
    DType("int8", 1, (), kv_cache=True, storage="int8", scale_bytes=2),
)
_BY_NAME = {n: d for d in DTYPES for n in (d.name, *d.aliases)}

RUN_DTYPES = ("auto", *(d.name for d in DTYPES if d.run))
KV_CACHE_DTYPES = ("auto", *(d.name for d in DTYPES if d.kv_cache))
# what --kv-cache-dtype accepts: the names and their aliases (vLLM's "fp8" = fp8_e4m3)
KV_CACHE_CHOICES = ("auto", *(n for d in DTYPES if d.kv_cache for n in (d.name, *d.aliases)))


def kv_cache_name(name: str) -> str:
    """The canonical name of a KV cache dtype or alias ("auto" stays); anything else is an error naming it."""
    if name == "auto":
        return name
    d = _BY_NAME.get(name.lower())
    if d is None or not d.kv_cache:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_CHOICES)}, got {name!r}")
    return d.name


def lookup(name: str) -> DType:
    """The dtype a name or alias means (case-insensitive); an unknown one is an error that lists the choices."""
    try:
        return _BY_NAME[name.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}: choose one of {', '.join(sorted(_BY_NAME))}") from None
