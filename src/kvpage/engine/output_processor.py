"""Per-sequence output state: incremental text, stop conditions, logprobs, and RequestOutput snapshots."""

from __future__ import annotations

from dataclasses import dataclass

from kvpage.core.engine_core import Finish, Sample, length_stop, token_stop
from kvpage.core.sequence import Request, Sequence
from kvpage.engine.structured import GrammarCompiler
from kvpage.model.tokenizer import IncrementalDetokenizer, KVTokenizer
from kvpage.outputs import CompletionOutput, Logprob, RequestOutput


@dataclass
class SeqOutputState:
    detok: IncrementalDetokenizer
    text: str = ""
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, Logprob]] | None = None
    sent_chars: int = 0  # for delta outputs
    sent_tokens: int = 0
    sent_finish: bool = False  # delta outputs: the finish was reported; the sample is left out from then on


class TextOutputProcessor:
    """The engine's ``OutputProcessor``: incremental text, stop strings and logprobs per sequence."""

    def __init__(self, tokenizer: KVTokenizer, eos_ids: tuple[int, ...], max_model_len: int,
                 grammars: GrammarCompiler) -> None:
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.max_model_len = max_model_len
        self.grammars = grammars

    def init_seq(self, seq: Sequence) -> None:
        p = seq.request.params
        detok = IncrementalDetokenizer(self.tokenizer, seq.token_ids[: seq.prompt_len], p.skip_special_tokens)
        seq.state = SeqOutputState(detok, logprobs=[] if p.logprobs is not None else None)
        if p.structured_outputs is not None:
            seq.guide = self.grammars.guide(p.structured_outputs)

    def append(self, seq: Sequence, sample: Sample) -> Finish | None:
        complete = seq.guide is not None and seq.guide.advance(sample.token_id)
        done = append_sample(seq, sample, self.tokenizer, self.eos_ids, self.max_model_len)
        if done is None and complete:  # the constraint is met and takes nothing more
            seq.state.text += seq.state.detok.flush()
            return "stop", None
        return done


def append_sample(seq: Sequence, sample: Sample, tokenizer: KVTokenizer, eos_ids: tuple[int, ...],
                  max_model_len: int) -> Finish | None:
    """Add one generated token; returns (finish_reason, stop_reason) when the sequence is done."""
    st: SeqOutputState = seq.state
    p = seq.request.params
    seq.token_ids.append(sample.token_id)
    st.cumulative_logprob += sample.logprob
    if st.logprobs is not None:
        entry: dict[int, Logprob] = {}
        for rank, (t, lp) in enumerate(sample.top_logprobs or [], start=1):
            entry[t] = Logprob(lp, rank, tokenizer.decode([t], skip_special_tokens=False))
        if sample.token_id not in entry:
            entry[sample.token_id] = Logprob(sample.logprob, sample.rank,
                                             tokenizer.decode([sample.token_id], skip_special_tokens=False))
        st.logprobs.append(entry)
    tok = sample.token_id
    done = token_stop(seq, tok, eos_ids)
    if done is not None:
        if done[1] is not None and p.include_stop_str_in_output:
            st.text += st.detok.add(tok)
        st.text += st.detok.flush()
        return done
    delta = st.detok.add(tok)
    st.text += delta
    if p.stop_list and delta and seq.num_output_tokens >= p.min_tokens:
        hit = _find_stop(st.text, len(delta), p.stop_list)
        if hit is not None:
            pos, stop = hit
            st.text = st.text[: pos + (len(stop) if p.include_stop_str_in_output else 0)]
            return "stop", stop
    done = length_stop(seq, max_model_len)
    if done is not None:
        st.text += st.detok.flush()
    return done


def _find_stop(text: str, delta_len: int, stops: list[str]) -> tuple[int, str] | None:
    """Earliest stop string that ends inside the newest delta (it may start in earlier text)."""
    best: tuple[int, str] | None = None
    for stop in stops:
        start = max(0, len(text) - delta_len - len(stop) + 1)
        pos = text.find(stop, start)
        if pos != -1 and (best is None or pos < best[0]):
            best = (pos, stop)
    return best


