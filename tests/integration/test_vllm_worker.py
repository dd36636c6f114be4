"""The rollout worker's refusals on the vLLM backend, before it connects to anything. The worker on the real
engine, in the whole loop, is tests/vllm/test_loop.py (vLLM's CPU build, `make test-vllm`)."""

from __future__ import annotations

import sys

import pytest

from tlt_stream.cli import main
from tlt_stream.roles.rollout_worker import RolloutSettings
from tlt_stream.rollout.adaptive import AdaptiveSettings


def test_adaptive_sd_is_refused_on_the_vllm_backend() -> None:
    with pytest.raises(ValueError, match="fixed --sd-arm"):
        RolloutSettings(drafter="ngram", adaptive=AdaptiveSettings(), backend="vllm")
    with pytest.raises(ValueError, match="unknown rollout backend 'tensorrt'"):
        RolloutSettings(backend="tensorrt")


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ([], "the vllm rollout backend needs vLLM"),
        (["--drafter", "ngram"], "use a fixed sd.arm"),  # adaptive SD, the default
        (["--drafter", "ngram", "--adaptive-sd"], "use a fixed sd.arm"),
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
    assert err.startswith("tlt-stream rollout-worker: ") and needle in err and "\n" not in err
