"""Small random checkpoints of the model families the torch runtime runs, each built from the family's own
transformers config class with the keys its real releases carry (Qwen3's explicit `head_dim` and tied
embeddings, Llama 3.1's `llama3` RoPE, a YaRN-scaled Qwen2.5, Mistral without a window, Ministral's
per-layer window). The RoPE of the scaled families changes at every position; `ORIGINAL` is short so a
test's positions pass it. `tiny_spec` is a tiny Llama as the runtime's own `ModelSpec`, for tests that build a
model or a drafter without a checkpoint."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tlt_stream.model.spec import ModelSpec

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


def tiny_spec(**changes: Any) -> ModelSpec:
    """A one-layer GQA Llama of vocabulary 50 and hidden size 32, whose head_dim (12) is not hidden / heads (32 /
    4), so a config written from it must carry head_dim (the drafter export tests build drafters and targets of
    it); `changes` replace any field."""
    from tlt_stream.model.spec import ModelSpec

    spec = ModelSpec(
        architecture="llama",
        vocab_size=50,
        hidden_size=32,
        intermediate_size=48,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=12,
        max_position_embeddings=128,
    )
    return dataclasses.replace(spec, **changes)


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


QWEN3_TEMPLATE = (
    "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
"""Qwen3's chat structure: ChatML turns, and `enable_thinking=False` pre-filling an empty thinking block."""
QWEN3_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
QWEN3_EOS = ["<|im_end|>", "<|endoftext|>"]

LLAMA3_TEMPLATE = (
    "{{- '<|begin_of_text|>' }}{%- for m in messages %}"
    "{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] + '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
"""Llama 3's chat structure: header ids around each role, `<|eot_id|>` ending each turn."""
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
LLAMA3_EOS = ["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"]


def chat_tokenizer(specials: list[str], eos: str, template: str):  # -> PreTrainedTokenizerFast
    """A byte-level BPE tokenizer trained here on a small arithmetic corpus, with `specials` as single tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    corpus = [f"Question: what is {a} plus {b}? Answer: {a + b}." for a in range(40) for b in range(7)]
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=eos, pad_token=specials[0], chat_template=template)


def chat_policy(family: str, out: Path, *, positions: int = 512, seed: int = 0) -> Path:
    """A random `family` ("qwen3" or "llama3") checkpoint with its chat structure: the template, the special
    tokens, and every EOS id its releases list in generation_config.json (config.json names the first). The
    final norm's gain is small, so responses meet an EOS within a few dozen tokens."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    if family == "qwen3":
        tokenizer = chat_tokenizer(QWEN3_SPECIALS, "<|im_end|>", QWEN3_TEMPLATE)
        eos_tokens = QWEN3_EOS
    else:
        tokenizer = chat_tokenizer([*LLAMA3_SPECIALS, "<|eom_id|>"], "<|eot_id|>", LLAMA3_TEMPLATE)
        eos_tokens = LLAMA3_EOS
    eos = [tokenizer.convert_tokens_to_ids(t) for t in eos_tokens]
    config = family_config(family, vocab=len(tokenizer), max_position_embeddings=positions, eos_token_id=eos[0])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        model.model.norm.weight.fill_(0.01)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    GenerationConfig(eos_token_id=eos, pad_token_id=tokenizer.pad_token_id).save_pretrained(out)
    return out
