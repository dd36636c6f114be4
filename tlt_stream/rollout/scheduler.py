"""Continuous-batching bookkeeping: which sequences run, in which cache slot, and when they stop.

Pure Python (no torch) so it is tested as plain code. Running sequences always occupy slots
`0..n-1`: when one finishes, the sequence in the last slot moves into the hole, and the scheduler hands
the moves to the engine to mirror in the KV cache. Contiguous slots let the model read the cache as a view.

Partial rollouts (`rollout/reverify.py`): a request with an `ahead_limit` is a draft for the next policy
version. After `ahead_limit` tokens, or when it ends earlier (its end may be rejected by the next version),
it is parked: out of its slot, neither running nor finished. `new_version` hands every sequence holding
tokens (running, parked, or queued to resume) to the engine for re-verification; the verified ones go back
with `place` (into slots) or `requeue` (to the queue's front, resumed by a prefill over their tokens).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any, Literal

FinishReason = Literal["eos", "stop", "length"]
"""eos: an EOS id ended it (kept); stop: a stop rule did (`rollout.stops.StopStrings`, its token kept);
length: the token budget did (the response is truncated)."""
StopRule = Callable[[SequenceOf[int]], bool]
"""Called with the response's token ids after each new token: True ends the response there."""


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    PARKED = auto()
    """A draft that used its `ahead_limit` (or ended): holds no slot until the next policy re-verifies it."""
    FINISHED = auto()


def keep_prefix(row: Any, kept_logprobs: SequenceOf[float]) -> bool:
    """A re-verified row (the torch scheduler's `Sequence`, vLLM's `Pending`) keeps its first
    `len(kept_logprobs)` tokens with the new policy's log-probabilities and drops the rest; it counts the
    re-verification and stops being a draft. True when tokens were dropped (an ended response is then no
    longer ended)."""
    kept, total = len(kept_logprobs), len(row.token_ids)
    if not 0 <= kept <= total:
        raise ValueError(f"request {row.request_id!r}: kept {kept} of {total} tokens")
    row.reverifications += 1
    row.tokens_kept += kept
    row.tokens_discarded += total - kept
    row.ahead_limit = None
    del row.token_ids[kept:]
    row.logprobs = [float(lp) for lp in kept_logprobs]
    return kept < total


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
    ahead_limit: int | None = None
    """Set for a draft: tokens it may generate before the next policy version (lifted by `new_version`)."""
    reverifications: int = 0
    """Re-verifications under a newly loaded policy that had tokens to check."""
    tokens_kept: int = 0
    """Tokens the re-verifications kept, summed over them."""
    tokens_discarded: int = 0
    """Tokens the re-verifications discarded (the rejected one and every one after it), summed over them."""

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError(f"request {self.request_id!r}: empty prompt")
        if self.max_new_tokens < 1:
            raise ValueError(f"request {self.request_id!r}: max_new_tokens must be >= 1")
        if self.ahead_limit is not None and self.ahead_limit < 1:
            raise ValueError(f"request {self.request_id!r}: ahead_limit must be >= 1 or None")

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
    def num_prefill_tokens(self) -> int:
        """Inputs of its prefill: the prompt, plus every generated token but the last when it resumes."""
        return len(self.prompt_ids) + max(0, len(self.token_ids) - 1)

    @property
    def last_token(self) -> int:
        return self.token_ids[-1] if self.token_ids else self.prompt_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def is_running(self) -> bool:
        return self.status is SequenceStatus.RUNNING

    def append(self, token: int, logprob: float) -> bool:
        """Record one generated token; stop on an EOS id (kept in the output), on the stop rule (its token
        kept), or at the token budget. A draft parks instead of finishing, and parks at its `ahead_limit`
        (a token count: where it waits never depends on what it would sample next). True: feed no more."""
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
        if self.ahead_limit is not None and (self.finish_reason is not None or len(self.token_ids) >= self.ahead_limit):
            self.status = SequenceStatus.PARKED
        elif self.finish_reason is not None:
            self.status = SequenceStatus.FINISHED
        else:
            return False
        return True

    def reverified(self, kept_logprobs: SequenceOf[float]) -> bool:
        """Record a re-verification under a new policy: the first `len(kept_logprobs)` tokens are kept, with
        the new policy's log-probabilities; the rest are discarded. Afterwards it is an ordinary request
        (RUNNING, ready for the next token) or, when it kept every token and had already ended, FINISHED
        (the return value)."""
        if keep_prefix(self, kept_logprobs):
            self.finish_reason = None
        self.status = SequenceStatus.RUNNING if self.finish_reason is None else SequenceStatus.FINISHED
        return self.is_finished


@dataclass(frozen=True, slots=True)
class SlotMove:
    """Move the KV entries of the sequence in slot `src` to slot `dst` (apply in order)."""

    src: int
    dst: int


