"""The model families reasoning RL trains on, through the vLLM backend: Qwen3 (QK norm, explicit head_dim),
Llama 3.x (rope_type llama3), a YaRN-scaled Qwen2, Mistral and Ministral (which vLLM runs through its
Transformers backend), each a small random checkpoint built here with transformers, greedy output identical to
transformers' (fp32). One engine per family, one at a time.

The Qwen3 engine drafts with EAGLE: its drafter is made as a user makes one for a policy of their own
(`tlt-stream drafter init` on the checkpoint's chat template and a dataset, then `tlt-stream export-drafter`),
and vLLM loads the export with its EAGLE Llama draft model; the greedy check then also covers the target's
verify rounds, and the accept lengths say whose drafts were verified."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

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
    from transformers import LlamaConfig, MinistralConfig, MistralConfig, Qwen2Config, Qwen3Config

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
    if name == "ministral":  # every layer windowed, the window longer than any sequence here (as families.py)
        return MinistralConfig(head_dim=32, sliding_window=4096, **SHAPE)
    raise ValueError(name)


def qwen3_with_drafter(root: Path) -> tuple[Path, Path, list[list[int]]]:
    """A random Qwen3 chat checkpoint (tests/families.py: its template, special tokens and EOS ids; head_dim
    32, tied embeddings), a drafter made for it by `tlt-stream drafter init` and exported by `tlt-stream
    export-drafter`, and chat prompts: (policy, export, prompts)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from tests.families import QWEN3_EOS, QWEN3_SPECIALS, QWEN3_TEMPLATE, chat_tokenizer
    from tests.families import family_config as qwen3_config
    from tlt_stream.commands.cli import main

    policy = root / "policy"
    tokenizer = chat_tokenizer(QWEN3_SPECIALS, "<|im_end|>", QWEN3_TEMPLATE)
    eos = [tokenizer.convert_tokens_to_ids(t) for t in QWEN3_EOS]
    config = qwen3_config("qwen3", vocab=len(tokenizer), max_position_embeddings=256, eos_token_id=eos[0],
                          hidden_size=128, intermediate_size=256, initializer_range=0.02)  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        model.model.norm.weight.fill_(12.0)  # peaked distributions: greedy ties are rare
    model.save_pretrained(policy)
    tokenizer.save_pretrained(policy)
    GenerationConfig(eos_token_id=eos, pad_token_id=tokenizer.pad_token_id).save_pretrained(policy)
    questions = [f"what is {a} plus {b}?" for a in range(5, 30, 3) for b in (1, 4)]
    data = root / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": q, "answer": "0"}) + "\n" for q in questions))
    drafter = root / "drafter"
    init = ["drafter", "init", "--policy", str(policy), "--dataset", str(data), "--out", str(drafter),
            "--max-len", "128", "--samples", str(len(questions)), "--steps", "60", "--threads", "1",
            "--lr", "3e-3", "--set", "rollout.temperature=0.3"]  # fmt: skip
    assert main(init) == 0
    assert main(["export-drafter", str(drafter), "--format", "eagle", "--out", str(root / "eagle")]) == 0
    tokenizer = AutoTokenizer.from_pretrained(policy)
    texts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        for q in ("what is 7 plus 2?", "what is 23 plus 4?", "what is 11 plus 1?")
    ]
    return policy, root / "eagle", [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


@pytest.fixture(scope="module", params=["qwen3", "llama3", "yarn", "mistral", "ministral"])
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple]:
    """(name, engine, transformers' greedy output per prompt, prompts); the Qwen3 engine drafts with EAGLE
    (`qwen3_with_drafter`), d4k1v4. The oracle's output is computed before the engine starts: vLLM runs
    Ministral through its Transformers backend, which may patch transformers' classes in this process, and
    the oracle must be transformers as shipped."""
    from transformers import AutoModelForCausalLM

    from tlt_stream.rollout.vllm.backend import VllmEngine

    root = tmp_path_factory.mktemp(request.param)
    if request.param == "qwen3":
        policy, export, prompts = qwen3_with_drafter(root)
    else:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(family_config(request.param))
        with torch.no_grad():
            model.model.norm.weight.fill_(12.0)  # peaked distributions: greedy ties are rare
        model.save_pretrained(root / "policy")
        policy, prompts = root / "policy", [p + p for p in prompt_ids(3, seed=41)]  # past the unscaled range
    oracle = Oracle(policy)
    expected = [oracle.greedy(prompt, 48) for prompt in prompts]
    del oracle
    if request.param == "qwen3":
        engine = VllmEngine(policy, settings=settings(root, max_len=256, arm="d4k1v4"), drafter=export)
    else:
        engine = VllmEngine(policy, settings=settings(root, max_len=256))
    try:
        yield request.param, engine, expected, prompts
    finally:
        engine.close()


def test_greedy_output_of_each_family_is_transformers_greedy(family: tuple) -> None:
    """Each family's greedy output is transformers'; the Qwen3 engine's with the exported drafter's EAGLE
    drafts verified in every round, and accepted as often as the torch engine accepts the same drafter's (the
    rounds per request within one: drafts computed by vLLM's kernels may differ in rounding)."""
    name, engine, expected, prompts = family
    results = engine.generate(prompts, 48, temperature=0.0)
    for tokens, result in zip(expected, results, strict=True):
        assert result.token_ids == tokens, name
    if name == "qwen3":
        assert engine.arm is not None and engine.arm.label == "d4k1v4"
        assert all(r.accept_lengths for r in results)
        torch_rounds = torch_engine_rounds(engine.policy, engine.policy.parent / "drafter", prompts, 48)
        vllm_rounds = [len(r.accept_lengths) for r in results]
        print(f"qwen3 verify rounds for 48 tokens: vLLM {vllm_rounds}, torch engine {torch_rounds}")
        assert sum(vllm_rounds) < 0.5 * 48 * len(prompts)  # the drafter's tokens were accepted: its weights ran
        assert all(abs(v - t) <= 1 for v, t in zip(vllm_rounds, torch_rounds, strict=True))  # as the torch engine's


def torch_engine_rounds(policy: Path, drafter: Path, prompts: list[list[int]], new_tokens: int) -> list[int]:
    """Verify rounds the torch engine needs per prompt with the same drafter, greedy, d4k1v4."""
    from tlt_stream.drafter.model import load_drafter
    from tlt_stream.model import load_model
    from tlt_stream.rollout.arms import Arm
    from tlt_stream.rollout.engine import GenerationEngine
    from tlt_stream.rollout.proposers import EagleProposer

    target = load_model(policy)
    engine = GenerationEngine(target, 1, 256, proposer=EagleProposer(load_drafter(drafter, target)),
                              arm=Arm.drafter(4, 1, 4))  # fmt: skip
    return [len(engine.generate([p], new_tokens)[0].accept_lengths) for p in prompts]
