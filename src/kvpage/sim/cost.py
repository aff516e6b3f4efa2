"""How long one engine step takes, without running a model.

Two models share one input, the features of a scheduled step (``StepFeatures``), so a real engine run
can record exactly what the simulator later predicts from:

* ``RooflineCost`` (the default): fixed per-step and per-sequence overheads plus, for each phase of the
  step (linear layers, lm head, attention), the larger of its compute time at the machine's GEMM rate and
  its memory time (weights once per step; each sequence's KV once per step) at the machine's bandwidth.
* ``LinearCost``: ``seconds = c0 + c_tokens*tokens + c_seqs*seqs + c_context*context + c_pairs*pairs``,
  fitted by non-negative least squares to a step log recorded from a real ``kvpage`` run
  (``benchmarks/sim_calibration.py`` writes one; ``kvpage simulate --calibrate FILE`` reads it).
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from kvpage.core.step import StepFeatures, step_log_sample
from kvpage.kv import DEFAULT_BLOCK_SIZE


class CostModel(Protocol):
    def step_seconds(self, f: StepFeatures) -> float: ...

    def describe(self) -> str: ...


@dataclass(frozen=True)
class ModelSpec:
    """The numbers of a model that decide step time (from its config; no weights needed)."""

    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    dtype_bytes: float = 2.0  # weights and activations
    kv_bytes_per_token: float = 0  # keys per channel: a block's bytes over its tokens

    @property
    def linear_params(self) -> int:
        """Weights every token multiplies through (attention projections and the gated MLP)."""
        q = self.num_attention_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        mlp = 3 * self.hidden_size * self.intermediate_size
        per_layer = self.hidden_size * (q + 2 * kv) + q * self.hidden_size + mlp
        return self.num_layers * per_layer

    @property
    def head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def weight_bytes(self) -> float:
        return (self.linear_params + self.head_params) * self.dtype_bytes

    def step_flops(self, f: StepFeatures) -> dict[str, float]:
        """The arithmetic a step must do whatever the engine: every token through the linear layers, every
        scored (query, key) pair through QK^T and P.V, the lm head for sequences that sample."""
        return {"linear": 2.0 * self.linear_params * f.num_tokens,
                "attention": 4.0 * self.num_layers * self.num_attention_heads * self.head_dim * f.attn_pairs,
                "lm_head": 2.0 * self.head_params * f.logit_rows}


MACHINE_KIND = "kvpage-machine"
# A profile: GEMM rate per weight dtype class ("bfloat16" stands for every 2-byte-or-smaller dtype), KV and
# streaming bandwidths, and the two overheads, as benchmarks/sim_calibration.py --machine-out writes them.
MACHINE_PROFILES: dict[str, dict[str, Any]] = {
    # 2-vCPU Xeon, AVX512_BF16 + AMX (measured 2026-11-22/23): bf16 through the AMX tile GEMM; float32 through oneDNN.
    "xeon-amx": {"gemm_tflops": {"bfloat16": 1.8, "float32": 0.3}, "kv_read_gb_s": 16.9, "read_gb_s": 25.0,
                 "step_overhead_ms": 9.4, "seq_overhead_ms": 0.195},
    # 2-vCPU AMD EPYC Zen 3, AVX2 + FMA only (measured 2026-11-24): float32 through kvpage's panel GEMM; no bf16 rate,
    # as the CPU has no bf16 instructions and the engine runs float32 there. Out of sample: +4.6% makespan.
    "zen3-avx2": {"gemm_tflops": {"float32": 0.18}, "kv_read_gb_s": 20.7, "read_gb_s": 30.2,
                  "step_overhead_ms": 10.8, "seq_overhead_ms": 0.48},
    # One A100 SXM 80 GB GPU, modeled from its datasheet (not measured: no GPU here): 312 TFLOP/s dense bf16
    # taken at ~65%, 2.0 TB/s HBM at ~80%; a GPU engine's step and per-sequence overheads of ~1 ms / 10 us.
    "a100-sxm": {"gemm_tflops": {"bfloat16": 200.0, "float32": 19.5}, "kv_read_gb_s": 1600.0, "read_gb_s": 1600.0,
                 "step_overhead_ms": 1.0, "seq_overhead_ms": 0.01},
}


_XEON = MACHINE_PROFILES["xeon-amx"]


@dataclass(frozen=True)
class MachineSpec:
    """The rates and overheads one machine runs a step at, for one weight dtype. The defaults are the
    ``xeon-amx`` profile (see ``MACHINE_PROFILES``): measured on a 2-vCPU Xeon with AVX512_BF16/AMX by
    ``benchmarks/sim_calibration.py`` from the engine's own kernels (BENCHMARKS.md): bf16 projection GEMM (AMX
    tiles) ~1.8 TFLOP/s at a 256-row batch, KV read by the paged decode kernel ~16.9 GB/s, weights streamed at
    ~25 GB/s. The two overheads (per-step Python work and the small per-layer ops: slot writes, norms, rotary;
    per-sequence sampling and outputs) are fitted by the same script (``fit_roofline_overheads``) on a real
    run there with those rates."""

    gemm_flops: float = _XEON["gemm_tflops"]["bfloat16"] * 1e12
    mem_bandwidth: float = _XEON["kv_read_gb_s"] * 1e9  # KV reads in attention
    copy_bandwidth: float = _XEON["read_gb_s"] * 1e9  # weight streaming, swap and copy-on-write copies
    step_overhead: float = _XEON["step_overhead_ms"] * 1e-3  # per step: scheduling, batch preparation, small ops
    seq_overhead: float = _XEON["seq_overhead_ms"] * 1e-3  # per sequence: metadata, sampling, detokenizing
    name: str = "xeon-amx"


def _gemm_key(dtype_bytes: float) -> str:
    return "float32" if dtype_bytes >= 4 else "bfloat16"


def machine_from_profile(profile: dict[str, Any], dtype_bytes: float, name: str,
                         gemm_flops: float | None = None) -> MachineSpec:
    """The ``MachineSpec`` a profile gives for weights of ``dtype_bytes`` bytes; a clear error for a profile
    that lacks a number or has no GEMM rate for that dtype (a rate measured for another dtype would mislead)
    unless ``gemm_flops`` is given instead."""
    if not isinstance(profile, dict):
        raise ValueError(f"machine {name}: expected a JSON object")
    need = ("gemm_tflops", "kv_read_gb_s", "read_gb_s", "step_overhead_ms", "seq_overhead_ms")
    missing = [k for k in need if k not in profile]
    if missing:
        raise ValueError(f"machine {name}: missing {', '.join(missing)}")
    rates = profile["gemm_tflops"]
    if not isinstance(rates, dict) or set(rates) - {"float32", "bfloat16"}:
        raise ValueError(f"machine {name}: gemm_tflops must map float32 and/or bfloat16 to TFLOP/s, got {rates!r}")
    key = _gemm_key(dtype_bytes)
    if gemm_flops is not None:
        rates = {**rates, key: gemm_flops / 1e12}
    if key not in rates:
        raise ValueError(f"machine {name}: no GEMM rate for {key} weights (it has: {', '.join(sorted(rates))}); "
                         f"simulate with --dtype {' or '.join(sorted(rates))}, or pass --gemm-tflops")
    values = {f"gemm_tflops.{key}": rates[key], **{k: profile[k] for k in need[1:]}}
    for k, v in values.items():
        if not isinstance(v, int | float) or isinstance(v, bool) or v < 0 or (v == 0 and not k.endswith("_ms")):
            raise ValueError(f"machine {name}: {k} must be a positive number, got {v!r}")
    return MachineSpec(gemm_flops=rates[key] * 1e12, mem_bandwidth=profile["kv_read_gb_s"] * 1e9,
                       copy_bandwidth=profile["read_gb_s"] * 1e9, step_overhead=profile["step_overhead_ms"] * 1e-3,
                       seq_overhead=profile["seq_overhead_ms"] * 1e-3, name=name)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e.msg})") from None


def load_machine(spec: str, dtype_bytes: float, gemm_flops: float | None = None) -> MachineSpec:
    """A named profile (``MACHINE_PROFILES``) or a JSON file written by ``sim_calibration.py --machine-out``."""
    if spec in MACHINE_PROFILES:
        return machine_from_profile(MACHINE_PROFILES[spec], dtype_bytes, spec, gemm_flops)
    path = Path(spec)
    if not path.is_file():
        raise FileNotFoundError(f"--machine {spec}: neither a profile ({', '.join(MACHINE_PROFILES)}) nor a file")
    data = _read_json(path)
    if not isinstance(data, dict) or data.get("kind") != MACHINE_KIND:
        raise ValueError(f"{path}: not a machine profile (expected \"kind\": \"{MACHINE_KIND}\")")
    return machine_from_profile(data, dtype_bytes, str(data.get("name") or path.stem), gemm_flops)


def machine_profile(machine: MachineSpec, dtype_bytes: float, **extra: Any) -> dict[str, Any]:
    """The JSON form of a measured ``MachineSpec`` (its GEMM rate under the dtype it was measured for)."""
    return {"kind": MACHINE_KIND, "name": machine.name,
            "gemm_tflops": {_gemm_key(dtype_bytes): machine.gemm_flops / 1e12},
            "kv_read_gb_s": machine.mem_bandwidth / 1e9, "read_gb_s": machine.copy_bandwidth / 1e9,
            "step_overhead_ms": machine.step_overhead * 1e3, "seq_overhead_ms": machine.seq_overhead * 1e3, **extra}


@dataclass(frozen=True)
class RooflineCost:
    """A CPU step runs its phases one after another, each bound by compute or by memory: the linear
    layers (weights streamed once per step), the lm head for sequences that sample, and attention
    (each sequence's KV read once per step by the GQA-aware kernel)."""

    model: ModelSpec
    machine: MachineSpec = field(default_factory=MachineSpec)
    block_size: int = DEFAULT_BLOCK_SIZE

    def parts(self, f: StepFeatures) -> dict[str, float]:
        m, hw = self.model, self.machine
        moved = (f.swap_blocks + f.copy_blocks) * self.block_size * m.kv_bytes_per_token
        linear = head = attention = 0.0
        flops = m.step_flops(f)
        if f.num_tokens:
            linear = max(flops["linear"] / hw.gemm_flops, m.linear_params * m.dtype_bytes / hw.copy_bandwidth)
            attention = max(flops["attention"] / hw.gemm_flops,
                            m.kv_bytes_per_token * f.context_tokens / hw.mem_bandwidth)
        if f.logit_rows:
            head = max(flops["lm_head"] / hw.gemm_flops, m.head_params * m.dtype_bytes / hw.copy_bandwidth)
        return {
            "overhead": (hw.step_overhead if f.num_seqs or moved else 0.0) + hw.seq_overhead * f.num_seqs,
            "linear": linear,
            "lm_head": head,
            "attention": attention,
            "copy": moved / hw.copy_bandwidth,
        }

    def step_seconds(self, f: StepFeatures) -> float:
        return sum(self.parts(f).values())

    def describe(self) -> str:
        hw = self.machine
        return (f"roofline ({hw.name}): {self.model.name}, {self.model.weight_bytes / 1e6:.0f} MB weights, "
                f"{self.model.kv_bytes_per_token} B KV/token; GEMM {hw.gemm_flops / 1e12:.2f} TFLOP/s, "
                f"KV read {hw.mem_bandwidth / 1e9:.1f} GB/s, overhead {hw.step_overhead * 1e3:.1f} ms/step "
                f"+ {hw.seq_overhead * 1e3:.2f} ms/seq")


def fit_roofline_overheads(cost: RooflineCost, samples: list[tuple[StepFeatures, float]]) -> MachineSpec:
    """The step and per-sequence overheads that make the roofline match measured steps (least squares on
    what the compute/memory terms leave unexplained; clamped at zero)."""
    base = RooflineCost(cost.model, replace(cost.machine, step_overhead=0.0, seq_overhead=0.0), cost.block_size)
    rows = [(float(f.num_seqs), t - base.step_seconds(f)) for f, t in samples if f.num_seqs]
    if len(rows) < 2:
        raise ValueError("fitting overheads needs at least two recorded steps")
    n = len(rows)
    sx, sy = sum(x for x, _ in rows), sum(y for _, y in rows)
    sxx, sxy = sum(x * x for x, _ in rows), sum(x * y for x, y in rows)
    den = n * sxx - sx * sx
    per_seq = max(0.0, (n * sxy - sx * sy) / den) if den else 0.0
    per_step = max(0.0, (sy - per_seq * sx) / n)
    return replace(cost.machine, step_overhead=per_step, seq_overhead=per_seq)


LINEAR_TERMS = ("const", "num_tokens", "num_seqs", "context_tokens", "attn_pairs")


@dataclass(frozen=True)
class LinearCost:
    coefficients: dict[str, float]
    source: str = ""
    fit_error: float | None = None  # median relative error on the calibration steps

    def step_seconds(self, f: StepFeatures) -> float:
        if not (f.num_seqs or f.swap_blocks or f.copy_blocks):
            return 0.0
        c = self.coefficients
        return c.get("const", 0.0) + sum(c.get(k, 0.0) * getattr(f, k) for k in LINEAR_TERMS[1:])

    def describe(self) -> str:
        terms = ", ".join(f"{k}={v:.3g}" for k, v in self.coefficients.items())
        err = f", median fit error {self.fit_error:.1%}" if self.fit_error is not None else ""
        return f"calibrated from {self.source or 'coefficients'}: {terms}{err}"


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None if singular."""
    n = len(b)
    m = [[*row[:], b[i]] for i, row in enumerate(a)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) < 1e-12:
            return None
        m[col], m[piv] = m[piv], m[col]
        for r in range(n):
            if r != col:
                k = m[r][col] / m[col][col]
                for c in range(col, n + 1):
                    m[r][c] -= k * m[col][c]
    return [m[i][n] / m[i][i] for i in range(n)]


def fit_linear(samples: list[tuple[StepFeatures, float]]) -> tuple[dict[str, float], float]:
    """Non-negative least squares over the few terms, by trying every subset (2^5 small solves)."""
    if len(samples) < len(LINEAR_TERMS):
        raise ValueError(f"a calibration needs at least {len(LINEAR_TERMS)} recorded steps, got {len(samples)}")
    rows = [[1.0] + [float(getattr(f, k)) for k in LINEAR_TERMS[1:]] for f, _ in samples]
    ys = [t for _, t in samples]
    scale = [max(abs(r[j]) for r in rows) or 1.0 for j in range(len(LINEAR_TERMS))]
    xs = [[r[j] / scale[j] for j in range(len(r))] for r in rows]
    best: tuple[float, dict[str, float]] | None = None
    for k in range(1, len(LINEAR_TERMS) + 1):
        for subset in itertools.combinations(range(len(LINEAR_TERMS)), k):
            a = [[sum(x[i] * x[j] for x in xs) for j in subset] for i in subset]
            b = [sum(x[i] * y for x, y in zip(xs, ys, strict=True)) for i in subset]
            sol = _solve(a, b)
            if sol is None or any(v < 0 for v in sol):
                continue
            coef = {LINEAR_TERMS[i]: v / scale[i] for i, v in zip(subset, sol, strict=True)}
            sse = sum((y - sum(coef.get(LINEAR_TERMS[j], 0.0) * r[j] for j in range(len(r)))) ** 2
                      for r, y in zip(rows, ys, strict=True))
            if best is None or sse < best[0]:
                best = (sse, coef)
    if best is None:
        raise ValueError("could not fit the step log: every subset of terms was singular")
    coef = {k: best[1].get(k, 0.0) for k in LINEAR_TERMS}
    model = LinearCost(coef)
    errs = sorted(abs(model.step_seconds(f) - t) / t for f, t in samples if t > 0)
    return coef, errs[len(errs) // 2] if errs else 0.0


def load_calibration(path: str | Path) -> LinearCost:
    """A step log (``{"steps": [{features..., "seconds": s}, ...]}``) to fit, or fitted ``coefficients``."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"calibration file not found: {path}")
    data = _read_json(path)
    if isinstance(data, dict) and isinstance(data.get("coefficients"), dict):
        unknown = set(data["coefficients"]) - set(LINEAR_TERMS)
        if unknown:
            raise ValueError(f"{path}: unknown coefficients {sorted(unknown)} (known: {', '.join(LINEAR_TERMS)})")
        return LinearCost({k: float(v) for k, v in data["coefficients"].items()}, str(path))
    if not isinstance(data, dict) or not isinstance(data.get("steps"), list):
        raise ValueError(f"{path}: expected {{'steps': [...]}} (a step log) or {{'coefficients': {{...}}}}")
    samples = []
    for i, row in enumerate(data["steps"]):
        if not isinstance(row, dict) or "seconds" not in row:
            raise ValueError(f"{path}: step {i} needs 'seconds' and step features")
        samples.append(step_log_sample(row))
    coef, err = fit_linear(samples)
    return LinearCost(coef, str(path), err)