class Scheduler:
    """FIFO admission into at most `max_batch` slots, kept contiguous as sequences finish.

    Drafts (requests with an `ahead_limit`) are admitted only while fewer than `draft_rows` rows run (None:
    up to `max_batch`): they are meant to fill decode capacity the tail leaves idle, and past the batch where
    a step's cost starts to grow they would slow the on-policy rows they share each forward with. A request
    that is not a draft may overtake drafts held back in the queue. Which draft waits is decided by the
    batch, never by what it would sample, so partial rollouts stay lossless."""

    def __init__(self, max_batch: int, max_prefill_tokens: int | None = None, draft_rows: int | None = None) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if max_prefill_tokens is not None and max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {max_prefill_tokens}")
        if draft_rows is not None and draft_rows < 1:
            raise ValueError(f"draft_rows must be >= 1 or None, got {draft_rows}")
        self.max_batch = max_batch
        self.max_prefill_tokens = max_prefill_tokens
        self.draft_rows = draft_rows
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        """Index == slot."""
        self.parked: list[Sequence] = []
        """Drafts waiting for the next policy version, in the order they parked."""
        self._live_ids: set[Hashable] = set()

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_parked(self) -> int:
        return len(self.parked)

    @property
    def is_idle(self) -> bool:
        return not self.waiting and not self.running and not self.parked

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
        held: list[Sequence] = []  # drafts kept waiting for want of free capacity, in order
        longest = 0
        while self.waiting and len(self.running) < self.max_batch:
            seq = self.waiting[0]
            if seq.ahead_limit is not None and self.draft_rows is not None and len(self.running) >= self.draft_rows:
                held.append(self.waiting.popleft())
                continue
            longest_if = max(longest, seq.num_prefill_tokens)
            if admitted and not self._fits(len(admitted) + 1, longest_if):
                break
            self.waiting.popleft()
            longest = longest_if
            seq.status = SequenceStatus.RUNNING
            seq.slot = len(self.running)
            self.running.append(seq)
            admitted.append(seq)
        self.waiting.extendleft(reversed(held))
        return admitted

    def _fits(self, rows: int, longest: int) -> bool:
        return self.max_prefill_tokens is None or rows * longest <= self.max_prefill_tokens

    def passes(self, seqs: SequenceOf[Sequence]) -> list[list[Sequence]]:
        """Consecutive prefill-like passes over prompt + tokens of `seqs`, in order (a re-verification's):
        at most `max_batch` rows and (with `max_prefill_tokens`) padded tokens each, one row at least."""
        out: list[list[Sequence]] = []
        longest = 0
        for seq in seqs:
            n = seq.num_tokens
            if not out or len(out[-1]) == self.max_batch or not self._fits(len(out[-1]) + 1, max(longest, n)):
                out.append([])
                longest = 0
            out[-1].append(seq)
            longest = max(longest, n)
        return out

    def retire(self) -> tuple[list[Sequence], list[SlotMove]]:
        """Drop finished and parked sequences and fill their slots from the tail.

        Returns the finished sequences (in slot order) and the slot moves to mirror in the KV cache; the
        parked ones join `parked`.
        """
        leaving = [s for s in self.running if not s.is_running]
        if not leaving:
            return [], []
        alive = len(self.running) - len(leaving)
        holes = [i for i in range(alive) if not self.running[i].is_running]  # ascending
        tail = [j for j in range(len(self.running) - 1, alive - 1, -1) if self.running[j].is_running]
        moves = [SlotMove(src=j, dst=hole) for hole, j in zip(holes, tail, strict=True)]
        for move in moves:
            self.running[move.src].slot = move.dst
        self.running = sorted((s for s in self.running if s.is_running), key=lambda s: s.slot)
        finished = [s for s in leaving if s.is_finished]
        for seq in leaving:
            seq.slot = None
        self.parked += [s for s in leaving if not s.is_finished]
        self.forget(finished)
        return finished, moves

    def forget(self, finished: SequenceOf[Sequence]) -> None:
        """Finished sequences that hold no slot leave the scheduler (their ids may be used again)."""
        for seq in finished:
            self._live_ids.discard(seq.request_id)

    def new_version(self) -> list[Sequence]:
        """A new policy version: every sequence holding tokens leaves its slot or queue for re-verification
        and is returned (running ones in slot order, then those queued to resume, then parked ones); drafts
        not started yet become ordinary requests (nothing of theirs came from the old version). The engine
        hands each returned sequence back with `place`, `requeue` or `forget`."""
        out = [*self.running, *(s for s in self.waiting if s.token_ids), *self.parked]
        self.running, self.parked = [], []
        self.waiting = deque(s for s in self.waiting if not s.token_ids)
        for seq in self.waiting:
            seq.ahead_limit = None
        for seq in out:
            seq.slot = None
        return out

    def place(self, seqs: SequenceOf[Sequence]) -> None:
        """Put sequences whose cache entries the engine just built into the slots after the running ones, in
        order (finished ones too: the next `retire` takes them out)."""
        if len(self.running) + len(seqs) > self.max_batch:
            raise ValueError(f"{len(seqs)} sequences do not fit the {self.max_batch - len(self.running)} free slots")
        for seq in seqs:
            if seq.status not in (SequenceStatus.RUNNING, SequenceStatus.FINISHED):
                raise ValueError(f"request {seq.request_id!r} is {seq.status.name}, not RUNNING or FINISHED")
            seq.slot = len(self.running)
            self.running.append(seq)

    def requeue(self, seqs: SequenceOf[Sequence]) -> None:
        """Queue sequences with tokens but no slot at the front of the queue, in order; their admission
        resumes them (a prefill over prompt and tokens, no token emitted)."""
        for seq in seqs:
            if not seq.is_running:
                raise ValueError(f"request {seq.request_id!r} is {seq.status.name}, not RUNNING")
            seq.status, seq.slot = SequenceStatus.WAITING, None
        self.waiting.extendleft(reversed(seqs))
