"""Calibrated KV transforms kept on disk, so an engine with quantized pages calibrates once per model and machine.

Calibration (worker/kv_calibration.py) runs five passes of a 512-token text through the model: 1.3 s on a Zen 5
EPYC in bf16, 10.5 s of a 14.4 s start on the AVX2-only family-23 EPYC in float32. Its result is deterministic
for what the key holds: the model's files (path, sizes, modification times), the model's and the pages' dtypes, the
keys' layout, the kernels' build and configuration, the tensor-parallel shard, and the sources that define the
text and the arithmetic (a kvpage that changes them reads no older entry). A file holds each layer's chosen
parts and the digest they must give; one that does not load or gives another digest is ignored (and replaced).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch

from kvpage.attention.kv_transform import KeyTransform, KVTransform, ValueTransform

logger = logging.getLogger(__name__)

FORMAT = 2  # 2: the keys' rounding feedback
_SOURCES = ("attention/kv_transform.py", "attention/kv_quant.py", "worker/kv_calibration.py",
            "worker/transform_cache.py")


def default_dir(setting: str) -> Path | None:
    """The directory ``KVPAGE_CACHE_DIR``'s value names: '' for $XDG_CACHE_HOME/kvpage (~/.cache/kvpage), 'off'
    for none."""
    if setting == "off":
        return None
    if setting:
        return Path(setting).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvpage"


def cache_key(model_path: Path, model_dtype: torch.dtype, kv_dtype: torch.dtype, channel_keys: bool,
              identity: dict[str, Any]) -> str:
    """The entry's name: a digest of everything the transforms depend on."""
    path = Path(model_path).resolve()
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]  # a checkpoint's files
    stats = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    root = Path(__file__).resolve().parents[1]
    code = hashlib.sha256(b"".join((root / s).read_bytes() for s in _SOURCES)).hexdigest()
    key = {"format": FORMAT, "model": str(path), "files": stats, "model_dtype": str(model_dtype),
           "kv_dtype": str(kv_dtype), "channel_keys": channel_keys, "code": code, **identity}
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:32]


def _entry(directory: Path, key: str) -> Path:
    return directory / "kv-transforms" / f"{key}.pt"


def save(directory: Path, key: str, transforms: list[KVTransform | None], digest: str | None) -> None:
    """Write the layers' transforms (atomically: a reader sees the old file or the whole new one); a directory
    that cannot be written costs the next start its calibration, nothing else."""
    layers = []
    for t in transforms:
        entry: dict[str, torch.Tensor] = {}
        for name, part in (("keys", None if t is None else t.keys), ("values", None if t is None else t.values)):
            for f in () if part is None else fields(part):
                entry[f"{name}.{f.name}"] = getattr(part, f.name).contiguous().clone()
        if t is not None and t.feedback is not None:
            entry["feedback"] = t.feedback.contiguous().clone()
        layers.append(entry)
    path = _entry(directory, key)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"format": FORMAT, "digest": digest, "layers": layers}, tmp)
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:  # torch's writer reports some of its OS errors as RuntimeError
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        logger.warning("could not keep the calibrated KV transforms in %s: %s", path.parent, e)


def load(directory: Path, key: str, layers: int) -> tuple[list[KVTransform | None], str | None] | None:
    """The transforms kept under ``key`` and their recorded digest, or None (no entry, or one that does not load:
    the caller calibrates and checks the digest)."""
    path = _entry(directory, key)
    if not path.is_file():
        return None
    try:
        data = torch.load(path, weights_only=True)
        if data.get("format") != FORMAT or len(data["layers"]) != layers:
            raise ValueError("another format or layer count")
        out: list[KVTransform | None] = []
        for entry in data["layers"]:
            keys = {k.split(".", 1)[1]: v for k, v in entry.items() if k.startswith("keys.")}
            values = {k.split(".", 1)[1]: v for k, v in entry.items() if k.startswith("values.")}
            feedback = entry.get("feedback")
            out.append(KVTransform(KeyTransform(**keys) if keys else None,
                                   ValueTransform(**values) if values else None, feedback)
                       if keys or values or feedback is not None else None)
        return out, data["digest"]
    except Exception as e:
        logger.warning("ignoring %s: %s", path, e)
        return None
