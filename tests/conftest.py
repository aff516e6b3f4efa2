"""Shared fixtures: the embedded SmolLM2 model (ours, fp32 and bf16) and the transformers reference."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the reference must never reach for the network
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

from tests.helpers.prompts import encode_prompts


@pytest.fixture(scope="module", autouse=True)
def _hand_back_memory():
    """After each test module: engines that only a reference cycle still holds are collected, and the heaps' free
    pages go back to the OS. Why: a module's engines and KV caches otherwise stay with the test process until the
    collector happens to run (4.2 GB resident after tests/engine, 1.5 GB with this), and on these VMs a large
    resident test process slows every process a later test starts (a server's start took ~13 s instead of ~5 s,
    a bare `import torch` 4.0 s instead of 2.4 s, while the parent held 6 GB; Zen 3, 2026-12-07)."""
    yield
    import gc

    from kvpage.worker.heap import trim_heap

    gc.collect()
    trim_heap()


@pytest.fixture(scope="session")
def smol_fp32():
    from kvpage.model.loader import load_model

    return load_model("SmolLM2-135M-Instruct", dtype="float32")


@pytest.fixture(scope="session")
def smol_bf16():
    from kvpage.model.loader import load_model

    return load_model("SmolLM2-135M-Instruct", dtype="bfloat16")


@pytest.fixture(scope="session")
def prompts(smol_fp32) -> dict[str, list[int]]:
    return encode_prompts(smol_fp32.tokenizer)


@pytest.fixture(scope="session")
def hf_smol(smol_fp32):
    """transformers' own GGUF loader and Llama implementation (float32): the independent reference, for the slow
    tests that run it; the default run compares against its stored outputs (tests/helpers/reference.py)."""
    from tests.helpers.reference import load_hf_gguf

    return load_hf_gguf(smol_fp32.path)


@pytest.fixture(scope="session")
def hf_greedy(prompts) -> dict[str, list[int]]:
    """transformers' greedy continuation of every prompt (stopping at EOS like kvpage), as stored."""
    from tests.helpers.reference import stored_greedy

    return stored_greedy(prompts)
