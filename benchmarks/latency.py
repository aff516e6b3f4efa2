"""Single-stream decode speed and cold start of `kvpage generate` (command to first streamed token).

    python benchmarks/latency.py [--rounds 3] [--dtypes auto float32] [--envs VAR=0 VAR=1] [--no-cold-start]
    python benchmarks/latency.py --model gemma-3-270m --kv-dtypes bfloat16 int8 --no-cold-start

Targets (issue #5): single-stream decode >= 115 tok/s; cold start <= 5 s. Each round is a fresh process;
with several --dtypes the rounds alternate between them (auto: the engine's default; float32: the exact
step-by-step path), with several --kv-dtypes between KV cache dtypes, and with several --envs between those
environment settings too (each a comma-separated list of VAR=VALUE, "-" for none), so variants are compared side
by side on a noisy machine. --model picks another packaged model (the targets are SmolLM2's).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time

DEFAULT = "SmolLM2-135M-Instruct"

SINGLE = r"""
import time
from kvpage.engine.llm import LLM
from kvpage.sampling_params import SamplingParams
import sys
llm = LLM(model=sys.argv[3], kv_cache_memory="1GiB", max_model_len=2048, dtype=sys.argv[1], kv_cache_dtype=sys.argv[2])
llm.generate("Hello", SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
t = time.perf_counter()
out = llm.generate("Tell me a story about a lighthouse.", SamplingParams(temperature=0, max_tokens=256,
                   ignore_eos=True), use_tqdm=False)[0]
dt = time.perf_counter() - t
print(len(out.outputs[0].token_ids) / dt)
"""


def cold_start(dtype: str, kv_dtype: str, model: str, env: dict[str, str] | None = None) -> float:
    """Seconds from launching `kvpage generate --stream` to the first byte of generated text on stdout."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "kvpage.entrypoints.cli", "generate", "Hi!",
                             "--stream", "--max-tokens", "8", "--temperature", "0", "--dtype", dtype,
                             "--kv-cache-dtype", kv_dtype, "--model", model] + (["--chat"] if model == DEFAULT else []),
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    assert proc.stdout is not None
    proc.stdout.read(1)
    first = time.perf_counter() - t0
    proc.wait(timeout=120)
    return first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtypes", nargs="+", default=["auto"], choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--kv-dtypes", nargs="+", default=["auto"], help="KV cache dtypes, e.g. bfloat16 int8")
    ap.add_argument("--model", default=DEFAULT, help="a packaged model (default: %(default)s)")
    ap.add_argument("--envs", nargs="+", default=["-"], help="environment variants, e.g. KVPAGE_QUANT_INT16=0")
    ap.add_argument("--no-cold-start", action="store_true", help="decode speed only")
    args = ap.parse_args()
    variants = [(d, kv, e) for d in args.dtypes for kv in args.kv_dtypes for e in args.envs]
    extra = {e: parse_env(e) for e in args.envs}
    single: dict[tuple[str, str, str], list[float]] = {v: [] for v in variants}
    cold: dict[tuple[str, str, str], list[float]] = {v: [] for v in variants}
    for _ in range(args.rounds):
        for v in variants:
            d, kv, e = v
            env = dict(os.environ, **extra[e])
            out = subprocess.run([sys.executable, "-c", SINGLE, d, kv, args.model], capture_output=True, text=True,
                                 check=True, env=env).stdout
            single[v].append(float(out.strip().splitlines()[-1]))
            if not args.no_cold_start:
                cold[v].append(cold_start(d, kv, args.model, env))
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores; {args.model}")
    for v in variants:
        d, kv, e = v
        name = f"dtype {d}" + ("" if kv == "auto" else f", KV {kv}") + ("" if e == "-" else f" [{e}]")
        targets = args.model == DEFAULT  # issue #5's targets are the default model's
        print(f"{name}: single-stream decode: median {statistics.median(single[v]):.1f} tok/s "
              f"(runs {', '.join(f'{x:.1f}' for x in single[v])}{'; target >= 115' if targets else ''})")
        if cold[v]:
            print(f"{name}: cold start to first token: median {statistics.median(cold[v]):.2f} s "
                  f"(runs {', '.join(f'{x:.2f}' for x in cold[v])}{'; target <= 5 s' if targets else ''})")


def parse_env(spec: str) -> dict[str, str]:
    """'A=1,B=x' -> {'A': '1', 'B': 'x'}; '-' -> {}."""
    if spec == "-":
        return {}
    pairs = [p.split("=", 1) for p in spec.split(",")]
    bad = [p[0] for p in pairs if len(p) != 2 or not p[0]]
    if bad:
        raise SystemExit(f"--envs: expected VAR=VALUE[,VAR=VALUE...], got {spec!r}")
    return dict(pairs)


if __name__ == "__main__":
    main()
