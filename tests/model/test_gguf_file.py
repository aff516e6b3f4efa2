"""kvpage's GGUF reader against gguf-py's GGUFReader (the independent reference) and on broken files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFWriter, quants

from kvpage.model.config import open_gguf
from kvpage.model.gguf_file import GGUFFile
from kvpage.model.registry import resolve_model_path


def _reference(path: Path) -> tuple[dict, list]:
    r = GGUFReader(str(path))
    return {k: f.contents() for k, f in r.fields.items()}, list(r.tensors)


def _same(path: Path) -> GGUFFile:
    g = GGUFFile(path)
    fields, tensors = _reference(path)
    assert g.fields == fields
    for key, value in fields.items():
        assert type(g.fields[key]) is type(value), key
    assert [t.name for t in g.tensors] == [t.name for t in tensors]
    for ours, ref in zip(g.tensors, tensors, strict=True):
        assert ours.tensor_type == ref.tensor_type and ours.shape == tuple(int(x) for x in ref.shape)
        assert ours.data.dtype == ref.data.dtype and ours.data.shape == ref.data.shape, ours.name
        assert ours.data_offset == ref.data_offset and ours.n_bytes == ref.n_bytes
        assert np.array_equal(ours.data, ref.data), ours.name
    return g


def test_default_model_reads_like_gguf_py():
    path = resolve_model_path("default")
    assert path is not None
    g = _same(path)
    assert len(g.fields["tokenizer.ggml.tokens"]) == 49152
    assert g.fields["llama.attention.head_count_kv"] == 3


def _write(path: Path, alignment: int | None = None) -> None:
    w = GGUFWriter(str(path), "llama")
    if alignment:
        w.add_custom_alignment(alignment)
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -5)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -300)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -7)
    w.add_float32("t.f32", 0.1)
    w.add_uint64("t.u64", 2**60)
    w.add_int64("t.i64", -(2**40))
    w.add_float64("t.f64", 1e-300)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ✓")
    w.add_array("t.ints", [1, 2, 3])
    w.add_array("t.floats", [0.5, -1.25])
    w.add_array("t.bools", [True, False, True])
    w.add_array("t.strs", ["a", "", "ü" * 3])
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((2, 4)).astype(np.float16))
    w.add_tensor("i32", np.arange(7, dtype=np.int32))
    for kind in (Q.Q4_1, Q.Q8_0, Q.BF16):
        a = rng.standard_normal((4, 64)).astype(np.float32)
        w.add_tensor(f"q.{kind.name}", quants.quantize(a, kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("alignment", [None, 64])
def test_every_value_type_and_tensor_format_reads_like_gguf_py(tmp_path: Path, alignment):
    path = tmp_path / "m.gguf"
    _write(path, alignment)
    g = _same(path)
    assert g.fields["t.str"] == "héllo ✓" and g.fields["t.strs"] == ["a", "", "üüü"]
    assert g.fields["t.bools"] == [True, False, True] and g.fields["t.u64"] == 2**60
    assert g.alignment == (alignment or 32) and g.data_offset % g.alignment == 0


def test_broken_files_get_clear_errors(tmp_path: Path):
    good = tmp_path / "m.gguf"
    _write(good)
    raw = good.read_bytes()
    cases = {
        "empty.gguf": (b"", "empty"),
        "magic.gguf": (b"GGML" + raw[4:], "magic"),
        "version.gguf": (raw[:4] + (1).to_bytes(4, "little") + raw[8:], "version 1"),
        "header.gguf": (raw[:200], "truncated GGUF header"),
        "data.gguf": (raw[: len(raw) - 16], "runs past the end of the file"),
    }
    for name, (content, message) in cases.items():
        path = tmp_path / name
        path.write_bytes(content)
        with pytest.raises(ValueError, match=message):
            GGUFFile(path)
        with pytest.raises(ValueError, match="not a readable GGUF file"):
            open_gguf(path)
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        open_gguf(tmp_path / "missing.gguf")
