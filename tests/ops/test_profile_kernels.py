"""benchmarks/profile_step.py --ops times each compiled kernel call by the wall clock: every call is counted under
its kernel's name (paged attention under its cache's dtype and size), results are unchanged, and the class is
restored afterwards (even when a call raises), so nothing else in the process sees the timers."""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from kvpage.ops import Kernels, kernels
from tests.helpers.kernels import have_cxx

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def profile_step():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import profile_step

        yield profile_step
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


@pytest.mark.skipif(not have_cxx(), reason="no C++ compiler: kernels cannot be built")
def test_timed_kernels_count_calls_and_restore_the_class(profile_step):
    ops = kernels()
    before = dict(vars(Kernels))
    x = torch.randn(5, 2, 16)
    mul = torch.full((2, 16), 2.0)
    acc: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    with profile_step.timed_kernels(acc):
        assert vars(Kernels)["kv_affine_rows"] is not before["kv_affine_rows"]
        for _ in range(3):
            y = ops.kv_affine_rows(x, None, mul, False, None)
        with pytest.raises(RuntimeError, match="contiguous float32"):
            ops.kv_affine_rows(x, None, mul[:1], False, None)
    assert torch.equal(y, x * 2)
    assert acc["kv_affine_rows"][0] == 4 and acc["kv_affine_rows"][1] > 0
    assert set(acc) == {"kv_affine_rows"}
    assert dict(vars(Kernels)) == before


def test_paged_attention_calls_are_keyed_by_cache_dtype_and_size(profile_step):
    q_small, q_large = torch.empty(8, 4, 16), torch.empty(profile_step.DECODE_ROWS + 1, 4, 16)
    cache = torch.empty(2, 4, 16, 1, 16, dtype=torch.int8)
    key = profile_step._key
    assert key("paged_attention", (None, q_small, cache)) == "paged_attention [int8 cache, decode-sized]"
    assert key("paged_attention", (None, q_large, cache.bfloat16())) == "paged_attention [bfloat16 cache, larger]"
    assert key("reshape_and_cache", (None, q_small)) == "reshape_and_cache"
