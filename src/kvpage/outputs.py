"""What generation returns (vLLM's shapes: RequestOutput with one CompletionOutput per sample)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Logprob:
    logprob: float
    rank: int  # 1 = most likely
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def latency(self) -> float | None:
        """Arrival to finish (end to end)."""
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    error: str | None = field(default=None)
    # with SamplingParams.prompt_logprobs: per prompt token, None for the first, then its own and the top
    # logprobs under the model at the position before (vLLM's field); in a delta stream only the first output
    # after the prompt is computed carries it
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


@dataclass
class BeamSearchSequence:
    """One returned beam, as vLLM's ``LLM.beam_search`` gives it: ``tokens`` and ``text`` cover the prompt and
    the output; ``output_token_ids`` / ``output_text`` the output alone."""

    tokens: list[int]
    cum_logprob: float
    text: str | None
    output_token_ids: list[int]
    output_text: str
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)  # vLLM's field; not computed here


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # best first
