"""Helpers shared by the benchmark scripts (timing, driving an engine to completion, naming the CPU, the
engine's projection GEMM rate, variants with kernel switches)."""

from __future__ import annotations

import json
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable


def median_seconds(fn: Callable[[], object], reps: int) -> float:
    """Median wall time of ``fn`` over ``reps`` calls, after one untimed warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def memory_read_gbps(gib: int = 1, reps: int = 5) -> float:
    """This hour's memory read rate: a float32 sum over ``gib`` GiB on every core, median of ``reps`` passes. The
    machines share memory with their neighbours, and a run's figures move with it (20.9-31.0 GB/s on the AMX
    Xeon between hours), so the online and structured runs print it beside their results."""
    import torch

    x = torch.ones((gib << 30) // 4)
    seconds = median_seconds(lambda: x.sum(), reps)
    return (gib << 30) / seconds / 1e9


def alternating_medians(a: Callable[[], float], b: Callable[[], float], rounds: int,
                        warmup: int = 1) -> tuple[float, float]:
    """Median seconds of two passes that time themselves, run alternately (after ``warmup`` untimed rounds) so
    that drift on this noisy machine hits both alike."""
    for _ in range(warmup):
        a(), b()
    a_times, b_times = [], []
    for _ in range(rounds):
        a_times.append(a())
        b_times.append(b())
    return statistics.median(a_times), statistics.median(b_times)


def drive(engine, on_step: Callable[[], None] | None = None) -> tuple[int, float]:
    """Step ``engine`` until every request has finished; returns (generated tokens, seconds of stepping).
    ``on_step`` runs after each step (to sample KV statistics); its time is left out of the seconds, since it
    is the benchmark's instrumentation, not the engine's work (and it runs once per step, so it would weigh
    more on a run of many small steps than on one of few large ones)."""
    tokens = 0
    stepping = 0.0
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        for ro in engine.step():
            if ro.finished:
                tokens += len(ro.outputs[0].token_ids)
        stepping += time.perf_counter() - t
        if on_step is not None:
            on_step()
    return tokens, stepping


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo) with its family and widest vector instructions, for the machine line
    every result is printed with: "AMD EPYC" alone names three kinds of machine here (Zen 2/3 with AVX2 only,
    Zen 5 with AVX-512)."""
    # imported here: _vllm_attention.py loads this module in vLLM's interpreter, which has no kvpage
    from kvpage.cpuinfo import cpu_flags, cpuinfo_field

    name = cpuinfo_field("model name") or platform.processor() or platform.machine()
    flags = cpu_flags()
    isa = [f for f in ("amx_tile", "avx512_bf16", "avx512_vnni", "avx512f") if f in flags] or \
        (["avx2"] if "avx2" in flags else [])
    family = cpuinfo_field("cpu family")
    return f"{name} (family {family}; {' '.join(isa) or 'no AVX2'})" if family else name


def run_c(source: str, name: str, args: list[str], flags: tuple[str, ...] = (), env: dict | None = None,
          runs: int = 1) -> list[str]:
    """Compile a small C program once with gcc for this CPU (-march=native) in a scratch directory, run it `runs`
    times with args and return each run's standard output (the microbenchmarks that time instructions or memory,
    not kvpage's kernels)."""
    gcc = shutil.which("gcc")
    if gcc is None:
        raise SystemExit(f"{name} needs gcc")
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = os.path.join(tmp, f"{name}.c"), os.path.join(tmp, name)
        with open(src, "w") as f:
            f.write(source)
        subprocess.run([gcc, "-O2", "-march=native", *flags, "-o", exe, src], check=True)
        return [subprocess.run([exe, *args], check=True, capture_output=True, text=True, env=env).stdout
                for _ in range(runs)]


def engine_gemm_tflops(dtype: str, rows: int = 256) -> float:
    """TFLOP/s of the engine's own projection GEMM for ``dtype`` (``PackedLinear``: AMX tiles for bf16 where
    the CPU has them, kvpage's panel GEMM for float32 on AVX2 builds, oneDNN otherwise) on SmolLM2's gate
    shape (576 -> 1536) at ``rows`` rows, the weight in cache: the best rate a step's products can reach."""
    import torch

    from kvpage.model.layers.linear import PackedLinear
    from kvpage.ops import kernels

    dt = getattr(torch, dtype)
    a = torch.randn(rows, 576).to(dt)
    lin = PackedLinear(torch.randn(1536, 576).to(dt), None, ops=kernels())
    with torch.inference_mode():
        seconds = median_seconds(lambda: lin(a), 15)
    return 2 * rows * 576 * 1536 / seconds / 1e12


def run_python(python: str, code: str, reqs: object, env: dict | None = None, timeout: float = 3600) -> dict:
    """Run ``code`` with ``python`` (an engine in its own process), ``reqs`` as JSON on stdin; its last
    ``{"seconds": ...}`` line of stdout is the result. Its output goes to files, read once the runner itself has
    exited: a helper process a peer leaves behind (vLLM's resource tracker) can hold an inherited pipe open for
    ever. A result line counts whatever the exit status (vLLM 0.32's CPU build aborts in its shutdown after a
    run with prompt logprobs, its result already printed); without one the runner's last error line is raised."""
    # Run from a neutral directory: with this one as the working directory, a peer that imports a module
    # named like one of these scripts (vLLM and HF's `kernels` package) would pick up the script instead.
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([python, "-c", code], stdin=subprocess.PIPE, stdout=out, stderr=err, text=True,
                                env={**os.environ, **(env or {})}, cwd=tempfile.gettempdir())
        try:
            proc.communicate(json.dumps(reqs), timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        out.seek(0)
        for line in reversed(out.read().strip().splitlines()):  # peers may log to stdout after the result
            if line.startswith('{"seconds"'):
                return json.loads(line)
        err.seek(0)
        lines = err.read().strip().splitlines()
        raise RuntimeError(lines[-1] if lines else f"exit status {proc.returncode}, no result line in its output")


def variant_env(spec: str) -> tuple[str, dict[str, str]]:
    """`HEAD+VAR=VALUE[+VAR=VALUE...]` -> (HEAD, {VAR: VALUE}), each VAR checked against kvpage's registry
    (docs/envs.md) so that a misspelt switch stops the run instead of measuring the default."""
    from kvpage.envs import read

    head, *pairs = spec.split("+")
    env = dict(pair.split("=", 1) for pair in pairs if "=" in pair)
    if len(env) != len(pairs):
        raise SystemExit(f"{spec}: expected {head}+VAR=VALUE[+VAR=VALUE...]")
    for name in env:
        try:
            read(name, env)
        except KeyError:
            raise SystemExit(f"{spec}: {name} is not a kvpage variable (docs/envs.md)") from None
        except ValueError as e:
            raise SystemExit(f"{spec}: {e}") from None
    return head, env
