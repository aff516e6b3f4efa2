"""Load a runnable model: config + weights + tokenizer, from the default name, a .gguf file or an HF dir."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kvpage import dtypes, envs
from kvpage.attention.backends import get_attention_backend
from kvpage.distributed.shard import head_shard
from kvpage.envs import KernelConfig
from kvpage.model.config import ModelConfig, config_from_gguf, config_from_hf_dir, gguf_fields, open_gguf
from kvpage.model.gemma3 import Gemma3ForCausalLM
from kvpage.model.layers.row_buckets import bucket_linears, bucketed_product
from kvpage.model.llama import LlamaForCausalLM
from kvpage.model.quant import QuantWeight
from kvpage.model.registry import DEFAULT_MODEL, resolve_model_path
from kvpage.model.rope import rope_inv_freq
from kvpage.model.tokenizer import KVTokenizer
from kvpage.model.tp_weights import Take, shard_takes
from kvpage.model.weights import check_architecture, iter_gguf_tensors, iter_safetensors
from kvpage.ops import Kernels, kernels

logger = logging.getLogger(__name__)



def _maybe_enable_fast_path(net: LlamaForCausalLM | Gemma3ForCausalLM, run_dtype: torch.dtype, backend: str,
                            quant: dict[str, QuantWeight], fast: bool, ops: Kernels | None) -> None:
    """With the compiled backend: packed fused projections + fused elementwise kernels, and the GGUF's own
    quantized blocks for few-token steps. Without ``fast`` (float32 by default) the model keeps the
    step-by-step transformers arithmetic (the exactness reference)."""
    if not fast or backend == "reference":
        return
    from kvpage.model.layers.linear import packing_available

    if ops is None or not packing_available(run_dtype):
        logger.info("%s fast path unavailable (kernels or oneDNN packing missing here): plain path", run_dtype)
        return
    if isinstance(net, Gemma3ForCausalLM):
        from kvpage.model.gemma3_fast import Gemma3FastPath

        net.fast = Gemma3FastPath(net, ops, quant)
        return
    from kvpage.model.fast_path import FastPath

    net.fast = FastPath(net, ops, quant)


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        d = dtypes.lookup(name)
    except ValueError:
        d = None
    if d is None or not d.torch:
        raise ValueError(f"unknown dtype {name!r}: choose float32 or bfloat16 (float16 also accepted)") from None
    return getattr(torch, d.name)


@dataclass
class LoadedModel:
    config: ModelConfig
    model: LlamaForCausalLM | Gemma3ForCausalLM
    tokenizer: KVTokenizer
    dtype: torch.dtype
    path: Path
    load_seconds: float


_LOADED: dict[tuple, LoadedModel] = {}
_MAX_CACHED = 3


def load_model(model: str = DEFAULT_MODEL, dtype: str | torch.dtype = "float32",
               attention_backend: str = "auto", fast: bool | None = None,
               kernel_config: KernelConfig | None = None, tp: tuple[int, int] | None = None) -> LoadedModel:
    """Everything from local files; never the network. Engines in one process share a loaded model
    (weights are read-only; each engine owns its KV cache). ``fast``: the fast path (config.fast_path);
    None = bfloat16 yes, float32 no. ``kernel_config``: the kernel paths (default: the environment's).
    ``tp`` = (rank, size): that tensor-parallel rank's shard alone (kvpage.distributed), never shared, on the
    plain path (its all-reduces go between the layer's modules)."""
    run_dtype = parse_dtype(dtype)
    kernel_config = kernel_config or envs.kernel_config()
    fast = run_dtype == torch.bfloat16 if fast is None else fast
    path = resolve_model_path(model)
    if path is None:
        raise ValueError(f"{model!r} is a preset (architecture numbers only, no weights): it can be planned, not run")
    if tp is not None and tp[1] > 1:
        return _load(model, path, run_dtype, attention_backend, False, kernel_config, tp)
    key = (str(path.resolve()), path.stat().st_mtime_ns, run_dtype, attention_backend, model.lower(), fast,
           kernel_config)
    if key not in _LOADED:
        if len(_LOADED) >= _MAX_CACHED:
            _LOADED.pop(next(iter(_LOADED)))
        _LOADED[key] = _load(model, path, run_dtype, attention_backend, fast, kernel_config)
    return _LOADED[key]


def _shard(cfg: ModelConfig, tp: tuple[int, int] | None) -> tuple[ModelConfig, dict[str, Take] | None]:
    """The rank's model shape (its query slots, KV heads and MLP slice) and what it reads of each tensor."""
    if tp is None or tp[1] == 1:
        return cfg, None
    shard = head_shard(tp[0], tp[1], cfg.num_attention_heads, cfg.num_kv_heads, cfg.intermediate_size)
    local = cfg.with_overrides(num_attention_heads=shard.local_heads, num_kv_heads=shard.local_kv_heads,
                               intermediate_size=cfg.intermediate_size // tp[1])
    return local, shard_takes(cfg, shard)


def _load(model: str, path: Path, run_dtype: torch.dtype, attention_backend: str, fast: bool,
          kernel_config: KernelConfig, tp: tuple[int, int] | None = None) -> LoadedModel:
    t0 = time.perf_counter()
    freq_factors = None
    quant: dict[str, QuantWeight] = {}
    if path.is_dir() and (path / "config.json").is_file():
        cfg = config_from_hf_dir(path)
        check_architecture(cfg)
        cfg, takes = _shard(cfg, tp)
        tensors = iter_safetensors(path, takes)
        tokenizer = KVTokenizer.from_hf_dir(path)
    else:
        if path.is_dir():
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) != 1:
                raise ValueError(f"{path}: expected config.json or exactly one .gguf file, found {len(ggufs)} .gguf")
            path = ggufs[0]
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"{path}: unsupported model file (expected .gguf or a Hugging Face directory)")
        reader = open_gguf(path)
        fields = gguf_fields(reader, with_vocab=True)
        cfg = config_from_gguf(path, name=DEFAULT_MODEL if model.lower() in (DEFAULT_MODEL.lower(), "default")
                               else None, meta=fields)
        check_architecture(cfg)
        tokenizer = KVTokenizer.from_gguf_fields(fields, source=str(path))
        if not cfg.vocab_size:
            cfg = cfg.with_overrides(vocab_size=len(fields["tokenizer.ggml.tokens"]))
        full = cfg
        cfg, takes = _shard(cfg, tp)
        tensors = iter_gguf_tensors(reader, path, full, quant if fast else None, takes)
    if not cfg.intermediate_size or not cfg.hidden_size or not cfg.vocab_size:
        raise ValueError(f"{path}: config lacks hidden_size, intermediate_size or vocab_size")

    state: dict[str, torch.Tensor] = {}
    for name, tensor in tensors:
        if name == "rope_freqs":
            freq_factors = tensor
            continue
        state[name] = tensor.to(run_dtype)
    if "lm_head.weight" in state and cfg.tie_word_embeddings:
        cfg = cfg.with_overrides(tie_word_embeddings=False)
    with torch.device("meta"):
        model_class = Gemma3ForCausalLM if cfg.architecture == "gemma3" else LlamaForCausalLM
        net = model_class(cfg, get_attention_backend(attention_backend, kernel_config))
    expected = set(net.state_dict())
    missing, unexpected = expected - set(state), set(state) - expected
    if missing or unexpected:
        raise ValueError(
            f"{path}: weights do not match a {cfg.architecture} model with {cfg.num_layers} layers "
            f"(missing: {sorted(missing)[:5]}, unexpected: {sorted(unexpected)[:5]})"
        )
    net.load_state_dict(state, assign=True, strict=True)
    # Buffers built on the meta device hold no values: compute RoPE frequencies for real.
    if isinstance(net, Gemma3ForCausalLM):
        net.reset_rope(freq_factors)
    else:
        net.rotary.register_buffer(
            "inv_freq", rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, freq_factors), persistent=False
        )
    net.requires_grad_(False)
    net.eval()
    net.ops = kernels(kernel_config)  # the logits post-processing uses them on every path
    _maybe_enable_fast_path(net, run_dtype, attention_backend, quant, fast, net.ops)
    if getattr(net, "fast", None) is None and run_dtype != torch.float32:
        # the plain path's bf16 products go to oneDNN, which compiles and keeps a primitive per row count
        # (float32 ones go to MKL, which does not): a few row counts only (model/layers/row_buckets.py)
        bucket_linears(net)
        net.lm_product = bucketed_product
    seconds = time.perf_counter() - t0
    logger.info("loaded %s (%s, %d layers) from %s in %.1f s", cfg.name, run_dtype, cfg.num_layers, path, seconds)
    return LoadedModel(cfg, net, tokenizer, run_dtype, path, seconds)
