"""The layer products of prompt steps inside a real offline run: the AMX tile GEMM against oneDNN's packed GEMM,
call by call. Why this way: the AMX Xeon's hosts swing by a third from one minute to the next, so two runs of a
whole workload one after the other rarely agree on a few percent; here each call of more rows than
KVPAGE_AMX_LINEAR_MAX_ROWS runs both products on the same input, alternating which goes first, and the run goes
on with the engine's own choice of the two, so both see the step's real cache state.

    python benchmarks/prompt_products.py [--workload random256|sharegpt|...] [--model gemma-3-270m]

Prints the summed time of each product per projection shape (out features, in features, gated) and over all,
and the median of the per-call ratios. Needs a CPU with AMX (the tile GEMM) and the default row limit (or any
limit > 0), so that the layers keep oneDNN's packing too.
"""

from __future__ import annotations

import argparse
import statistics
import time

import kvpage.model.layers.linear as linear
from kvpage import LLM, SamplingParams
from throughput import build_workload


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="random256")
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    args = ap.parse_args()
    ratios: list[float] = []
    per: dict[tuple[int, int, bool], list[float]] = {}
    plain = linear.PackedLinear.forward
    first_tile = [True]

    def both(self: linear.PackedLinear, x):
        if self.packed is None or self.amx is None or x.shape[0] <= self.amx_max_rows:
            return plain(self, x)

        products = {"tile": self.tile_product, "onednn": self.onednn_product}
        first_tile[0] = not first_tile[0]
        seconds, outs = {}, {}
        for name in ("tile", "onednn") if first_tile[0] else ("onednn", "tile"):
            t = time.perf_counter()
            outs[name] = products[name](x)
            seconds[name] = time.perf_counter() - t
        ratios.append(seconds["onednn"] / seconds["tile"])
        acc = per.setdefault((self.out_features, x.shape[1], self.gated), [0.0, 0.0])
        acc[0] += seconds["tile"]
        acc[1] += seconds["onednn"]
        return outs["onednn"]  # the engine's own choice above the limit

    linear.PackedLinear.forward = both
    reqs = build_workload(args.workload, model=args.model)
    llm = LLM(model=args.model, kv_cache_memory="4GiB", max_model_len=2048, max_num_seqs=256,
              max_num_batched_tokens=2048)
    params = [SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=True) for r in reqs]
    llm.generate([{"prompt_token_ids": r["prompt_token_ids"]} for r in reqs], params, use_tqdm=False)
    if not ratios:
        raise SystemExit("no call took both products: needs AMX and KVPAGE_AMX_LINEAR_MAX_ROWS > 0 below the steps")
    print(f"{args.model}, {args.workload}: {len(ratios)} calls; oneDNN time / tile GEMM time")
    print("| out, in, gated | tile GEMM (s) | oneDNN (s) | ratio |\n|---|---:|---:|---:|")
    for key, (a, b) in sorted(per.items()):
        print(f"| {key} | {a:.2f} | {b:.2f} | {b / a:.3f} |")
    tile_s, dnn_s = sum(v[0] for v in per.values()), sum(v[1] for v in per.values())
    print(f"| all | {tile_s:.2f} | {dnn_s:.2f} | {dnn_s / tile_s:.3f} (median per call "
          f"{statistics.median(ratios):.3f}) |")


if __name__ == "__main__":
    main()
