"""Progress bars for long work: one rich bar per phase, fed by `progress(phase, done, total, metrics)`.

Bars go to stderr and vanish when not on a terminal (CI logs stay clean); the callback signature is
plain, so library code reports progress without importing rich.
"""

from __future__ import annotations

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
        text = "  ".join(f"{k} {v:.3g}" for k, v in metrics.items())
        self._progress.update(self._tasks[phase], completed=done, total=total, metrics=text)
