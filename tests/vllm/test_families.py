"""The model families reasoning RL trains on, through the vLLM backend: Qwen3 (QK norm, explicit head_dim),
Llama 3.x (rope_type llama3), a YaRN-scaled Qwen2 and Mistral, each a small random checkpoint built here with
transformers, greedy output identical to transformers' (fp32). One engine per family, one at a time."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.vllm.conftest import Oracle, prompt_ids, requires_vllm, settings

pytestmark = requires_vllm

SHAPE = dict(
    vocab_size=100,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)


def family_config(name: str):  # -> transformers.PretrainedConfig
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    if name == "qwen3":
        return Qwen3Config(head_dim=32, **SHAPE)
    if name == "llama3":
        scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
        return LlamaConfig(rope_scaling={**scaling, "original_max_position_embeddings": 64}, **SHAPE)
    if name == "yarn":
        return Qwen2Config(
            rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}, **SHAPE
        )
    if name == "mistral":
        return MistralConfig(head_dim=32, sliding_window=None, **SHAPE)
    raise ValueError(name)


@pytest.fixture(scope="module", params=["qwen3", "llama3", "yarn", "mistral"])
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple]:
    from transformers import AutoModelForCausalLM

    from tlt_stream.rollout.vllm.backend import VllmEngine

    root = tmp_path_factory.mktemp(request.param)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(family_config(request.param))
    with torch.no_grad():
        model.model.norm.weight.fill_(12.0)  # peaked distributions: greedy ties are rare
    model.save_pretrained(root / "policy")
    engine = VllmEngine(root / "policy", settings=settings(root, max_len=256))
    try:
        yield request.param, engine, Oracle(root / "policy")
    finally:
        engine.close()


def test_greedy_output_of_each_family_is_transformers_greedy(family: tuple) -> None:
    name, engine, oracle = family
    prompts = [p + p for p in prompt_ids(3, seed=41)]  # past 64 positions: the scaled RoPE range is used
    results = engine.generate(prompts, 48, temperature=0.0)
    for prompt, result in zip(prompts, results, strict=True):
        assert result.token_ids == oracle.greedy(prompt, 48), name
