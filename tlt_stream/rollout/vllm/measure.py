"""What each vLLM engine step cost and emitted, measured inside vLLM's worker (pure: no vllm import).

The per-bucket tuner (`tuning.py`) needs, per decode step: the running rows, the chain length K the step
verified, the tokens it emitted and its seconds. vLLM's scheduler fixes K per step (its batch-size schedule,
`SchedulerOutput.num_spec_tokens_to_schedule`), and its model runner does the step in two calls:
`execute_model(scheduler_output)` (the target's forward over every row's last token and the drafts it verifies)
and `sample_tokens(...)` (sampling, rejection, and the next drafts of K tokens), whose `ModelRunnerOutput`
lists the tokens each row emitted. `StepMeter.install(runner)` wraps those two calls on the runner instance
(the worker extension's `tlt_measure`), so a step's seconds are the model's draft + verify time, not the
engine core's scheduling or the client's output handling (the same for every arm).

A step is recorded only when it says what one arm costs: no row prefilled (every row scheduled 1 + its drafts
tokens), and the drafts it verified were made with the K it drafts with (a step after a change of K verifies
the old K's drafts and makes the new K's: neither arm's). K = 0 is plain decoding.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any, NamedTuple

__all__ = ["Step", "StepMeter"]


class Step(NamedTuple):
    """One decode step of vLLM's engine."""

    rows: int
    k: int
    """Draft tokens per row the step verified and drafted (0: plain)."""
    tokens: int
    """Tokens the step emitted over every row (accepted drafts + one each)."""
    seconds: float
    drafted: int
    """Draft tokens the step verified."""


def _sampled(output: Any) -> list[Any] | None:
    tokens = getattr(output, "sampled_token_ids", None)
    return tokens if isinstance(tokens, list) else None


class StepMeter:
    """Records `Step`s of one vLLM model runner (at most `keep` between drains: the newest)."""

    def __init__(self, *, keep: int = 4096, clock: Callable[[], float] = time.perf_counter) -> None:
        self.steps: deque[Step] = deque(maxlen=keep)
        self.clock = clock
        self._open: tuple[Any, float] | None = None
        self._last_k: int | None = None

    def install(self, runner: Any) -> None:
        """Wrap `runner.execute_model` and `runner.sample_tokens` (instance attributes: the class is vLLM's)."""
        execute, sample = runner.execute_model, getattr(runner, "sample_tokens", None)

        def execute_model(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            self.started(scheduler_output)
            out = execute(scheduler_output, *args, **kwargs)
            if out is not None:  # a runner that samples in execute_model (or returned early)
                self.finished(out)
            return out

        runner.execute_model = execute_model
        if sample is not None:

            def sample_tokens(*args: Any, **kwargs: Any) -> Any:
                out = sample(*args, **kwargs)
                self.finished(out)
                return out

            runner.sample_tokens = sample_tokens

    def started(self, scheduler_output: Any) -> None:
        self._open = (scheduler_output, self.clock())

    def finished(self, output: Any) -> None:
        if self._open is None:
            return
        scheduler_output, start = self._open
        self._open = None
        seconds = self.clock() - start
        scheduled: dict[str, int] = dict(getattr(scheduler_output, "num_scheduled_tokens", None) or {})
        drafts: dict[str, list[int]] = dict(getattr(scheduler_output, "scheduled_spec_decode_tokens", None) or {})
        k = int(getattr(scheduler_output, "num_spec_tokens_to_schedule", 0) or 0)
        last, self._last_k = self._last_k, k
        sampled = _sampled(output)
        if not scheduled or sampled is None:
            return
        decode_only = all(n == 1 + len(drafts.get(rid, ())) for rid, n in scheduled.items())
        verified = max((len(d) for d in drafts.values()), default=0)
        if not decode_only or last != k or verified > k:
            return
        tokens = sum(len(t) for t in sampled)
        if tokens > 0 and seconds > 0:
            self.steps.append(Step(len(scheduled), k, tokens, seconds, sum(len(d) for d in drafts.values())))

    def drain(self) -> list[tuple[int, int, int, float, int]]:
        """The steps recorded since the last drain, as plain tuples (they cross vLLM's process boundary)."""
        steps = [tuple(s) for s in self.steps]
        self.steps.clear()
        return steps  # type: ignore[return-value]
