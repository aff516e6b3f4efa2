"""A real `kvpage serve` process whose engine fails on purpose, for the fault-isolation tests.

Requests are marked by their seed:
- SAMPLE_FAULT_SEED: the batched sampler raises on that request's settings (it must fail alone);
- OUTPUT_FAULT_SEED: appending its third token raises (output processing fails for that request alone);
- FATAL_SEED: the model step that contains it raises (the engine dies; every request fails; exit 1).
"""

from __future__ import annotations

import argparse
import copy
import sys

from kvpage.engine.arg_utils import EngineArgs
from kvpage.engine.llm_engine import LLMEngine
from kvpage.entrypoints.openai.api_server import ServerConfig
from kvpage.entrypoints.serve import serve_engine

SAMPLE_FAULT_SEED = 6661
OUTPUT_FAULT_SEED = 6662
FATAL_SEED = 6663


class FaultyEngine(LLMEngine):
    def __init__(self, args: EngineArgs) -> None:
        super().__init__(args)
        execute, sample, append = self.worker.runner.execute, self.worker.sample_requests, self.core.processor.append

        def failing_execute(batch, *rest, **kw):
            if any(self._seed_of(s.seq_id) == FATAL_SEED for s in batch):
                raise RuntimeError("injected kernel failure")
            return execute(batch, *rest, **kw)

        def poisoned_sample(logits, reqs, rows):
            poisoned = []
            for r in reqs:
                if r.params.seed == SAMPLE_FAULT_SEED:
                    r = copy.copy(r)
                    r.params = copy.copy(r.params)
                    r.params.top_k = "not a number"  # type: ignore[assignment]  # the batched top-k raises on it
                poisoned.append(r)
            return sample(logits, poisoned, rows)

        def failing_append(seq, draw):
            if seq.request.params.seed == OUTPUT_FAULT_SEED and seq.num_output_tokens >= 2:
                raise ValueError("injected output failure")
            return append(seq, draw)

        # this engine instance only
        self.worker.runner.execute = failing_execute
        self.worker.sample_requests = poisoned_sample
        # every step draws from its logits, so that the poisoned request's call into the sampler fails there
        self.worker._plan_draws = lambda out: None
        self.core.processor.append = failing_append

    def _seed_of(self, seq_id: str) -> int | None:
        req = self.requests.get(seq_id.rsplit("#", 1)[0])
        return req.params.seed if req else None


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--shutdown-timeout", type=float, default=30.0)
    a = p.parse_args()
    return serve_engine(lambda: FaultyEngine(EngineArgs(kv_cache_memory="128MiB", max_model_len=1024,
                                                             kv_huge_pages=False)),
                        ServerConfig(""), "127.0.0.1", a.port, shutdown_timeout=a.shutdown_timeout)


if __name__ == "__main__":
    sys.exit(main())
