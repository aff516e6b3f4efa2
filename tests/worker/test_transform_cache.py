"""Calibrated KV transforms kept on disk (worker/transform_cache.py): a later start reads them back, bit for bit;
anything the key holds that differs, or a damaged file, means calibrating again."""

from __future__ import annotations

import pytest
import torch

from kvpage.model.loader import load_model
from kvpage.worker import kv_calibration, transform_cache
from kvpage.worker.kv_calibration import calibrate_kv_transforms
from kvpage.worker.transform_cache import default_dir
from tests.helpers.tiny_models import make_hf_model


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    make_hf_model(path, "llama", head_dim=64, heads=2, kv_heads=1)
    return path


def transforms(lm):
    return [layer.self_attn.attend.transforms[torch.int8] for layer in lm.model.layers]


def forget(lm):
    """A start afresh: the loaded model is shared, so its calibration is dropped instead."""
    for layer in lm.model.layers:
        layer.self_attn.attend.transforms.pop(torch.int8, None)
    return lm


def same(a, b) -> bool:
    if a is None or b is None:
        return a is b
    if (a.feedback is None) != (b.feedback is None) or (a.feedback is not None and not torch.equal(a.feedback,
                                                                                                  b.feedback)):
        return False
    return all((x is None and y is None) or (x is not None and y is not None and all(
        torch.equal(getattr(x, f), getattr(y, f)) for f in x.__dataclass_fields__))
               for x, y in ((a.keys, b.keys), (a.values, b.values)))


def test_a_later_start_reads_what_calibration_kept(tiny_path, tmp_path, monkeypatch):
    lm = forget(load_model(str(tiny_path), torch.float32))
    digest = calibrate_kv_transforms(lm, torch.int8, cache_dir=tmp_path, identity={"kernels": "a"})
    assert digest is not None  # the tiny model keeps a transform: there are tensors to keep
    kept = list((tmp_path / "kv-transforms").glob("*.pt"))
    assert len(kept) == 1
    first = transforms(lm)

    def no_passes(*args, **kwargs):
        raise AssertionError("calibrated again")

    again = forget(load_model(str(tiny_path), torch.float32))
    with monkeypatch.context() as m:
        m.setattr(kv_calibration, "chunked_hidden", no_passes)
        assert calibrate_kv_transforms(again, torch.int8, cache_dir=tmp_path, identity={"kernels": "a"}) == digest
        assert all(same(a, b) for a, b in zip(first, transforms(again), strict=True))
        with pytest.raises(AssertionError, match="calibrated again"):  # other kernels: another entry
            calibrate_kv_transforms(forget(again), torch.int8, cache_dir=tmp_path, identity={"kernels": "b"})
    kept[0].write_bytes(b"not a torch file")  # damaged: ignored, calibrated again and rewritten
    third = forget(load_model(str(tiny_path), torch.float32))
    assert calibrate_kv_transforms(third, torch.int8, cache_dir=tmp_path, identity={"kernels": "a"}) == digest
    assert all(same(a, b) for a, b in zip(first, transforms(third), strict=True))
    assert kept[0].read_bytes()[:4] != b"not "
    transform_cache.save(tmp_path, kept[0].stem, first, "another digest")  # loads, but is not what was kept
    fourth = forget(third)
    assert calibrate_kv_transforms(fourth, torch.int8, cache_dir=tmp_path, identity={"kernels": "a"}) == digest
    assert transform_cache.load(tmp_path, kept[0].stem, len(first))[1] == digest  # rewritten


def test_the_directory_setting(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_dir("") == tmp_path / "kvpage"
    assert default_dir("off") is None
    assert default_dir(str(tmp_path / "x")) == tmp_path / "x"


def test_a_directory_that_cannot_be_written_costs_nothing_but_the_entry(tmp_path, caplog):
    (tmp_path / "kv-transforms").write_text("a file where the entries' directory should be")
    transform_cache.save(tmp_path, "k", [None], None)
    assert "could not keep" in caplog.text
    assert transform_cache.load(tmp_path, "k", 1) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kv-transforms"]


def test_the_keys_rounding_feedback_is_kept_and_can_be_turned_off(tiny_path, tmp_path):
    """A transform of the feedback alone goes to disk and back bit for bit; KVPAGE_KEY_FEEDBACK=0 (feedback=False)
    calibrates without it, even on a model calibrated with it before."""
    from kvpage.attention.kv_quant import keys_feedback
    from kvpage.attention.kv_transform import KVTransform

    fb = keys_feedback(torch.randn(50, 2, 64) * torch.linspace(2, 0.1, 64), 1)
    layers = [KVTransform(None, None, fb), None]
    transform_cache.save(tmp_path, "entry", layers, "d")
    back, digest = transform_cache.load(tmp_path, "entry", 2)
    assert digest == "d" and back[1] is None and same(back[0], layers[0])
    assert not same(back[0], KVTransform(None, None, fb * 2))
    lm = forget(load_model(str(tiny_path), torch.float32))
    calibrate_kv_transforms(lm, torch.int8)
    with_it = transforms(lm)
    calibrate_kv_transforms(lm, torch.int8, feedback=False)
    assert all(t is None or t.feedback is None for t in transforms(lm))
    if any(t is not None and t.feedback is not None for t in with_it):  # it was kept: the second call redid it
        assert [t and t.fingerprint() for t in transforms(lm)] != [t and t.fingerprint() for t in with_it]
