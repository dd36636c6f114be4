"""Which Hugging Face checkpoints the torch runtime runs, and how each family's `config.json` maps onto a
`ModelSpec`; anything else is refused in one line that names what is missing.

Dense decoders with RoPE, grouped-query attention and a SwiGLU MLP run here:

- `LlamaForCausalLM`: `attention_bias` on q/k/v/o, `mlp_bias`.
- `Qwen2ForCausalLM`: a q/k/v bias always, none on o or the MLP.
- `Qwen3ForCausalLM`: per-head RMSNorm of q and k before RoPE; `attention_bias` on q/k/v/o (off in every
  release), so not Qwen2's mapping.
- `MistralForCausalLM`, `MinistralForCausalLM`: no biases; a sliding window only when the KV cache is no
  longer than it (then it never slides).

The config is read as the installed transformers reads it: a key left out takes the family's default
(`FAMILY_DEFAULTS`), a config without `architectures` runs as its `model_type`'s class. RoPE is read from
`rope_scaling` (earlier checkpoints; it wins where a config has both, as in transformers) or
`rope_parameters` (transformers 5), with `rope_theta` at the top level or inside: `default`, `linear`, `llama3`
and `yarn` (with its attention factor). Dynamic NTK is refused: transformers recomputes its frequencies once a
sequence passes the original length while the keys already cached keep the old ones, a state this runtime's
cache does not reproduce. Mixture-of-experts, a real sliding window, multimodal models and partial rotary embeddings are
refused with the same pointer: the vLLM backend (`rollout.backend = "vllm"`) runs them.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from tlt_stream.basics.errors import CheckpointError
from tlt_stream.model.spec import ModelSpec

__all__ = ["SUPPORTED_ARCHITECTURES", "hf_rope_parameters", "spec_from_hf_config"]

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MistralForCausalLM": "mistral",
    "MinistralForCausalLM": "mistral",
}
MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "ministral": "MinistralForCausalLM",
}
"""`model_type` -> the causal-LM class transformers' Auto classes build for it: what a config without
`architectures` runs as."""
_QWEN_DEFAULTS = {"num_key_value_heads": 32, "max_position_embeddings": 32_768, "sliding_window": 4096}
_MISTRAL_DEFAULTS = {"num_key_value_heads": 8, "max_position_embeddings": 131_072, "sliding_window": 4096}
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": {"max_position_embeddings": 2048},
    "Qwen2ForCausalLM": _QWEN_DEFAULTS,
    "Qwen3ForCausalLM": {**_QWEN_DEFAULTS, "head_dim": 128},
    "MistralForCausalLM": _MISTRAL_DEFAULTS,
    "MinistralForCausalLM": _MISTRAL_DEFAULTS,
}
"""What each family's transformers config class takes for a key its `config.json` leaves out, where that is not
the runtime's own reading (a key present, even as null, is the checkpoint's): Qwen3 heads of 128 whatever the
width, Qwen's and Mistral's KV-head counts, each family's context, Mistral's 4096-token window."""
SILU = ("silu", "swish")
"""`hidden_act` names of SiLU (transformers maps both to it)."""
VLLM = 'the vLLM backend (rollout.backend = "vllm") runs it'


def _require(cfg: dict[str, Any], key: str, path: Path) -> Any:
    if key not in cfg:
        raise CheckpointError(f"{path}: config.json has no {key!r}")
    return cfg[key]


def _refuse(path: Path, what: str) -> CheckpointError:
    return CheckpointError(f"{path}: {what} is not supported by the torch runtime; {VLLM}")


def _architecture(cfg: dict[str, Any], path: Path) -> str:
    """The class of `SUPPORTED_ARCHITECTURES` the checkpoint runs as: the first of its `architectures` that is
    one, else (no `architectures`, as a config saved on its own has none) its `model_type`'s, as transformers'
    Auto classes read it; anything else is refused."""
    archs = cfg.get("architectures") or []
    if not isinstance(archs, list):
        raise CheckpointError(f"{path}: config.json's architectures must be a list, got {archs!r}")
    known = [a for a in archs if a in SUPPORTED_ARCHITECTURES]
    if known:
        return known[0]
    if not archs and cfg.get("model_type") in MODEL_TYPES:
        return MODEL_TYPES[cfg["model_type"]]
    names = " ".join(archs)
    if "Moe" in names or "Mixtral" in names or cfg.get("num_experts") or cfg.get("num_local_experts"):
        raise _refuse(path, f"mixture-of-experts ({archs})")
    if "ConditionalGeneration" in names or "vision_config" in cfg or "text_config" in cfg:
        raise _refuse(path, f"a multimodal model ({archs})")
    raise CheckpointError(
        f"{path}: unsupported architectures {archs}; the torch runtime runs {sorted(SUPPORTED_ARCHITECTURES)}, "
        f"and {VLLM}"
    )


def _rope(cfg: dict[str, Any], path: Path) -> dict[str, Any]:
    """The `ModelSpec` RoPE fields, from `rope_parameters` or `rope_scaling`."""
    params = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}  # transformers: rope_scaling first
    if not isinstance(params, dict):
        raise CheckpointError(f"{path}: rope parameters must be an object, got {params!r}")
    if any(isinstance(v, dict) for v in params.values()):
        raise _refuse(path, "per-layer RoPE parameters")
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial is not None and float(partial) != 1.0:
        raise _refuse(path, f"partial rotary embeddings (partial_rotary_factor {partial})")
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta") or cfg.get("rope_theta") or 10_000.0)
    out: dict[str, Any] = {"rope_theta": theta, "rope_type": rope_type}
    if rope_type == "default":
        return out
    if rope_type == "dynamic":
        raise _refuse(path, "dynamic NTK RoPE (frequencies that change with the sequence length)")
    if rope_type not in ("linear", "llama3", "yarn"):
        raise _refuse(path, f"RoPE type {rope_type!r}")
    factor = params.get("factor")
    # transformers gives a top-level `original_max_position_embeddings` precedence over the parameters' own
    original = cfg.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
    original = int(original or cfg.get("max_position_embeddings") or 0)
    if factor is None and rope_type == "yarn" and original:
        factor = cfg["max_position_embeddings"] / original
    if factor is None:
        raise CheckpointError(f"{path}: {rope_type} RoPE without a 'factor'")
    out["rope_factor"] = float(factor)
    if rope_type == "llama3":
        out["rope_low_freq_factor"] = float(_require(params, "low_freq_factor", path))
        out["rope_high_freq_factor"] = float(_require(params, "high_freq_factor", path))
        out["rope_original_max_positions"] = original
    elif rope_type == "yarn":
        out["rope_original_max_positions"] = original
        out["rope_beta_fast"] = float(params.get("beta_fast") or 32)
        out["rope_beta_slow"] = float(params.get("beta_slow") or 1)
        out["rope_truncate"] = bool(params.get("truncate", True))
        out["rope_attention_factor"] = _yarn_attention_factor(params, float(factor))
    return out


def _yarn_attention_factor(params: dict[str, Any], factor: float) -> float:
    """transformers' `_compute_yarn_parameters`: the checkpoint's `attention_factor`, else from mscale."""

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    given = params.get("attention_factor")
    if given is not None:
        return float(given)
    if params.get("mscale") and params.get("mscale_all_dim"):
        return float(mscale(factor, params["mscale"]) / mscale(factor, params["mscale_all_dim"]))
    return mscale(factor)


QWEN_WINDOW_LAYERS = 28
"""transformers' `max_window_layers` for a Qwen2 or Qwen3 config that does not say (the layer from which the
window applies)."""


def _sliding_window(cfg: dict[str, Any], arch: str) -> int | None:
    """The attention window some layer of the checkpoint uses, or None when attention is full everywhere, as
    transformers reads the config: Qwen2 and Qwen3 keep `sliding_window` only with `use_sliding_window`, and
    without `layer_types` slide the layers from `max_window_layers` on (none, when that is past the last);
    Mistral without `layer_types` slides every layer; elsewhere the layers `layer_types` names slide."""
    window = cfg.get("sliding_window")
    if not window:
        return None
    types = cfg.get("layer_types")
    if arch in ("qwen2", "qwen3"):
        if not cfg.get("use_sliding_window"):
            return None
        if types is None:
            layers = cfg.get("num_hidden_layers")
            first = cfg.get("max_window_layers", QWEN_WINDOW_LAYERS)
            return int(window) if isinstance(layers, int) and isinstance(first, int) and first < layers else None
    elif arch == "mistral" and types is None:
        return int(window)
    return int(window) if "sliding_attention" in (types or []) else None


def _number(cfg: dict[str, Any], key: str, path: Path, kind: type, default: Any = None) -> Any:
    """`cfg[key]` as `kind` (int or float), `default` when absent (`_require`d when None); a value that is not
    a finite number of that kind (null, text, a bool, 2.5 for a size) is a `CheckpointError` naming the key."""
    value = _require(cfg, key, path) if default is None else cfg.get(key, default)
    number = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not number or (kind is int and value != int(value)):
        what = "an integer" if kind is int else "a number"
        raise CheckpointError(f"{path}: config.json's {key} must be {what}, got {value!r}")
    return kind(value)


def spec_from_hf_config(cfg: dict[str, Any], path: Path | str = "<config>") -> ModelSpec:
    """Translate a Hugging Face `config.json` dict into a `ModelSpec` as transformers reads it (a key left out
    takes its family's default, `FAMILY_DEFAULTS`), or raise `CheckpointError`."""
    path = Path(path)
    architecture = _architecture(cfg, path)
    arch = SUPPORTED_ARCHITECTURES[architecture]
    cfg = {**FAMILY_DEFAULTS[architecture], **cfg}
    if cfg.get("hidden_act", "silu") not in SILU:
        raise CheckpointError(f"{path}: hidden_act {cfg['hidden_act']!r} is not supported (only 'silu')")
    hidden = _number(cfg, "hidden_size", path, int)
    heads = _number(cfg, "num_attention_heads", path, int)
    if heads <= 0:
        raise CheckpointError(f"{path}: config.json's num_attention_heads must be positive, got {heads}")
    head_dim = _number(cfg, "head_dim", path, int) if cfg.get("head_dim") is not None else hidden // heads
    kv_heads = _number(cfg, "num_key_value_heads", path, int) if cfg.get("num_key_value_heads") is not None else heads
    attention_bias = bool(cfg.get("attention_bias", False)) and arch in ("llama", "qwen3")
    try:
        return ModelSpec(
            architecture=arch,
            vocab_size=_number(cfg, "vocab_size", path, int),
            hidden_size=hidden,
            intermediate_size=_number(cfg, "intermediate_size", path, int),
            num_layers=_number(cfg, "num_hidden_layers", path, int),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=_number(cfg, "rms_norm_eps", path, float, 1e-6),
            max_position_embeddings=_number(cfg, "max_position_embeddings", path, int, 32_768),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=arch == "qwen2" or attention_bias,
            o_bias=attention_bias,
            mlp_bias=arch == "llama" and bool(cfg.get("mlp_bias", False)),
            qk_norm=arch == "qwen3",
            sliding_window=_sliding_window(cfg, arch),
            **_rope(cfg, path),
        )
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{path}: {e}") from e


def hf_rope_parameters(spec: ModelSpec) -> dict[str, Any]:
    """`spec`'s RoPE as transformers 5 writes `rope_parameters` (what an exported config carries)."""
    out: dict[str, Any] = {"rope_type": spec.rope_type, "rope_theta": spec.rope_theta}
    if spec.rope_type == "default":
        return out
    out["factor"] = spec.rope_factor
    if spec.rope_type == "llama3":
        out["low_freq_factor"] = spec.rope_low_freq_factor
        out["high_freq_factor"] = spec.rope_high_freq_factor
    if spec.rope_type in ("llama3", "yarn"):
        out["original_max_position_embeddings"] = spec.rope_original_max_positions
    if spec.rope_type == "yarn":
        out["beta_fast"], out["beta_slow"] = spec.rope_beta_fast, spec.rope_beta_slow
        out["attention_factor"] = spec.rope_attention_factor
        if not spec.rope_truncate:
            out["truncate"] = False
    return out
