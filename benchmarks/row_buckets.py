"""What kvpage's row buckets (model/layers/row_buckets.py) cost and save on oneDNN's bf16 products.

For each row count, SmolLM2's four projection shapes on oneDNN's packed product: one exact call against the
same rows zero-padded to row_bucket's count (both with their primitives cached; medians of alternating rounds),
and the first call at a fresh row count (what building a primitive costs). Then resident memory after products
at every row count 1..N unbucketed against bucketed (each in a fresh process: oneDNN keeps its primitives).

    python benchmarks/row_buckets.py [--rows 100 300 700 1100 1500 2000] [--rounds 15] [--sweep 600]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

from kvpage.model.layers.row_buckets import by_row_buckets, row_bucket

SHAPES = [(1728, 576), (576, 576), (3072, 576), (576, 1536)]  # SmolLM2: q|k|v, o, gate|up, down


def _weights() -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [torch.ops.mkldnn._reorder_linear_weight(torch.randn(n, k).to(torch.bfloat16), 64) for n, k in SHAPES]


def _one(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def _rss_mib() -> float:
    return int(open(f"/proc/{os.getpid()}/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def sweep(n: int, bucketed: bool) -> None:
    """Products at every row count 1..n (the child process of --sweep); prints the resident growth."""
    ps = _weights()
    start = _rss_mib()
    for rows in range(1, n + 1):
        for (_, k), p in zip(SHAPES, ps, strict=True):
            x = torch.randn(rows, k).to(torch.bfloat16)
            by_row_buckets(x, lambda r, p=p: _one(r, p)) if bucketed else _one(x, p)
    print(f"{_rss_mib() - start:.0f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[100, 300, 700, 1100, 1500, 2000])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--sweep", type=int, default=600, help="row counts 1..N for the memory part (0: skip)")
    ap.add_argument("--child", choices=["exact", "bucketed"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        sweep(args.sweep, args.child == "bucketed")
        return
    ps = _weights()
    print(f"{'rows':>6s} {'bucket':>6s} {'exact ms':>9s} {'padded ms':>9s} {'ratio':>6s} {'first call ms':>13s}")
    for rows in args.rows:
        xs = [torch.randn(rows, k).to(torch.bfloat16) for _, k in SHAPES]
        t = time.perf_counter()
        for x, p in zip(xs, ps, strict=True):
            _one(x, p)
        first = time.perf_counter() - t
        runs = {"exact": lambda xs=xs: [_one(x, p) for x, p in zip(xs, ps, strict=True)],
                "padded": lambda xs=xs: [by_row_buckets(x, lambda r, p=p: _one(r, p))
                                         for x, p in zip(xs, ps, strict=True)]}
        times: dict[str, list[float]] = {k: [] for k in runs}
        for f in runs.values():
            f()
        for _ in range(args.rounds):
            for k, f in runs.items():
                t = time.perf_counter()
                f()
                times[k].append(time.perf_counter() - t)
        e, p = statistics.median(times["exact"]), statistics.median(times["padded"])
        print(f"{rows:6d} {row_bucket(rows):6d} {e * 1e3:9.2f} {p * 1e3:9.2f} {p / e:6.2f} {first * 1e3:13.2f}")
    if args.sweep:
        for mode in ("exact", "bucketed"):
            out = subprocess.run([sys.executable, __file__, "--child", mode, "--sweep", str(args.sweep)],
                                 capture_output=True, text=True, check=True).stdout.strip()
            print(f"resident growth over row counts 1..{args.sweep}, {mode}: +{out} MiB")


if __name__ == "__main__":
    main()
