"""transformers' (float32) outputs for SmolLM2 on the shared prompts: the greedy continuations and the beam
searches the tests compare kvpage against, stored in tests/model/data/smollm2_reference.json.

Loading the GGUF into transformers and generating from it in float32 took ~1.5 min of the default test run on a
2-core machine, more than most of the tests it serves. The stored outputs are keyed by a digest of each prompt's
tokens (and a beam search's settings), so a prompt that changes is refused rather than compared against another
prompt's reference; the slow test `test_stored_reference_is_what_transformers_generates` regenerates them with
transformers and holds the file equal, and ``python -m tests.helpers.reference`` rewrites it."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from tests.helpers.prompts import MAX_NEW, encode_prompts

STORED = Path(__file__).parents[1] / "model" / "data" / "smollm2_reference.json"
BEAM_LENGTH = 10  # generated tokens per beam
# How far a beam's cumulative log-probability may sit from the stored one. transformers' own float32 scores
# move by that much from one CPU to another (oneDNN picks its kernels by instruction set): regenerated on the
# AMX Xeon on 2026-12-04, the tokens were the stored ones and the scores moved by up to 1.1e-4. About three
# times that leaves room for kvpage's own summation order; a wrong token or KV value moves a score by orders of
# magnitude more.
BEAM_SCORE_TOL = 3e-4


def assert_same_beams(got, want, tol: float = BEAM_SCORE_TOL) -> None:
    """The same beams (tokens, exactly) in the same order, with scores within ``tol``."""
    assert [list(t) for t, _ in got] == [list(t) for t, _ in want]
    for (_, a), (_, b) in zip(got, want, strict=True):
        assert abs(a - b) < tol, (a, b)


@dataclass(frozen=True)
class BeamCase:
    """One beam search of one prompt: ``fixed`` suppresses EOS (min_new_tokens = max_new_tokens), so every beam
    runs BEAM_LENGTH tokens."""

    prompt: str
    width: int
    length_penalty: float
    fixed: bool
    early_stopping: bool | str = False

    @property
    def key(self) -> str:
        return f"{self.prompt}/k{self.width}/lp{self.length_penalty}/{'fixed' if self.fixed else 'eos'}/" \
               f"early={self.early_stopping}"


FIXED_PROMPTS = ("chat", "chat_multi", "story")
FINISHED_PROMPTS = ("fact", "chat", "count")
BEAM_CASES = [BeamCase(p, k, 0.0, True) for k in (2, 4, 8) for p in FIXED_PROMPTS] + [
    BeamCase(p, 4, 1.0, False, es) for es in (False, True, "never") for p in FINISHED_PROMPTS]


def digest(ids: list[int]) -> str:
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]


def load_hf_gguf(path: Path):
    """transformers' own GGUF loader and model implementation, float32: the independent reference."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval()


def hf_greedy_tokens(model, ids: list[int], eos: list[int]) -> list[int]:
    """transformers generate(): the greedy continuation of one prompt, stopping at EOS like kvpage."""
    import torch

    x = torch.tensor([ids])
    with torch.no_grad():
        g = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_NEW, do_sample=False,
                           eos_token_id=eos, pad_token_id=eos[0])
    return g[0, len(ids):].tolist()


def hf_beams(model, ids: list[int], case: BeamCase, eos: list[int]) -> list[tuple[list[int], float]]:
    """transformers' beams for one prompt: (output tokens, sequence score), best first."""
    import torch

    x = torch.tensor([ids])
    k = case.width
    with torch.no_grad():
        g = model.generate(x, attention_mask=torch.ones_like(x), num_beams=k, num_return_sequences=k,
                           max_new_tokens=BEAM_LENGTH, min_new_tokens=BEAM_LENGTH if case.fixed else 0,
                           do_sample=False, length_penalty=case.length_penalty, early_stopping=case.early_stopping,
                           eos_token_id=eos, pad_token_id=eos[0], return_dict_in_generate=True, output_scores=True)
    out = []
    for row, score in zip(g.sequences, g.sequences_scores, strict=True):
        toks = row[len(ids):].tolist()
        while toks and toks[-1] == eos[0] and len(toks) > 1 and toks[-2] == eos[0]:
            toks.pop()  # padding after an early EOS
        out.append((toks, float(score)))
    return out


def generate_reference(model, prompts: dict[str, list[int]], eos: list[int]) -> dict:
    """Everything the file holds, from transformers."""
    greedy = {n: {"prompt_digest": digest(ids), "tokens": hf_greedy_tokens(model, ids, eos)}
              for n, ids in prompts.items()}
    beams = {c.key: {"prompt_digest": digest(prompts[c.prompt]),
                     "beams": [[t, s] for t, s in hf_beams(model, prompts[c.prompt], c, eos)]} for c in BEAM_CASES}
    return {"greedy": greedy, "beams": beams}


@cache
def _stored() -> dict:
    return json.loads(STORED.read_text())


def checked_entry(entry: dict, ids: list[int], what: str, source: Path = STORED,
                  rewrite: str = "python -m tests.helpers.reference") -> dict:
    """A stored entry, refused unless it was generated from these prompt tokens."""
    assert entry["prompt_digest"] == digest(ids), (
        f"{what}: the prompt is not the one {source.name} was generated from: run {rewrite}")
    return entry


def entry_lines(entries: dict) -> str:
    """A JSON object's members one per line, so that a regenerated file's diff shows which outputs moved."""
    return ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in entries.items())


def stored_greedy(prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    """The stored greedy continuations, each only for the prompt it was generated from."""
    return {n: checked_entry(_stored()["greedy"][n], ids, n)["tokens"] for n, ids in prompts.items()}


def stored_beams(case: BeamCase, ids: list[int]) -> list[tuple[list[int], float]]:
    """The stored beams of one case (tokens, transformers' sequence score), best first."""
    entry = checked_entry(_stored()["beams"][case.key], ids, case.key)
    return [(list(t), float(s)) for t, s in entry["beams"]]


def write_reference(ref: dict, version: str) -> None:
    by = json.dumps(f"transformers {version}, float32; greedy: {MAX_NEW} tokens, stops at EOS; beams: "
                    f"{BEAM_LENGTH} tokens")
    STORED.parent.mkdir(exist_ok=True)
    STORED.write_text(f'{{"generated_by": {by},\n "greedy": {{\n{entry_lines(ref["greedy"])}}},\n'
                      f' "beams": {{\n{entry_lines(ref["beams"])}}}}}\n')
    _stored.cache_clear()


def main() -> None:
    import transformers

    from kvpage.model.loader import load_model

    lm = load_model("SmolLM2-135M-Instruct", dtype="float32")
    prompts = encode_prompts(lm.tokenizer)
    write_reference(generate_reference(load_hf_gguf(lm.path), prompts, list(lm.tokenizer.eos_token_ids)),
                    transformers.__version__)
    print(f"wrote {STORED}")


if __name__ == "__main__":
    main()
