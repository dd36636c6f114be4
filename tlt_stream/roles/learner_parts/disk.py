"""The learner's writes that must land (an update's checkpoint, its `metrics.jsonl` line): retried until they do.

A full data volume (ENOSPC), a read-only remount or a directory gone must cost neither the update nor its
samples. The learner keeps the update in memory, acks and publishes nothing of it before its checkpoint
exists, and tries the write again with capped backoff until it lands or the service is stopped (then the last
error is raised; the samples are still pending for a restart). It says so in one log line naming the error
(and that the file system is full, when it is), again at most once every `REPEAT_S` while it lasts, and once
when the write lands. Each failed attempt and the landing also go to the `stats` stream as a
`LearnerDiskTrouble` entry, which `tlt-stream monitor` shows and exports (`tlt_learner_disk_failing`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from tlt_stream.basics.aio import retry
from tlt_stream.basics.messages import LearnerDiskTrouble
from tlt_stream.store.durable import describe_write_error

__all__ = ["REPEAT_S", "describe_write_error", "until_written"]

T = TypeVar("T")
log = logging.getLogger("tlt_stream.roles.learner")

REPEAT_S = 60.0
"""While a write keeps failing, its log line is repeated at most this often (every attempt goes to `stats`)."""


async def until_written(
    write: Callable[[], Awaitable[T]],
    *,
    what: str,
    version: int,
    stop: asyncio.Event | None,
    meanwhile: str = "",
    report: Callable[[LearnerDiskTrouble], Awaitable[None]] | None = None,
    base: float = 0.5,
    cap: float = 10.0,
) -> tuple[T, int]:
    """`write()`'s result once it has succeeded, and how many attempts failed before. Any error is retried
    (an I/O failure inside a library's writer is not always an OSError) with capped backoff, until `stop` is
    set: then the last error is raised. `what` names the write in the log ("checkpoint", ...), `meanwhile`
    says there what waits for it, `report` receives each failed attempt and, after failures, the landing."""
    failures, since, said_at, error = 0, 0.0, 0.0, ""

    async def failed(attempt: int, exc: Exception, delay: float) -> None:
        nonlocal failures, since, said_at, error
        failures, now, error = attempt, time.time(), describe_write_error(exc)
        if attempt == 1:
            since = said_at = now
            log.warning(
                "%s of version %d failed (%s); retry %d in %.1fs%s", what, version, error, attempt, delay,
                f"; {meanwhile}" if meanwhile else "",
            )  # fmt: skip
        elif now - said_at >= REPEAT_S:
            said_at = now
            log.warning(
                "%s of version %d still failing after %d attempts over %.0f s (%s); retrying every %.0f s at most",
                what, version, attempt, now - since, error, cap,
            )  # fmt: skip
        else:
            log.debug("%s of version %d failed again (%s); retry %d in %.1fs", what, version, error, attempt, delay)
        if report is not None:
            await report(LearnerDiskTrouble(write=what, version=version, attempts=attempt, error=error, since=since))

    result = await retry(
        write,
        retry_on=(Exception,),
        what=f"{what} of version {version}",
        max_attempts=None,
        base=base,
        cap=cap,
        stop=stop,
        on_failure=failed,
    )
    if failures:
        log.warning(
            "%s for version %d written after %d failed attempts over %.0f s",
            what, version, failures, time.time() - since,
        )  # fmt: skip
        if report is not None:
            landed = LearnerDiskTrouble(
                write=what, version=version, attempts=failures, error=error, since=since, written=True
            )
            await report(landed)
    return result, failures
