"""Weights from a GGUF file or a Hugging Face directory, renamed to the model's parameter names."""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from kvpage.model.config import SUPPORTED_ARCHITECTURES, ModelConfig
from kvpage.model.tp_weights import Take, take_for, take_gguf, take_tensor

logger = logging.getLogger(__name__)

_GGUF_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma 3 names its four norms apart from Llama's two, and adds one per query and key head
_GGUF_LAYER_GEMMA3 = {
    **_GGUF_LAYER,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_GGUF_GLOBAL = {"token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head"}
_GGUF_NAME = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def check_architecture(cfg: ModelConfig) -> None:
    if cfg.architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{cfg.name}: architecture {cfg.architecture!r} is not supported "
            f"(kvpage runs {', '.join(SUPPORTED_ARCHITECTURES)})"
        )


def _unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp stores Llama's Q/K rows interleaved for its RoPE; restore the rotate-half order."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def iter_gguf_tensors(reader: Any, path: Path, cfg: ModelConfig, quant: dict[str, Any] | None = None,
                      takes: dict[str, Take] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(parameter name, float32 tensor) for every tensor of an open GGUF file (``open_gguf``); ``rope_freqs``
    passes through.

    With ``quant``, matrices stored as Q4_0 / Q4_1 / Q8_0 are also kept there as repacked blocks
    (``kvpage.model.quant.QuantWeight``) under the same parameter name. With ``takes`` (a tensor-parallel
    rank's shard, kvpage.model.tp_weights) only the rank's rows and columns are read and decoded.
    """
    from gguf import GGML_QUANT_SIZES
    from gguf import GGMLQuantizationType as Q

    from kvpage.model.dequant import NATIVE, dequantize
    from kvpage.model.quant import from_gguf

    names = _GGUF_LAYER_GEMMA3 if cfg.architecture == "gemma3" else _GGUF_LAYER
    for t in reader.tensors:
        shape = tuple(int(x) for x in reversed(t.shape))  # GGUF lists dims fastest-first
        if t.tensor_type not in NATIVE:
            logger.info("%s: %s decoded through gguf-py (slower path)", t.name, t.tensor_type.name)
        if t.name == "rope_freqs.weight":
            yield "rope_freqs", dequantize(t.data, t.tensor_type, shape)
            continue
        m = _GGUF_NAME.match(t.name)
        permuted = 0  # llama.cpp's interleaved Q/K rows (undone below, for the quantized copy too)
        if m:
            layer, kind, suffix = m.groups()
            if kind not in names:
                raise ValueError(f"{path}: unexpected tensor {t.name} for a {cfg.architecture} model")
            name = f"layers.{layer}.{names[kind]}.{suffix}"
            permuted = cfg.architecture == "llama" and kind in ("attn_q", "attn_k")
        else:
            base, _, suffix = t.name.rpartition(".")
            if base not in _GGUF_GLOBAL:
                raise ValueError(f"{path}: unexpected tensor {t.name}")
            name = f"{_GGUF_GLOBAL[base]}.{suffix}"
        take = take_for(name, takes) if takes else None
        try:
            if take is None:
                data = dequantize(t.data, t.tensor_type, shape)
            else:
                block = None if t.tensor_type in (Q.F32, Q.F16) else GGML_QUANT_SIZES[t.tensor_type]
                data = take_gguf(t.data, block, shape, take,
                                 lambda d, sh, qt=t.tensor_type: dequantize(d, qt, sh))
        except ValueError as e:
            raise ValueError(f"{path}: tensor {t.name}: {e}") from None
        rows = None  # how the output rows are rearranged, for the quantized copy too
        if permuted:
            rows = functools.partial(_unpermute_qk, n_head=data.shape[0] // cfg.head_dim)
            data = rows(data)
        if cfg.architecture == "gemma3" and t.name.endswith("norm.weight"):
            data = data - 1  # Gemma's GGUF norms hold 1 + w (llama.cpp multiplies by them directly)
        if quant is not None and suffix == "weight" and take is None:
            qw = from_gguf(t.data, t.tensor_type, shape)  # None for norms and non-block formats
            if qw is not None:
                quant[name] = qw if rows is None else qw.map_rows(rows)
        yield name, data


def iter_safetensors(path: Path, takes: dict[str, Take] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(parameter name, tensor) from a Hugging Face directory's safetensors; with ``takes`` (a tensor-parallel
    rank's shard) only the rank's rows and columns are read."""
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files")
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():  # noqa: SIM118 (safe_open is not a dict)
                name = key[len("model."):] if key.startswith("model.") else key
                if "rotary_emb.inv_freq" in name:
                    continue
                take = take_for(name, takes) if takes else None
                if take is None:
                    yield name, st.get_tensor(key)
                else:
                    sl = st.get_slice(key)
                    yield name, take_tensor(sl, sl.get_shape(), take)
