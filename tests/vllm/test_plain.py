"""One vLLM engine without speculation: greedy output, log-probs, EOS ids, stop strings, hidden states and an
in-place policy reload, each against transformers."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.vllm.conftest import MAX_LEN, Oracle, closing, prompt_ids, requires_vllm, settings

pytestmark = requires_vllm


@pytest.fixture(scope="module")
def engine(models: dict[str, Path], engine_dir: Path) -> Iterator:
    from tlt_stream.rollout.vllm.backend import VllmEngine

    yield from closing(VllmEngine(models["policy"], settings=settings(engine_dir, hidden="recompute")))


def test_greedy_output_is_transformers_greedy(engine, oracle: Oracle) -> None:
    prompts = prompt_ids(6, seed=1)
    results = engine.generate(prompts, 40, temperature=0.0)
    for prompt, result in zip(prompts, results, strict=True):
        assert result.token_ids == oracle.greedy(prompt, 40)
        assert result.finish_reason == "length" and result.accept_lengths == []


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
def test_logprobs_are_the_targets_at_the_rollout_temperature(engine, oracle: Oracle, temperature: float) -> None:
    prompts = prompt_ids(4, seed=2)
    results = engine.generate(prompts, 24, temperature=temperature, seed=5)
    for result in results:
        expected = oracle.logprobs(result.prompt_ids, result.token_ids, temperature)
        torch.testing.assert_close(torch.tensor(result.logprobs), torch.tensor(expected), atol=2e-4, rtol=0)


def test_a_response_stops_at_the_first_of_every_eos_id(engine, oracle: Oracle) -> None:
    """Two EOS ids chosen from the greedy response: it ends at whichever comes first, EOS kept."""
    (prompt,) = prompt_ids(1, seed=3)
    free = oracle.greedy(prompt, 40)
    first, second = free[12], free[25]
    cut = min(free.index(first), free.index(second)) + 1
    (result,) = engine.generate([prompt], 40, temperature=0.0, eos_ids=[second, first])
    assert result.finish_reason == "eos" and result.token_ids == free[:cut]
    (alone,) = engine.generate([prompt], 40, temperature=0.0, eos_ids=[second])
    assert alone.token_ids == free[: free.index(second) + 1]


def test_a_stop_string_cuts_the_response_where_the_torch_engine_would(engine, oracle: Oracle) -> None:
    from tlt_stream.rollout.stops import StopStrings
    from tlt_stream.tasks.tokenizer import build_tokenizer

    tokenizer = build_tokenizer()
    (prompt,) = prompt_ids(1, seed=4)
    free = oracle.greedy(prompt, 40)
    text = tokenizer.decode(free[10:12])  # two characters the greedy response writes at tokens 10-11
    stop = StopStrings(tokenizer, [text])
    keep = stop.first_stop(free)
    assert keep is not None and keep <= 12
    (result,) = engine.generate([prompt], 40, temperature=0.0, stop=stop)
    assert result.finish_reason == "stop" and result.token_ids == free[:keep]
    assert len(result.logprobs) == keep
    assert engine.num_running == 0  # the request vLLM was still running was aborted there


def test_hidden_states_of_vllm_samples_are_transformers_output_hidden_states(engine, oracle: Oracle) -> None:
    prompts = prompt_ids(3, seed=6)
    results = engine.generate(prompts, 20, temperature=1.0, seed=9, return_hidden=True)
    for result in results:
        reference = oracle.final_hidden(result.prompt_ids + result.token_ids)  # [P + n, H]
        p = len(result.prompt_ids)
        assert result.prompt_hidden is not None and result.hidden is not None
        torch.testing.assert_close(result.prompt_hidden, reference[: p - 1], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(result.hidden, reference[p - 1 : -1], atol=1e-4, rtol=1e-4)


def engine_pids() -> set[int]:
    """This process's children (vLLM's engine core and worker; none when inline)."""
    me = os.getpid()
    children = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == me:
                    children.add(int(entry.name))
            except (OSError, ValueError, IndexError):
                continue
    return children


def test_load_policy_in_place_gives_the_new_checkpoints_logprobs(
    engine, models: dict[str, Path], oracle: Oracle, oracle_b: Oracle
) -> None:
    prompts = prompt_ids(3, seed=7)
    llm, pids = engine.llm, engine_pids()
    try:
        engine.load_policy(models["policy_b"])
        results = engine.generate(prompts, 24, temperature=1.0, seed=3, return_hidden=True)
        for result in results:
            new = oracle_b.logprobs(result.prompt_ids, result.token_ids, 1.0)
            old = oracle.logprobs(result.prompt_ids, result.token_ids, 1.0)
            torch.testing.assert_close(torch.tensor(result.logprobs), torch.tensor(new), atol=2e-4, rtol=0)
            assert max(abs(a - b) for a, b in zip(result.logprobs, old, strict=True)) > 0.1
            reference = oracle_b.final_hidden(result.prompt_ids + result.token_ids)
            torch.testing.assert_close(result.hidden, reference[len(result.prompt_ids) - 1 : -1], atol=1e-4, rtol=1e-4)
        (greedy,) = engine.generate(prompts[:1], 30, temperature=0.0)
        assert greedy.token_ids == oracle_b.greedy(prompts[0], 30)
        assert engine.llm is llm and engine_pids() == pids  # the same engine: nothing restarted
    finally:
        engine.load_policy(models["policy"])
    (back,) = engine.generate(prompts[:1], 30, temperature=0.0)
    assert back.token_ids == oracle.greedy(prompts[0], 30)


def test_requests_the_engine_cannot_serve_are_refused_in_one_line(engine, tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from tlt_stream.basics.errors import CheckpointError
    from tlt_stream.rollout.vllm.config import UnsupportedSetting

    other = tmp_path / "other"
    LlamaForCausalLM(
        LlamaConfig(
            vocab_size=100,
            hidden_size=64,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
        )
    ).save_pretrained(other)
    with pytest.raises(ValueError, match="token ids must lie in"):
        engine.add_request([1, 10_000], 4)
    with pytest.raises(ValueError, match="exceeds max_len"):
        engine.add_request([1, 2], MAX_LEN)
    with pytest.raises(UnsupportedSetting, match="greedily below temperature"):
        engine.add_request([1, 2], 4, temperature=1e-7)
    with pytest.raises(UnsupportedSetting, match="no partial rollouts"):
        engine.add_request([1, 2], 4, ahead_limit=2)
    with pytest.raises(CheckpointError, match="different architecture"):
        engine.load_policy(other)
    assert engine.num_running == 0
