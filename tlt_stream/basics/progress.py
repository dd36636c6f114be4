"""Progress bars for long work: one rich bar per phase, fed by `progress(phase, done, total, metrics)`.

Bars go to stderr. When stderr is not a terminal (a cluster job's log, nohup, CI), each phase instead
prints one plain line per tenth of its work, so a log still shows how far a job got; each line's seconds are
its phase's own, from the phase's first report, as the bar's clock is. The callback
signature is plain, so library code reports progress without importing rich.
"""

from __future__ import annotations

import sys
import time
from types import TracebackType
from typing import Any


class PhaseProgress:
    """Context manager; call the instance as `progress(phase, done, total, metrics)`."""

    def __init__(self) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        console = Console(stderr=True)
        self._progress = Progress(
            TextColumn("{task.description:<14}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[metrics]}"),
            console=console,
            disable=not console.is_terminal,
        )
        self._tasks: dict[str, Any] = {}
        self._plain = not console.is_terminal
        self._logged: dict[str, int] = {}
        self._started: dict[str, float] = {}

    def __enter__(self) -> PhaseProgress:
        self._progress.__enter__()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self._progress.__exit__(kind, value, traceback)

    def __call__(self, phase: str, done: int, total: int, metrics: dict[str, float]) -> None:
        if phase not in self._tasks:
            self._tasks[phase] = self._progress.add_task(phase, total=total, metrics="")
            self._started[phase] = time.perf_counter()
        text = "  ".join(f"{k} {v:.3g}" for k, v in metrics.items())
        if self._plain:
            tenth = (10 * done) // max(1, total)
            if tenth > self._logged.get(phase, -1):
                self._logged[phase] = tenth
                elapsed = time.perf_counter() - self._started[phase]
                print(f"{phase}: {done}/{total} ({elapsed:.0f}s) {text}".rstrip(), file=sys.stderr, flush=True)
        self._progress.update(self._tasks[phase], completed=done, total=total, metrics=text)
