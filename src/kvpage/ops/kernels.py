"""Typed wrappers over the compiled kernels, bound to one ``KernelConfig``.

The model, the attention backend and the sampler call the kernels only through a ``Kernels`` object, which
the worker builds once (``kernels(config)``): the configuration's switches reach the C++ as arguments of
every call, never as globals. Tests of single kernels may call the raw module (``build.load_kernels()``).
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType

import torch

from kvpage.cpuinfo import cpuinfo_field
from kvpage.envs import KernelConfig, kernel_config
from kvpage.ops.build import load_kernels

Tensor = torch.Tensor
# amx_linear's act (ops.h): the plain product, or act(gate) * up from a [gate; up] weight in the epilogue
ACT_NONE, ACT_SILU, ACT_GELU_TANH = 0, 1, 2
PARTITION_SIZE = 512  # keys per context partition: long contexts split into this many keys per task


def cpu_vendor() -> str:
    """The CPU's vendor string (GenuineIntel, AuthenticAMD, ...), '' where /proc/cpuinfo has none."""
    return cpuinfo_field("vendor_id")


def amd_family() -> str:
    """AMD's CPU family ('25': Zen 3 / Zen 4, '26': Zen 5), '' on other vendors: the machine kinds whose
    measured defaults differ (int8_gemm_rows, packed_layouts)."""
    return cpuinfo_field("cpu family") if cpu_vendor() == "AuthenticAMD" else ""


# int8_gemm_rows' answer where the int8 GEMM takes every row count
I8_ALL_ROWS = 1 << 62
# Zen 4's limit: the int8 GEMM up to this many rows, oneDNN's bf16 GEMM above (the measurements below)
I8_ZEN4_MAX_ROWS = 48


def int8_gemm_rows(bf16_gemm: bool = False) -> int:
    """Up to how many rows the int8 GEMM (gemm_i8.cpp) beats the bf16 GEMM that would run instead here (0: none;
    bf16_gemm: kvpage's bf16 panel GEMM, gemm_bf16.cpp, else oneDNN's), by what was measured (benchmarks/linear.py
    --i8 and --bf16, one pass of SmolLM2's projections): on the Intel Xeon without AMX, where vdpbf16ps peaks at
    ~170 GFLOP/s on two cores, 2.25-2.76x oneDNN's at 8-2048 rows: every row count. On the AMD EPYC Zen 5, whose
    512-bit bf16 products oneDNN runs at ~0.9 TFLOP/s, 0.67-0.97x (2026-11-26): none. On the Zen 4 EPYC (CPU
    family 25 with AVX-512: its 512-bit products run on 256-bit units, while the int8 GEMM reads half the weight
    bytes) 1.67x / 1.33x / 1.17x / 1.12x / 1.01x / 0.91x oneDNN's at 8 / 16 / 32 / 48 / 64 / 96 rows
    (2026-12-03): up to 48 rows; but the bf16 panel GEMM took 0.89x / 0.91x / 0.78x / 0.80x / 0.77x the int8
    GEMM's time at 8 / 16 / 32 / 48 / 64 rows (2026-12-04, the two runs one after the other: 9.24 / 13.28 /
    21.28 / 30.47 / 38.22 ms against 10.36 / 14.67 / 27.30 / 38.22 / 49.43), so none where it runs."""
    if cpu_vendor() == "GenuineIntel":
        return I8_ALL_ROWS
    if amd_family() == "25":
        return 0 if bf16_gemm else I8_ZEN4_MAX_ROWS
    return 0


def bf16_gemm_pays() -> bool:
    """Whether bf16_gemm "auto" takes kvpage's bf16 panel GEMM (gemm_bf16.cpp) over oneDNN's on an AVX512_BF16 CPU
    without AMX: on the Zen 4 EPYC (family 25), where oneDNN's bf16 GEMM reaches ~75% of `vdpbf16ps`'s peak at
    128 rows and the panel GEMM ~85% (`python benchmarks/linear.py --bf16`: 1.1-1.7x oneDNN's at 8-256 rows,
    2026-12-04) and the engine served 1.10x / 1.17x / 1.10x the tokens on chat16 / chat128 / sharegpt
    (`benchmarks/throughput.py` against `kvpage+KVPAGE_BF16_GEMM=0`; Gemma 3 sharegpt 1.01x). Not measured on Zen 5
    or on Intel's CPUs without AMX (which take the int8 GEMM at every row count): oneDNN stays there."""
    return amd_family() == "25"


