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


DTYPES: tuple[DType, ...] = (
    DType("float32", 4, ("fp32", "f32"), run=True, kv_cache=True, torch=True),
    DType("bfloat16", 2, ("bf16",), run=True, kv_cache=True, torch=True),
    DType("float16", 2, ("fp16", "half", "f16"), kv_cache=True, torch=True),
    # sized by the planner and the simulator; the engine does not store them yet
    DType("fp8_e4m3", 1, ("fp8",)),
    DType("fp8_e5m2", 1),
    DType("int8", 1),
)
_BY_NAME = {n: d for d in DTYPES for n in (d.name, *d.aliases)}

RUN_DTYPES = ("auto", *(d.name for d in DTYPES if d.run))
KV_CACHE_DTYPES = ("auto", *(d.name for d in DTYPES if d.kv_cache))


def lookup(name: str) -> DType:
    """The dtype a name or alias means (case-insensitive); an unknown one is an error that lists the choices."""
    try:
        return _BY_NAME[name.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}: choose one of {', '.join(sorted(_BY_NAME))}") from None
