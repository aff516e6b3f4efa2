"""Single-stream decode speed and cold start of `kvpage generate` (command to first streamed token).

    python benchmarks/latency.py [--rounds 3]

Targets (issue #5): single-stream decode >= 115 tok/s; cold start <= 5 s. Each round is a fresh process.
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
llm = LLM(kv_cache_memory="1GiB", max_model_len=2048)
llm.generate("Hello", SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
t = time.perf_counter()
out = llm.generate("Tell me a story about a lighthouse.", SamplingParams(temperature=0, max_tokens=256,
                   ignore_eos=True), use_tqdm=False)[0]
dt = time.perf_counter() - t
print(len(out.outputs[0].token_ids) / dt)
"""


def cold_start() -> float:
    """Seconds from launching `kvpage generate --stream` to the first byte of generated text on stdout."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "kvpage.entrypoints.cli", "generate", "--chat", "Hi!",
                             "--stream", "--max-tokens", "8", "--temperature", "0"],  # default engine settings
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert proc.stdout is not None
    proc.stdout.read(1)
    first = time.perf_counter() - t0
    proc.wait(timeout=120)
    return first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    single, cold = [], []
    for _ in range(args.rounds):
        out = subprocess.run([sys.executable, "-c", SINGLE], capture_output=True, text=True, check=True).stdout
        single.append(float(out.strip().splitlines()[-1]))
        cold.append(cold_start())
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores; SmolLM2-135M-Instruct, dtype auto")
    print(f"single-stream decode: median {statistics.median(single):.1f} tok/s "
          f"(runs {', '.join(f'{x:.1f}' for x in single)}; target >= 115)")
    print(f"cold start to first token: median {statistics.median(cold):.2f} s "
          f"(runs {', '.join(f'{x:.2f}' for x in cold)}; target <= 5 s)")


if __name__ == "__main__":
    main()
