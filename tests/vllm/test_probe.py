"""The vLLM backend on checkpoints unlike the other modules' (a Qwen3 chat policy with tied embeddings, saved in
bf16, its EOS ids listed in generation_config.json; tests/families.py) and inputs vLLM cannot serve, against
transformers (fp32). Two engines: a plain one and an EAGLE one whose work directory holds an earlier engine's
export.

- A policy reloaded in place into an engine on a tied-embedding checkpoint gives the new weights' greedy output
  and log-probs: vLLM's layerwise reload leaves a tied LM head unprocessed, and the CPU build's packed GEMM
  kept the old embedding (`extension._reprocess_tied_heads`).
- Inputs vLLM cannot serve are refused before vLLM starts, in one line: a head size vLLM's CPU attention has
  no kernel for, a drafter made for another policy (both used to start an engine that died at its first
  step), an architecture vLLM does not know and a context longer than the checkpoint's (both a multi-line
  validation error of vLLM's), a Qwen2 config whose `head_dim` is not hidden / heads (vLLM's Qwen2 ignores it:
  a smaller one killed the engine as it loaded the weights, a larger one ran with weights cut to the wrong
  shape and gave other tokens than transformers).
- An engine starts in a process that imported numba (an inline n-gram engine before it): vLLM's kernel
  registry scan failed on llvmlite (`kernels.tolerate_numba_in_kernel_scan`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.vllm.conftest import Oracle, closing, requires_vllm, settings

pytestmark = requires_vllm

POSITIONS = 192


def qwen3_chat(out: Path, *, seed: int) -> Path:
    """A random Qwen3 chat checkpoint (head_dim 32, tied embeddings, EOS ids in generation_config.json) with a
    peaked final norm (greedy ties are rare), saved in bf16."""
    from transformers import AutoModelForCausalLM

    from tests.families import chat_policy

    chat_policy("qwen3", out, positions=POSITIONS, seed=seed)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert model.config.tie_word_embeddings and model.config.head_dim == 32
    with torch.no_grad():
        model.model.norm.weight.fill_(8.0)
    model.to(torch.bfloat16).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def chat(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Versions A and B of the Qwen3 chat policy, a random drafter for A, its EOS ids and chat prompts."""
    from transformers import AutoTokenizer

    from tests.families import QWEN3_EOS
    from tlt_stream.drafter.model import Drafter, save_drafter
    from tlt_stream.model import load_model

    root = tmp_path_factory.mktemp("probe-models")
    a, b = qwen3_chat(root / "a", seed=0), qwen3_chat(root / "b", seed=1)
    assert json.loads((a / "config.json").read_text())["dtype"] == "bfloat16"
    target = load_model(a)
    torch.manual_seed(2)
    save_drafter(Drafter(target.spec).bind(target), root / "drafter")
    tokenizer = AutoTokenizer.from_pretrained(a)
    questions = ("what is 7 plus 2?", "what is 23 plus 4?", "what is 11 plus 1?")
    texts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        for q in questions
    ]
    return {
        "a": a,
        "b": b,
        "drafter": root / "drafter",
        "eos": [tokenizer.convert_tokens_to_ids(t) for t in QWEN3_EOS],
        "prompts": [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts],
        "oracle_a": Oracle(a),
        "oracle_b": Oracle(b),
    }


