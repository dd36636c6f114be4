"""Adaptive speculative decoding, the pure part: when SD runs, and with which configuration.

SD pays while the running batch is small (verifying k tokens costs little more than one) and costs once
it is large. So, per engine step:

- `SdSwitch` (`switch.py`) turns SD on and off by running batch size, with a hysteresis band;
- `SdTuner` picks an `Arm` per batch-size bucket by epsilon-greedy on a robust throughput estimate over a
  sliding window of steps (accepted tokens and wall seconds of draft + verify): the median of the pooled
  rates (tokens / seconds) of consecutive runs of `chunk` steps. Optionally per context too: a small
  state of the running rows the engine reads before the step (how well the group's responses match them),
  so an arm whose speed depends on that state is judged in the state it will run in. Plain decoding and
  n-gram lookup are arms too, so the same measurements choose the fallback before a drafter exists or when
  its drafts stop being accepted. The switch is its prior, not a wall: where it is off, plain decoding runs
  unless an arm has been measured to beat it there (found by exploring), so a crossover measured on another
  workload or an older engine costs exploration, not the speed-up; exploration favours arms measured near
  the best;
- `aggregate_reports` (`switch.py`) merges several workers' measurements into the table the policy service
  publishes; workers exploit that table and keep exploring with probability epsilon.

Nothing here does I/O or keeps time: the engine feeds measurements in and asks for decisions, the services
move reports and tables over the bus. Given a seeded `random.Random`, every decision is reproducible.
"""

from __future__ import annotations

import itertools
import random
import statistics
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Literal

from tlt_stream.rollout.arms import Arm
from tlt_stream.rollout.switch import DEFAULT_EDGES, SdTable, bucket_of, check_edges

__all__ = ["DEFAULT_ARMS", "SdTuner"]

ResetMode = Literal["reset", "decay"]

DEFAULT_ARMS: tuple[Arm, ...] = tuple(
    Arm.from_label(label) for label in ("plain", "ngram-d6", "d2k1v2", "d4k1v4", "d6k1v6", "d4k2v8", "d6k4v16")
)
"""A spread of arms (plain, prompt lookup, drafter chains of three depths, two trees) for benchmarks."""


# ---------------------------------------------------------------------------------------------------- tuner


class _Window(deque):
    """A (bucket[, context], arm)'s recent (tokens, seconds) steps, and its estimate (`SdTuner.estimate`) kept
    until the steps change: a step's choice reads the estimates of many windows that have not changed."""

    def __init__(self, maxlen: int) -> None:
        super().__init__(maxlen=maxlen)
        self.cached: float | None = None

    def append(self, step: tuple[float, float]) -> None:
        super().append(step)
        self.cached = None

    def extend(self, steps: Iterable[tuple[float, float]]) -> None:
        super().extend(steps)
        self.cached = None

    def clear(self) -> None:
        super().clear()
        self.cached = None


