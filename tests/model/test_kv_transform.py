"""The quantized cache's key/value transforms (attention/kv_transform.py): exact in float arithmetic, smaller
int8 error where keys carry a constant part and wide channels, deterministic calibration that the engine and
its disk tier use, and float caches left untouched."""

from __future__ import annotations

import random
import re

import pytest
import torch

from kvpage.attention.backends.reference import ReferenceAttention
from kvpage.attention.kv_quant import keys_feedback, quantize_rows, write_rows
from kvpage.attention.kv_transform import KVTransform, LayerAttend
from kvpage.engine.llm import LLM
from kvpage.model.loader import load_model
from kvpage.sampling_params import SamplingParams
from kvpage.worker.kv_cache import kv_bytes_per_block
from kvpage.worker.kv_calibration import calibrate_kv_transforms
from tests.helpers.kernels import scatter_tables, step_metadata

HEADS, KV_HEADS, DIM, BS = 6, 2, 64, 16


def keys_with_offset(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries, keys and values shaped like a real layer's: keys with a large constant part and a few wide
    channels where the queries are small."""
    offset = 6 * torch.randn(1, KV_HEADS, DIM, generator=torch.Generator().manual_seed(0))  # the layer's own
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, HEADS, DIM, generator=g)
    k = torch.randn(n, KV_HEADS, DIM, generator=g) + offset
    k[..., 5] *= 12
    k[..., 5 + DIM // 2] *= 12
    q[..., 5] *= 0.05
    q[..., 5 + DIM // 2] *= 0.05
    v = torch.randn(n, KV_HEADS, DIM, generator=g) + 3
    return q, k, v


def one_step(ctx: int, seed: int):
    rng = random.Random(seed)
    tables = scatter_tables(rng, [-(-ctx // BS)], list(range(1, 40)))
    return step_metadata(tables, [ctx], [ctx], BS)


def test_the_transform_changes_nothing_in_float_arithmetic():
    q, k, v = keys_with_offset(100, 1)
    attend = LayerAttend(ReferenceAttention().forward)
    t = KVTransform.from_samples(*keys_with_offset(300, 2))
    assert t.keys is not None and t.values is not None
    attend.transforms[torch.int8] = t
    meta = one_step(100, 3)
    cache = torch.zeros(2, 40, BS, KV_HEADS, DIM)
    plain = attend.forward(q, k, v, cache.clone(), meta, DIM**-0.5)
    assert torch.equal(attend(q, k, v, cache.clone(), meta, DIM**-0.5), plain)  # other caches bypass it
    moved = attend.transformed(t, q, k, v, cache.clone(), meta, DIM**-0.5)
    torch.testing.assert_close(moved, plain, rtol=1e-4, atol=1e-4)
    assert attend.active(torch.int8) is t and attend.active(torch.float32) is None
    attend.transforms[torch.int8] = t.parts(False, False)  # calibrated to keep nothing: the plain call
    assert attend.active(torch.int8) is None


def test_constants_are_powers_of_two_shared_by_rope_pairs():
    q, k, v = keys_with_offset(300, 4)
    keys = KVTransform.from_samples(q, k, v).keys
    s = 1 / keys.inv_scale
    assert torch.equal(torch.exp2(torch.log2(s).round()), s)
    assert torch.equal(s[:, : DIM // 2], s[:, DIM // 2 :])
    assert torch.equal(keys.query_scale, s.repeat_interleave(HEADS // KV_HEADS, 0))
    assert s[:, 5].min() > 4  # the wide, query-quiet channel is scaled down in the keys
    torch.testing.assert_close(keys.center, k.mean(0))
    assert keys.query_scale.dtype == torch.float32 and len(KVTransform.from_samples(q, k, v).fingerprint()) == 16


def test_the_transform_cuts_the_int8_error():
    q, k, v = keys_with_offset(200, 5)
    meta = one_step(200, 6)
    exact = ReferenceAttention().forward(q, k, v, torch.zeros(2, 40, BS, KV_HEADS, DIM), meta, DIM**-0.5)
    attend = LayerAttend(ReferenceAttention().forward)
    int8 = quantize_rows(torch.zeros(2, 40, BS, KV_HEADS, DIM), torch.int8)
    plain = attend(q, k, v, int8.clone(), meta, DIM**-0.5)
    attend.transforms[torch.int8] = KVTransform.from_samples(*keys_with_offset(400, 7))
    moved = attend(q, k, v, int8.clone(), meta, DIM**-0.5)
    err_plain, err_moved = (float((x - exact).norm() / exact.norm()) for x in (plain, moved))
    assert err_moved < 0.5 * err_plain, (err_moved, err_plain)


def test_the_keys_rounding_feedback_reaches_the_write_and_the_digest():
    """A transform's feedback (attention/kv_quant.py keys_feedback) goes to the backend's write with the rows as
    the key part maps them; it is part of the digest (blocks written under it are read under it only), and a
    transform of the feedback alone is still a transform."""
    q, k, v = keys_with_offset(100, 8)
    full = KVTransform.from_samples(*keys_with_offset(300, 9))
    fb = keys_feedback(keys_with_offset(300, 9)[0] * full.keys.query_scale, KV_HEADS)
    meta = one_step(100, 10)
    seen = []

    def forward(*args, key_feedback=None):
        seen.append(key_feedback)
        return ReferenceAttention().forward(*args, key_feedback=key_feedback)

    attend = LayerAttend(forward)
    int8 = quantize_rows(torch.zeros(2, 40, BS, KV_HEADS, DIM), torch.int8)
    for t in (full.parts(True, False, fb), full.parts(False, False, fb), full.parts(True, True)):
        attend.transforms[torch.int8] = t
        attend(q, k, v, int8.clone(), meta, DIM**-0.5)
        assert seen[-1] is t.feedback
    assert full.parts(False, False, fb) is not None and full.parts(False, False) is None
    prints = {full.parts(True, False).fingerprint(), full.parts(True, False, fb).fingerprint(),
              full.parts(False, False, fb).fingerprint(), full.parts(True, False, fb * 2).fingerprint()}
    assert len(prints) == 4
    # the stored keys: the key part's rows, rounded with the feedback (the oracle's bytes)
    cache = int8.clone()
    attend.transforms[torch.int8] = full.parts(True, False, fb)
    attend(q, k, v, cache, meta, DIM**-0.5)
    mapped = (k.float() - full.keys.center) * full.keys.inv_scale
    oracle = int8.clone()
    write_rows(mapped, v, oracle, meta.slot_mapping, fb)
    assert torch.equal(cache, oracle)


@pytest.mark.slow
def test_calibration_keeps_the_parts_that_lower_the_error_and_is_deterministic(caplog):
    lm = load_model(dtype="float32")
    attends = [layer.self_attn.attend for layer in lm.model.layers]
    for dtype in (torch.int8, torch.float8_e4m3fn):
        for a in attends:
            a.transforms.pop(dtype, None)
        with caplog.at_level("INFO", logger="kvpage.worker.kv_calibration"):
            first = calibrate_kv_transforms(lm, dtype)
        # the log lists each choice's hidden-state error; the kept parts are the smallest one
        line = next(r.getMessage() for r in caplog.records if str(dtype) in r.getMessage())
        errors = {k: float(e) for k, e in re.findall(r"(\(\w+, \w+, \w+\)): ([0-9.e+-]+)", line)}
        assert len(errors) == 5 and "(False, False, False)" in errors  # no transform; feedback with each part
        assert all(k.endswith("True)") for k in errors if k != "(False, False, False)")
        none = KVTransform(None, None)  # what a model that keeps no part holds (None) stands for
        t = attends[0].transforms[dtype] or none
        kept = f"({t.keys is not None}, {t.values is not None}, {t.feedback is not None})"
        assert errors[kept] == min(errors.values()), (kept, errors)
        assert all(((a.transforms[dtype] or none).keys is None) == (t.keys is None) for a in attends)
        saved = [a.transforms.pop(dtype) or none for a in attends]
        assert calibrate_kv_transforms(lm, dtype) == first
        assert [(a.transforms[dtype] or none).fingerprint() for a in attends] == [s.fingerprint() for s in saved]
    assert torch.float32 not in attends[0].transforms


def test_the_engine_calibrates_its_quantized_pages(tmp_path):
    lm = load_model()
    block = kv_bytes_per_block(lm.config, 16, torch.int8)
    llm = LLM(kv_cache_dtype="int8", kv_cache_memory=64 * block, max_model_len=256,
              kv_offload_dir=str(tmp_path), kv_offload_disk="4MiB")
    worker = llm.engine.worker
    assert all(torch.int8 in layer.self_attn.attend.transforms for layer in worker.lm.model.layers)
    out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8
    assert worker.runner.persist.__self__.identity["kv_transform"] == worker.kv_transform
