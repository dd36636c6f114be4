"""Rewards that may be slow, raise or hang, scored a whole group at a time in worker processes.

A reward runs in a process of its own (spawned: no torch state is forked), so a slow one never blocks
generation and a hung one can be killed: past `timeout_s` the pool's processes are killed and replaced, and
the group fails as a whole. A failed group is never scored 0 (zeroing or skipping failed samples biases the
update): the caller drops it whole and counts it. The reward is named, not pickled (`rewards.resolve_reward`
runs in each process), so a function from a file of one's own works the same there.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import multiprocessing
import traceback
from typing import Any

from tlt_stream.rl.rewards import RewardFn, call_reward, resolve_reward

__all__ = ["INLINE_REWARDS", "RewardFailed", "RewardPool"]

INLINE_REWARDS = frozenset({"repeated_add", "exact"})
"""Built-in rewards cheap enough to score on the worker's own thread (`rollout.reward_workers` auto: 0)."""

_reward: RewardFn | None = None


class RewardFailed(Exception):
    """The reward raised or ran past its timeout on a group; `detail` holds the traceback when there is one."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(reason)
        self.reason = reason
        self.detail = detail


def _init(name: str) -> None:
    global _reward
    _reward = resolve_reward(name)


def _score(texts: list[str], answer: str, fields: dict[str, Any]) -> list[float] | tuple[str, str]:
    """The group's rewards, or (reason, traceback) when the reward raised on one of them."""
    assert _reward is not None
    try:
        return [call_reward(_reward, text, answer, fields) for text in texts]
    except Exception as exc:
        return f"the reward raised: {type(exc).__name__}: {exc}", traceback.format_exc()


class RewardPool:
    """`workers` processes scoring groups with the reward `name`, each group within `timeout_s`."""

    def __init__(self, name: str, *, workers: int, timeout_s: float) -> None:
        if workers < 1 or not timeout_s > 0:
            raise ValueError(f"a reward pool needs workers >= 1 and timeout_s > 0, got {workers}, {timeout_s}")
        resolve_reward(name)  # a bad name fails here, in the caller, in one line
        self.name = name
        self.workers = workers
        self.timeout_s = timeout_s
        self.timeouts = 0
        self._slots = asyncio.Semaphore(workers)
        self._generation = 0
        self._executor = self._start()

    def _start(self) -> concurrent.futures.ProcessPoolExecutor:
        return concurrent.futures.ProcessPoolExecutor(
            self.workers, mp_context=multiprocessing.get_context("spawn"), initializer=_init, initargs=(self.name,)
        )

    async def score(self, texts: list[str], answer: str, fields: dict[str, Any] | None = None) -> list[float]:
        """The rewards of a group's responses; raises `RewardFailed` when the reward raised or hung on it.

        At most `workers` groups are in the processes at once (the others wait here), so a group's timeout
        counts its own scoring, not a queue behind a hung one. A group whose process was killed for another
        group's hang is scored again in the fresh processes: only the group that hung fails."""
        async with self._slots:
            for _ in range(3):
                generation = self._generation
                future = asyncio.wrap_future(self._executor.submit(_score, texts, answer, fields or {}))
                try:  # asyncio.timeout, not wait_for: Python 3.11's wait_for can drop a cancellation
                    async with asyncio.timeout(self.timeout_s):
                        result: Any = await future
                except TimeoutError:
                    self.timeouts += 1
                    self._restart()
                    raise RewardFailed(f"the reward ran past its timeout of {self.timeout_s:g} s") from None
                except concurrent.futures.process.BrokenProcessPool:
                    if self._generation != generation:
                        continue  # killed with the others for another group's hang: score this one again
                    self._restart()
                    raise RewardFailed("the reward's process died (a crash or out of memory)") from None
                if isinstance(result, tuple):
                    raise RewardFailed(*result)
                return result
            raise RewardFailed("the reward's processes were replaced three times while scoring this group")

    def _restart(self) -> None:
        """Kill the pool's processes (a hung reward never returns) and start fresh ones."""
        self.close()
        self._generation += 1
        self._executor = self._start()

    def close(self) -> None:
        """Kill the processes, whatever they are doing, and let the pool go."""
        for process in list(getattr(self._executor, "_processes", {}).values()):  # no public way to kill one
            process.kill()
        self._executor.shutdown(wait=False, cancel_futures=True)


def pool_size(name: str, workers: int | None) -> int:
    """Processes for reward `name`: `workers` when set, else none for the cheap built-ins and one otherwise."""
    if workers is not None:
        return workers
    return 0 if name in INLINE_REWARDS else 1
