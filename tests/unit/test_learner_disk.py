"""The learner's writes that must land (`roles/learner_parts/disk.py`): retried until written, said once, reported;
and what the monitor makes of the reports. A real full file system: tests/integration/test_full_disk.py."""

from __future__ import annotations

import asyncio
import errno
import logging
import re

import pytest

from tlt_stream.basics.messages import LearnerDiskTrouble, LearnerStats
from tlt_stream.roles.learner_parts import disk
from tlt_stream.roles.learner_parts.disk import describe_write_error, until_written
from tlt_stream.roles.monitor import learner_disk_summary, prometheus_text
from tlt_stream.roles.monitor.dashboard import summary_line
from tlt_stream.store.durable import disk_full


class SafetensorLike(Exception):
    """An I/O failure as a library's writer wraps it (safetensors raises its own type, not OSError)."""


def test_a_full_file_system_is_named_whatever_wraps_the_error() -> None:
    full = OSError(errno.ENOSPC, "No space left on device")
    assert describe_write_error(full) == "OSError: [Errno 28] No space left on device (the file system is full)"
    wrapped = SafetensorLike("Error while serializing: I/O error: No space left on device (os error 28)\nmore")
    assert describe_write_error(wrapped).endswith("(os error 28) (the file system is full)")
    assert describe_write_error(NotADirectoryError(errno.ENOTDIR, "Not a directory")).endswith("Not a directory")
    assert describe_write_error(RuntimeError()) == "RuntimeError"
    # A task group's error (the rollout worker's drafter training): the full disk inside it is found and named.
    group = ExceptionGroup("unhandled errors in a TaskGroup", [ValueError("other"), wrapped])
    assert disk_full(group) and describe_write_error(group).startswith("SafetensorLike: Error while serializing")
    assert not disk_full(ExceptionGroup("x", [ValueError("other")]))


def failing(times: int, error: Exception) -> tuple[list[int], object]:
    calls: list[int] = []

    async def write() -> str:
        calls.append(len(calls) + 1)
        if len(calls) <= times:
            raise error
        return "written"

    return calls, write


async def test_a_write_is_retried_until_it_lands_said_once_and_reported_each_time(
    caplog: pytest.LogCaptureFixture,
) -> None:
    calls, write = failing(4, OSError(errno.ENOSPC, "No space left on device"))
    reports: list[LearnerDiskTrouble] = []

    async def report(trouble: LearnerDiskTrouble) -> None:
        reports.append(trouble)

    with caplog.at_level(logging.DEBUG, logger="tlt_stream.roles.learner"):
        result, failed = await until_written(
            write, what="checkpoint", version=3, stop=asyncio.Event(), meanwhile="nothing acked", report=report,
            base=0.0, cap=0.0,
        )  # fmt: skip
    assert (result, failed, calls) == ("written", 4, [1, 2, 3, 4, 5])
    assert [(r.attempts, r.written, r.version, r.write) for r in reports] == [
        *((n, False, 3, "checkpoint") for n in (1, 2, 3, 4)),
        (4, True, 3, "checkpoint"),
    ]
    assert len({r.since for r in reports}) == 1 and "(the file system is full)" in reports[0].error
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 2, warnings  # the first failure and the landing; the repeats only at debug
    assert warnings[0].startswith("checkpoint of version 3 failed (OSError: [Errno 28] No space left on device")
    assert warnings[0].endswith("; nothing acked")
    assert warnings[1].startswith("checkpoint for version 3 written after 4 failed attempts")
    assert not any(r.exc_info for r in caplog.records), "no traceback"


async def test_a_long_failure_is_said_again_at_most_once_per_period(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(disk, "REPEAT_S", 0.0)  # every failure is past the period
    _, write = failing(3, OSError(errno.ENOSPC, "No space left on device"))
    with caplog.at_level(logging.WARNING, logger="tlt_stream.roles.learner"):
        await until_written(write, what="metrics line", version=1, stop=None, base=0.0, cap=0.0)
    said = [r.getMessage() for r in caplog.records]
    assert [re.sub(r" over \d+ s$", "", s.split(" (")[0]) for s in said] == [
        "metrics line of version 1 failed",
        "metrics line of version 1 still failing after 2 attempts",
        "metrics line of version 1 still failing after 3 attempts",
        "metrics line for version 1 written after 3 failed attempts",
    ]


async def test_a_stop_ends_the_retries_with_the_last_error() -> None:
    stop = asyncio.Event()
    calls, write = failing(10**6, OSError(errno.ENOSPC, "No space left on device"))

    async def report(trouble: LearnerDiskTrouble) -> None:
        if trouble.attempts == 3:
            stop.set()

    with pytest.raises(OSError, match="No space left"):
        await until_written(write, what="checkpoint", version=1, stop=stop, report=report, base=0.0, cap=0.0)
    assert calls == [1, 2, 3]


def test_the_monitor_shows_a_failing_write_until_it_lands_or_the_learner_moves_on() -> None:
    def trouble(attempts: int, written: bool = False, write: str = "checkpoint") -> LearnerDiskTrouble:
        return LearnerDiskTrouble(
            write=write, version=4, attempts=attempts, error="OSError: full", since=70.0, written=written
        )

    update = LearnerStats(step=3, policy_version=3, groups=2, samples=4)
    assert learner_disk_summary([(90.0, update)], 100.0) is None
    failing = learner_disk_summary([(95.0, trouble(2)), (80.0, trouble(1)), (60.0, update)], 100.0)
    assert failing == {
        "failing": True, "write": "checkpoint", "version": 4, "attempts": 2, "error": "OSError: full",
        "failing_s": 30.0, "age_s": 5.0,
    }  # fmt: skip
    landed = learner_disk_summary([(96.0, trouble(2, written=True)), (95.0, trouble(2))], 100.0)
    assert landed is not None and not landed["failing"] and landed["failing_s"] is None
    # A learner restarted while failing wrote no landing, but its next update says it has moved on.
    moved_on = learner_disk_summary([(99.0, update), (95.0, trouble(2))], 100.0)
    assert moved_on is not None and not moved_on["failing"]

    snap = {
        "run": "r1", "reachable": True, "time": 100.0, "streams": {}, "dead": {"counts": {}, "total": 0},
        "worker_states": {}, "workers": [], "versions": {}, "learner": None, "drafter": None,
        "rollout": {"workers": {}, "tokens_per_s": 0.0, "generation_tokens_per_s": None, "tokens_per_forward": None,
                    "sd_on_workers": 0},
        "stats_read": {"undecodable": 0}, "learner_disk": failing,
    }  # fmt: skip
    text = prometheus_text(snap)
    assert 'tlt_learner_disk_failing{run="r1"} 1.0' in text
    assert 'tlt_learner_disk_failed_attempts{run="r1"} 2.0' in text
    assert "the checkpoint of version 4 cannot be written for 30 s (2 attempts: OSError: full)" in summary_line(snap)
    assert 'tlt_learner_disk_failing{run="r1"} 0.0' in prometheus_text({**snap, "learner_disk": landed})
    assert 'tlt_learner_disk_failing{run="r1"} 0.0' in prometheus_text({**snap, "learner_disk": None})
    assert "cannot be written" not in summary_line({**snap, "learner_disk": landed})