def packed_layouts() -> tuple[bool, bool, bool]:
    """Whether kv_layout "auto" takes the packed bf16, int8 and fp8 layouts (where the build has them).

    Why: the packed layouts were built where the row loops' rearranging, not memory, limited decode (the Intel
    Xeon without AMX: packed int8 0.49x the bf16 cache's time; the AMX Xeon's tile kernels read only the packed
    layout): Intel, both. On the AMD EPYC Zen 5 the AVX2 row loop streams the cache faster than the packed loops
    (`python benchmarks/kv_quant.py --skip capacity accuracy`, 64 sequences x 8K keys, 2026-11-26: bf16 rows
    11.8 ms against packed 17.2 ms, int8 rows 9.0 against 11.1), and the engine with rows served more (offline
    sharegpt +9-10%, chat128 within noise; online 256/128 at 10 req/s and at once +3-8%): neither. On the Zen 4
    EPYC (family 25 with AVX-512; its 512-bit products run on 256-bit units, so the int8 row loop's widening
    and 16-bit products set its pace) the packed int8 loop, whose byte products take the codes as they lie,
    reads int8 pages in 0.74x the row loop's time (13.32 against 17.91 ms, `--kv-layout packed`, 2026-12-03) and
    the engine decoding 32 sequences over 3K-token contexts on int8 pages made 1.48x the tokens per second
    (`benchmarks/long_decode.py`), while it served sharegpt with bf16 rows 1.06x the packed bf16 pages: int8
    and fp8 (whose packed loop, packed_fp8.h, was built there for the same reason). fp8 pages stay rows
    elsewhere: AMX Xeons read fp8 rows on their bf16 tiles (amx_fp8.h), and the packed fp8 loop was measured on
    the Zen 4 alone."""
    if cpu_vendor() != "AuthenticAMD":
        return True, True, False
    zen4 = amd_family() == "25"
    return False, zen4, zen4


