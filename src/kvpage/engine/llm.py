"""Offline API: ``LLM(model=...).generate(prompts, SamplingParams)`` and ``.chat(messages)``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from kvpage.engine.arg_utils import EngineArgs
from kvpage.engine.llm_engine import LLMEngine, PromptInput
from kvpage.errors import EngineDeadError
from kvpage.model.registry import DEFAULT_MODEL
from kvpage.outputs import BeamSearchOutput, BeamSearchSequence, RequestOutput
from kvpage.sampling_params import BeamSearchParams, SamplingParams

Messages = list[dict[str, Any]]


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, **engine_args: Any) -> None:
        self.engine = LLMEngine(EngineArgs(model=model, **engine_args))
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks now (they also stop when this process exits)."""
        self.engine.shutdown()

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix block (pool, host and disk tiers); returns how many entries went."""
        return self.engine.reset_prefix_cache()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | BeamSearchParams | Sequence[SamplingParams | BeamSearchParams] | None
        = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order."""
        batch = self._as_batch(prompts)
        params = self._params_for(batch, sampling_params)
        if priority is not None and len(priority) != len(batch):
            raise ValueError(f"{len(priority)} priorities for {len(batch)} prompts")
        ids = []
        try:
            for i, (prompt, p) in enumerate(zip(batch, params, strict=True)):
                rid = f"req-{next(self._ids)}"
                self.engine.add_request(rid, prompt, p, priority=priority[i] if priority else 0)
                ids.append(rid)
        except Exception:
            self.engine.abort_request(ids)  # a bad prompt must not leave the earlier ones queued
            while self.engine.has_unfinished_requests():
                self.engine.step()
            raise
        return self._run(ids, use_tqdm)

    def beam_search(self, prompts: PromptInput | Sequence[PromptInput], params: BeamSearchParams,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """Beam search inside the engine, every prompt at once: the beams of a prompt share its blocks, fork
        (copy-on-write on the partial last block) and are freed when pruned (vLLM's call and output shape)."""
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"beam_search takes BeamSearchParams, got {type(params).__name__}")
        outputs = self.generate(prompts, params, use_tqdm)
        tk = self.engine.tokenizer
        result = []
        for ro in outputs:
            if ro.error:
                raise RuntimeError(f"beam search for request {ro.request_id} failed: {ro.error}")
            prompt_text = tk.decode(ro.prompt_token_ids)
            result.append(BeamSearchOutput([
                BeamSearchSequence(ro.prompt_token_ids + c.token_ids, c.cumulative_logprob or 0.0, prompt_text + c.text,
                                   list(c.token_ids), c.text, c.finish_reason, c.stop_reason) for c in ro.outputs]))
        return result

    def chat(
        self,
        messages: Messages | Sequence[Messages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """Apply a chat template (``chat_template``'s text, else the model's) to each conversation, then
        generate; ``continue_final_message`` leaves the last message open for the model to continue; ``tools``
        (OpenAI's function tools) become the template's ``tools`` variable, as vLLM's LLM.chat hands them over."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)  # type: ignore[list-item]
        tk = self.engine.tokenizer
        prompts: list[PromptInput] = []
        for conv in convs:
            text = tk.apply_chat_template(conv, add_generation_prompt=add_generation_prompt,  # type: ignore[arg-type]
                                          chat_template=chat_template, continue_final_message=continue_final_message,
                                          **{**({"tools": tools} if tools else {}), **(chat_template_kwargs or {})})
            prompts.append({"prompt": text, "prompt_token_ids": tk.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm)

    @staticmethod
    def _as_batch(prompts: PromptInput | Sequence[PromptInput]) -> list[PromptInput]:
        if isinstance(prompts, str | dict):
            return [prompts]
        prompts = list(prompts)
        if prompts and all(isinstance(t, int) for t in prompts):
            return [prompts]  # one prompt given as token ids
        if not prompts:
            raise ValueError("no prompts given")
        return prompts

    @staticmethod
    def _params_for(batch: list[PromptInput], sp: SamplingParams | Sequence[SamplingParams] | None):
        if sp is None:
            return [SamplingParams() for _ in batch]
        if isinstance(sp, SamplingParams | BeamSearchParams):
            return [sp] * len(batch)
        sp = list(sp)
        if len(sp) != len(batch):
            raise ValueError(f"{len(sp)} SamplingParams for {len(batch)} prompts")
        return sp

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm and len(ids) > 1:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", unit="req", dynamic_ncols=True)
        wanted = set(ids)
        while self.engine.has_unfinished_requests():
            for ro in self.engine.step():
                if ro.finished and ro.request_id in wanted:
                    final[ro.request_id] = ro
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        if self.engine.fatal_error is not None:
            raise EngineDeadError(self.engine.fatal_error)
        return [final[i] for i in ids]
