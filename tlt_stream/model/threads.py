"""Torch's CPU threads for work done off a process's compute thread.

With OpenMP (torch's CPU backend here), every thread that runs a torch operator gets its own team of OpenMP
threads, as many as the last `torch.set_num_threads` of *any* thread asked for (ATen initializes each thread's
count lazily from that one global value). A service that sets its compute thread to all the cores and then runs
one operator on an executor thread (loading a checkpoint, saving one) keeps a second full team alive for as long as
the executor thread lives. The process then has more OpenMP threads than cores, and libgomp all but stops spinning
at its barriers (its "throttled" spin count), so every parallel region of the compute thread's own team waits for
a sleeping thread to be woken: a decode step takes up to twice as long for as long as the other thread lives
(`bench/side_threads.py` measures it, with the side thread on one torch thread beside).

So torch work off the compute thread takes one of two forms:

- work the compute thread waits for (loading a policy and re-verifying rows, saving or resuming a checkpoint):
  `in_own_thread`, a thread of its own that ends with the work, at the compute thread's torch threads; its team
  ends with it;
- work that runs beside the compute thread's (the drafter's training slices, an optimizer state written behind
  the next update): one torch thread (`one_torch_thread`, `off_compute_thread`), so there is no second team.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import threading
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import torch

__all__ = ["in_own_thread", "off_compute_thread", "one_torch_thread"]

P = ParamSpec("P")
R = TypeVar("R")


def one_torch_thread() -> None:
    """The calling thread's torch operators run on it alone (an executor's `initializer`, or the first thing a
    side thread does). Never call it on the compute thread: its count is its own and stays as set."""
    torch.set_num_threads(1)


def off_compute_thread(fn: Callable[P, R]) -> Callable[P, R]:
    """`fn` for a thread that runs beside the compute thread: it first puts its thread on one torch thread."""

    @functools.wraps(fn)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        one_torch_thread()
        return fn(*args, **kwargs)

    return run


async def in_own_thread(fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
    """`fn(*args, **kwargs)` on a new thread that ends when it returns, with the calling thread's torch threads,
    awaited without blocking the event loop (as `asyncio.to_thread`, whose pooled threads outlive the work and
    keep their OpenMP teams). A cancelled await leaves the work to finish on its thread."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[R] = loop.create_future()
    threads = torch.get_num_threads()
    context = contextvars.copy_context()

    def settle(result: R | None, error: BaseException | None) -> None:
        if done.cancelled():
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)  # type: ignore[arg-type]

    def run() -> None:
        torch.set_num_threads(threads)
        try:
            result = context.run(fn, *args, **kwargs)
        except BaseException as exc:  # handed to the awaiting task, as to_thread does
            loop.call_soon_threadsafe(settle, None, exc)
        else:
            loop.call_soon_threadsafe(settle, result, None)

    threading.Thread(target=run, name=f"torch-{getattr(fn, '__name__', 'work')}").start()
    return await done
