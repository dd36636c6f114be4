"""Continuous-batching bookkeeping: which sequences run, in which cache slot, and when they stop.

Pure Python (no torch) so it is tested as plain code. Running sequences always occupy slots
`0..n-1`: when one finishes, the sequence in the last slot moves into the hole, and the scheduler hands
the moves to the engine to mirror in the KV cache. Contiguous slots let the model read the cache as a view.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Literal

FinishReason = Literal["eos", "stop", "length"]
"""eos: an EOS id ended it (kept); stop: a stop rule did (`rollout.stops.StopStrings`, its token kept);
length: the token budget did (the response is truncated)."""
StopRule = Callable[[SequenceOf[int]], bool]
"""Called with the response's token ids after each new token: True ends the response there."""


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


@dataclass(eq=False)
class Sequence:
    """One request: its prompt, its stopping rules, and the tokens generated so far."""

    request_id: Hashable
    prompt_ids: list[int]
    max_new_tokens: int
    eos_ids: frozenset[int] = frozenset()
    temperature: float = 0.0
    seed: int | None = None
    stop: StopRule | None = None
    status: SequenceStatus = SequenceStatus.WAITING
    slot: int | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: FinishReason | None = None

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError(f"request {self.request_id!r}: empty prompt")
        if self.max_new_tokens < 1:
            raise ValueError(f"request {self.request_id!r}: max_new_tokens must be >= 1")

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.token_ids)

    @property
    def last_token(self) -> int:
        return self.token_ids[-1] if self.token_ids else self.prompt_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append(self, token: int, logprob: float) -> bool:
        """Record one generated token; stop on an EOS id (kept in the output), on the stop rule (its token
        kept), or at the token budget."""
        if self.status is not SequenceStatus.RUNNING:
            raise ValueError(f"request {self.request_id!r} is {self.status.name}, not RUNNING")
        self.token_ids.append(token)
        self.logprobs.append(logprob)
        if token in self.eos_ids:
            self.finish_reason = "eos"
        elif self.stop is not None and self.stop(self.token_ids):
            self.finish_reason = "stop"
        elif len(self.token_ids) >= self.max_new_tokens:
            self.finish_reason = "length"
        else:
            return False
        self.status = SequenceStatus.FINISHED
        return True


@dataclass(frozen=True, slots=True)
class SlotMove:
    """Move the KV entries of the sequence in slot `src` to slot `dst` (apply in order)."""

    src: int
    dst: int


class Scheduler:
    """FIFO admission into at most `max_batch` slots, kept contiguous as sequences finish."""

    def __init__(self, max_batch: int, max_prefill_tokens: int | None = None) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if max_prefill_tokens is not None and max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {max_prefill_tokens}")
        self.max_batch = max_batch
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        """Index == slot."""
        self._live_ids: set[Hashable] = set()

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def is_idle(self) -> bool:
        return not self.waiting and not self.running

    def add(self, seq: Sequence) -> None:
        if seq.status is not SequenceStatus.WAITING:
            raise ValueError(f"request {seq.request_id!r} is {seq.status.name}, not WAITING")
        if seq.request_id in self._live_ids:
            raise ValueError(f"request id {seq.request_id!r} is already queued or running")
        self._live_ids.add(seq.request_id)
        self.waiting.append(seq)

    def admit(self) -> list[Sequence]:
        """Move waiting sequences into the free slots after the running ones, in arrival order.

        With `max_prefill_tokens`, stop before the padded prefill (count x longest prompt) would exceed
        it; the first sequence is always admitted so a long prompt cannot starve.
        """
        admitted: list[Sequence] = []
        longest = 0
        while self.waiting and len(self.running) < self.max_batch:
            seq = self.waiting[0]
            longest_if = max(longest, seq.num_prompt_tokens)
            budget = self.max_prefill_tokens
            if admitted and budget is not None and longest_if * (len(admitted) + 1) > budget:
                break
            self.waiting.popleft()
            longest = longest_if
            seq.status = SequenceStatus.RUNNING
            seq.slot = len(self.running)
            self.running.append(seq)
            admitted.append(seq)
        return admitted

    def retire(self) -> tuple[list[Sequence], list[SlotMove]]:
        """Drop finished sequences and fill their slots from the tail.

        Returns the finished sequences (in slot order) and the slot moves to mirror in the KV cache.
        """
        finished = [s for s in self.running if s.is_finished]
        if not finished:
            return [], []
        alive = len(self.running) - len(finished)
        holes = [i for i in range(alive) if self.running[i].is_finished]  # ascending
        tail = [j for j in range(len(self.running) - 1, alive - 1, -1) if not self.running[j].is_finished]
        moves = [SlotMove(src=j, dst=hole) for hole, j in zip(holes, tail, strict=True)]
        for move in moves:
            self.running[move.src].slot = move.dst
        self.running = sorted((s for s in self.running if not s.is_finished), key=lambda s: s.slot)
        for seq in finished:
            seq.slot = None
            self._live_ids.discard(seq.request_id)
        return finished, moves
