"""Small random checkpoints of the model families the torch runtime runs, each built from the family's own
transformers config class with the keys its real releases carry (Qwen3's explicit `head_dim` and tied
embeddings, Llama 3.1's `llama3` RoPE, a YaRN-scaled Qwen2.5, Mistral without a window, Ministral's
per-layer window). The RoPE of the scaled families changes at every position; `ORIGINAL` is short so a
test's positions pass it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

VOCAB = 41
EOS = 0
ORIGINAL = 32
"""`original_max_position_embeddings` of the scaled families: a test's sequences run past it."""

SHAPE: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.25,
)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
YARN = {"rope_type": "yarn", "factor": 8.0}

FAMILIES = ("llama", "qwen2", "qwen3", "llama3", "yarn", "linear", "mistral", "ministral")


def family_config(name: str, *, vocab: int = VOCAB, **overrides: Any):  # -> transformers.PretrainedConfig
    """The transformers config of family `name` at the tests' size (`overrides` replace any key)."""
    from transformers import LlamaConfig, MinistralConfig, MistralConfig, Qwen2Config, Qwen3Config

    shape = {**SHAPE, "vocab_size": vocab, "eos_token_id": EOS, **overrides}
    original = {"original_max_position_embeddings": ORIGINAL}
    if name == "llama":
        return LlamaConfig(**shape)
    if name == "qwen2":
        return Qwen2Config(**shape)
    if name == "qwen3":  # Qwen3-0.6B's kind: head_dim apart from hidden/heads, tied embeddings, theta 1e6
        return Qwen3Config(**{"head_dim": 32, "tie_word_embeddings": True, "rope_theta": 1e6, **shape})
    if name == "llama3":  # Llama 3.1/3.2's RoPE, theta 5e5
        return LlamaConfig(rope_parameters={**LLAMA3, **original, "rope_theta": 500_000.0}, **shape)
    if name == "yarn":  # Qwen2.5 long-context / QwQ style
        return Qwen2Config(rope_parameters={**YARN, **original, "rope_theta": 1e6}, **shape)
    if name == "linear":
        return LlamaConfig(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10_000.0}, **shape)
    if name == "mistral":
        return MistralConfig(**{"head_dim": 16, "sliding_window": None, **shape})
    if name == "ministral":  # every layer windowed, the window longer than any test sequence
        return MinistralConfig(**{"head_dim": 16, "sliding_window": 4096, **shape})
    raise ValueError(f"unknown family {name!r}")


def build_family(name: str, out: Path, *, seed: int = 0, vocab: int = VOCAB, **overrides: Any):
    """Save a random checkpoint of family `name` to `out` (config.json, model.safetensors and a
    generation_config.json naming EOS); returns the eval-mode transformers model."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(family_config(name, vocab=vocab, **overrides)).eval()
    hf.save_pretrained(out)
    GenerationConfig(eos_token_id=[EOS], pad_token_id=EOS).save_pretrained(out)
    return hf


def as_rope_scaling(path: Path) -> None:
    """Rewrite `path/config.json` the way checkpoints from before transformers 5 carry RoPE: `rope_theta` at
    the top level and the scaling, if any, as `rope_scaling` with the old `type` key."""
    cfg = json.loads((path / "config.json").read_text())
    params = dict(cfg.pop("rope_parameters", None) or {})
    cfg["rope_theta"] = params.pop("rope_theta", 10_000.0)
    rope_type = params.pop("rope_type", "default")
    cfg["rope_scaling"] = None if rope_type == "default" else {"type": rope_type, **params}
    (path / "config.json").write_text(json.dumps(cfg))
