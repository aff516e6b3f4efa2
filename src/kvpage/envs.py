"""Every environment variable kvpage reads: named, typed, documented and parsed here, nowhere else.

The kernel switches are read once, into a frozen ``KernelConfig`` (``kernel_config()``), which the worker
passes down to the model, the attention backend and the kernels; code below it never looks at the
environment. Tests and benchmarks build a ``KernelConfig`` themselves instead of setting variables.
docs/envs.md lists the same table for users (a test keeps the two in step).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from functools import lru_cache


@dataclass(frozen=True)
class EnvVar:
    name: str
    kind: type  # bool, int or str
    default: object
    doc: str
    field: str | None = None  # the KernelConfig field it sets; None for variables read elsewhere
    choices: tuple[str, ...] | None = None


VARIABLES: tuple[EnvVar, ...] = (
    EnvVar("KVPAGE_QUANT_MAX_TOKENS", int, 4, "steps with at most this many tokens multiply the checkpoint's "
           "quantized blocks directly (reading fewer bytes); 0 turns that off", "quant_max_tokens"),
    EnvVar("KVPAGE_QUANT_PANELS", bool, True, "float32 models on AVX2 builds: those steps read the blocks in the "
           "float32 panel GEMM's order and sums, so a request's logits are the same bits in any step; 0 keeps "
           "rows of blocks (their own sums, and 16-bit activation codes below)", "quant_panels"),
    EnvVar("KVPAGE_QUANT_INT16", bool, True, "those steps' activations as 16-bit integer blocks on AVX2 builds; "
           "0 keeps float32 (the exact-sum reference)", "quant_int16"),
    EnvVar("KVPAGE_DECODE_LAYERS", str, "compiled", "decode-only steps (few tokens on the quantized blocks, more on "
           "the AMX tile GEMM) run the whole layer stack in one compiled call; 'python' keeps the Python layer loop "
           "(same bits)", "decode_layers", ("compiled", "python")),
    EnvVar("KVPAGE_AMX_LINEAR", bool, True, "the AMX tile GEMM for bf16 projections where the CPU has AMX; 0 keeps "
           "oneDNN's packed GEMM", "amx_linear"),
    EnvVar("KVPAGE_AMX_LINEAR_MAX_ROWS", int, 1536, "where the AMX tile GEMM runs, layer projections of steps of "
           "more rows than this (prompt steps near the 2,048-token budget) with an inner dimension of at most 1,536 "
           "take oneDNN's packed GEMM (0.75-0.86x the tile GEMM's time at 2,048 rows on the AMX Xeon), for a second "
           "packing of those weights (+180 MB resident for SmolLM2); 0: the tile GEMM at every row count",
           "amx_linear_max_rows"),
    EnvVar("KVPAGE_I8_GEMM", str, "auto", "bf16 models' many-row projections multiply the checkpoint's Q4 / Q8 "
           "blocks with int8 activation codes (AVX-512 VNNI, CPUs without AMX): 'auto' on Intel CPUs, where it is "
           "2.3-2.8x oneDNN's bf16 GEMM, never on AMD's Zen 4 (kvpage's bf16 panel GEMM is faster there at every row "
           "count; up to 48 rows with KVPAGE_BF16_GEMM=0) or Zen 5 (0.67-0.97x oneDNN's); 1 wherever the build "
           "has it, at every row count; 0 keeps the bf16 GEMM",
           "i8_gemm", ("auto", "1", "0")),
    EnvVar("KVPAGE_BF16_GEMM", str, "auto", "kvpage's bf16 panel GEMM for bf16 layer projections on AVX512_BF16 "
           "CPUs without AMX, above the rows the int8 GEMM takes: 'auto' on AMD's Zen 4 (every row count past the "
           "few-token steps; 1.1-1.7x oneDNN's at 8-256 rows there), where it was measured; 1 wherever the build "
           "has it; 0 keeps oneDNN's", "bf16_gemm", ("auto", "1", "0")),
    EnvVar("KVPAGE_F32_GEMM", bool, True, "kvpage's float32 panel GEMM for float32 projections on AVX2 builds; 0 keeps "
           "oneDNN's", "f32_gemm"),
    EnvVar("KVPAGE_LM_SCREEN", bool, True, "greedy steps on AVX2 builds find each row's argmax of the float32 lm head "
           "from integer products of 7-bit hidden and 8-bit head codes with exact error bounds, then multiply in "
           "float32 only the few tokens that can still be the largest (the panel GEMM's bits, so the same tokens; "
           "0.5-0.7x the head's time on a Zen 3, SmolLM2 and Gemma 3); 0 multiplies the whole head", "lm_screen"),
    EnvVar("KVPAGE_AMX_DECODE", bool, True, "AMX tile products for decode attention where the CPU and OS allow them; "
           "0 keeps the AVX-512 loops", "amx_decode"),
    EnvVar("KVPAGE_SPLIT_SHORT", bool, True, "one stream's short contexts are cut over the threads; 0 keeps one task "
           "per sequence (batch-invariant attention never cuts them)", "split_short"),
    EnvVar("KVPAGE_BATCH_INVARIANT", str, "auto", "attention whose every query row is the same bits alone, in a busy "
           "step or in any chunk of its prompt: contexts cut at fixed 512-key partitions whatever the batch, and "
           "whole prompts on the paged kernel instead of torch's SDPA; 'auto' on AVX2 builds without AVX-512, "
           "where the float32 default path is batch-invariant in its products too (docs/engine.md, "
           "Reproducibility); 0 lets the batch pick the cuts", "batch_invariant", ("auto", "1", "0")),
    EnvVar("KVPAGE_KV_LAYOUT", str, "auto", "bf16, int8 and fp8 KV blocks in the packed operand order of the "
           "dot-product instructions ('packed') or as rows ('rows'); 'auto': bf16 and int8 packed on Intel CPUs "
           "(fp8 rows, which AMX tiles read); on AMD's rows, where the row loops stream long contexts faster (Zen 5, "
           "64 x 8K keys: bf16 0.69x, int8 0.81x the packed loops' time), except int8 and fp8 pages on Zen 4 "
           "(family 25), which the packed loops read in 0.74x and 0.60-0.72x the row loops' time",
           "kv_layout", ("auto", "packed", "rows")),
    EnvVar("KVPAGE_AMX_PREFILL", bool, True, "fresh prompts' attention with AMX tiles where the CPU has them; 0 keeps "
           "torch's SDPA", "amx_prefill"),
    EnvVar("KVPAGE_PREFILL_CACHED", bool, True, "prompt chunks after cached keys on the AMX prompt kernel, reading the "
           "packed cache; 0 sends them to the paged kernel", "prefill_cached"),
    EnvVar("KVPAGE_PAGED_PROMPTS", bool, True, "without the AMX prompt kernel, whole fresh prompts over bf16 caches "
           "go to the paged kernel on AVX512_BF16 CPUs (1.7-3.2x torch's SDPA on a Zen 5 EPYC); 0 keeps SDPA",
           "paged_prompts"),
    EnvVar("KVPAGE_TP_VOCAB_HEAD", bool, True, "under tensor parallelism each rank multiplies its slice of the lm "
           "head's vocabulary and rank 0 gathers the logits; 0 keeps the whole head on rank 0 (the others skip it)",
           "tp_vocab_head"),
    EnvVar("KVPAGE_INT8_KEYS", str, "rows", "int8 pages' keys: 'rows' (one scale per token and head, every backend) "
           "or 'channel' (a zero point and a step per channel over each complete block, the filling block's keys "
           "held unrounded in a residual KV group); `kvpage plan` and `kvpage simulate` price int8 pages by it unless "
           "given `--int8-keys`", "int8_keys",
           ("rows", "channel")),
    EnvVar("KVPAGE_KEY_FEEDBACK", bool, True, "quantized row pages: calibration may round keys with feedback from "
           "the layer's queries' statistics (docs/kv.md), kept where it lowers the error; 0 measures only the parts "
           "without it", "key_feedback"),
    EnvVar("KVPAGE_WEIGHT_HUGE_PAGES", bool, True, "the packed weights a step streams gathered into one arena on 2 MiB "
           "pages (where transparent huge pages are 'madvise' or 'always'): no TLB miss every 4 KiB of weights; 0 "
           "leaves each on the allocator's pages", "weight_huge_pages"),
    EnvVar("KVPAGE_CACHE_DIR", str, "", "where kvpage keeps what it computes once per model and machine (the "
           "calibrated transforms of quantized KV pages); unset: $XDG_CACHE_HOME/kvpage or ~/.cache/kvpage; 'off' "
           "keeps nothing"),
    EnvVar("KVPAGE_API_KEY", str, None, "the key `kvpage serve` requires (as --api-key; read by the serve command)"),
)
_BY_NAME = {v.name: v for v in VARIABLES}


def _parse(var: EnvVar, raw: str) -> object:
    if var.kind is bool:
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{var.name}={raw!r}: expected 1 or 0")
    if var.kind is int:
        try:
            value = int(raw)
        except ValueError:
            raise ValueError(f"{var.name}={raw!r}: expected an integer") from None
        if value < 0:
            raise ValueError(f"{var.name}={raw!r}: expected an integer >= 0")
        return value
    if var.choices is not None and raw not in var.choices:
        raise ValueError(f"{var.name}={raw!r}: expected one of {', '.join(var.choices)}")
    return raw


def read(name: str, environ: Mapping[str, str] | None = None) -> object:
    """One variable's value (its default when unset or empty); a bad value is an error that names it."""
    var = _BY_NAME[name]
    raw = (os.environ if environ is None else environ).get(name, "")
    return var.default if raw == "" else _parse(var, raw)


