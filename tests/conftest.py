"""Shared fixtures: the embedded SmolLM2 model (ours, fp32 and bf16) and the transformers reference."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the reference must never reach for the network
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

from tests.helpers.prompts import CHATS, MAX_NEW, PROMPT_TEXTS


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
    tk = smol_fp32.tokenizer
    out = {name: tk.encode(text) for name, text in PROMPT_TEXTS.items()}
    for name, messages in CHATS.items():
        out[name] = tk.encode(tk.apply_chat_template(messages))
    return out


@pytest.fixture(scope="session")
def hf_smol(smol_fp32):
    """transformers' own GGUF loader and Llama implementation: the independent reference."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    path = smol_fp32.path
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    model.eval()
    return model


@pytest.fixture(scope="session")
def hf_greedy(hf_smol, prompts, smol_fp32) -> dict[str, list[int]]:
    """transformers generate(): greedy continuation of every prompt, stopping at EOS like ours."""
    import torch

    eos = list(smol_fp32.tokenizer.eos_token_ids)
    out = {}
    for name, ids in prompts.items():
        x = torch.tensor([ids])
        with torch.no_grad():
            g = hf_smol.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_NEW, do_sample=False,
                                 eos_token_id=eos, pad_token_id=eos[0])
        out[name] = g[0, len(ids):].tolist()
    return out
