"""Small asyncio helpers every service shares: the stop event, interruptible sleep, and the one retry helper.

Services own their tasks in one `asyncio.TaskGroup`; a SIGTERM/SIGINT sets a stop `Event` that every loop
watches, so shutdown is "stop taking work, drain, exit" rather than cancellation in the middle of a write.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import signal
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

__all__ = [
    "Backoff",
    "as_task",
    "install_stop_signals",
    "one_error",
    "retry",
    "run",
    "sleep_or_stop",
    "wait_or_stop",
    "wait_until",
]

T = TypeVar("T")
log = logging.getLogger(__name__)


async def sleep_or_stop(stop: asyncio.Event, seconds: float) -> bool:
    """Sleep up to `seconds`, waking early when `stop` is set. Returns True when stop is set."""
    if stop.is_set():
        return True
    try:  # not asyncio.wait_for: on Python 3.11 it drops a cancellation that lands as `stop` is set
        async with asyncio.timeout(max(0.0, seconds)):
            await stop.wait()
    except TimeoutError:
        return False
    return True


@contextlib.contextmanager
def one_error() -> Iterator[None]:
    """Inside a task group's block: its one error goes out as itself, not as a group of one, so a caller's
    `except ValueError` (a service's exit 2, a learner's ranks out of step) still sees it."""
    try:
        yield
    except BaseExceptionGroup as group:
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise


async def wait_until(awaitable: Awaitable[object], stop: asyncio.Event, timeout: float | None = None) -> bool:
    """Await `awaitable` until it is done, `stop` is set, or `timeout` seconds pass (it is cancelled then).
    Returns whether it finished; an error it raised is raised here."""
    with one_error():
        async with asyncio.TaskGroup() as tasks:
            waited = tasks.create_task(_awaited(awaitable), name="wait-until")
            stopped = tasks.create_task(stop.wait(), name="wait-until-stop")
            await asyncio.wait({waited, stopped}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            for task in (waited, stopped):
                task.cancel()
    return not waited.cancelled()


async def _awaited(awaitable: Awaitable[T]) -> T:
    return await awaitable


def as_task(awaitable: Awaitable[T], name: str) -> asyncio.Task[T]:
    """`awaitable` as a named task (itself when it is one)."""
    if isinstance(awaitable, asyncio.Task):
        return awaitable
    return asyncio.create_task(_awaited(awaitable), name=name)


async def wait_or_stop(event: asyncio.Event, stop: asyncio.Event, timeout: float | None = None) -> bool:
    """Wait until `event` is set, `stop` is set, or `timeout` seconds pass. Returns whether `event` is set."""
    if not (event.is_set() or stop.is_set()):
        await wait_until(event.wait(), stop, timeout)
    return event.is_set()


def install_stop_signals(stop: asyncio.Event) -> None:
    """Set `stop` on SIGTERM and SIGINT (a second SIGINT falls through to the default: KeyboardInterrupt)."""
    loop = asyncio.get_running_loop()

    def _on_signal(sig: signal.Signals) -> None:
        if stop.is_set() and sig == signal.SIGINT:
            loop.remove_signal_handler(signal.SIGINT)
        log.info("received %s: stopping", sig.name)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, _on_signal, sig)
        except (NotImplementedError, RuntimeError):  # not the main thread, or no signals on this platform
            pass


@dataclass
class Backoff:
    """Capped exponential backoff with full jitter: delay n is uniform in [0, min(cap, base * 2**n)]."""

    base: float = 0.1
    cap: float = 30.0
    attempt: int = 0

    def next_delay(self) -> float:
        delay = min(self.cap, self.base * (2**self.attempt))
        self.attempt += 1
        return random.uniform(0.5 * delay, delay)

    def reset(self) -> None:
        self.attempt = 0


async def retry(
    operation: Callable[[], Awaitable[T]],
    *,
    retry_on: tuple[type[Exception], ...],
    what: str,
    max_attempts: int | None = 8,
    base: float = 0.1,
    cap: float = 30.0,
    stop: asyncio.Event | None = None,
    on_failure: Callable[[int, Exception, float], Awaitable[None]] | None = None,
) -> T:
    """Run `operation`, retrying the listed errors with capped backoff; other errors propagate at once.

    `max_attempts=None` retries until `stop` is set (then the last error is raised). Each failure to be
    retried is logged as one warning, or handed to `on_failure(attempt, error, delay)` instead.
    """
    backoff = Backoff(base=base, cap=cap)
    attempt = 0
    while True:
        attempt += 1
        try:
            return await operation()
        except retry_on as exc:
            if max_attempts is not None and attempt >= max_attempts:
                raise
            delay = backoff.next_delay()
            if on_failure is not None:
                await on_failure(attempt, exc, delay)
            else:
                log.warning("%s failed (%s: %s); retry %d in %.1fs", what, type(exc).__name__, exc, attempt, delay)
            if stop is None:
                await asyncio.sleep(delay)
            elif await sleep_or_stop(stop, delay):
                raise


def run(main: Awaitable[T]) -> T:
    """Run a coroutine on uvloop when it is available (the services' entry), else on asyncio's loop."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency except on Windows
        return asyncio.run(main)  # type: ignore[arg-type]
    return uvloop.run(main)  # type: ignore[arg-type]
