"""Time to load the embedded default model: kvpage vs transformers, measured alternately in fresh processes.

    python benchmarks/load_model.py [--rounds 3]

Each measurement is a fresh interpreter (imports included), so caches from a previous load do not help.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

KVPAGE = """
import time, json
t0 = time.perf_counter()
from kvpage.model.loader import load_model
lm = load_model("SmolLM2-135M-Instruct", dtype="{dtype}")
print(json.dumps({{"seconds": time.perf_counter() - t0}}))
"""
TRANSFORMERS = """
import time, json, os
os.environ["HF_HUB_OFFLINE"] = "1"
t0 = time.perf_counter()
import torch
from transformers import AutoModelForCausalLM
from transformers.utils import logging
logging.disable_progress_bar()
from kvpage.model.registry import default_model_path
p = default_model_path()
m = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=getattr(torch, "{dtype}"))
print(json.dumps({{"seconds": time.perf_counter() - t0}}))
"""


def run(code: str) -> float:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])["seconds"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args()
    ours, theirs = [], []
    for _ in range(args.rounds):
        ours.append(run(KVPAGE.format(dtype=args.dtype)))
        theirs.append(run(TRANSFORMERS.format(dtype=args.dtype)))
    mo, mt = statistics.median(ours), statistics.median(theirs)
    print(f"load SmolLM2-135M-Instruct Q4_1 GGUF as {args.dtype}, fresh process each, {args.rounds} rounds alternating")
    print(f"kvpage        median {mo:6.2f} s  (all: {', '.join(f'{x:.2f}' for x in ours)})")
    print(f"transformers  median {mt:6.2f} s  (all: {', '.join(f'{x:.2f}' for x in theirs)})")
    print(f"kvpage / transformers: {mo / mt:.2f}")


if __name__ == "__main__":
    main()
