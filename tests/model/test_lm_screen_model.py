"""Greedy steps through the lm-head screen (model/lm_screen.py; float32 on AVX2 builds): on SmolLM2's hidden rows
of real prompts and their continuations, the screened argmax is the whole product's, and a greedy batch generates
the same tokens with the screen as without it. Gemma 3's head (262,144 tokens): tests/model/test_gemma3.py
(test_fast_path_greedy_through_the_lm_screen)."""

from __future__ import annotations

import pytest
import torch

from kvpage.envs import KernelConfig


def test_screened_argmax_is_the_whole_products(load_fast, prompts):
    from tests.helpers.paged_driver import generate

    lm = load_fast(KernelConfig())
    fast = lm.model.fast
    if fast.lm_screen is None:
        pytest.skip("the screen runs on AVX2 builds' float32 heads (where f32_linear runs)")
    seen: list[torch.Tensor] = []
    inner = fast.compute_logits_ex

    def capture(hidden, *args, **kw):
        seen.append(hidden.clone())
        return inner(hidden, *args, **kw)

    fast.compute_logits_ex = capture
    try:
        names = sorted(prompts)
        generate(lm, [prompts[n] for n in names], 12)
    finally:
        fast.compute_logits_ex = inner
    rows = torch.cat(seen)
    assert rows.shape[0] > 40
    before = list(fast.lm_screen.candidates)
    for start in range(0, rows.shape[0], 64):
        hidden = rows[start : start + 64]
        if hidden.shape[0] <= lm.model.ops.config.quant_max_tokens:
            continue
        got = fast.compute_logits_ex(hidden, argmax_only=True)
        whole = fast.compute_logits_ex(hidden, argmax_only=False)
        assert got.logits is None and torch.equal(got.argmax, whole.argmax)
    screened, exact = (a - b for a, b in zip(fast.lm_screen.candidates, before, strict=True))
    assert screened > 0
    # real rows: tens to hundreds of the 49,152 tokens multiplied in float32 per row (docs/model.md), not all
    assert exact / screened < 500


def test_greedy_tokens_with_and_without_the_screen(load_fast, prompts):
    from tests.helpers.paged_driver import PagedGreedy

    names = sorted(prompts)
    out = []
    for on in (True, False):
        lm = load_fast(KernelConfig(lm_screen=on))
        if on and lm.model.fast.lm_screen is None:
            pytest.skip("the screen runs on AVX2 builds' float32 heads (where f32_linear runs)")
        assert (lm.model.fast.lm_screen is not None) == on
        driver = PagedGreedy(lm, argmax_only=True)
        ids = [driver.add(prompts[n], 16) for n in names]
        got = driver.run()
        out.append([got[i] for i in ids])
    assert out[0] == out[1]
