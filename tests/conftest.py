"""Shared fixtures: the embedded SmolLM2 model (ours, fp32 and bf16) and the transformers reference."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the reference must never reach for the network
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

MAX_NEW = 24

_LONG = (
    "Serving a language model to many users at once is mostly a memory problem. Every request keeps the keys "
    "and values of all its previous tokens so that the next token can attend to them, and this cache grows "
    "by a fixed number of bytes per token, per layer and per key-value head. A contiguous reservation sized "
    "for the longest possible conversation wastes most of that memory, because most conversations are short "
    "and nobody knows in advance how long an answer will be. Paging fixes this the way operating systems did "
    "decades ago: memory is cut into small fixed blocks, each sequence keeps a table mapping its logical "
    "blocks to physical ones, and blocks are handed out only when a sequence actually grows into them. "
    "Because every block has the same size, any free block fits any request, so external fragmentation "
    "disappears and the only waste is the unused tail of each sequence's last block. Blocks can also be "
    "shared: two requests that start with the same system prompt can point at the same physical blocks, and "
    "parallel samples of one prompt share everything until they diverge, at which point the shared block is "
    "copied before the first write. The scheduler then decides, step by step, which requests run, which wait "
    "and which must give their memory back when the pool runs dry, either by recomputing later or by moving "
    "its blocks to host memory for a while. In short, the"
)

PROMPT_TEXTS = {
    "short": "Hi",
    "fact": "The capital of France is",
    "story": "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "long": _LONG,
    "non_ascii": "東京は日本の首都です。Café, naïve, façade — and a robot 🤖 says:",
    "code": "def fibonacci(n):\n    ",
    "count": "Count from 1 to 10: 1, 2, 3,",
}
CHATS = {
    "chat": [{"role": "user", "content": "Write a haiku about memory."}],
    "chat_multi": [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "What is a KV cache?"},
        {"role": "assistant", "content": "Stored keys and values of past tokens."},
        {"role": "user", "content": "Why page it?"},
    ],
}


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


def have_cxx() -> bool:
    """A C++ compiler is present, so the kernels must build: a build error fails the kernel tests, never skips."""
    import shutil

    return any(shutil.which(c) for c in ("c++", "g++", "clang++"))


def amx_ops(available: str):
    """The compiled kernels when `ops.<available>()` says its AMX kernel can run here; the test is skipped
    otherwise (no compiler, or a CPU/OS without AMX tiles)."""
    if not have_cxx():
        pytest.skip("no C++ compiler: kernels cannot be built")
    from kvpage.ops import load_kernels

    ops = load_kernels()
    if ops is None or not getattr(ops, available)():
        pytest.skip("AMX tile products unavailable on this CPU/OS")
    return ops
