"""Greedy steps' lm head on float32 machines: the whole float32 product and its argmax against the integer screen
(model/lm_screen.py), alternating calls in one process, on the model's own final hidden rows (SmolLM2 unless
--model names another, e.g. gemma-3-270m): a fixed text's (prose, markup and code) and a prompt of random tokens
(what `vllm bench serve`'s random dataset sends).

    python benchmarks/lm_screen.py [--model gemma-3-270m] [--rows 16 64 128] [--rounds 9]

AVX2 + FMA builds without AVX-512 only (where the float32 panel GEMM runs). Reports the medians per step, their
ratio, and how many of the vocabulary's tokens each row multiplied in float32; every call's argmax is checked
equal.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from _common import cpu_model
from kvpage.envs import KernelConfig
from kvpage.model.loader import load_model
from kvpage.worker.scoring import chunked_hidden

TEXT = Path(__file__).resolve().parent / "data" / "kv_quant_text.txt"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 64, 128])
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    lm = load_model(args.model, dtype="float32", fast=True, kernel_config=KernelConfig())
    fast = lm.model.fast
    if fast is None or fast.lm_screen is None:
        sys.exit("the screen runs on AVX2 + FMA builds without AVX-512 (float32 heads): not this machine")
    screen = fast.lm_screen
    ids = lm.tokenizer.encode(TEXT.read_text())[:1024]
    noise = torch.randint(0, lm.config.vocab_size, (512,), generator=torch.Generator().manual_seed(0)).tolist()
    bos = lm.tokenizer.bos_token_id
    if bos is not None and ids[:1] == [bos]:  # a model that asks for BOS (Gemma 3) gets it before the noise too
        noise = [bos, *noise[1:]]
    sources = {"random tokens": chunked_hidden(lm, noise, torch.float32, chunk=256),
               "text": chunked_hidden(lm, ids, torch.float32, chunk=256)}
    print(f"machine: {cpu_model()}; {args.model}, vocabulary {fast.lm_weight.shape[0]}; medians of {args.rounds} "
          "alternating calls, ms per step")
    print(f"{'rows from':>14} {'rows':>5} {'whole head':>11} {'screen':>8} {'ratio':>6} {'float32 per row':>15}")
    for name, hidden in sources.items():
        for rows in args.rows:
            h = hidden[-rows:].contiguous()
            whole_t, screen_t = [], []
            for r in range(args.rounds + 1):
                for use in ((False, True) if r % 2 == 0 else (True, False)):
                    fast.lm_screen = screen if use else None
                    before = screen.candidates[1]
                    t = time.perf_counter()
                    got = fast.compute_logits_ex(h, argmax_only=True).argmax
                    took = time.perf_counter() - t
                    if r == 0:  # warm-up; both answers kept to compare
                        if use:
                            exact = (screen.candidates[1] - before) / rows
                            ref_s = got
                        else:
                            ref_w = got
                        continue
                    (screen_t if use else whole_t).append(took)
            fast.lm_screen = screen
            if not torch.equal(ref_s, ref_w):
                sys.exit(f"{name}, {rows} rows: the screen's argmax differs from the whole head's")
            w, s = statistics.median(whole_t) * 1e3, statistics.median(screen_t) * 1e3
            print(f"{name:>14} {rows:>5} {w:>11.2f} {s:>8.2f} {s / w:>6.2f} {exact:>15.1f}")


if __name__ == "__main__":
    main()