@pytest.fixture(scope="module")
def plain(chat: dict, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """A plain engine on version A, its context the checkpoint's (max_len unset), dtype "auto"."""
    from tlt_stream.rollout.vllm.backend import VllmEngine

    s = settings(tmp_path_factory.mktemp("probe-plain"), max_len=None, dtype="auto")
    yield from closing(VllmEngine(chat["a"], settings=s))


def test_a_tied_embedding_policy_reloaded_in_place_gives_the_new_weights_output(plain, chat: dict) -> None:
    prompts, eos, oracle_a, oracle_b = chat["prompts"], chat["eos"], chat["oracle_a"], chat["oracle_b"]
    assert plain.settings.max_len == POSITIONS
    for prompt, result in zip(prompts, plain.generate(prompts, 40, temperature=0.0, eos_ids=eos), strict=True):
        assert result.token_ids == oracle_a.greedy(prompt, 40, eos)
    at_limit = (prompts[0] * 20)[: POSITIONS - 1]  # the last position the context holds
    (last,) = plain.generate([at_limit], 1, temperature=0.0)
    assert last.token_ids == oracle_a.greedy(at_limit, 1)
    try:
        plain.load_policy(chat["b"])
        results = plain.generate(prompts, 40, temperature=0.0, eos_ids=eos)
        for prompt, result in zip(prompts, results, strict=True):
            assert result.token_ids == oracle_b.greedy(prompt, 40, eos)
        for result in plain.generate(prompts, 16, temperature=1.0, seed=3):
            new = oracle_b.logprobs(result.prompt_ids, result.token_ids, 1.0)
            old = oracle_a.logprobs(result.prompt_ids, result.token_ids, 1.0)
            torch.testing.assert_close(torch.tensor(result.logprobs), torch.tensor(new), atol=2e-4, rtol=0)
            assert max(abs(x - y) for x, y in zip(result.logprobs, old, strict=True)) > 0.1
    finally:
        plain.load_policy(chat["a"])
    (back,) = plain.generate(prompts[:1], 30, temperature=0.0)
    assert back.token_ids == oracle_a.greedy(prompts[0], 30)


@pytest.fixture(scope="module")
def eagle(chat: dict, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """An EAGLE engine on version A (d3k1v3, a random drafter) whose work directory holds an earlier engine's
    export, `drafter-0` (the export used to refuse a non-empty directory), started after numba was imported
    (as after an inline n-gram engine: vLLM's kernel registry failed on llvmlite, `kernels.py`): (engine, the
    earlier export)."""
    from tlt_stream.rollout.vllm.backend import VllmEngine

    pytest.importorskip("numba")  # llvmlite in the process: vLLM's kernel registry scan used to fail on it
    work = tmp_path_factory.mktemp("probe-eagle")
    earlier = work / "drafter-0"
    earlier.mkdir()
    (earlier / "config.json").write_text("{}")
    s = settings(work, max_len=128, arm="d3k1v3")
    for engine in closing(VllmEngine(chat["a"], settings=s, drafter=chat["drafter"])):
        yield engine, earlier


def test_an_eagle_engine_in_a_used_work_dir_drafts_on_a_tied_policy_and_its_reload(eagle, chat: dict) -> None:
    """Greedy output with EAGLE drafts is transformers', before and after an in-place reload of the tied
    policy (the draft model shares the target's LM head)."""
    engine, earlier = eagle
    assert (earlier / "config.json").read_text() == "{}"  # the earlier export is left alone
    prompts, eos = chat["prompts"], chat["eos"]
    results = engine.generate(prompts, 32, temperature=0.0, eos_ids=eos)
    for prompt, result in zip(prompts, results, strict=True):
        assert result.token_ids == chat["oracle_a"].greedy(prompt, 32, eos)
        assert result.accept_lengths
    engine.load_policy(chat["b"])
    results = engine.generate(prompts, 32, temperature=0.0, eos_ids=eos)
    for prompt, result in zip(prompts, results, strict=True):
        assert result.token_ids == chat["oracle_b"].greedy(prompt, 32, eos)


def test_inputs_vllm_cannot_serve_are_refused_before_it_starts_in_one_line(chat: dict, tmp_path: Path) -> None:
    from tests.families import build_family
    from tests.vllm.conftest import hf_policy
    from tlt_stream.basics.errors import CheckpointError, ConfigError
    from tlt_stream.drafter.model import Drafter, save_drafter
    from tlt_stream.model import load_model
    from tlt_stream.rollout.vllm.backend import VllmEngine
    from tlt_stream.rollout.vllm.config import UnsupportedSetting

    build_family("llama", tmp_path / "hd16")  # hidden 64 over 4 heads: head size 16
    narrow = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=32)  # not 128 / 2
    wide_heads = dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=64)  # not 64 / 2
    for name, shape in (("qwen2-narrow", narrow), ("qwen2-wide", wide_heads)):
        build_family("qwen2", tmp_path / name, **shape)
        assert json.loads((tmp_path / name / "config.json").read_text())["head_dim"] == shape["head_dim"]
    wide = hf_policy(tmp_path / "wide", seed=0)  # hidden 128, vocabulary 100
    target = load_model(wide)
    save_drafter(Drafter(target.spec).bind(target), tmp_path / "wide-drafter")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    for file in chat["a"].iterdir():
        (foreign / file.name).write_bytes(file.read_bytes())
    config = json.loads((foreign / "config.json").read_text())
    (foreign / "config.json").write_text(json.dumps({**config, "architectures": ["TltUnknownForCausalLM"]}))

    cases = [
        (UnsupportedSetting, "head size 16", lambda: VllmEngine(tmp_path / "hd16", settings=settings(tmp_path))),
        (
            CheckpointError,
            "made for a policy of hidden size 128",
            lambda: VllmEngine(
                chat["a"], settings=settings(tmp_path, max_len=128, arm="d3k1v3"), drafter=tmp_path / "wide-drafter"
            ),
        ),
        (ConfigError, "longer than the 192 positions", lambda: VllmEngine(chat["a"], settings=settings(tmp_path))),
        (
            UnsupportedSetting,
            r"head_dim 32, .*Qwen2ForCausalLM.* \(128 / 2 = 64\).*rollout.backend=torch",
            lambda: VllmEngine(tmp_path / "qwen2-narrow", settings=settings(tmp_path, max_len=128)),
        ),
        (
            UnsupportedSetting,
            r"head_dim 64, .*\(64 / 2 = 32\)",
            lambda: VllmEngine(tmp_path / "qwen2-wide", settings=settings(tmp_path, max_len=128)),
        ),
        (
            UnsupportedSetting,
            "TltUnknownForCausalLM",
            lambda: VllmEngine(foreign, settings=settings(tmp_path, max_len=128, hidden="none")),
        ),
    ]
    for error, words, build in cases:
        with pytest.raises(error, match=words) as caught:
            build().close()
        assert "\n" not in str(caught.value), str(caught.value)