class Kernels:
    """The compiled kernels under one configuration (each method says what it computes; ops/csrc/ops.h has the C++)."""

    def __init__(self, module: ModuleType, config: KernelConfig) -> None:
        self._c = module
        self.config = config
        # What this build and machine can run, asked once.
        # AVX-512 BF16 dot products in the attention loops (the packed layout needs them; bf16 rows use them too)
        self.bf16_dot = module.has_packed_layout()
        bf16_pays, int8_pays, fp8_pays = packed_layouts()

        def chosen(pays: bool) -> bool:
            return config.kv_layout == "packed" or (config.kv_layout == "auto" and pays)

        # bf16 rows' decode on the AVX2 loop (AVX-512 builds keep their own row loop otherwise): where the same
        # measurements keep bf16 rows, since that loop is what streams them faster there
        self.avx2_row_decode = not bf16_pays
        self.packed_layout = self.bf16_dot and chosen(bf16_pays)
        self.packed_int8_layout = module.has_packed_int8_layout() and chosen(int8_pays)
        # fp8 pages' packed loop is built where the packed int8 one is (packed_fp8.h)
        self.packed_fp8_layout = module.has_packed_int8_layout() and chosen(fp8_pays)
        self.amx_linear_ok = config.amx_linear and module.amx_linear_available()
        self.f32_gemm_ok = config.f32_gemm and module.f32_gemm_available()
        # greedy steps' lm-head argmax screened in integers, exact against the panel GEMM's bits (lm_screen.cpp)
        self.lm_screen_ok = config.lm_screen and self.f32_gemm_ok
        # bf16 projections on AVX512_BF16 CPUs where the AMX tile GEMM does not take them ("auto": where measured)
        self.bf16_gemm_ok = (module.bf16_gemm_available() and not self.amx_linear_ok
                             and (config.bf16_gemm == "1" or (config.bf16_gemm == "auto" and bf16_gemm_pays())))
        # the int8 GEMM for projections of up to i8_max_rows rows (the bf16 panel GEMM or oneDNN's above)
        wanted = ({"1": I8_ALL_ROWS, "0": 0}.get(config.i8_gemm) if config.i8_gemm != "auto"
                  else int8_gemm_rows(self.bf16_gemm_ok))
        self.i8_max_rows = wanted if module.i8_gemm_available() else 0
        self.amx_prefill_ok = config.amx_prefill and module.prefill_amx_available()
        # auto: where float32 runs the panel GEMM (AVX2 builds), the one path whose products are batch-invariant
        self.batch_invariant = config.batch_invariant == "1" or (
            config.batch_invariant == "auto" and module.f32_gemm_available())
        self.quant_int16 = config.quant_int16

    @property
    def i8_gemm_ok(self) -> bool:
        """Whether the int8 GEMM takes any row count here (layers then pack their weights for it)."""
        return self.i8_max_rows > 0

    # what the build has (diagnostics and tests)
    def last_decode_kernel(self) -> str:
        """The main loop that served the last paged_attention call's decode tasks."""
        return self._c.last_decode_kernel()

    def quant_int16_available(self) -> bool:
        return self._c.quant_int16_available()

    def f32_gemm_available(self) -> bool:
        return self._c.f32_gemm_available()

    def amx_decode_available(self) -> bool:
        return self._c.amx_decode_available()

    def amx_int8_decode_available(self) -> bool:
        return self._c.amx_int8_decode_available()

    # attention (csrc/attention/)
    def reshape_and_cache(self, key: Tensor, value: Tensor, kv_cache: Tensor, slot_mapping: Tensor,
                          packed: bool, key_feedback: Tensor | None = None) -> None:
        """Scatter new K/V rows to their slots (row or packed layout); quantized pages round the keys with
        ``key_feedback`` ``[kv_heads, D, D]`` float32 if given (attention/kv_quant.py quantize_rows)."""
        self._c.reshape_and_cache(key, value, kv_cache, slot_mapping, packed, key_feedback)

    def kv_affine_rows(self, x: Tensor, sub: Tensor | None, mul: Tensor | None, rotate: bool,
                       add: Tensor | None) -> Tensor:
        """A quantized cache's key/value transform in one pass (attention/kv_transform.py affine_rows, whose
        bits it gives): ``(x - sub) * mul``, Walsh-Hadamard rotated if ``rotate``, ``+ add``, rounded once."""
        return self._c.kv_affine_rows(x, sub, mul, rotate, add)

    def reshape_and_cache_channel(self, key: Tensor, value: Tensor, pages: Tensor, slot_mapping: Tensor,
                                  residual_slots: Tensor, block_size: int) -> None:
        """int8 pages with keys per channel (attention/kv_channel.py, whose write_pages it equals byte for
        byte): values as rows, keys unrounded at their residual slots, blocks this write completes rounded."""
        self._c.reshape_and_cache_channel(key, value, pages, slot_mapping, residual_slots, block_size)

    def plan_attention(self, block_tables: Tensor, query_start_loc: Tensor, seq_lens: Tensor, num_heads: int,
                       num_blocks: int, block_size: int, window: int | None = None):
        """A step's paged-attention plan (csrc/attention/plan.h), checked once against caches of ``num_blocks``
        blocks of ``block_size`` tokens; every layer's ``paged_attention`` runs it. ``window``: a sliding-window
        layer's (a query sees itself and window - 1 positions back; keys before that are never read)."""
        return self._c.plan_attention(block_tables, query_start_loc, seq_lens, num_heads, num_blocks, block_size,
                                      PARTITION_SIZE, self.config.split_short, window or 0, self.batch_invariant)

    def paged_attention(self, query: Tensor, kv_cache: Tensor, plan, scale: float, packed: bool) -> Tensor:
        """Varlen causal attention of a flat batch over the paged cache, under the step's plan."""
        return self._c.paged_attention_planned(query, kv_cache, plan, scale, packed, self.config.amx_decode,
                                               self.avx2_row_decode)

    def paged_attention_channel(self, query: Tensor, pages: Tensor, plan, residual_tables: Tensor,
                                scale: float) -> Tensor:
        """The same over int8 pages with keys per channel: each sequence's filling block read from its block in
        ``residual_tables`` (the residual-key group's, shaped as the plan's block tables)."""
        return self._c.paged_attention_channel(query, pages, plan, residual_tables, scale)

    def prefill_attention(self, query: Tensor, key: Tensor, value: Tensor, out: Tensor, starts: list[int],
                          lengths: list[int], scale: float, window: int | None = None) -> None:
        """Whole fresh prompts (bf16, head size 64, 128 or 256) with AMX tiles, into ``out``; with a sliding
        ``window`` each query sees its last ``window`` keys."""
        self._c.prefill_attention(query, key, value, out, starts, lengths, scale, window=window or 0)

    def prefill_attention_paged(self, query: Tensor, kv_cache: Tensor, block_tables: Tensor, out: Tensor,
                                starts: list[int], lengths: list[int], seq_lens: list[int], seqs: list[int],
                                scale: float, window: int | None = None) -> None:
        """Prompt chunks whose keys (cached prefix and their own) are in the packed cache, with AMX tiles; with a
        sliding window only the keys each row's window reaches (the cache's blocks before the first row's window
        may be freed)."""
        self._c.prefill_attention_paged(query, kv_cache, block_tables, out, starts, lengths, seq_lens, seqs, scale,
                                        window=window or 0)

    def decode_layers(self, first_norm: Tensor, first_eps: float, num_heads: int, num_kv_heads: int,
                      head_dim: int, scale: float):
        """An empty compiled decode layer stack (csrc/decode_layers.h); layers are added with add_layer."""
        return self._c.DecodeLayers(first_norm, first_eps, num_heads, num_kv_heads, head_dim, scale,
                                    self.config.amx_decode, self.avx2_row_decode)

    # linear layers (csrc/linear/)
    def quant_linear(self, x: Tensor, qs: Tensor, d: Tensor, m: Tensor | None, float_out: bool = False,
                     gated: bool = False) -> Tensor:
        """x . W^T from Q4 / Q8 blocks; gated: silu(x . Wg^T) * (x . Wu^T)."""
        return self._c.quant_linear(x, qs, d, m, float_out, self.quant_int16, gated)

    def amx_pack_weight(self, w: Tensor) -> Tensor:
        return self._c.amx_pack_weight(w)

    def amx_pack_gate_up(self, w: Tensor) -> Tensor:
        return self._c.amx_pack_gate_up(w)

    def amx_linear(self, x: Tensor, packed: Tensor, bias: Tensor | None = None, act: int = ACT_NONE,
                   stream: bool = False) -> Tensor:
        """x . W^T (+ bias) with AMX tile products; act (ACT_SILU, ACT_GELU_TANH) on a [gate; up] weight packed by
        amx_pack_gate_up: act(gate) * up in the epilogue, the gated MLP's half. stream: the output written with
        non-temporal stores (wide outputs read once afterwards: logits), the same values."""
        return self._c.amx_linear(x, packed, bias, act, stream)

    def i8_pack_weight(self, qs: Tensor, d: Tensor, m: Tensor | None, gated: bool) -> tuple[Tensor, Tensor]:
        """Q4 / Q8 blocks as i8_linear's 16-column panels: (unsigned byte codes, per-block scales and offsets)."""
        return self._c.i8_pack_weight(qs, d, m, gated)

    def i8_linear(self, x: Tensor, codes: Tensor, scales: Tensor, n: int, gated: bool,
                  bias: Tensor | None, stream: bool = False) -> Tensor:
        """x . W^T with int8 activation codes per 32-block against the exact quantized weights (VNNI); stream as
        amx_linear's."""
        return self._c.i8_linear(x, codes, scales, n, gated, bias, stream)

    def bf16_pack_weight(self, w: Tensor, gated: bool = False) -> Tensor:
        return self._c.bf16_pack_weight(w, gated)

    def bf16_linear(self, x: Tensor, packed: Tensor, n: int, bias: Tensor | None, act: int = 0) -> Tensor:
        """act (ACT_SILU / ACT_GELU_TANH, a gated packing): the MLP's act(gate) * up, [rows, n / 2]."""
        return self._c.bf16_linear(x, packed, n, bias, act)

    def f32_pack_weight(self, w: Tensor) -> Tensor:
        return self._c.f32_pack_weight(w)

    def f32_linear(self, x: Tensor, packed: Tensor, n: int, bias: Tensor | None) -> Tensor:
        return self._c.f32_linear(x, packed, n, bias)

    def lm_screen_prepare(self, weight: Tensor) -> list[Tensor]:
        """A float32 [vocab, hidden] head as 7-bit codes per row: codes, scale, code_sum, err_norm, w_norm."""
        return self._c.lm_screen_prepare(weight)

    def lm_screen_argmax(self, hidden: Tensor, weight: Tensor, prepared: Sequence[Tensor], outliers: Tensor,
                         w_out: Tensor) -> tuple[Tensor, Tensor]:
        """Each row's argmax of hidden . weight^T as f32_linear's bits (first index on ties), and how many tokens
        each row multiplied in float32 (its candidates); w_out is f32_pack_weight of the head's ``outliers`` columns."""
        return tuple(self._c.lm_screen_argmax(hidden, weight, *prepared, outliers, w_out))

    # norms, RoPE, activation, logits (ops/csrc/fused_ops.cpp)
    def rms_norm(self, residual: Tensor, weight: Tensor, eps: float) -> Tensor:
        return self._c.rms_norm(residual, weight, eps)

    def add_rms_norm(self, x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> Tensor:
        """residual += x, then its RMS norm times weight."""
        return self._c.add_rms_norm(x, residual, weight, eps)

    def rotary_(self, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> None:
        self._c.rotary_(q, k, cos, sin)

    def silu_mul(self, gate_up: Tensor) -> Tensor:
        return self._c.silu_mul(gate_up)

    def norm_add_norm(self, x: Tensor, residual: Tensor, w1: Tensor, w2: Tensor, eps: float,
                      out_dtype: torch.dtype) -> Tensor:
        """Gemma's norms around a sublayer's output x: residual += rms_norm(x) * w1, then rms_norm(residual) * w2
        in out_dtype (bfloat16 or float32); float32 weights."""
        return self._c.norm_add_norm(x, residual, w1, w2, eps, out_dtype == torch.bfloat16)

    def qk_norm_rope(self, qkv: Tensor, q_weight: Tensor, k_weight: Tensor, eps: float, cos: Tensor, sin: Tensor,
                     num_heads: int, num_kv_heads: int) -> tuple[Tensor, Tensor]:
        """Gemma's QK-norm then RoPE over the q and k heads at the front of qkv's rows: new q [tokens, num_heads,
        D] and k [tokens, num_kv_heads, D] in qkv's dtype."""
        q, k = self._c.qk_norm_rope(qkv, q_weight, k_weight, eps, cos, sin, num_heads, num_kv_heads)
        return q, k

    def gelu_mul(self, gate_up: Tensor) -> Tensor:
        """gelu_tanh(gate) * up for [gate | up] rows (Gemma's MLP), one pass."""
        return self._c.gelu_mul(gate_up)

    def logits_postprocess(self, logits: Tensor | Sequence[Tensor], hidden: Tensor, weight: Tensor,
                           with_logits: bool, out: Tensor | None = None) -> list[Tensor]:
        """float32 logits with exact near-max entries, the argmax and the log-sum-exp. ``logits`` may come as
        column parts (the lm head's vocabulary slices, in order); ``out`` is a float32 buffer kept across steps
        for the logits (a view of it is returned)."""
        parts = [logits] if isinstance(logits, Tensor) else list(logits)
        return self._c.logits_postprocess(parts, hidden, weight, with_logits, out)

    def logits_draw(self, parts: Sequence[Tensor], hidden: Tensor, weight: Tensor, temperature: Tensor,
                    top_k: Tensor, top_p: Tensor, min_p: Tensor, uniforms: Tensor, mask_of: Tensor | None = None,
                    masks: Tensor | None = None) -> list[Tensor]:
        """logits_postprocess's pass with each row's draws made in it (sample_rows' settings; temperature 0: the
        argmax), no logits kept: (tokens [rows, draws], argmax [rows]). Row b with ``mask_of[b] >= 0`` draws
        only among the tokens whose bits are set in int32 words ``masks[mask_of[b]]`` (none set: its argmax)."""
        return self._c.logits_draw(list(parts), hidden, weight, temperature, top_k, top_p, min_p, uniforms,
                                   mask_of, masks)

    def logits_scan(self, part: Tensor, start: int, vocab: int, hidden: Tensor, weight: Tensor, row_max: Tensor,
                    best_value: Tensor, best_index: Tensor, out: Tensor | None) -> None:
        """One vocabulary slice of the logits pass: widened into ``out`` (then logits_finish), or, without
        ``out``, folded into the running argmax (best_index) with exact values near the running maximum."""
        self._c.logits_scan(part, start, vocab, hidden, weight, row_max, best_value, best_index, out)

    def logits_finish(self, out: Tensor, hidden: Tensor, weight: Tensor, row_max: Tensor,
                      bf16_logits: bool) -> list[Tensor]:
        """(argmax, log-sum-exp) of the logits in ``out``, the entries near each maximum made exact first."""
        return self._c.logits_finish(out, hidden, weight, row_max, bf16_logits)

    # sampling (ops/csrc/sampler.cpp)
    def sample_rows(self, logits: Tensor, rows: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor,
                    min_p: Tensor, uniforms: Tensor) -> Tensor:
        return self._c.sample_rows(logits, rows, temperature, top_k, top_p, min_p, uniforms)

    def apply_penalties_(self, logits: Tensor, rows: Tensor, prompt_ids: Tensor, prompt_offsets: Tensor,
                         output_ids: Tensor, output_offsets: Tensor, repetition: Tensor, presence: Tensor,
                         frequency: Tensor) -> None:
        self._c.apply_penalties_(logits, rows, prompt_ids, prompt_offsets, output_ids, output_offsets, repetition,
                                 presence, frequency)


_BOUND: dict[KernelConfig, Kernels] = {}


def kernels(config: KernelConfig | None = None) -> Kernels | None:
    """The kernels under ``config`` (default: the environment's, read once), or None where they cannot be built."""
    module = load_kernels()
    if module is None:
        return None
    config = kernel_config() if config is None else config
    if config not in _BOUND:
        _BOUND[config] = Kernels(module, config)
    return _BOUND[config]
