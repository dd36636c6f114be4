"""Progress off a terminal: one plain line per tenth of each phase, so job logs show how far work got."""

from __future__ import annotations

import pytest

from tlt_stream.basics.progress import PhaseProgress


def test_plain_progress_logs_each_tenth_of_each_phase(capsys: pytest.CaptureFixture[str]) -> None:
    with PhaseProgress() as progress:
        for done in range(1, 201):
            progress("policy", done, 200, {"loss": 1.0 / done})
        for done in range(1, 4):
            progress("drafter", done, 3, {})
    lines = capsys.readouterr().err.splitlines()
    policy = [line for line in lines if line.startswith("policy:")]
    assert len(policy) == 11, policy  # the first step, then every tenth
    assert policy[-1].startswith("policy: 200/200") and "loss 0.005" in policy[-1]
    assert [line.split()[1] for line in lines if line.startswith("drafter:")] == ["1/3", "2/3", "3/3"]


def test_plain_lines_count_each_phase_from_its_own_start(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each line counted from the start of all progress: `run`'s last train line said 50s where the run's
    closing line, counted from the start of training, said 43s (the evaluation before it was in the first)."""
    import time as clock

    now = [100.0]
    monkeypatch.setattr(clock, "perf_counter", lambda: now[0])
    with PhaseProgress() as progress:
        progress("eval", 0, 1, {})
        now[0] += 7.0
        progress("eval", 1, 1, {})
        progress("train", 0, 2, {})
        now[0] += 43.0
        progress("train", 2, 2, {})
    lines = capsys.readouterr().err.splitlines()
    assert "eval: 1/1 (7s)" in lines and "train: 0/2 (0s)" in lines and "train: 2/2 (43s)" in lines, lines
