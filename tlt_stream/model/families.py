"""Which Hugging Face checkpoints the torch runtime runs, and how each family's `config.json` maps onto a
`ModelSpec`; anything else is refused in one line that names what is missing.

Dense decoders with RoPE, grouped-query attention and a SwiGLU MLP run here:

- `LlamaForCausalLM`: `attention_bias` on q/k/v/o, `mlp_bias`.
- `Qwen2ForCausalLM`: a q/k/v bias always, none on o or the MLP.
- `Qwen3ForCausalLM`: per-head RMSNorm of q and k before RoPE; `attention_bias` on q/k/v/o (off in every
  release), so not Qwen2's mapping.
- `MistralForCausalLM`, `MinistralForCausalLM`: no biases; a sliding window only when the KV cache is no
  longer than it (then it never slides).

RoPE is read from `rope_parameters` (transformers 5) or `rope_scaling` (earlier checkpoints), with
`rope_theta` at the top level or inside: `default`, `linear`, `llama3` and `yarn` (with its attention
factor). Dynamic NTK is refused: transformers recomputes its frequencies once a sequence passes the
original length while the keys already cached keep the old ones, a state this runtime's cache does not
reproduce. Mixture-of-experts, a real sliding window, multimodal models and partial rotary embeddings are
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
VLLM = 'the vLLM backend (rollout.backend = "vllm") runs it'


def _require(cfg: dict[str, Any], key: str, path: Path) -> Any:
    if key not in cfg:
        raise CheckpointError(f"{path}: config.json has no {key!r}")
    return cfg[key]


def _refuse(path: Path, what: str) -> CheckpointError:
    return CheckpointError(f"{path}: {what} is not supported by the torch runtime; {VLLM}")


def _architecture(cfg: dict[str, Any], path: Path) -> str:
    archs = cfg.get("architectures") or []
    known = [SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES]
    if known:
        return known[0]
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
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
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
    original = params.get("original_max_position_embeddings", cfg.get("original_max_position_embeddings"))
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


def spec_from_hf_config(cfg: dict[str, Any], path: Path | str = "<config>") -> ModelSpec:
    """Translate a Hugging Face `config.json` dict into a `ModelSpec`, or raise `CheckpointError`."""
    path = Path(path)
    arch = _architecture(cfg, path)
    if cfg.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{path}: hidden_act {cfg['hidden_act']!r} is not supported (only 'silu')")
    hidden = int(_require(cfg, "hidden_size", path))
    heads = int(_require(cfg, "num_attention_heads", path))
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    attention_bias = bool(cfg.get("attention_bias", False)) and arch in ("llama", "qwen3")
    try:
        return ModelSpec(
            architecture=arch,
            vocab_size=int(_require(cfg, "vocab_size", path)),
            hidden_size=hidden,
            intermediate_size=int(_require(cfg, "intermediate_size", path)),
            num_layers=int(_require(cfg, "num_hidden_layers", path)),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 32_768)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=arch == "qwen2" or attention_bias,
            o_bias=attention_bias,
            mlp_bias=arch == "llama" and bool(cfg.get("mlp_bias", False)),
            qk_norm=arch == "qwen3",
            sliding_window=_sliding_window(cfg, arch),
            **_rope(cfg, path),
        )
    except ValueError as e:
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
