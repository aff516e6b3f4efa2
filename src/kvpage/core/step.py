"""What one scheduled step computes, as numbers: the features the engine records in its step log and the
simulator's cost models predict step time from (so a real run and a simulated one describe steps alike).
Torch-free; shared by ``engine/`` and ``sim/``, so the engine never imports the simulator."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from kvpage.core.scheduler import SchedulerOutput


@dataclass(frozen=True)
class StepFeatures:
    num_seqs: int = 0  # sequences computing tokens this step
    num_tokens: int = 0  # tokens through the linear layers
    prefill_tokens: int = 0  # of which in prompt chunks (more than one token for a sequence)
    context_tokens: int = 0  # KV positions read: each sequence's whole context, once
    attn_pairs: int = 0  # (query, key) pairs scored: causal within a chunk, full over the cached part
    logit_rows: int = 0  # sequences that produce a next token (lm head + sampling)
    swap_blocks: int = 0  # blocks copied between device and host
    copy_blocks: int = 0  # blocks copied on the device (copy-on-write, static forks)

    @staticmethod
    def of(out: SchedulerOutput) -> StepFeatures:
        seqs = tokens = prefill = context = pairs = rows = 0
        for w in out.work:
            n, s = w.num_tokens, w.start_pos
            seqs += 1
            tokens += n
            if n > 1:
                prefill += n
            context += s + n
            pairs += n * s + n * (n + 1) // 2
            rows += w.completes_prompt
        return StepFeatures(seqs, tokens, prefill, context, pairs, rows, len(out.swap_out) + len(out.swap_in),
                            len(out.copies))


def step_log_entry(f: StepFeatures, seconds: float) -> dict[str, float]:
    return {**asdict(f), "seconds": seconds}


def step_log_sample(row: dict[str, Any]) -> tuple[StepFeatures, float]:
    """A step log entry back as (features, seconds): the inverse of ``step_log_entry``."""
    names = StepFeatures.__dataclass_fields__
    return StepFeatures(**{k: int(v) for k, v in row.items() if k in names}), float(row["seconds"])
