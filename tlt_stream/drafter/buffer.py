"""The online drafter's training buffer: the newest windows, plus a long-tail-aware sample of older ones.

The `hidden` stream is lossy and unbounded in time; the buffer decides what the drafter trains on, in a
fixed memory budget counted in tokens (a window's memory is its length times the hidden size).

- **Newest first.** The newest `recent_tokens` tokens are kept whole (FIFO) and supply `recent_share`
  of every batch, so training follows the current policy's states.
- **Older windows: a stratified reservoir.** A window leaving the recent region is offered to one of
  two reservoirs, split at the running median window length: windows longer than the median go to the
  `long` one, the rest to the `short` one, and the long one owns `long_share` of the reservoir tokens.
  By count, long windows are few and a plain reservoir would hold them in proportion; they are the
  tail that speculative decoding exists for, so here they keep half the older tokens (and half the
  reservoir's picks) however rare they are.
- **Each reservoir is Algorithm R generalised to a token budget.** Every window gets a seeded uniform
  key on arrival; the reservoir keeps the windows with the largest keys that fit its budget, and a
  window whose key is not above the largest key ever evicted is refused. With equal-length windows this
  is exactly Algorithm R's sample (k of the n seen, uniformly, whatever the arrival order); with unequal
  lengths it is still a uniform-in-time sample, so old sequences are kept as readily as new ones.

Sampling draws (with the caller's `torch.Generator`, which the trainer checkpoints) never changes the
buffer, so the same generator state on the same contents gives the same batches.
"""

from __future__ import annotations

import bisect
import heapq
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tlt_stream.basics.messages import HiddenWindow
from tlt_stream.drafter.train import Window

__all__ = ["BufferedWindow", "WindowBuffer", "window_from_message"]


def window_from_message(message: HiddenWindow) -> Window:
    """A training window from a `hidden` stream entry (the states stay in their wire dtype, bf16 usually)."""
    return Window(
        tokens=torch.tensor(message.token_ids, dtype=torch.long),
        features=message.hidden.to_torch(),
        prompt_len=message.prompt_len,
    )


@dataclass(frozen=True)
class BufferedWindow:
    window: Window
    policy_version: int
    seq: int
    """Arrival order (chunks of one window share it)."""
    length: int
    """Tokens of the whole window it came from (a chunk is classed long or short by this)."""

    @property
    def tokens(self) -> int:
        return int(self.window.tokens.shape[0])


@dataclass(order=True)
class _Keyed:
    key: float
    seq: int
    entry: BufferedWindow = field(compare=False)


