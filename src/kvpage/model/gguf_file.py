"""A small GGUF reader: metadata as Python values, tensors as read-only numpy views of a memory map.

gguf-py's ``GGUFReader`` builds a numpy view for every part of every field; for a 49k-entry vocabulary and
its merges that is ~250k views and ~2.4 s of every start on this machine. This reader walks the header with
``struct`` and decodes the big string arrays in one loop (~0.1 s). Tensor views keep gguf-py's layout
(dims fastest-first in ``shape``; block formats as uint8 ``[..., bytes per row]``) so the decoders in
``dequant`` and ``quant`` take them unchanged. No torch here: the planner reads configs with it.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

_MAGIC = b"GGUF"
# GGUF value types -> (struct code, size) for the fixed-size ones; 8 = string, 9 = array.
_SCALARS = {0: ("B", 1), 1: ("b", 1), 2: ("H", 2), 3: ("h", 2), 4: ("I", 4), 5: ("i", 4), 6: ("f", 4),
            7: ("?", 1), 10: ("Q", 8), 11: ("q", 8), 12: ("d", 8)}
_STRING, _ARRAY = 8, 9
# Element types whose tensor view keeps its numpy dtype (everything else is viewed as bytes, like gguf-py).
_PLAIN = {GGMLQuantizationType.F32: "f4", GGMLQuantizationType.F16: "f2", GGMLQuantizationType.F64: "f8",
          GGMLQuantizationType.I8: "i1", GGMLQuantizationType.I16: "i2", GGMLQuantizationType.I32: "i4",
          GGMLQuantizationType.I64: "i8"}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order: fastest-varying dimension first
    data: np.ndarray  # read-only view of the file
    data_offset: int  # absolute byte offset in the file
    n_bytes: int


class GGUFFile:
    """``fields``: key -> value (ints, floats, bools, strings, lists); ``tensors`` in file order."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        with open(self.path, "rb") as f:
            try:
                self._buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError as e:  # an empty file cannot be mapped
                raise ValueError(f"{self.path}: not a GGUF file (empty)") from e
        if self._buf[:4] != _MAGIC:
            raise ValueError(f"{self.path}: not a GGUF file (magic {bytes(self._buf[:4])!r})")
        self._end = "<"
        version = self._unpack("I", 4)
        if version & 0xFFFF == 0:  # written on a big-endian machine
            self._end = ">"
            version = self._unpack("I", 4)
        if version not in (2, 3):
            raise ValueError(f"{self.path}: GGUF version {version} is not supported (2 and 3 are)")
        n_tensors, n_kv = self._unpack("Q", 8), self._unpack("Q", 16)
        self._pos = 24
        self.fields: dict[str, Any] = {"GGUF.version": version, "GGUF.tensor_count": n_tensors,
                                       "GGUF.kv_count": n_kv}
        try:
            for _ in range(n_kv):
                key = self._string()
                self.fields[key] = self._value(self._take("I", 4))
            infos = [self._tensor_info() for _ in range(n_tensors)]
        except (struct.error, IndexError) as e:
            raise ValueError(f"{self.path}: truncated GGUF header ({e})") from None
        align = int(self.fields.get("general.alignment", 32))
        if align <= 0 or align & (align - 1):
            raise ValueError(f"{self.path}: general.alignment {align} is not a power of two")
        self.alignment = align
        self.data_offset = -(-self._pos // align) * align
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        self.tensors = [self._tensor(*info) for info in infos]

    # ------------------------------------------------------------------ header walking
    def _unpack(self, code: str, at: int) -> Any:
        return struct.unpack_from(self._end + code, self._buf, at)[0]

    def _take(self, code: str, size: int) -> Any:
        value = struct.unpack_from(self._end + code, self._buf, self._pos)[0]
        self._pos += size
        return value

    def _string(self) -> str:
        n = self._take("Q", 8)
        raw = self._buf[self._pos:self._pos + n]
        if len(raw) != n:
            raise IndexError("string runs past the end of the file")
        self._pos += n
        return raw.decode("utf-8", errors="replace")

    def _value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self._take(*_SCALARS[vtype])
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            item, count = self._take("I", 4), self._take("Q", 8)
            if item in _SCALARS:
                code, size = _SCALARS[item]
                dtype = np.dtype(self._end + {"?": "u1"}.get(code, code))
                end = self._pos + count * size
                if end > len(self._buf):
                    raise IndexError("array runs past the end of the file")
                values = np.frombuffer(self._buf, dtype=dtype, count=count, offset=self._pos)
                self._pos = end
                return values.astype(bool).tolist() if code == "?" else values.tolist()
            if item == _STRING:
                return self._strings(count)
            return [self._value(item) for _ in range(count)]
        raise ValueError(f"{self.path}: unknown GGUF value type {vtype} at byte {self._pos}")

    def _strings(self, count: int) -> list[str]:
        """The vocabulary-sized arrays: one tight loop, no per-item struct calls."""
        buf, pos, out = self._buf, self._pos, []
        order = "little" if self._end == "<" else "big"
        from_bytes = int.from_bytes
        for _ in range(count):
            n = from_bytes(buf[pos:pos + 8], order)
            pos += 8
            out.append(buf[pos:pos + n].decode("utf-8", errors="replace"))
            pos += n
        if pos > len(buf):
            raise IndexError("string array runs past the end of the file")
        self._pos = pos
        return out

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string()
        dims = tuple(self._take("Q", 8) for _ in range(self._take("I", 4)))
        return name, dims, self._take("I", 4), self._take("Q", 8)

    def _tensor(self, name: str, dims: tuple[int, ...], type_id: int, offset: int) -> GGUFTensor:
        try:
            qtype = GGMLQuantizationType(type_id)
            block, type_size = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise ValueError(f"{self.path}: tensor {name} has unknown GGML type {type_id}") from None
        np_dims = tuple(reversed(dims)) or (1,)
        n_elems = int(np.prod(dims, dtype=np.int64)) if dims else 1
        if np_dims[-1] % block:
            raise ValueError(f"{self.path}: tensor {name}: row of {np_dims[-1]} is not whole {qtype.name} blocks")
        n_bytes = n_elems // block * type_size
        start = self.data_offset + offset
        if start + n_bytes > len(self._map):
            raise ValueError(f"{self.path}: tensor {name} runs past the end of the file (truncated download?)")
        raw = self._map[start:start + n_bytes]
        if qtype in _PLAIN:
            data = raw.view(np.dtype(self._end + _PLAIN[qtype])).reshape(np_dims)
        else:
            data = raw.reshape(*np_dims[:-1], np_dims[-1] // block * type_size)
        return GGUFTensor(name, qtype, dims, data, start, n_bytes)
