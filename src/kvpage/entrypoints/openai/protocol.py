"""OpenAI request bodies (plus vLLM's extras) and their translation into SamplingParams.

Unknown fields are ignored, as the OpenAI clients send some this server has no use for; known fields with the
wrong type or an impossible value become a 400 naming the field, and so do the API's fields that kvpage
cannot honour (audio, legacy functions, ...), unless they carry their neutral value. Chat completions take tools
(tools.py). ``use_beam_search`` (with ``n``,
``best_of``, ``length_penalty``, ``early_stopping``, as vLLM's server takes them) runs beam search; it does not
stream, and refuses the sampling fields that have no meaning for it.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from kvpage.sampling_params import MAX_LOGPROBS, BeamSearchParams, SamplingParams, StructuredOutputsParams

# Sampling fields beam search has no use for, with their neutral values (anything else is a 400 naming it).
_NOT_FOR_BEAMS: dict[str, Any] = {"top_p": (None, 1.0), "top_k": (None, 0, -1), "min_p": (None, 0.0),
                                  "presence_penalty": (None, 0.0), "frequency_penalty": (None, 0.0),
                                  "repetition_penalty": (None, 1.0), "stop": (None, "", []), "logit_bias": (None, {}),
                                  "allowed_token_ids": (None,), "bad_words": (None, [])}


class APIError(Exception):
    """An OpenAI-style error: HTTP status, message, type, and the offending parameter if there is one."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    @property
    def printable_message(self) -> str:
        """The message as every error body writes it (any API shape): client text in it kept JSON-encodable."""
        return _printable(self.message)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.printable_message, "type": self.type,
                          "param": None if self.param is None else _printable(self.param),
                          "code": self.code or self.status}}


