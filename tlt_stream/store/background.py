"""A write that runs behind training: the optimizer state of a checkpoint that is already committed.

The learner publishes a version once its policy, ledger and meta are durable; its optimizer moments (twice
the policy's bytes in fp32) only matter to a resume, so they are written on a thread while the next update
runs, as TLT's selective checkpoints write what rollout does not need off the critical path. The state is a
snapshot taken before the next optimizer step can change it. At most one write is in flight: a new one first
waits for the previous. One process's write lands through `atomic_directory`, so its directory appears
whole or not at all, and its presence is what marks the state complete; a write that fails or is killed
leaves only a `.tmp-` leftover. A sharded learner's rank lands one file of a set the ranks write each on
their own thread (`directory=False`: the write is atomic itself, `store/shards.py`), and the set counts
only once complete. Either way a resume falls back to the newest complete state (`rl/checkpoint.py`,
`optimizer_source`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tlt_stream.store.durable import atomic_directory

__all__ = ["BackgroundWriter", "WriteReport"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WriteReport:
    """How one background write went."""

    target: Path
    seconds: float
    error: str | None = None
    """None: the directory is durable at `target`; else why it is not there."""


class BackgroundWriter:
    """One background write at a time, each of a directory or file that appears whole or not at all."""

    def __init__(self, name: str = "background-write") -> None:
        self.name = name
        self._thread: threading.Thread | None = None
        self._target: Path | None = None
        self.last: WriteReport | None = None
        """The newest finished write."""
        self.last_failure: WriteReport | None = None
        """The newest failed write (kept when later writes succeed: a sharded learner reports it to rank 0)."""
        self.failures = 0

    @property
    def busy(self) -> Path | None:
        """The directory or file a write in flight is making (None when idle); nothing may remove the
        checkpoint it is in."""
        thread = self._thread
        return self._target if thread is not None and thread.is_alive() else None

    def submit(self, target: Path, write: Callable[[Path], None], *, directory: bool = True) -> float:
        """Make `target` on a thread, after the previous write has finished: a directory that `write(tmp)`
        fills in a temporary sibling, or (`directory=False`) whatever `write(target)` lands atomically on its
        own. The seconds spent waiting for the previous write (0 when it was done)."""
        waited = self.wait()
        if target.exists():
            raise FileExistsError(f"{target}: already written")
        self._target = target
        args = (target, write, directory)
        self._thread = threading.Thread(target=self._run, args=args, name=self.name, daemon=False)
        self._thread.start()
        return waited

    def wait(self) -> float:
        """Block until the write in flight (if any) has finished; the seconds waited. Never raises for the
        write's own failure: that is logged and kept in `last`."""
        thread = self._thread
        if thread is None:
            return 0.0
        started = time.perf_counter()
        thread.join()
        self._thread = None
        return time.perf_counter() - started

    def _run(self, target: Path, write: Callable[[Path], None], directory: bool) -> None:
        started = time.perf_counter()
        try:
            if directory:
                with atomic_directory(target) as tmp:
                    write(tmp)
            else:
                write(target)
        except Exception as exc:  # a thread's exception would vanish: the checkpoint just lacks this state
            report = WriteReport(target, time.perf_counter() - started, f"{type(exc).__name__}: {exc}")
            self.last = self.last_failure = report
            self.failures += 1  # after the report it counts: a reader that sees the count sees its report
            log.error("background write of %s failed (%s); a resume uses an older complete one", target, exc)
            return
        self.last = WriteReport(target, time.perf_counter() - started)
