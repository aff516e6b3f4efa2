"""Model architecture description, read from a GGUF file, a Hugging Face config.json, or a preset.

Reading a config never imports torch: the capacity planner uses it on machines with no model runtime.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# Architectures the runner implements (issue: Llama family). The planner accepts any decoder with a KV cache.
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "gemma3")
# Layer kinds of ModelConfig.layer_types: every position attends to the whole history, or to the last
# ``sliding_window`` positions (itself included).
FULL, SLIDING = "full_attention", "sliding_attention"

# GGUF general.file_type codes -> the weight format name llama.cpp uses.
GGUF_FILE_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K", 11: "Q3_K_S",
    12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K",
    32: "BF16",
}


@dataclass(frozen=True)
class ModelConfig:
    name: str
    architecture: str  # llama | mistral | qwen2 | ...
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int = 0
    intermediate_size: int = 0
    vocab_size: int = 0
    max_position_embeddings: int = 0
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    dtype: str = "bfloat16"  # the weights' native dtype: the default for the KV cache too
    v_head_dim: int | None = None  # when values are narrower/wider than keys
    source: str = "explicit"  # gguf:<path> | hf:<dir> | preset:<name> | explicit
    extra: dict[str, Any] = field(default_factory=dict)
    # Per layer FULL or SLIDING (None: every layer full); the window and the sliding layers' RoPE base.
    layer_types: tuple[str, ...] | None = None
    sliding_window: int | None = None
    rope_local_theta: float | None = None
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5 (default: head_dim)

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_attention_heads", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{self.name}: {name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_kv_heads:
            raise ValueError(
                f"{self.name}: {self.num_attention_heads} query heads do not group evenly over "
                f"{self.num_kv_heads} KV heads"
            )
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers or not set(self.layer_types) <= {FULL, SLIDING}:
                raise ValueError(f"{self.name}: layer_types must name {FULL!r} or {SLIDING!r} for each of the "
                                 f"{self.num_layers} layers, got {self.layer_types!r}")
            if SLIDING in self.layer_types and not (isinstance(self.sliding_window, int) and self.sliding_window > 0):
                raise ValueError(f"{self.name}: sliding layers need a positive sliding_window, got "
                                 f"{self.sliding_window!r}")

    def layer_type(self, layer: int) -> str:
        return FULL if self.layer_types is None else self.layer_types[layer]

    def layer_window(self, layer: int) -> int | None:
        """The layer's attention window in positions (itself included), None for full attention."""
        return self.sliding_window if self.layer_type(layer) == SLIDING else None

    @property
    def attention_scale(self) -> float:
        return float(self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def value_head_dim(self) -> int:
        return self.v_head_dim or self.head_dim

    def with_overrides(self, **changes: Any) -> ModelConfig:
        clean = {k: v for k, v in changes.items() if v is not None}
        return replace(self, **clean) if clean else self


# --------------------------------------------------------------------------- GGUF
def open_gguf(path: Path) -> Any:
    """A parsed GGUF file (``kvpage.model.gguf_file.GGUFFile``); a clear ValueError when it is not one."""
    try:
        from kvpage.model.gguf_file import GGUFFile
    except ImportError as e:  # pragma: no cover - gguf is a declared dependency
        raise RuntimeError("reading GGUF files needs the 'gguf' package: pip install gguf") from e
    try:
        return GGUFFile(path)
    except Exception as e:
        raise ValueError(f"{path}: not a readable GGUF file ({e})") from e


_VOCAB_KEYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.scores")


def gguf_fields(reader: Any, with_vocab: bool = False) -> dict[str, Any]:
    """Metadata as Python values; the large vocab arrays only when asked for."""
    out = {k: v for k, v in reader.fields.items() if with_vocab or k not in _VOCAB_KEYS}
    out["__tensor_names__"] = {t.name for t in reader.tensors}
    return out


def config_from_gguf(path: str | Path, name: str | None = None, meta: dict[str, Any] | None = None) -> ModelConfig:
    """Architecture from GGUF metadata (``meta``: fields already read by ``gguf_fields``)."""
    path = Path(path)
    if meta is None:
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {path}")
        meta = gguf_fields(open_gguf(path))
    arch = meta.get("general.architecture")
    if not arch:
        raise ValueError(f"{path}: GGUF metadata has no general.architecture")

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    n_layers = get("block_count")
    n_heads = get("attention.head_count")
    n_kv = get("attention.head_count_kv", n_heads)
    if isinstance(n_kv, list):  # per-layer KV head counts (some hybrid models)
        if len(set(n_kv)) != 1:
            raise ValueError(f"{path}: per-layer KV head counts {sorted(set(n_kv))} are not supported")
        n_kv = n_kv[0]
    hidden = get("embedding_length", 0)
    if n_layers is None or n_heads is None:
        raise ValueError(f"{path}: GGUF metadata lacks {arch}.block_count or {arch}.attention.head_count")
    head_dim = get("attention.key_length") or (hidden // n_heads if hidden else None)
    v_dim = get("attention.value_length")
    scaling = None
    if get("rope.scaling.type"):
        scaling = {
            "rope_type": get("rope.scaling.type"),
            "factor": get("rope.scaling.factor"),
            "original_max_position_embeddings": get("rope.scaling.original_context_length"),
        }
    file_type = meta.get("general.file_type")
    layer_types, window, local_theta, pre_attn = None, get("attention.sliding_window"), None, None
    if arch == "gemma3":
        # llama.cpp's reading of Gemma 3: every sixth layer global, the others sliding with RoPE base 10k
        layer_types = tuple(FULL if (i + 1) % 6 == 0 else SLIDING for i in range(int(n_layers)))
        local_theta, pre_attn = 10000.0, float(head_dim)
    elif window:  # a uniform window (Mistral-style)
        layer_types = (SLIDING,) * int(n_layers)
    return ModelConfig(
        name=name or meta.get("general.name") or path.stem,
        architecture=arch,
        num_layers=int(n_layers),
        num_attention_heads=int(n_heads),
        num_kv_heads=int(n_kv),
        head_dim=int(head_dim),
        v_head_dim=int(v_dim) if v_dim and v_dim != head_dim else None,
        hidden_size=int(hidden),
        intermediate_size=int(get("feed_forward_length", 0)),
        vocab_size=int(get("vocab_size", 0)),
        max_position_embeddings=int(get("context_length", 0)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        tie_word_embeddings="output.weight" not in meta["__tensor_names__"],
        attention_bias="blk.0.attn_q.bias" in meta["__tensor_names__"],
        dtype="bfloat16",  # GGUF weights are dequantized to the run dtype; bf16 is kvpage's default
        source=f"gguf:{path}",
        extra={"file_type": GGUF_FILE_TYPES.get(file_type, str(file_type)) if file_type is not None else None},
        layer_types=layer_types,
        sliding_window=int(window) if layer_types and window else None,
        rope_local_theta=local_theta,
        query_pre_attn_scalar=pre_attn,
    )


# ---------------------------------------------------------------- Hugging Face
_HF_ARCH = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "gemma3_text": "gemma3", "gemma3": "gemma3"}


def config_from_hf_dir(path: str | Path, name: str | None = None) -> ModelConfig:
    path = Path(path)
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{path}: no config.json (expected a Hugging Face model directory)")
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_path}: invalid JSON ({e})") from e
    if "text_config" in cfg and "num_hidden_layers" not in cfg:
        cfg = {**cfg, **cfg["text_config"]}
    missing = [k for k in ("num_hidden_layers", "num_attention_heads") if k not in cfg]
    if missing:
        raise ValueError(f"{cfg_path}: missing {', '.join(missing)}")
    n_heads = int(cfg["num_attention_heads"])
    hidden = int(cfg.get("hidden_size", 0))
    head_dim = cfg.get("head_dim") or (hidden // n_heads if hidden else None)
    if not head_dim:
        raise ValueError(f"{cfg_path}: cannot derive head_dim (no head_dim and no hidden_size)")
    model_type = str(cfg.get("model_type", "unknown"))
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16").replace("torch.", "")
    # transformers >= 5 writes rope_parameters (theta inside); older files have rope_theta + rope_scaling.
    rope = cfg.get("rope_parameters") or {}
    rope_theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = cfg.get("rope_scaling") or {k: v for k, v in rope.items() if k != "rope_theta"} or None
    if scaling and (scaling.get("rope_type") or scaling.get("type")) in (None, "default"):
        scaling = None
    if cfg.get("mlp_bias"):
        raise ValueError(f"{cfg_path}: mlp_bias=true is not supported")
    for cap in ("final_logit_softcapping", "attn_logit_softcapping"):
        if cfg.get(cap) is not None:
            raise ValueError(f"{cfg_path}: {cap}={cfg[cap]} is not supported (kvpage computes uncapped logits)")
    max_pos = int(cfg.get("max_position_embeddings", 0))
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
    layer_types, local_theta = None, None
    if cfg.get("layer_types"):
        layer_types = tuple(FULL if t == FULL else SLIDING for t in cfg["layer_types"])
        if SLIDING not in layer_types:
            window = None
    elif window and (not max_pos or window < max_pos):
        layer_types = (SLIDING,) * int(cfg["num_hidden_layers"])  # a uniform window (Mistral-style)
    if isinstance(rope.get("sliding_attention"), dict):  # per layer type (Gemma 3)
        local_theta = float(rope["sliding_attention"].get("rope_theta", 10000.0))
        rope_theta = float(rope.get("full_attention", {}).get("rope_theta", rope_theta))
        scaling = None
    elif model_type in ("gemma3", "gemma3_text"):
        local_theta = float(cfg.get("rope_local_base_freq", 10000.0))
    return ModelConfig(
        name=name or path.name,
        architecture=_HF_ARCH.get(model_type, model_type),
        num_layers=int(cfg["num_hidden_layers"]),
        num_attention_heads=n_heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
        head_dim=int(head_dim),
        hidden_size=hidden,
        intermediate_size=int(cfg.get("intermediate_size", 0)),
        vocab_size=int(cfg.get("vocab_size", 0)),
        max_position_embeddings=max_pos,
        rope_theta=rope_theta,
        rope_scaling=scaling,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
        dtype=dtype,
        source=f"hf:{path}",
        layer_types=layer_types,
        sliding_window=int(window) if layer_types and SLIDING in layer_types else None,
        rope_local_theta=local_theta,
        query_pre_attn_scalar=cfg.get("query_pre_attn_scalar"),
    )