class _Reservoir:
    """Keeps the largest-key windows that fit in `budget` tokens (see the module docstring)."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.heap: list[_Keyed] = []  # min-heap by key: the next eviction on top
        self.tokens = 0
        self.floor = -1.0

    def offer(self, entry: BufferedWindow, key: float) -> None:
        if key <= self.floor:
            return
        heapq.heappush(self.heap, _Keyed(key, entry.seq, entry))
        self.tokens += entry.tokens
        while self.tokens > self.budget:
            evicted = heapq.heappop(self.heap)
            self.tokens -= evicted.entry.tokens
            self.floor = max(self.floor, evicted.key)

    def entries(self) -> list[BufferedWindow]:
        return [k.entry for k in sorted(self.heap, key=lambda k: (k.seq, k.key))]

    def discard(self, keep: Callable[[BufferedWindow], bool]) -> int:
        before = len(self.heap)
        self.heap = [k for k in self.heap if keep(k.entry)]
        heapq.heapify(self.heap)
        self.tokens = sum(k.entry.tokens for k in self.heap)
        return before - len(self.heap)


class WindowBuffer:
    """Bounded store of training windows: at most `recent_tokens + reservoir_tokens` tokens at any time."""

    def __init__(
        self,
        *,
        recent_tokens: int,
        reservoir_tokens: int,
        recent_share: float = 0.5,
        long_share: float = 0.5,
        max_window_tokens: int | None = None,
        median_of: int = 1001,
        seed: int = 0,
    ) -> None:
        if not 0.0 <= recent_share <= 1.0 or not 0.0 < long_share < 1.0:
            raise ValueError(f"recent_share must be in [0, 1], long_share in (0, 1); got {recent_share}, {long_share}")
        long_budget = int(reservoir_tokens * long_share)
        short_budget = reservoir_tokens - long_budget
        largest = min(recent_tokens, long_budget, short_budget)
        if largest < 2:
            raise ValueError(
                f"budgets too small: recent {recent_tokens}, reservoir {reservoir_tokens} (long share {long_share}) "
                "must leave room for a window of 2 tokens in each region"
            )
        self.max_window_tokens = largest if max_window_tokens is None else max_window_tokens
        if not 2 <= self.max_window_tokens <= largest:
            raise ValueError(f"max_window_tokens must be in [2, {largest}], got {max_window_tokens}")
        self.recent_tokens = recent_tokens
        self.recent_share = recent_share
        self.long_share = long_share
        self.recent: deque[BufferedWindow] = deque()
        self.recent_held = 0
        self.long = _Reservoir(long_budget)
        self.short = _Reservoir(short_budget)
        self._rng = random.Random(seed)
        self._lengths: deque[int] = deque(maxlen=median_of)
        self._sorted_lengths: list[int] = []
        self._seq = 0

    # ---------------------------------------------------------------------------------------- contents

    @property
    def tokens(self) -> int:
        return self.recent_held + self.long.tokens + self.short.tokens

    def __len__(self) -> int:
        return len(self.recent) + len(self.long.heap) + len(self.short.heap)

    @property
    def long_threshold(self) -> int:
        """The running median window length: longer windows leaving the recent region are `long`."""
        if not self._sorted_lengths:
            return 0
        return self._sorted_lengths[len(self._sorted_lengths) // 2]

    def entries(self) -> dict[str, list[BufferedWindow]]:
        return {"recent": list(self.recent), "long": self.long.entries(), "short": self.short.entries()}

    def stats(self) -> dict[str, float]:
        return {
            "windows": float(len(self)),
            "tokens": float(self.tokens),
            "recent_tokens": float(self.recent_held),
            "long_tokens": float(self.long.tokens),
            "short_tokens": float(self.short.tokens),
            "long_threshold": float(self.long_threshold),
            "seen": float(self._seq),
        }

    # ---------------------------------------------------------------------------------------- writing

    def add(self, window: Window, policy_version: int = 0) -> None:
        """Add a window (cut into overlapping chunks of at most `max_window_tokens` tokens if longer); one
        without a training pair (a single token) or with a non-finite hidden state is left out."""
        n = int(window.tokens.shape[0])
        if n < 2 or not bool(torch.isfinite(window.features).all()):  # no pair, or states that would poison training
            return
        self._note_length(n)
        seq, self._seq = self._seq, self._seq + 1
        size = self.max_window_tokens
        for start in range(0, n - 1, size - 1):  # consecutive chunks share one token, so no pair is lost
            end = min(n, start + size)
            if end >= window.prompt_len:  # else every pair of the chunk predicts a prompt token
                chunk = window if (start, end) == (0, n) else _chunk(window, start, end)
                self.recent.append(BufferedWindow(chunk, policy_version, seq, n))
                self.recent_held += end - start
            if end == n:
                break
        while self.recent_held > self.recent_tokens:
            old = self.recent.popleft()
            self.recent_held -= old.tokens
            reservoir = self.long if old.length > self.long_threshold else self.short
            reservoir.offer(old, self._rng.random())

    def discard_before(self, policy_version: int) -> int:
        """Drop windows computed by policies older than `policy_version`; returns how many were dropped."""

        def keep(entry: BufferedWindow) -> bool:
            return entry.policy_version >= policy_version

        before = len(self.recent)
        self.recent = deque(e for e in self.recent if keep(e))
        self.recent_held = sum(e.tokens for e in self.recent)
        return before - len(self.recent) + self.long.discard(keep) + self.short.discard(keep)

    def _note_length(self, n: int) -> None:
        if len(self._lengths) == self._lengths.maxlen:
            oldest = self._lengths[0]
            del self._sorted_lengths[bisect.bisect_left(self._sorted_lengths, oldest)]
        self._lengths.append(n)
        bisect.insort(self._sorted_lengths, n)

    # ---------------------------------------------------------------------------------------- reading

    def sample(self, pairs: int, generator: torch.Generator) -> list[Window]:
        """Windows (without replacement) until they hold at least `pairs` training pairs or all are taken.

        Each pick is from the recent region with probability `recent_share`, else from the reservoir
        (its long part with probability `long_share`); an empty source falls through to the others.
        """
        pools = {name: list(entries) for name, entries in self.entries().items()}
        picked: list[Window] = []
        total = 0
        while total < pairs and any(pools.values()):
            u, v = torch.rand(2, generator=generator).tolist()
            reservoir = ("long", "short") if v < self.long_share else ("short", "long")
            order = ("recent", *reservoir) if u < self.recent_share else (*reservoir, "recent")
            pool = next(pools[name] for name in order if pools[name])
            index = int(torch.randint(len(pool), (1,), generator=generator))
            entry = pool.pop(index)
            picked.append(entry.window)
            total += entry.window.num_pairs
        return picked


def _chunk(window: Window, start: int, end: int) -> Window:
    return Window(
        tokens=window.tokens[start:end].clone(),
        features=window.features[start:end].clone(),
        prompt_len=max(0, window.prompt_len - start),
    )
