"""One vLLM engine with n-gram (prompt lookup) speculation, started as the backend starts it by default (vLLM's
engine core and worker in processes of their own): greedy identity against transformers, then what happens
when that engine process dies under a request in flight. The death test is the module's last: it kills the
engine the module shares."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.vllm.conftest import Oracle, children, closing, prompt_ids, requires_vllm, settings

pytestmark = requires_vllm


@pytest.fixture(scope="module")
def engine(models: dict[str, Path], engine_dir: Path) -> Iterator:
    from tlt_stream.rollout.vllm.backend import VllmEngine

    yield from closing(VllmEngine(models["policy"], settings=settings(engine_dir, arm="ngram-d4", inline=False)))


def repetitive_prompts(count: int) -> list[list[int]]:
    """Prompts that repeat a phrase: prompt lookup finds what the greedy response copies."""
    return [p + p[-12:] * 3 for p in prompt_ids(count, seed=31)]


def test_greedy_output_with_ngram_drafts_is_transformers_greedy(engine, oracle: Oracle) -> None:
    prompts = repetitive_prompts(6)
    results = engine.generate(prompts, 40, temperature=0.0)
    for prompt, result in zip(prompts, results, strict=True):
        assert result.token_ids == oracle.greedy(prompt, 40)
        assert sum(result.accept_lengths) <= len(result.token_ids)
    assert any(n > 1 for r in results for n in r.accept_lengths)  # some lookup drafts were accepted


def test_an_engine_whose_process_dies_fails_in_one_line_and_does_not_hang(engine) -> None:
    from tlt_stream.rollout.vllm.backend import EngineDied

    (prompt,) = repetitive_prompts(1)
    engine.add_request(prompt, 120, 1.0, seed=1, request_id="doomed")
    engine.step()
    cores = [pid for pid, line in children(os.getpid()).items() if "EngineCore" in line]
    assert len(cores) == 1, children(os.getpid())
    os.kill(cores[0], signal.SIGKILL)
    with pytest.raises(EngineDied) as caught:
        while True:  # each step either returns or raises: a dead engine must raise, never block
            engine.step()
    message = str(caught.value)
    assert "\n" not in message and "engine died" in message
    with pytest.raises(EngineDied):
        engine.add_request(prompt, 4, 0.0)
