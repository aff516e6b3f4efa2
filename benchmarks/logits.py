"""The lm head and its logits pass, as the fast path runs them: oneDNN's product over the whole vocabulary in
one call (each step's [rows, vocab] output a fresh allocation) against the product by vocabulary slices with
the logits pass folded in slice by slice, and the float32 logits in a buffer kept across steps. Greedy steps
want the argmax only; sampled steps the float32 logits.

    python benchmarks/logits.py [--rows 64 128 256] [--rounds 9]

Shapes: SmolLM2's head (49,152 x 576) and Gemma 3's (262,144 x 640), random bf16 weights.
"""

from __future__ import annotations

import argparse
from functools import partial

import torch

from _common import cpu_model, median_seconds
from kvpage.envs import KernelConfig
from kvpage.model.fast_path import LOGITS_SPLIT_ROWS, packed_logits
from kvpage.model.layers.linear import PackedLinear
from kvpage.model.logits import LogitsBuffer
from kvpage.ops import kernels


def median_ms(fn, rounds: int) -> float:
    return median_seconds(fn, rounds) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    ops = kernels(KernelConfig(amx_linear=False, quant_max_tokens=0))  # oneDNN's product at every row count
    print(f"machine: {cpu_model()}; medians of {args.rounds}, ms per step")
    print(f"{'head':>16} {'rows':>5} {'greedy: whole':>14} {'sliced':>7} {'sampled: whole':>15} {'sliced+buffer':>14}")
    g = torch.Generator().manual_seed(0)
    for name, vocab, hidden in (("SmolLM2", 49152, 576), ("Gemma 3", 262144, 640)):
        w = (torch.randn(vocab, hidden, generator=g) * 0.05).bfloat16()
        whole = PackedLinear(w, None, ops=ops)
        sliced = PackedLinear(w, None, ops=ops, split_rows=LOGITS_SPLIT_ROWS)
        buffer = LogitsBuffer()
        for rows in args.rows:
            h = torch.randn(rows, hidden, generator=g)
            a = median_ms(partial(packed_logits, ops, whole, w, h, True), args.rounds)
            b = median_ms(partial(packed_logits, ops, sliced, w, h, True), args.rounds)
            c = median_ms(partial(packed_logits, ops, whole, w, h, False), args.rounds)
            d = median_ms(partial(packed_logits, ops, sliced, w, h, False, buffer), args.rounds)
            print(f"{name + ' ' + str(vocab):>16} {rows:>5} {a:14.1f} {b:7.1f} {c:15.1f} {d:14.1f}")


if __name__ == "__main__":
    main()
