"""The simulator's ``StepWorker``: instead of running the model, a step advances a simulated clock by the
time the cost model predicts for it, and every draw is a fresh token id. Everything else (scheduling, forks,
stops, retiring) is the engine's own loop (``core.engine_core``)."""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from kvpage.core.engine_core import Sample, SampleTask
from kvpage.core.prompt_scores import PromptScore
from kvpage.core.scheduler import SchedulerOutput
from kvpage.core.step import StepFeatures
from kvpage.kv.specs import KVLayout
from kvpage.sim.cost import CostModel
from kvpage.sim.workloads import TokenSource


@dataclass
class SimClock:
    """Simulated seconds since the start; the engine loop reads its timestamps from it."""

    now: float = 0.0

    def __call__(self) -> float:
        return self.now


class CostModelWorker:
    """Each step costs ``cost.step_seconds`` of its features; ``on_step(features, seconds)`` sees every step
    before the clock moves (the simulator samples memory there, while the step's blocks are held)."""

    def __init__(self, cost: CostModel, clock: SimClock, tokens: TokenSource | None = None,
                 on_step: Callable[[StepFeatures, float], None] | None = None, layout: KVLayout | None = None) -> None:
        self.cost = cost
        self.layout = layout  # sliding-window layers read only their window
        self.clock = clock
        self.tokens = tokens or TokenSource()
        self.on_step = on_step

    def execute_model(self, out: SchedulerOutput) -> None:
        features = StepFeatures.of(out, self.layout)
        seconds = self.cost.step_seconds(features)
        if self.on_step is not None:
            self.on_step(features, seconds)
        self.clock.now += seconds

    def prompt_scores(self, step: None) -> dict[str, list[PromptScore]]:
        """The simulator computes no logits: its workloads ask for no prompt logprobs."""
        return {}

    def sample(self, step: None, tasks: Seq[SampleTask]) -> list[list[Sample] | BaseException]:
        """Fresh ids that no prompt holds, so generated tokens never hit the prefix cache by accident."""
        return [[Sample(t) for t in self.tokens.fresh(len(task.targets))] for task in tasks]
