"""Fixtures of the model tests: the model loaded on the fast path under a kernel configuration."""

from __future__ import annotations

import pytest

from kvpage.envs import KernelConfig


@pytest.fixture()
def load_fast():
    """Loads the model for one test under a kernel configuration: float32 on the fast path (what dtype auto runs
    on a CPU without AVX512_BF16) unless a dtype is given."""
    from kvpage.model import loader

    before = set(loader._LOADED)

    def load(config: KernelConfig | None = None, dtype: str = "float32"):
        lm = loader.load_model("SmolLM2-135M-Instruct", dtype=dtype, fast=True, kernel_config=config)
        if lm.model.fast_ops is None:
            pytest.skip("no compiled kernels or oneDNN packing here")
        return lm

    try:
        yield load
    finally:
        for key in set(loader._LOADED) - before:
            loader._LOADED.pop(key)


@pytest.fixture()
def smol_fp32_fast(load_fast):
    return load_fast()