def _printable(text: str) -> str:
    """Client text quoted in an error may hold lone surrogates, which no JSON encoder writes as UTF-8."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _set(value: Any) -> bool:
    return value not in (None, False, [], {}, "")


# Field -> is the value one kvpage cannot honour? (A client sending the neutral value is served as usual.)
_UNSUPPORTED: dict[str, Any] = {
    "functions": _set,
    "function_call": lambda v: v not in (None, "none", "auto"),
    "guided_whitespace_pattern": _set,
    "audio": _set,
    "modalities": lambda v: v is not None and v != ["text"],
    "prediction": _set,
    "web_search_options": _set,
    "logits_processors": _set,
    "logprob_token_ids": _set,
    "prompt_embeds": _set,
    "watermarking": _set,
    "repetition_detection": _set,
    "thinking_token_budget": _set,
    "mm_processor_kwargs": _set,
    "media_io_kwargs": _set,
    "mm_payload": _set,
    "return_mm_kwargs": _set,
    "kv_transfer_params": _set,
    "ec_transfer_params": _set,
    "vllm_xargs": _set,
}


def refuse_unsupported(data: dict[str, Any]) -> None:
    """400 naming the first field whose value kvpage would otherwise have to ignore."""
    for name, unsupported in _UNSUPPORTED.items():
        if name in data and unsupported(data[name]):
            raise APIError(400, f"{name} is not supported by this server; "
                                f"remove it or send its neutral value", param=name, code="unsupported_parameter")


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


# OpenAI's fields that its schema lets a client send as null, meaning "the default", where kvpage's default is
# not None (clients that serialize every field send them so; OpenAI's schema, and vLLM 0.32 but for the
# completions' n, read them as if left out).
_NULL_MEANS_DEFAULT = ("n", "stream", "logprobs", "echo")


class SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict) and any(data.get(f, 0) is None for f in _NULL_MEANS_DEFAULT):
            data = {k: v for k, v in data.items() if not (k in _NULL_MEANS_DEFAULT and v is None)}
        return data

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    cache_salt: str | None = None
    priority: int = 0  # vLLM's: lower runs first, on a server started with --scheduling-policy priority
    truncation_side: Literal["left", "right"] | None = None  # vLLM's: truncation keeps the last (left) or first
    request_id: str | None = Field(None, max_length=256)  # vLLM's: the response's id carries it ("": none)
    return_token_ids: bool | None = False  # vLLM's: the prompt's and each choice's token ids (null: false)
    return_tokens_as_token_ids: bool | None = False  # vLLM's: logprobs name tokens "token_id:{id}" (null: false)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None  # vLLM's: words the output never completes
    # the output's form (structured.py reads them): OpenAI's, vLLM's object and vLLM's older guided_* fields
    response_format: Any = None
    structured_outputs: Any = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last k tokens (-1: up to max_model_len)
    prompt_logprobs: int | None = None  # vLLM's extra: top-k logprobs per prompt token (not with stream)
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False

    def beam_width(self) -> int:
        """Sequences the engine runs: beams, or samples of which the best n are returned."""
        return self.n

    def ranked_samples(self) -> bool:
        """More samples than choices returned (best_of > n without beam search)."""
        return not self.use_beam_search and self.beam_width() > self.n

    def token_bias(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        bias = {}
        for key, value in self.logit_bias.items():
            if not (key.isdigit() and len(key) < 20):
                raise APIError(400, f"logit_bias keys must be token ids, got {key[:40]!r}", param="logit_bias")
            bias[int(key)] = value
        return bias

    def requested_prompt_logprobs(self) -> int | None:
        return self.prompt_logprobs

    def structured(self) -> StructuredOutputsParams | None:
        from kvpage.entrypoints.openai.structured import structured_params  # (it raises this module's APIError)

        return structured_params(self)

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        stream: bool) -> SamplingParams | BeamSearchParams:
        if self.prompt_logprobs is not None and stream:  # (its range is SamplingParams' check)
            raise APIError(400, "prompt_logprobs are not available with stream: true", param="prompt_logprobs")
        if self.use_beam_search:
            return self.beam_search_params(max_tokens, logprobs, stream)
        if self.ranked_samples():  # their sums of logprobs rank them: the engine returns them
            logprobs = 0 if logprobs is None else logprobs
        try:
            return SamplingParams(
                n=self.beam_width(),
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=0 if self.top_k is None else self.top_k,
                min_p=self.min_p or 0.0,
                seed=self.seed,
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
                max_tokens=max_tokens,
                min_tokens=self.min_tokens,
                stop=self.stop,
                stop_token_ids=self.stop_token_ids,
                ignore_eos=self.ignore_eos,
                logprobs=logprobs,
                include_stop_str_in_output=self.include_stop_str_in_output,
                skip_special_tokens=self.skip_special_tokens,
                output_kind="delta" if stream else "final_only",
                logit_bias=self.token_bias(),
                allowed_token_ids=self.allowed_token_ids,
                bad_words=self.bad_words,
                structured_outputs=self.structured(),
                prompt_logprobs=self.requested_prompt_logprobs(),
            )
        except ValueError as e:
            raise APIError(400, str(e), param=str(e).split(" ", 1)[0]) from None


    def beam_search_params(self, max_tokens: int | None, logprobs: int | None, stream: bool) -> BeamSearchParams:
        if stream:
            raise APIError(400, "use_beam_search does not stream (the best beams are known only at the end): send "
                                "stream: false", param="stream")
        if logprobs is not None:
            raise APIError(400, "logprobs are not returned with use_beam_search", param="logprobs")
        if self.requested_prompt_logprobs() is not None:
            raise APIError(400, "prompt_logprobs are not returned with use_beam_search", param="prompt_logprobs")
        if self.structured() is not None:
            raise APIError(400, "structured outputs do not run with use_beam_search", param="use_beam_search")
        for name, neutral in _NOT_FOR_BEAMS.items():
            if getattr(self, name) not in neutral:
                raise APIError(400, f"{name} has no meaning with use_beam_search: remove it", param=name)
        try:
            return BeamSearchParams(beam_width=self.beam_width(), max_tokens=max_tokens or 16, n=self.n,
                                    ignore_eos=self.ignore_eos, min_tokens=self.min_tokens,
                                    temperature=self.temperature or 0.0, length_penalty=self.length_penalty,
                                    early_stopping=self.early_stopping, stop_token_ids=self.stop_token_ids,
                                    include_stop_str_in_output=self.include_stop_str_in_output)
        except ValueError as e:
            param = str(e).split(" ", 1)[0]
            raise APIError(400, str(e), param="best_of" if param in ("beam_width", "n") else param) from None


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    add_special_tokens: bool = True  # vLLM's: the tokenizer's BOS before a text prompt
    best_of: int | None = None
    suffix: str | None = None
    tools: Any = None  # chat completions' only
    tool_choice: Any = None

    def check(self) -> None:
        for name in ("tools", "tool_choice"):
            if getattr(self, name) not in (None, "none", []):
                raise APIError(400, f"{name} is for chat completions (/v1/chat/completions)", param=name,
                               code="unsupported_parameter")
        if self.echo and self.use_beam_search:
            raise APIError(400, "echo is not supported with use_beam_search", param="echo")
        if self.max_tokens == 0 and not self.echo:
            raise APIError(400, "max_tokens must be at least 1 (0 only with echo: the prompt alone comes back)",
                           param="max_tokens")
        if self.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if self.best_of is not None and self.best_of < self.n:
            raise APIError(400, f"n must be <= best_of, got n={self.n} and best_of={self.best_of}", param="best_of")
        if self.ranked_samples() and self.stream:
            raise APIError(400, "best_of > n does not stream (the best samples are known only at the end): send "
                                "stream: false", param="stream")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise APIError(400, f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}", param="logprobs")

    def beam_width(self) -> int:
        return self.n if self.best_of is None else self.best_of

    def requested_prompt_logprobs(self) -> int | None:
        """echo with logprobs needs the prompt's logprobs too (as many top ones as the output's)."""
        if self.prompt_logprobs is None and self.echo and self.logprobs is not None:
            return self.logprobs
        return self.prompt_logprobs

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: the engine runs one token (max_tokens 1) that the response leaves out."""
        return self.echo and self.max_tokens == 0

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise APIError(400, "prompt is empty", param="prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls (tools.py)
    tool_call_id: str | None = None  # a tool message answers this call

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(400, f"only text content parts are supported, got {part.get('type')!r}",
                               param="messages")
            parts.append(part["text"])
        return "".join(parts)


class ChatTemplateFields(BaseModel):
    """How messages become the prompt's text; chat completions and /tokenize share them, so /tokenize counts
    the tokens a chat completion would run."""
    model_config = ConfigDict(extra="ignore")

    add_generation_prompt: bool = True
    continue_final_message: bool = False  # leave the last message open for the model to continue (vLLM's)
    chat_template: str | None = None  # vLLM's: a template for this request, with --trust-request-chat-template
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None  # handed to the template as it is, as vLLM does
    tools: Any = None  # function tools, handed to the template (tools.py checks them)

    def check_template_fields(self) -> None:
        if self.continue_final_message and self.add_generation_prompt:
            raise APIError(400, "continue_final_message and add_generation_prompt cannot both be true: send "
                                "add_generation_prompt: false to continue the last message",
                           param="continue_final_message")


def conversation(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the template takes them: text content, a developer message as a system one, and an
    assistant's tool calls with their arguments as objects (tools.py)."""
    from kvpage.entrypoints.openai.tools import template_message  # (it raises this module's APIError)

    out = []
    for i, m in enumerate(messages):
        msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        for key in ("name", "tool_call_id", "tool_calls"):
            if getattr(m, key) is not None:
                msg[key] = getattr(m, key)
        out.append(template_message(msg, i))
    return out


class ChatCompletionRequest(SamplingFields, ChatTemplateFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    echo: bool = False  # vLLM's: the reply starts with the last message's text when that is the assistant's
    add_special_tokens: bool = False  # vLLM's: the tokenizer's BOS before the rendered chat (templates add theirs)
    tool_choice: Any = None  # "none", "auto", "required" or a named function (tools.py)
    parallel_tool_calls: bool | None = None

    _plan: Any = PrivateAttr(None)

    def tool_plan(self) -> Any:
        """The tools and tool_choice checked and resolved, once per request (the route, its sampling params and a
        response's every event body ask for it)."""
        if self._plan is None:
            from kvpage.entrypoints.openai.tools import tool_plan

            self._plan = tool_plan(self.tools, self.tool_choice, self.parallel_tool_calls)
        return self._plan

    def structured(self) -> StructuredOutputsParams | None:
        """A named or required tool choice constrains the output itself, so it takes no other output form."""
        forced = self.tool_plan().constraint()
        asked = super().structured()
        if forced is not None and asked is not None:
            raise APIError(400, "a named or required tool_choice constrains the output already: send either it or "
                                "a structured output form", param="tool_choice")
        return forced or asked

    def check(self) -> None:  # the template fields are checked where the messages are rendered
        if self.top_logprobs and not self.logprobs:  # 0 without logprobs is the neutral value (vLLM takes it too)
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise APIError(400, f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {self.top_logprobs}",
                           param="top_logprobs")

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def conversation(self) -> list[dict[str, str]]:
        return conversation(self.messages)

    def echoed(self) -> str:
        """What echo puts before the reply: the last message's text if the assistant wrote it, else nothing."""
        last = self.messages[-1]
        return last.text() if self.echo and last.role == "assistant" else ""


class TokenizeRequest(ChatTemplateFields):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]
