"""Shared fixtures: the embedded SmolLM2 model (ours, fp32 and bf16) and the transformers reference."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the reference must never reach for the network
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

from tests.helpers.prompts import encode_prompts


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
