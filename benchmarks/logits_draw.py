"""A sampled step's logits pass and draw, as the engine runs them when no request needs its logits: the draw
made inside the row-by-row pass (`logits_draw`: each row widened into a per-thread scratch row, finished, and
drawn from while it is in cache) against the pass writing the [rows, vocab] float32 logits to the buffer kept
across steps, followed by `sample_rows` over them (what a step with a logprobs request still runs).

    python benchmarks/logits_draw.py [--rows 64 128 256] [--rounds 15]

SmolLM2's head shape (49,152 x 576, random bf16 weights, hidden states scaled so that each row's softmax is
spread like the model's), its output as the two vocabulary slices the tile GEMM writes; settings: temperature
1.0 alone (the API default) and temperature 1.0 / top-p 0.95 / top-k 50. Before each timed call a 256 MB write
evicts the logits buffer and the head's output from cache, as the rest of a step does. Milliseconds per step,
medians of alternating runs; both give the same tokens (tests/ops/test_fused_ops.py).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import alternating_medians, cpu_model
from kvpage.ops import load_kernels

SETTINGS = {"temperature 1.0": (0, 1.0), "t 1.0, top-p 0.95, top-k 50": (50, 0.95)}


def make_case(ops, weight: torch.Tensor, evict: torch.Tensor, b: int, top_k: int, top_p: float,
              g: torch.Generator) -> tuple[Callable[[], float], Callable[[], float]]:
    """The two timed passes over one step of b rows: the logits pass into a kept buffer then sample_rows, and
    the draw inside the pass."""
    vocab, hidden = weight.shape
    h = torch.randn(b, hidden, generator=g) * 4
    raw = (h.bfloat16() @ weight.T).bfloat16()
    parts = [raw[:, :32768].contiguous(), raw[:, 32768:].contiguous()]
    temps = torch.ones(b)
    ks = torch.full((b,), top_k, dtype=torch.long)
    ps = torch.full((b,), top_p)
    mins = torch.zeros(b)
    u = torch.rand(b, 1, generator=g, dtype=torch.float64)
    buf = torch.empty(b * vocab)
    rows = torch.arange(b)

    def two_passes() -> float:
        evict.add_(1)
        t = time.perf_counter()
        logits = ops.logits_postprocess(parts, h, weight, True, buf)[0]
        ops.sample_rows(logits, rows, temps, ks, ps, mins, u)
        return time.perf_counter() - t

    def in_pass() -> float:
        evict.add_(1)
        t = time.perf_counter()
        ops.logits_draw(parts, h, weight, temps, ks, ps, mins, u)
        return time.perf_counter() - t

    return two_passes, in_pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    ops = load_kernels()
    vocab, hidden = 49152, 576
    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(vocab, hidden, generator=g) * 0.05).bfloat16()
    evict = torch.empty(256 << 20, dtype=torch.uint8)
    print(f"machine: {cpu_model()}; torch {torch.get_num_threads()} threads; medians of {args.rounds}, ms per step")
    print(f"{'setting':<28} {'rows':>5} {'pass + sample_rows':>19} {'draw in the pass':>17} {'ratio':>7}")
    for name, (top_k, top_p) in SETTINGS.items():
        for b in args.rows:
            two_passes, in_pass = make_case(ops, weight, evict, b, top_k, top_p, g)
            a, c = alternating_medians(two_passes, in_pass, args.rounds)
            print(f"{name:<28} {b:>5} {a * 1e3:>19.3f} {c * 1e3:>17.3f} {c / a:>6.2f}x", flush=True)


if __name__ == "__main__":
    main()
