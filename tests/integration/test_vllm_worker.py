"""The rollout worker's refusals on the vLLM backend, before it connects to anything. The worker on the real
engine, in the whole loop, is tests/vllm/test_loop.py (vLLM's CPU build, `make test-vllm`)."""

from __future__ import annotations

import sys

import pytest

from tlt_stream.basics.config import DEFAULTS, ConfigError, override
from tlt_stream.commands.cli import main


def test_partial_rollouts_reach_the_vllm_engines_settings() -> None:
    """The worker's vLLM engine is built to stream its requests for re-verification (the engine itself:
    tests/vllm/test_partial.py)."""
    from tlt_stream.rollout.build import vllm_settings

    on = override(DEFAULTS, {"rollout.backend": "vllm", "policy.partial_rollouts": True})
    assert vllm_settings(on, None, hidden=False).partial_rollouts
    assert not vllm_settings(override(on, {"policy.partial_rollouts": False}), None, hidden=False).partial_rollouts


def test_adaptive_group_drafts_are_refused_on_the_vllm_backend() -> None:
    with pytest.raises(ConfigError, match="use --fixed-sd with group drafts"):
        override(DEFAULTS, {"sd.drafter": "ngram", "sd.group": True, "sd.adaptive": True, "rollout.backend": "vllm"})
    with pytest.raises(ConfigError, match=r"rollout\.backend: invalid enum value 'tensorrt'"):
        override(DEFAULTS, {"rollout.backend": "tensorrt"})


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ([], "tlt-stream rollout-worker: the vllm rollout backend needs vLLM"),
        (["--drafter", "ngram"], "tlt-stream rollout-worker: the vllm rollout backend needs vLLM"),  # adaptive
        (["--drafter", "ngram", "--set", "sd.group=true"], "configuration error: sd.adaptive: "),
        # partial rollouts are accepted (then vLLM is missing); drafts held back by ahead_rows are not
        (["--set", "policy.partial_rollouts=true"], "tlt-stream rollout-worker: the vllm rollout backend needs vLLM"),
        (
            ["--set", "policy.partial_rollouts=true", "--set", "policy.ahead_rows=4"],
            "configuration error: policy.ahead_rows: ",
        ),
    ],
)
def test_a_vllm_worker_is_refused_in_one_line_before_it_connects(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], extra: list[str], needle: str
) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError, installed or not
    # An unreachable Redis: a worker that got past the refusal would fail on connecting, not with exit 2.
    argv = ["rollout-worker", "--backend", "vllm", "--redis-url", "redis://127.0.0.1:9/0", *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tlt-stream") and needle in err and "\n" not in err


@pytest.mark.parametrize("grouped", [False, True])
def test_a_worker_whose_engine_died_exits_non_zero_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], grouped: bool
) -> None:
    """What the worker does with `EngineDied` from its engine (the real engine raising it when its process is
    killed: tests/vllm/test_ngram.py; the whole run around it: tests/vllm/test_engine_death.py)."""
    from tlt_stream.roles import rollout_worker, serve
    from tlt_stream.rollout.vllm import backend
    from tlt_stream.rollout.vllm.lifecycle import EngineDied

    died = EngineDied("vLLM's engine died (EngineCore_DP0 exited with code -9): EngineDeadError: gone")

    def dying(*_: object) -> int:
        raise ExceptionGroup("hop", [died]) if grouped else died

    monkeypatch.setattr(backend, "require_vllm", lambda: None)
    monkeypatch.setattr(serve, "serve", dying)
    config = override(DEFAULTS, {"rollout.backend": "vllm", "rollout.worker_id": "w7"})
    assert rollout_worker.serve_rollout_worker(config) == rollout_worker.ENGINE_DIED != 0
    err = capsys.readouterr().err.strip()
    assert err == f"tlt-stream rollout-worker w7: {died}; its unfinished groups go to another worker"
