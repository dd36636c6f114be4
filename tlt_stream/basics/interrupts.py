"""Ctrl-C noticed even where a C extension swallowed it.

Python turns a SIGINT into KeyboardInterrupt at the next bytecode it runs, and that may be Python code called
back from C: torch, building a tensor from a sequence (a list, a storage), calls the sequence's `__getitem__`
and turns any exception it raises into `ValueError("could not determine the shape of object type ...")`. A
Ctrl-C that lands there would reach a command as a ValueError, which it reports as a failed step ("evaluation
before training failed: could not determine the shape ...", exit 1) instead of an interruption. While
`noting_sigint()` is active, a SIGINT is noted before it raises, so a command that catches an error can ask
`sigint_received()` and report an interruption (exit 130) instead."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType

__all__ = ["noting_sigint", "sigint_received"]

_received = False


def _note_sigint(signum: int, frame: FrameType | None) -> None:
    """Python's own SIGINT handler (KeyboardInterrupt), noting the signal first."""
    global _received
    _received = True
    signal.default_int_handler(signum, frame)


def sigint_received() -> bool:
    """Whether a SIGINT arrived since the innermost `noting_sigint()` was entered."""
    return _received


@contextlib.contextmanager
def noting_sigint() -> Iterator[None]:
    """Note every SIGINT while inside (then raise KeyboardInterrupt, as Python's default handler does). Only in
    the main thread and only over Python's default handler: a handler of someone else's (an event loop's, a
    test runner's) is left alone, and the one found is put back on the way out."""
    global _received
    _received = False
    previous = None
    main = threading.current_thread() is threading.main_thread()
    if main and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        previous = signal.signal(signal.SIGINT, _note_sigint)
    try:
        yield
    finally:
        if previous is not None and signal.getsignal(signal.SIGINT) is _note_sigint:
            signal.signal(signal.SIGINT, previous)
