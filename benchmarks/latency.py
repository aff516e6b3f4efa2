"""Single-stream decode speed and cold start of `kvpage generate` (command to first streamed token).

    python benchmarks/latency.py [--rounds 3] [--dtypes auto float32]

Targets (issue #5): single-stream decode >= 115 tok/s; cold start <= 5 s. Each round is a fresh process;
with several --dtypes the rounds alternate between them (auto: the engine's default; float32: the exact
step-by-step path).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time

SINGLE = r"""
import time
from kvpage.engine.llm import LLM
from kvpage.sampling_params import SamplingParams
import sys
llm = LLM(kv_cache_memory="1GiB", max_model_len=2048, dtype=sys.argv[1])
llm.generate("Hello", SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
t = time.perf_counter()
out = llm.generate("Tell me a story about a lighthouse.", SamplingParams(temperature=0, max_tokens=256,
                   ignore_eos=True), use_tqdm=False)[0]
dt = time.perf_counter() - t
print(len(out.outputs[0].token_ids) / dt)
"""


def cold_start(dtype: str) -> float:
    """Seconds from launching `kvpage generate --stream` to the first byte of generated text on stdout."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "kvpage.entrypoints.cli", "generate", "--chat", "Hi!",
                             "--stream", "--max-tokens", "8", "--temperature", "0", "--dtype", dtype],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert proc.stdout is not None
    proc.stdout.read(1)
    first = time.perf_counter() - t0
    proc.wait(timeout=120)
    return first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtypes", nargs="+", default=["auto"], choices=["auto", "float32", "bfloat16"])
    args = ap.parse_args()
    single: dict[str, list[float]] = {d: [] for d in args.dtypes}
    cold: dict[str, list[float]] = {d: [] for d in args.dtypes}
    for _ in range(args.rounds):
        for d in args.dtypes:
            out = subprocess.run([sys.executable, "-c", SINGLE, d], capture_output=True, text=True, check=True).stdout
            single[d].append(float(out.strip().splitlines()[-1]))
            cold[d].append(cold_start(d))
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores; SmolLM2-135M-Instruct")
    for d in args.dtypes:
        print(f"dtype {d}: single-stream decode: median {statistics.median(single[d]):.1f} tok/s "
              f"(runs {', '.join(f'{x:.1f}' for x in single[d])}; target >= 115)")
        print(f"dtype {d}: cold start to first token: median {statistics.median(cold[d]):.2f} s "
              f"(runs {', '.join(f'{x:.2f}' for x in cold[d])}; target <= 5 s)")


if __name__ == "__main__":
    main()
