"""Memory pages under large tensors (kvpage/pages.py): one arena for the packed weights, on 2 MiB pages."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch

from kvpage.pages import HUGE_PAGE, gather_on_huge_pages, thp_mode
from tests.worker.test_worker import _thp_eligible


def _tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(300, 64, generator=g).bfloat16(), torch.randint(0, 255, (1001,), generator=g).to(torch.uint8),
            torch.randn(7, 33, generator=g).half(), torch.randn(3 * 2**20 // 4, generator=g),
            torch.randn(5, generator=g).double()]


def test_copies_are_equal_aligned_and_in_one_arena():
    src = _tensors()
    out, _ = gather_on_huge_pages(src)
    assert len(out) == len(src)
    for a, b in zip(src, out, strict=True):
        assert b.dtype == a.dtype and b.shape == a.shape and torch.equal(a, b)
        assert b.data_ptr() != a.data_ptr() and b.data_ptr() % 64 == 0  # a copy, on a cache line
    storage = {t.untyped_storage().data_ptr() for t in out}
    assert len(storage) == 1  # one arena, the copies in the order given, none overlapping
    assert out[0].data_ptr() % HUGE_PAGE == 0
    ends = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in out]
    assert all(e0 <= b1 for (_, e0), (b1, _) in pairwise(ends))
    before = src[1].clone()
    out[1].add_(1)  # the copies are writable and independent of their sources
    assert torch.equal(src[1], before) and not torch.equal(out[1], before)


def test_empty_and_non_contiguous():
    assert gather_on_huge_pages([]) == ([], 0)
    with pytest.raises(ValueError, match="contiguous"):
        gather_on_huge_pages([torch.ones(4, 4).t()])


@pytest.mark.skipif(thp_mode() not in ("madvise", "always"), reason="transparent huge pages are off here")
def test_arena_is_advised_onto_huge_pages():
    out, advised = gather_on_huge_pages(_tensors())
    size = out[-1].data_ptr() + out[-1].numel() * out[-1].element_size() - out[0].data_ptr()
    assert size <= advised < size + HUGE_PAGE  # every 2 MiB page the arena touches
    eligible = _thp_eligible(out[0].data_ptr())
    if eligible is None:
        pytest.skip("smaps has no THPeligible field")
    assert eligible
