"""The sampler alone: the batched sampler (one pass over a step's logits) against the per-request loop it
replaced, on random float32 logits of SmolLM2's vocabulary (49,152).

    python benchmarks/sampler.py [--batches 1 8 32 64 128 256] [--reps 20] [--vocab 49152]

Settings: greedy with precomputed argmax (the engine's fast path), temperature 1.0, top-p 0.95, top-k 50,
temperature 1.0 / top-p 0.95 / top-k 50 together, min-p 0.05, and penalties (repetition 1.1, presence 0.5,
frequency 0.5 over 256 prompt and 64 output tokens). Columns: the batched sampler with its compiled draw
kernel, the same with torch operators only, and the per-request loop. Milliseconds per step, medians of
alternating runs.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import alternating_medians, cpu_model
from kvpage.sampling_params import SamplingParams
from kvpage.worker.sampler import SampleRequest, sample

SETTINGS = {
    "greedy": dict(temperature=0.0),
    "temperature 1.0": dict(temperature=1.0),
    "top-p 0.95": dict(top_p=0.95),
    "top-k 50": dict(top_k=50),
    "t1.0 / p0.95 / k50": dict(temperature=1.0, top_p=0.95, top_k=50),
    "min-p 0.05": dict(min_p=0.05),
    "penalties": dict(repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.5),
}


# ---------------------------------------------------------------- the per-request loop that was replaced
def _legacy_penalties(logits, p, prompt_ids, output_ids):
    vocab = logits.shape[-1]
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted({t for t in (*prompt_ids, *output_ids) if t < vocab}), dtype=torch.long)
        if seen.numel():
            vals = logits[seen]
            logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and output_ids:
        counts = torch.bincount(torch.tensor([t for t in output_ids if t < vocab], dtype=torch.long),
                                minlength=vocab).to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def _legacy_filter(logits, p):
    logits = logits / p.temperature
    if p.top_k > 0 and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop = (torch.cumsum(probs, dim=-1) - probs) >= p.top_p
        logits = logits.scatter(0, order[drop], float("-inf"))
    if p.min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    return logits


def legacy_sample(logits: torch.Tensor, requests: Sequence[SampleRequest], argmax, lse) -> list[int]:
    """One request at a time, as kvpage sampled until 2026-11 (a full log-softmax and rank count each)."""
    amax, lses = argmax.tolist(), lse.tolist()
    out = []
    for row, req in enumerate(requests):
        p = req.params
        if p.temperature == 0 and not p.uses_penalties:
            out.append(amax[row])
            _ = float(logits[row, amax[row]]) - lses[row]
            continue
        x = logits[row].clone()
        if p.uses_penalties:
            x = _legacy_penalties(x, p, req.prompt_ids, req.output_ids)
        if p.temperature == 0:
            t = int(torch.argmax(x))
        else:
            t = int(torch.multinomial(torch.softmax(_legacy_filter(x, p), dim=-1), 1))
        lp = torch.log_softmax(logits[row], dim=-1)
        _ = (float(lp[t]), int((lp > lp[t]).sum()) + 1)
        out.append(t)
    return out


TEXT = """The lighthouse keeper climbed the spiral stairs every evening at dusk, counting the steps as his
father had taught him. There were one hundred and twelve of them, worn smooth in the middle by two centuries of
boots. At the top he trimmed the wick, polished the great lens, and wrote the weather in the log: wind from
the north-west, force five, visibility good, a fishing boat running for harbour. def fibonacci(n):\n    a, b
= 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n In 1887 the price of wheat fell by 12%
while exports rose to 3.4 million tonnes; economists argued about the cause for a decade. Photosynthesis turns
light, water and carbon dioxide into glucose and oxygen inside the chloroplasts of a leaf."""


def model_logits() -> torch.Tensor:
    """Float32 next-token logits of SmolLM2 at every position of TEXT (teacher-forced)."""
    from kvpage.model.loader import load_model
    from kvpage.worker.kv_cache import KVCache
    from kvpage.worker.model_runner import ModelRunner, ScheduledSeq

    lm = load_model(dtype="float32")
    ids = lm.tokenizer.encode(TEXT)
    runner = ModelRunner(lm.model, KVCache(lm.config, 64, 16, torch.float32))
    return runner.execute([ScheduledSeq("s", ids, 0, list(range(64)), all_logits=True)])["s"].float().contiguous()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    ap.add_argument("--logits", choices=["model", "random"], default="model",
                    help="model: SmolLM2's next-token logits at every position of a text (real distributions); "
                         "random: N(0, 9) logits (flat, the hard case for top-p)")
    args = ap.parse_args()
    pool = model_logits() if args.logits == "model" else None
    torch.manual_seed(0)
    print(f"machine: {cpu_model()}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"{args.logits} logits, vocab {args.vocab if pool is None else pool.shape[1]}; ms per step, median of "
          f"{args.reps} alternating runs")
    print(f"{'setting':<20} {'batch':>5} {'kernel':>9} {'torch':>9} {'per-request':>12} {'kernel speed-up':>16}")
    from kvpage.ops import load_kernels

    ops = load_kernels()
    gen = torch.Generator().manual_seed(1)
    for name in args.settings:
        for b in args.batches:
            if pool is None:
                logits = torch.randn(b, args.vocab, generator=gen) * 3
            else:
                logits = pool[torch.randint(0, pool.shape[0], (b,), generator=gen)].contiguous()
            argmax, lse = logits.argmax(dim=1), torch.logsumexp(logits, dim=1)
            params = SamplingParams(**SETTINGS[name])
            prompt = torch.randint(0, args.vocab, (256,), generator=gen).tolist()
            output = torch.randint(0, args.vocab, (64,), generator=gen).tolist()
            reqs = [SampleRequest(params, prompt, output, [None]) for _ in range(b)]

            def batched(logits=logits, reqs=reqs, argmax=argmax, lse=lse, path=ops) -> float:
                import time
                fresh = [SampleRequest(r.params, r.prompt_ids, r.output_ids, r.generators) for r in reqs]
                t = time.perf_counter()
                sample(logits, fresh, argmax, lse, ops=path)
                return time.perf_counter() - t

            def torch_path(logits=logits, reqs=reqs, argmax=argmax, lse=lse) -> float:
                return batched(logits, reqs, argmax, lse, None)

            def loop(logits=logits, reqs=reqs, argmax=argmax, lse=lse) -> float:
                import time
                t = time.perf_counter()
                legacy_sample(logits, reqs, argmax, lse)
                return time.perf_counter() - t

            a, c = alternating_medians(batched, loop, args.reps)
            tp = alternating_medians(torch_path, torch_path, max(3, args.reps // 4))[0]
            print(f"{name:<20} {b:>5} {a * 1e3:>9.3f} {tp * 1e3:>9.3f} {c * 1e3:>12.3f} {c / a:>15.2f}x",
                  flush=True)


if __name__ == "__main__":
    main()
