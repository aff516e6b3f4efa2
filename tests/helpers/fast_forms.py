"""The float32 fast path's forms of few-token steps and a one-token-per-step teacher-forced decode: shared by the
model reference tests and the compiled layer stack's tests."""

from __future__ import annotations

import pytest
import torch

from kvpage.envs import KernelConfig
from kvpage.kv import KVSequence
from kvpage.worker.model_runner import ScheduledSeq
from tests.helpers.marks import slow
from tests.helpers.paged_driver import PagedGreedy


def teacher_forced_decode(lm, seq: list[int], start: int) -> torch.Tensor:
    """Logits for positions start-1 .. len(seq)-2 of seq: a prefill of seq[:start], then one token per step
    (so every step after the prompt is a decode step of one token)."""
    d = PagedGreedy(lm, block_size=16, num_blocks=64)
    d.m.allocate_slots(KVSequence("x", seq[:start]), start)
    rows = [d.runner.execute([ScheduledSeq("x", seq[:start], 0, d.m.block_table("x"))])["x"]]
    for i in range(start, len(seq) - 1):
        d.m.allocate_slots(KVSequence("x", seq[: i + 1]), 1)
        rows.append(d.runner.execute([ScheduledSeq("x", seq[i : i + 1], i, d.m.block_table("x"))])["x"])
    return torch.stack(rows)


# The forms of few-token steps on the float32 fast path: the blocks as panels with the panel GEMM's sums (the
# default where the build has that GEMM: AVX2), and rows of blocks (KVPAGE_QUANT_PANELS=0) with 16-bit activation
# codes for one token (where the build has them) or float32 (the exact-sum form, the only one on other builds).
# The default run keeps the default form; the others, and test_int16_decode_agrees_with_fp32, run under -m slow.
FORMS = {"default": KernelConfig(), "int16": KernelConfig(quant_panels=False),
         "float": KernelConfig(quant_panels=False, quant_int16=False)}
FORM_PARAMS = ["default", slow("int16"), slow("float")]


def check_form(lm, form: str) -> None:
    ops = lm.model.fast_ops
    if form == "int16" and not ops.quant_int16_available():
        pytest.skip("this build has no 16-bit activation codes")
    if form == "float" and not ops.f32_gemm_ok:
        pytest.skip("without the panel GEMM the default is this form")