def _visible_text(seq: Sequence) -> str:
    """Hold back a tail that could still turn out to be the start of a stop string."""
    st: SeqOutputState = seq.state
    if seq.finished or not seq.request.params.stop_list:
        return st.text
    hold = max(len(s) for s in seq.request.params.stop_list) - 1
    return st.text[: len(st.text) - hold] if hold > 0 else st.text


def make_request_output(req: Request, tokenizer: KVTokenizer | None = None) -> RequestOutput | None:
    kind = req.params.output_kind
    if kind == "final_only" and not req.finished:
        return None
    if req.beam is not None:
        return _beam_output(req, tokenizer)
    outs = []
    for seq in sorted(req.seqs, key=lambda s: s.index):
        st: SeqOutputState = seq.state
        text = _visible_text(seq)
        token_ids = seq.output_token_ids
        logprobs = st.logprobs
        if kind == "delta":
            if st.sent_finish:
                continue
            st.sent_finish = seq.finished
            new_text, new_tokens = text[st.sent_chars:], token_ids[st.sent_tokens:]
            new_logprobs = logprobs[st.sent_tokens:] if logprobs is not None else None
            st.sent_chars, st.sent_tokens = len(text), len(token_ids)
            text, token_ids, logprobs = new_text, new_tokens, new_logprobs
        else:
            token_ids = list(token_ids)
            logprobs = list(logprobs) if logprobs is not None else None
        outs.append(CompletionOutput(
            index=seq.index, text=text, token_ids=token_ids,
            cumulative_logprob=st.cumulative_logprob if req.params.logprobs is not None else None,
            logprobs=logprobs, finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
        ))
    return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs, req.finished,
                         req.num_cached_tokens, req.metrics, req.error, _prompt_logprobs(req, tokenizer, kind))


def _prompt_logprobs(req: Request, tokenizer: KVTokenizer | None, kind: str) -> list | None:
    """The request's prompt logprobs once every prompt position is scored (rendered once, kept on the
    request); a delta stream gets them in one output only."""
    if req.params.prompt_logprobs is None or not req.prompt_scored:
        return None
    if req.prompt_logprobs is None:
        def text(t: int) -> str | None:
            return None if tokenizer is None else tokenizer.decode([t], skip_special_tokens=False)

        rendered: list[dict[int, Logprob] | None] = [None]
        for tok, score in zip(req.prompt_token_ids[1:], req.prompt_scores, strict=True):
            entry = {t: Logprob(lp, rank, text(t)) for rank, (t, lp) in enumerate(score.top, start=1)}
            if tok not in entry:
                entry[tok] = Logprob(score.logprob, score.rank, text(tok))
            rendered.append(entry)
        req.prompt_logprobs = rendered
    if kind == "delta":
        if req.sent_prompt_logprobs:
            return None
        req.sent_prompt_logprobs = True
    return req.prompt_logprobs


def _beam_output(req: Request, tokenizer: KVTokenizer | None) -> RequestOutput:
    """A finished beam search: its best n hypotheses, best first (nothing streams before the end)."""
    p = req.params
    outs = []
    for i, h in enumerate(req.beam.results() if not req.error else []):
        ids = list(h.token_ids)
        # the token that stopped it stays out of the text, unless it is a stop id the caller wants shown
        keep_last = h.finish_reason != "stop" or (h.stop_reason is not None and p.include_stop_str_in_output)
        shown = ids if keep_last else ids[:-1]
        text = tokenizer.decode(shown, skip_special_tokens=p.skip_special_tokens) if tokenizer is not None else ""
        outs.append(CompletionOutput(index=i, text=text, token_ids=ids, cumulative_logprob=h.cum_logprob,
                                     finish_reason=h.finish_reason, stop_reason=h.stop_reason))
    return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs, req.finished,
                         req.num_cached_tokens, req.metrics, req.error)