class SdTuner:
    """Per-bucket epsilon-greedy over `arms` on the throughput of each arm's last `window` steps (`estimate`).

    The exploit arm of a bucket (`greedy`) is, in order: the adopted table's arm for the bucket; else the
    first arm (in `arms` order) not yet measured there; else the arm with the highest estimate (ties: the
    earlier in `arms`). `choose` returns it, except with probability `epsilon` another eligible arm,
    untried ones first, so non-greedy picks happen at rate epsilon. While a bucket without a table entry
    still has untried arms, it tries them in order without exploring.

    Where SD is not expected to pay (`expect_sd=False`: the switch is off, the batch is wide), the exploit
    arm is the baseline (plain, else the first non-drafter arm) unless another arm has at least `confirm`
    measurements there and a higher estimate, and untried arms wait for exploration instead of being tried
    first. An arm measured there faster than the exploit arm but not yet confirmed (a challenger) is run
    with probability `challenge` per step until it is confirmed faster or falls behind: exploration alone,
    at epsilon shared by every other arm, can take several rollouts to confirm one in a wide bucket, while
    a challenger settles in a few steps (one lucky step of a slow arm costs about `confirm` - 1 more).

    Exploration draws untried arms first, then each other arm with weight max(`explore_floor`,
    (rate / best rate) ** `explore_power`), rate being the higher of its estimate and its latest run's:
    an arm measured at half the best is drawn ~16x less often than one near it (exploration costs less in
    buckets where some arms lose badly), and one good measurement of an arm that improved raises its weight
    at once, so its window refills quickly. Every arm keeps a weight of at least `explore_floor`.

    With `contexts` > 1 each step also names a context (0 .. contexts - 1: a state of the running rows known
    before the step, such as how well the group's responses match them; `AdaptiveSd` reads it from the
    proposer). An arm's speed can depend on that state for many steps in a row (a row that follows a
    sibling's response drafts well from the group for as long as it follows it), and a window filled in the
    stretches where an arm was chosen then overrates it everywhere else. So every step is also kept in a
    window per (bucket, context, arm), and an arm with at least `context_confirm` steps in the step's context
    (two runs of `chunk` by default: fewer give an SD arm's skewed steps too much say) is judged by that
    window; below that, by its bucket's window over every context (a new context inherits the bucket's
    estimates instead of trying every arm again). Likewise an adopted table's arm gives way to an arm
    confirmed faster in the step's context than the table's arm, itself confirmed there.

    Drafter arms are eligible only once a drafter exists (`drafter_version >= 0`); at least one plain or
    n-gram arm is required, so there is always a choice. A new drafter (`on_new_drafter`) resets or
    decays the drafter arms' windows; plain and n-gram measurements stay.
    """

    def __init__(
        self,
        arms: Sequence[Arm] = DEFAULT_ARMS,
        *,
        edges: Sequence[int] = DEFAULT_EDGES,
        epsilon: float = 0.1,
        window: int = 16,
        chunk: int = 4,
        drafter_version: int = -1,
        decay_keep: float = 0.25,
        confirm: int = 3,
        explore_power: float = 4.0,
        explore_floor: float = 0.1,
        contexts: int = 1,
        context_confirm: int | None = None,
        challenge: float = 0.5,
    ) -> None:
        if len(set(arms)) != len(arms) or not arms:
            raise ValueError(f"arms must be non-empty and distinct, got {[a.label for a in arms]}")
        if all(arm.uses_drafter for arm in arms):
            raise ValueError("include a plain or n-gram arm: it is the choice before a drafter exists")
        if not 0 <= epsilon <= 1 or not 0 <= challenge <= 1:
            raise ValueError(f"epsilon and challenge must be in [0, 1], got {epsilon}, {challenge}")
        if window < 1 or chunk < 1:
            raise ValueError(f"window and chunk must be >= 1, got {window}, {chunk}")
        if not 0 < decay_keep <= 1:
            raise ValueError(f"decay_keep must be in (0, 1], got {decay_keep}")
        if contexts < 1:
            raise ValueError(f"contexts must be >= 1, got {contexts}")
        if confirm < 1 or explore_power < 0 or not 0 < explore_floor <= 1:
            raise ValueError(
                f"need confirm >= 1, explore_power >= 0 and explore_floor in (0, 1], got {confirm}, "
                f"{explore_power}, {explore_floor}"
            )
        self.arms = tuple(arms)
        self.edges = check_edges(edges)
        self.epsilon = epsilon
        self.challenge = challenge
        self.window = window
        self.chunk = chunk
        self.decay_keep = decay_keep
        self.confirm = min(confirm, window)
        self.explore_power = explore_power
        self.explore_floor = explore_floor
        self.contexts = contexts
        self.context_confirm = min(window, 2 * chunk if context_confirm is None else context_confirm)
        if self.context_confirm < 1:
            raise ValueError(f"context_confirm must be >= 1, got {context_confirm}")
        self._drafter_version = drafter_version
        self._trusted_drafter = -1  # tables measured before this drafter version are refused (after a reset)
        self._windows: dict[tuple[int, Arm], _Window] = {}  # (tokens, seconds) per step
        self._context_windows: dict[tuple[int, int, Arm], _Window] = {}  # with contexts > 1
        self._table: SdTable | None = None

    @property
    def drafter_version(self) -> int:
        return self._drafter_version

    @property
    def table(self) -> SdTable | None:
        return self._table

    def bucket(self, batch_size: int) -> int:
        return bucket_of(batch_size, self.edges)

    def eligible_arms(self) -> list[Arm]:
        return [arm for arm in self.arms if not arm.uses_drafter or self._drafter_version >= 0]

    def rate(self, batch_size: int, arm: Arm, *, context: int | None = None) -> float | None:
        """The arm's estimated tokens/s in the batch size's bucket (`estimate`), or None when untried; with a
        `context`, what a decision in that context goes by (the context's window once confirmed)."""
        bucket = self.bucket(batch_size)
        if context is not None:
            return self._judged(bucket, self._check_context(context), arm)
        window = self._windows.get((bucket, arm))
        return self.estimate(window) if window else None

    def estimate(self, steps: Sequence[tuple[float, float]]) -> float:
        """Throughput of (tokens, seconds) steps, robust to rare stalls: split into runs of about `chunk`
        consecutive steps (all of them in one when fewer than two runs' worth), pool each run's tokens over
        its seconds, take the median. Not the median of per-step rates: an SD step emits 1 to depth + 1
        tokens in about the same time, so its per-step rates are skewed and their median sits well below
        the arm's throughput, while plain decoding's (always one token) do not; that biased the choice
        towards plain. One stalled step (a GC pause, a neighbour's burst) moves one run, not the median."""
        if isinstance(steps, _Window):
            if steps.cached is None:
                steps.cached = self._pooled_median(steps)
            return steps.cached
        return self._pooled_median(steps)

    def _pooled_median(self, steps: Sequence[tuple[float, float]]) -> float:
        steps = list(steps)
        runs = max(1, len(steps) // self.chunk)
        bounds = [round(i * len(steps) / runs) for i in range(runs + 1)]
        rates = []
        for lo, hi in itertools.pairwise(bounds):
            tokens = sum(t for t, _ in steps[lo:hi])
            seconds = sum(s for _, s in steps[lo:hi])
            rates.append(tokens / seconds)
        return statistics.median(rates)

    def samples(self, batch_size: int, arm: Arm) -> int:
        return len(self._windows.get((self.bucket(batch_size), arm), ()))

    def rates(self, batch_size: int) -> dict[Arm, float]:
        """Estimated tokens/s of every arm tried in the batch size's bucket."""
        bucket = self.bucket(batch_size)
        return {arm: self.estimate(w) for arm in self.arms if (w := self._windows.get((bucket, arm)))}

    def greedy(self, batch_size: int, *, expect_sd: bool = True, context: int = 0) -> Arm:
        """What `choose` returns when it does not explore."""
        return self._greedy(self.bucket(batch_size), self.eligible_arms(), expect_sd, self._check_context(context))

    def choose(self, batch_size: int, rng: random.Random, *, expect_sd: bool = True, context: int = 0) -> Arm:
        """The arm for a step at this batch size; `expect_sd=False` where the switch says SD should not pay;
        `context`: the running rows' state before the step (0 .. contexts - 1)."""
        bucket = self.bucket(batch_size)
        context = self._check_context(context)
        arms = self.eligible_arms()
        greedy = self._greedy(bucket, arms, expect_sd, context)
        if expect_sd and self._table_arm(bucket, arms) is None and not self._tried(bucket, greedy):
            return greedy
        challenger = None if expect_sd else self._challenger(bucket, arms, greedy, context)
        if challenger is not None and rng.random() < self.challenge:
            return challenger
        others = [arm for arm in arms if arm != greedy]
        if others and rng.random() < self.epsilon:
            return self._explore(bucket, others, rng, context)
        return greedy

    def _challenger(self, bucket: int, arms: list[Arm], greedy: Arm, context: int) -> Arm | None:
        """Where SD is not expected and no table rules: the fastest arm measured faster than `greedy` in the
        bucket that is not yet confirmed there (fewer than `confirm` steps), if any."""
        if self.challenge <= 0 or self._table_arm(bucket, arms) is not None:
            return None
        to_beat = self._judged(bucket, context, greedy)
        if to_beat is None:
            return None
        best, best_rate = None, to_beat
        for arm in arms:
            window = self._windows.get((bucket, arm))
            if arm == greedy or not window or len(window) >= self.confirm:
                continue
            if (rate := self.estimate(window)) > best_rate:
                best, best_rate = arm, rate
        return best

    def _check_context(self, context: int) -> int:
        if not 0 <= context < self.contexts:
            raise ValueError(f"context must be in [0, {self.contexts}), got {context}")
        return context

    def _in_context(self, bucket: int, context: int, arm: Arm) -> deque[tuple[float, float]] | None:
        """The arm's window in the context, when it holds at least `context_confirm` steps (else the bucket's)."""
        if self.contexts == 1:
            return None
        window = self._context_windows.get((bucket, context, arm))
        return window if window is not None and len(window) >= self.context_confirm else None

    def _judged(self, bucket: int, context: int, arm: Arm) -> float | None:
        """What a decision in `context` goes by: the context's window once confirmed, else the bucket's."""
        window = self._in_context(bucket, context, arm) or self._windows.get((bucket, arm))
        return self.estimate(window) if window else None

    def _explore_weights(self, bucket: int, arms: Sequence[Arm], context: int = 0) -> list[float]:
        """Relative odds of each of `arms` when the tuner explores (untried arms are drawn before these)."""
        rates = {arm: self._rate(bucket, arm, context) for arm in self.arms if self._tried(bucket, arm)}
        best = max(rates.values(), default=0.0)
        if best <= 0:
            return [1.0] * len(arms)
        return [max(self.explore_floor, (rates.get(arm, best) / best) ** self.explore_power) for arm in arms]

    def record(self, batch_size: int, arm: Arm, tokens: int, seconds: float, *, context: int = 0) -> None:
        """One measurement: `tokens` accepted (bonus tokens included) in `seconds` of draft + verify, in a step
        whose rows were in `context`."""
        if arm not in self.arms:
            raise ValueError(f"arm {arm.label} is not one of this tuner's arms")
        if tokens < 0 or not seconds > 0:
            raise ValueError(f"need tokens >= 0 and seconds > 0, got {tokens}, {seconds}")
        context = self._check_context(context)
        bucket, step = self.bucket(batch_size), (float(tokens), float(seconds))
        windows: list[tuple[dict, tuple]] = [(self._windows, (bucket, arm))]
        if self.contexts > 1:
            windows.append((self._context_windows, (bucket, context, arm)))
        for by_key, key in windows:
            window = by_key.get(key)
            if window is None:
                window = by_key[key] = _Window(self.window)
            window.append(step)

    def adopt_table(self, table: SdTable) -> bool:
        """Exploit `table` from now on (replacing any earlier one). Refused, returning False, when it was
        measured with a drafter older than one this tuner reset its statistics for."""
        if table.drafter_version < self._trusted_drafter:
            return False
        self._table = table
        return True

    def on_new_drafter(self, version: int, mode: ResetMode = "reset") -> bool:
        """A new drafter is in use; returns False (and changes nothing) unless `version` is newer.

        - `reset`: drafter arms' windows are emptied (so they are tried again first) and a table measured
          with an older drafter is dropped: its comparisons involved the old drafter.
        - `decay`: each drafter arm's window shrinks to `decay_keep` of its length (at least 1) filled with
          steps at its estimate: it stays as a prior that fresh measurements outvote quickly; the table stays.
        """
        if mode not in ("reset", "decay"):
            raise ValueError(f"mode must be 'reset' or 'decay', got {mode!r}")
        if version <= self._drafter_version:
            return False
        self._drafter_version = version
        for key, window in itertools.chain(self._windows.items(), self._context_windows.items()):
            arm = key[-1]
            if not arm.uses_drafter or not window:
                continue
            if mode == "reset":
                window.clear()
            else:
                prior = self.estimate(window)
                keep = max(1, int(len(window) * self.decay_keep))
                window.clear()
                window.extend([(prior, 1.0)] * keep)
        if mode == "reset":
            self._trusted_drafter = version
            if self._table is not None and self._table.drafter_version < version:
                self._table = None
        return True

    def _tried(self, bucket: int, arm: Arm) -> bool:
        return bool(self._windows.get((bucket, arm)))

    def _rate(self, bucket: int, arm: Arm, context: int = 0) -> float:
        """For exploration odds: the higher of the arm's estimate and its latest run's pooled rate (in the
        context once confirmed there)."""
        window = self._in_context(bucket, context, arm) or self._windows[bucket, arm]
        return max(self.estimate(window), self.estimate(list(window)[-self.chunk :]))  # the latest run: pooled

    def _explore(self, bucket: int, others: list[Arm], rng: random.Random, context: int = 0) -> Arm:
        untried = [arm for arm in others if not self._tried(bucket, arm)]
        if untried:
            return rng.choice(untried)
        return rng.choices(others, self._explore_weights(bucket, others, context))[0]

    def _table_arm(self, bucket: int, eligible: list[Arm]) -> Arm | None:
        if self._table is None:
            return None
        arm = self._table.best.get(bucket)
        return arm if arm in eligible else None

    def _greedy(self, bucket: int, eligible: list[Arm], expect_sd: bool = True, context: int = 0) -> Arm:
        if (arm := self._table_arm(bucket, eligible)) is not None:
            return self._beats_table(bucket, context, arm, eligible)
        if not expect_sd:
            base = next((arm for arm in eligible if arm.kind == "plain"), None) or next(
                arm for arm in eligible if not arm.uses_drafter
            )
            if not self._tried(bucket, base):
                return base
            confirmed = [
                (arm, self._judged(bucket, context, arm))
                for arm in (base, *(a for a in eligible if a != base))
                if (w := self._windows.get((bucket, arm))) and (arm == base or len(w) >= self.confirm)
            ]
            return max(confirmed, key=lambda pair: pair[1])[0]
        estimates: list[tuple[Arm, float]] = []
        for arm in eligible:
            estimate = self._judged(bucket, context, arm)
            if estimate is None:
                return arm
            estimates.append((arm, estimate))
        return max(estimates, key=lambda pair: pair[1])[0]

    def _beats_table(self, bucket: int, context: int, table_arm: Arm, eligible: list[Arm]) -> Arm:
        """The table's arm, unless both it and another arm are confirmed in `context` and the other is faster."""
        own = self._in_context(bucket, context, table_arm)
        if own is None:
            return table_arm
        best, best_rate = table_arm, self.estimate(own)
        for arm in eligible:
            window = self._in_context(bucket, context, arm) if arm != table_arm else None
            if window is not None and (rate := self.estimate(window)) > best_rate:
                best, best_rate = arm, rate
        return best
