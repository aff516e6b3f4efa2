"""Huge-page placement of the packed weights: same values, same results, and a clean no-op when switched off."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from kvpage import hugepages
from kvpage.engine.arg_utils import EngineArgs


def thp_allowed() -> bool:
    """Anonymous huge pages on request ("always" or "madvise" mode)."""
    try:
        mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False
    return "[never]" not in mode


def anon_huge_kib() -> int:
    text = Path("/proc/self/smaps_rollup").read_text()
    return int(re.search(r"AnonHugePages:\s+(\d+)", text).group(1))


def test_copies_keep_values_dtypes_and_alignment():
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(300, 70, generator=gen).bfloat16(), torch.randint(0, 255, (513,), dtype=torch.uint8),
               torch.randn(3, 5, generator=gen).half(), torch.empty(0, 4), torch.randn(1 << 20, generator=gen)]
    copies = hugepages.huge_page_copies(tensors)
    if copies is None:
        pytest.skip("this kernel refuses MADV_HUGEPAGE")
    for t, c in zip(tensors, copies, strict=True):
        assert c.dtype == t.dtype and c.shape == t.shape and c.is_contiguous()
        assert torch.equal(c, t)
        if t.numel():
            assert c.data_ptr() != t.data_ptr() and c.data_ptr() % 64 == 0
    assert copies[0].data_ptr() % hugepages.HUGE_PAGE == 0  # the arena starts on a huge page


@pytest.mark.skipif(not thp_allowed(), reason="transparent huge pages are off on this machine")
def test_arena_is_backed_by_huge_pages():
    before = anon_huge_kib()
    (big,) = hugepages.huge_page_copies([torch.ones(16 << 20, dtype=torch.uint8)])
    assert anon_huge_kib() - before >= 8 * 1024  # most of the 16 MiB arrived in 2 MiB pages
    assert int(big.sum()) == 16 << 20


def test_switched_off_by_environment(monkeypatch):
    monkeypatch.setenv("KVPAGE_HUGE_PAGES", "0")
    assert hugepages.huge_page_copies([torch.ones(4)]) is None


def test_weights_on_huge_pages_give_the_same_tokens(prompts):
    """A private copy of the bf16 model (the loader shares its cached one between engines): its packed weights
    move, keep their values, and greedy decoding gives the same tokens on the AMX and quantized paths."""
    from kvpage.model.llama import PackedLinear
    from kvpage.model.loader import _load, resolve_model_path
    from tests.paged_driver import PagedGreedy

    lm = _load("SmolLM2-135M-Instruct", resolve_model_path("SmolLM2-135M-Instruct"), torch.bfloat16, "auto")
    model = lm.model
    if model.fast_ops is None:
        pytest.skip("no compiled fast path here")
    batch = [prompts[name] for name in sorted(prompts)][:6]  # six rows: the AMX path; one row: quantized blocks

    def greedy() -> list[list[int]]:
        out = []
        for group in (batch, batch[:1]):  # six rows (AMX tiles), then one row (quantized blocks)
            g = PagedGreedy(lm, num_blocks=256)
            ids = [g.add(p, 8) for p in group]
            g.run()
            out += [g.outputs[i] for i in ids]
        return out

    linear = next(m for m in model.modules() if isinstance(m, PackedLinear) and m.amx is not None)
    before_amx = linear.amx.clone()
    before = greedy()
    placed = model.weights_to_huge_pages()
    if not placed:
        pytest.skip("huge pages refused here")
    assert model.weights_to_huge_pages() is True  # once per model
    assert torch.equal(linear.amx, before_amx) and linear.amx.data_ptr() != before_amx.data_ptr()
    assert greedy() == before


def test_cli_defaults():
    import argparse

    for default in (True, False):
        p = argparse.ArgumentParser()
        EngineArgs.add_cli_args(p, huge_pages=default)
        assert EngineArgs.from_cli_args(p.parse_args([])).huge_pages is default
        assert EngineArgs.from_cli_args(p.parse_args(["--no-huge-pages"])).huge_pages is False
        assert EngineArgs.from_cli_args(p.parse_args(["--huge-pages"])).huge_pages is True