@dataclass(frozen=True)
class KernelConfig:
    """Which kernel paths the model, the attention backend and the kernels take (defaults: the fastest that
    the machine has). Frozen: resolved once and handed down, never flipped while an engine runs."""

    quant_max_tokens: int = 4
    quant_panels: bool = True
    quant_int16: bool = True
    decode_layers: str = "compiled"
    amx_linear: bool = True
    amx_linear_max_rows: int = 1536
    i8_gemm: str = "auto"
    bf16_gemm: str = "auto"
    f32_gemm: bool = True
    lm_screen: bool = True
    amx_decode: bool = True
    split_short: bool = True
    batch_invariant: str = "auto"
    kv_layout: str = "auto"
    amx_prefill: bool = True
    prefill_cached: bool = True
    paged_prompts: bool = True
    tp_vocab_head: bool = True
    int8_keys: str = "rows"
    key_feedback: bool = True
    weight_huge_pages: bool = True

    def __post_init__(self) -> None:
        for f in fields(self):
            var = next(v for v in VARIABLES if v.field == f.name)
            value = getattr(self, f.name)
            if not isinstance(value, var.kind) or (var.kind is int and isinstance(value, bool)):
                raise ValueError(f"KernelConfig.{f.name} must be {var.kind.__name__}, got {value!r}")
            if var.choices is not None and value not in var.choices:
                raise ValueError(f"KernelConfig.{f.name} must be one of {', '.join(var.choices)}, got {value!r}")
            if var.kind is int and value < 0:
                raise ValueError(f"KernelConfig.{f.name} must be >= 0, got {value}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> KernelConfig:
        return cls(**{v.field: read(v.name, environ) for v in VARIABLES if v.field is not None})


@lru_cache(maxsize=1)
def kernel_config() -> KernelConfig:
    """The process's kernel configuration from its environment, read on first use."""
    return KernelConfig.from_env()
