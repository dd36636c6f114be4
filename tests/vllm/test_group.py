"""Group/history drafts inside vLLM: this project's suffix index as vLLM's `custom_class` proposer
(`rollout/vllm/group.py`), one inline engine: greedy output identical to transformers', log-probs the
target's, and a prompt's later responses drafting from its earlier ones (accept lengths, from vLLM's own
per-request metrics)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.vllm.conftest import Oracle, closing, prompt_ids, requires_vllm, settings

pytestmark = requires_vllm

DEPTH = 4


@pytest.fixture(scope="module")
def engine(models: dict[str, Path], engine_dir: Path) -> Iterator:
    from tlt_stream.rollout.vllm.backend import VllmEngine

    yield from closing(VllmEngine(models["policy"], settings=settings(engine_dir, arm=f"group-d{DEPTH}v{DEPTH}")))


def mean_accept(results: list) -> float:
    rounds = [n for r in results for n in r.accept_lengths]
    return sum(rounds) / max(1, len(rounds))


def test_a_prompts_later_responses_draft_from_its_earlier_ones_and_stay_transformers_greedy(
    engine, oracle: Oracle
) -> None:
    first, second = prompt_ids(2, seed=41)
    (alone,) = engine.generate([first], 48, temperature=0.0)  # nothing of this prompt's responses indexed yet
    assert alone.token_ids == oracle.greedy(first, 48)
    group = engine.generate([first] * 4, 48, temperature=0.0)  # the first response is history now
    for result in group:
        assert result.token_ids == alone.token_ids
        assert sum(result.accept_lengths) <= len(result.token_ids)
    assert mean_accept(group) > 2.0, [r.accept_lengths for r in group]  # a chain of 4 mostly accepted
    assert engine._rpc("tlt_group_drafted")[0] > 0
    (other,) = engine.generate([second], 48, temperature=0.0)  # another prompt: its own index, exact still
    assert other.token_ids == oracle.greedy(second, 48)


def test_logprobs_with_group_drafts_are_the_targets_at_the_rollout_temperature(engine, oracle: Oracle) -> None:
    (prompt,) = prompt_ids(1, seed=42)
    results = engine.generate([prompt] * 6, 32, temperature=0.7, seed=3)
    results += engine.generate([prompt] * 6, 32, temperature=0.7, seed=4)  # drafting from the first six
    assert any(n > 1 for r in results for n in r.accept_lengths), "some group drafts were accepted"
    for result in results:
        expected = oracle.logprobs(result.prompt_ids, result.token_ids, 0.7)
        torch.testing.assert_close(torch.tensor(result.logprobs), torch.tensor(expected), atol=2e-4, rtol=0)


def test_a_response_remembered_from_another_worker_is_drafted_from(engine, oracle: Oracle) -> None:
    """`group_history.remember` (what the rollout worker's follower calls with other workers' samples): the
    first request of a prompt this engine never ran drafts from the remembered response."""
    (prompt,) = prompt_ids(1, seed=43)
    response = oracle.greedy(prompt, 48)  # what another worker's greedy request returned
    engine.group_history.remember(prompt, response)
    (result,) = engine.generate([prompt], 48, temperature=0.0)
    assert result.token_ids == response
    assert mean_accept([result]) > 2.0, result.accept_lengths
