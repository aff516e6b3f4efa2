"""What one scheduled step computes, as numbers: the features the engine records in its step log and the
simulator's cost models predict step time from (so a real run and a simulated one describe steps alike).
Torch-free; shared by ``engine/`` and ``sim/``, so the engine never imports the simulator."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from kvpage.core.scheduler import SchedulerOutput
from kvpage.kv.specs import KVLayout


@dataclass(frozen=True)
class StepFeatures:
    num_seqs: int = 0  # sequences computing tokens this step
    num_tokens: int = 0  # tokens through the linear layers
    prefill_tokens: int = 0  # of which in prompt chunks (more than one token for a sequence)
    context_tokens: int = 0  # KV positions read per layer (averaged over layers): a sequence's context, once
    attn_pairs: int = 0  # (query, key) pairs scored per layer (averaged): causal within a chunk, full over the past
    logit_rows: int = 0  # sequences that produce a next token (lm head + sampling)
    swap_blocks: int = 0  # blocks copied between device and host
    copy_blocks: int = 0  # blocks copied on the device (copy-on-write, static forks)

    @staticmethod
    def of(out: SchedulerOutput, layout: KVLayout | None = None) -> StepFeatures:
        """The step's features; with a ``layout`` of sliding-window layers, their attention reads only the
        window, so context and pairs are the average over layers of what each layer reads and scores."""
        shares = [(1.0, None)] if layout is None else [
            (len(g.layers) / layout.num_layers, g.spec.window) for g in layout.groups if not g.spec.residual]
        seqs = tokens = prefill = rows = 0
        context = pairs = 0.0
        for w in out.work:
            n, s = w.num_tokens, w.start_pos
            seqs += 1
            tokens += n
            if n > 1:
                prefill += n
            for share, window in shares:
                c, p = attention_reach(s, n, window)
                context += share * c
                pairs += share * p
            rows += w.completes_prompt
        return StepFeatures(seqs, tokens, prefill, round(context), round(pairs), rows,
                            len(out.swap_out) + len(out.swap_in), len(out.copies))


def attention_reach(start: int, num_tokens: int, window: int | None = None) -> tuple[int, int]:
    """(KV positions read, query-key pairs scored) by one layer for a chunk of ``num_tokens`` queries at
    positions start .. start + num_tokens - 1; under a window of W a query sees itself and W - 1 back."""
    end = start + num_tokens
    if window is None:
        return end, num_tokens * start + num_tokens * (num_tokens + 1) // 2
    first_key = max(0, start - window + 1)
    # queries below position W see every key before them (p + 1 each); the others see W
    last_short = min(end, window) - 1  # the last query position p with p + 1 <= W
    short = max(0, last_short - start + 1)
    pairs = (short * (start + 1 + last_short + 1)) // 2 if short else 0
    pairs += (num_tokens - short) * window
    return end - first_key, pairs


def step_log_entry(f: StepFeatures, seconds: float) -> dict[str, float]:
    return {**asdict(f), "seconds": seconds}


def step_log_sample(row: dict[str, Any]) -> tuple[StepFeatures, float]:
    """A step log entry back as (features, seconds): the inverse of ``step_log_entry``."""
    names = StepFeatures.__dataclass_fields__
    return StepFeatures(**{k: int(v) for k, v in row.items() if k in names}), float(row["seconds"])
