"""The step simulator: rollout workers, the policy service and the learner as discrete events, with the
system's own rules.

- Policy service: step s is dispatched once version s - max_staleness (- 1 with partial rollouts at staleness
  0: the next step goes out one version early, as drafts) has been announced; its prompt groups queue in
  order and workers take whole groups while they have room (`max_batch` rows, or the KV cache's tokens).
- Rollout worker (one engine): it loads an announced version once its rows in flight have finished and
  starts nothing new meanwhile; with partial rollouts it loads at once and re-verifies every row holding
  tokens (`costs.reverify_s`; `kept_share` of the tokens survive). A draft row (a group of the version after
  the worker's) runs at most `ahead_tokens` tokens, then parks without its slot; with `ahead_rows` drafts start
  only while fewer rows run. Each engine step is a plain decode or a speculative round of the arm chosen:
  the SD switch (`rollout.switch.SdSwitch`, the configured crossover and margin) and, per batch bucket, the tuner's
  converged choice, the arm of highest expected tokens/s (rows x tokens per round / round cost), explored with
  probability epsilon by the tuner's weights. A round is charged for what its rows accept on average
  (`costs.round_s`'s `accepted`: the arm's tokens a round at the bucket, less the target's own). The first drafter
  round after rows were prefilled or re-verified also pays the drafter's forward over their prompts (and held
  tokens), `costs.catch_up_s`. Above the crossover an arm runs only where it beats plain (`above_crossover =
  "measure"`) or never (`"plain"`). A step that follows steps of the other kind (a plain step after a round, a round
  after plain steps) costs `costs.switch_s` more, and the tuner judges arms by what their steps would cost now, the
  switch included (`Setup.judged_as_run`).
- The worker's own loop: after each hop of `steps_per_hop` engine steps (fewer when a row finishes) it polls for
  work (`costs.hop_s`), after a hop in which rows finished it publishes its rows in flight (`costs.finish_s`),
  where the drafter trains it sends each finished row's hidden-state window (`costs.window_s`, for
  `hidden_share` of the rows), and a group whose rows are all done is sent (`costs.group_s`) before its next
  hop; the learner sees the group once it is sent.
- Drafter training: a worker with nothing to generate holds the training lease (one holder at a time); work
  that arrives preempts it within one training step and the slice's commit (`preempt_s`).
- Learner: groups join its queue in order of completion; an update takes the first `prompts` groups inside
  the staleness window (older ones are dropped), costs `learn_s` of the `trained_share` of their tokens (groups
  whose rewards are all equal train nothing; a replayed group its own share) plus `optimizer_s`, and the
  new version is announced `publish_s` later. Overlapped (on-policy): each group's forward and backward runs
  as soon as it is complete and the learner is free; the step ends one optimizer step after its last group.
  Colocated (verl, TLT): the learner's devices are the engines', so no engine step runs during an update.
- Cores: where processes share `costs.cores`, every step and update in progress runs at the rate
  `1 / costs.slowdown` of the cores busy with other work: the other modelled processes' busy threads, the
  drafter's training where the others leave it a core (one thread at the lowest priority), plus
  `background_cores`; rates are recomputed whenever a worker or the learner starts or stops (processor
  sharing), so an update is slowed for the part of it the rollout runs beside.

With `seed` set, a round's emitted tokens are drawn from the chain model (`acceptance.Acceptance.draw`) and
lengths from the distribution; with `seed=None` every round emits its mean and lengths are used in order,
for closed-form checks. With `Setup.replay` (a measured run's groups in the order they were dispatched),
each group takes its recorded lengths and trained share whatever the seed.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
import statistics
from collections import deque
from dataclasses import dataclass, field

from tlt_stream.basics.config import DEFAULTS
from tlt_stream.plan.acceptance import Acceptance
from tlt_stream.plan.costs import EngineCosts, slowdown
from tlt_stream.plan.lengths import LengthDist
from tlt_stream.rollout.arms import Arm
from tlt_stream.rollout.switch import DEFAULT_EDGES, SdSwitch, bucket_of

__all__ = ["EAGLE_ARMS", "Mode", "Result", "Setup", "simulate"]

EAGLE_ARMS: tuple[str, ...] = tuple(a for a in DEFAULTS.sd.arms if Arm.from_label(a).kind in ("plain", "drafter"))
"""The configured arms an EAGLE-only worker runs (`rollout.adaptive`: those of its proposer's kinds)."""


@dataclass(frozen=True)
class Mode:
    """One of `bench/e2e.py`'s configurations (or the overlapped learner)."""

    name: str
    sd: bool = False
    max_staleness: int = 0
    partial: bool = False
    overlapped: bool = False


@dataclass(frozen=True)
class Setup:
    """The workload and the system's settings a simulation runs with (defaults: the configuration tree's)."""

    prompts: int = DEFAULTS.policy.prompts_per_step
    group_size: int = DEFAULTS.policy.group_size
    steps: int = DEFAULTS.policy.steps
    workers: int = DEFAULTS.launch.workers
    max_batch: int = DEFAULTS.rollout.max_batch
    prompt_len: int = 32
    max_response: int = 1_000_000
    arms: tuple[str, ...] = EAGLE_ARMS
    crossover: int = DEFAULTS.sd.crossover
    margin: int = DEFAULTS.sd.margin
    edges: tuple[int, ...] = DEFAULT_EDGES
    epsilon: float = DEFAULTS.sd.epsilon
    above_crossover: str = DEFAULTS.sd.above_crossover
    ahead_tokens: int = DEFAULTS.policy.ahead_tokens
    ahead_rows: int = DEFAULTS.policy.ahead_rows
    kept_share: float = 0.99
    trained_share: float = 1.0
    """Share of the groups' response tokens the update trains on: a group whose rewards are all equal has no
    advantage and is left out of the forward and backward (`rl/learner.py`); a workload input (a run's
    `degenerate_groups`), 1 where every group has a signal."""
    preempt_s: float = 0.2
    """Work arriving at a worker training the drafter waits this long: the training step in progress and the
    slice's commit (an assumption: the trainer checks for work before every step)."""
    train_drafter: bool = True
    hidden_share: float = DEFAULTS.rollout.hidden_share
    """Share of the rows whose hidden-state windows are streamed where the drafter trains (`rollout.hidden_share`):
    each costs its worker `costs.window_s` when it finishes."""
    colocated: bool = False
    kv_capacity_tokens: int | None = None
    worker_threads: int = 1
    learner_threads: int = 1
    """Threads each rollout worker and the learner run with (where `costs.cores` is finite, the busy threads of
    the others slow every step and update: `costs.slowdown`)."""
    background_cores: float = 0.0
    """Cores kept busy by work the simulator does not model (the policy service, Redis, the launcher, the
    machine's neighbours): a measured input of a run (`bench/plan_load.py`), 0 on a machine of one's own."""
    judged_as_run: bool = True
    """The tuner judges each arm by what a step of it would cost now, after the steps the worker ran (a switch of
    kind included, `costs.switch_s`), as the real tuner measures arms in the steps it runs; False: by its cost
    back to back."""
    steps_per_hop: int = DEFAULTS.rollout.steps_per_hop
    """Engine steps a worker runs before its loop polls for work (fewer when a row finishes): `costs.hop_s` is
    charged per hop."""
    macro_steps: int = 1
    """Plain decode steps simulated as one event while no row finishes (1: every step; more is faster for long
    responses, and delays what another event would have changed by at most that many steps)."""
    seed: int | None = DEFAULTS.policy.seed
    replay: tuple[tuple[tuple[int, ...], float], ...] = ()
    """A measured run's workload, group by group in the order the policy service dispatched them: each group's
    response lengths and the share of its tokens the update trained on (0 for a group whose rewards were all
    equal); the n-th dispatched group takes entry n (cycled where the run had fewer). Empty: lengths from the
    distribution and `trained_share` for every group."""


@dataclass
class _Row:
    step: int
    group: int
    length: int
    draft_of: int  # the version the row needs; it is a draft while the worker's is older
    done: float = 0.0
    version: int = -1
    unseen: float = 0.0  # (token, state) pairs the drafter has not seen: the prompt after a prefill, and the
    # held tokens after a re-verification (`costs.catch_up_s`, at the worker's next drafter round)


@dataclass
class _Worker:
    wid: int
    switch: SdSwitch
    version: int = 0
    running: list[_Row] = field(default_factory=list)
    parked: list[_Row] = field(default_factory=list)
    step: tuple[str, float] | None = None  # (arm label, seconds) of the step in progress
    arm: Arm | None = None
    repeat: int = 1  # engine steps the event stands for
    busy: bool = False
    pending: int = -1  # the sequence number of the event that ends the step in progress
    training_since: float | None = None
    idle_s: float = 0.0
    idle_since: float | None = 0.0
    began: float = 0.0  # when the step in progress started
    plain_run: int = 0  # plain steps since its last speculative round, or since it began
    rounded: bool = False  # it has run a speculative round
    hop_steps: int = 0  # engine steps since the loop's last poll
    owed: float = 0.0  # the loop's polls not yet charged
    outbox: list = field(default_factory=list)  # complete groups whose output (`costs.group_s`) is not yet sent
    parts: dict[str, float] = field(default_factory=dict)  # its unslowed seconds by what they were spent on


@dataclass
class Result:
    mode: str
    step_times: list[float]
    version_times: list[float]
    rollout_spans: list[float]
    learner_s: list[float]
    emitted: float
    finished_tokens: float
    in_flight_tokens: float
    discarded_tokens: float
    dropped_groups: int
    drafter_train_s: float
    rounds: dict[str, int]
    sd_share: float
    workers: int
    """Rollout workers simulated (`worker_seconds` counts the idle time of each)."""
    activity: list[tuple[float, float, dict[str, float]]] = field(default_factory=list)
    """The workers' time, step by step: (start, end, the step's unslowed seconds by part: `plain` or an SD arm's
    label, `prefill`, `load`, `reverify`, `loop` (the worker's polls and groups' output), `train`), each step's
    wall time shared among its parts."""

    def worker_seconds(self, start: float, end: float) -> dict[str, float]:
        """The workers' wall seconds between `start` and `end` by what they were spent on (`activity`'s parts;
        `idle` the rest), summed over workers."""
        out: dict[str, float] = {}
        for a, b, parts in self.activity:
            overlap = min(b, end) - max(a, start)
            total = sum(parts.values())
            if overlap <= 0 or total <= 0:
                continue
            for label, seconds in parts.items():
                out[label] = out.get(label, 0.0) + overlap * seconds / total
        out["idle"] = max(0.0, self.workers * (end - start) - sum(out.values()))
        return out

    @property
    def steady_step_times(self) -> list[float]:
        """The steps after the first (the pipeline filling), or the one step there is."""
        return self.step_times[1:] if len(self.step_times) > 1 else self.step_times

    @property
    def step_time(self) -> float:
        return statistics.median(self.steady_step_times)

    def steady_worker_seconds(self) -> dict[str, float]:
        """`worker_seconds` per step over the steady steps (from the first version after the pipeline filled
        to the last), rounded; over the one step there is where the run made only one."""
        times = self.version_times
        first = 1 if len(times) > 2 else 0
        steps = len(times) - 1 - first
        if steps < 1:
            return {}
        spent = self.worker_seconds(times[first], times[-1])
        return {k: round(v / steps, 4) for k, v in sorted(spent.items())}

    def summary(self) -> dict[str, object]:
        return {
            "mode": self.mode,
            "step_time_s": round(self.step_time, 4),
            "step_times_s": [round(x, 4) for x in self.step_times],
            "rollout_span_s": round(statistics.median(self.rollout_spans), 4) if self.rollout_spans else None,
            "learner_s": round(statistics.median(self.learner_s), 4) if self.learner_s else None,
            "sd_step_share": round(self.sd_share, 3),
            "drafter_train_s_per_step": round(self.drafter_train_s / max(len(self.step_times), 1), 3),
            "worker_s_per_step": self.steady_worker_seconds(),
            "dropped_groups": self.dropped_groups,
            "discarded_tokens": round(self.discarded_tokens, 1),
        }


class _Sim:
    def __init__(self, mode: Mode, setup: Setup, lengths: LengthDist, acceptance: Acceptance, costs: EngineCosts):
        self.mode, self.setup, self.acc, self.costs = mode, setup, acceptance, costs
        self.drafter_trains = mode.sd and setup.train_drafter
        """The drafter trains online: its rows' hidden-state windows are streamed, idle workers train it."""
        self.rng = random.Random(setup.seed) if setup.seed is not None else None
        self.length_rng = random.Random(setup.seed if setup.seed is not None else 0)
        self.lengths = lengths
        self._in_order = itertools.cycle(lengths.lengths)
        arms = [Arm.from_label(a) for a in setup.arms] if mode.sd else [Arm.plain()]
        self.arms = [a for a in arms if a.kind != "plain"]
        self.plain = Arm.plain()
        self.events: list[tuple[float, int, str, int]] = []
        self.seq = itertools.count()
        self.workers = [
            _Worker(w, SdSwitch.from_crossover(setup.crossover, setup.margin)) for w in range(setup.workers)
        ]
        self.queue: deque[list[_Row]] = deque()
        self.replacements = itertools.count(setup.steps * setup.prompts)
        """Ids of the groups sent again (`replace`), past those of the steps' own."""
        self.dispatched = 0
        self.announced = 0
        self.version_times = [0.0]
        self.learner_version = 0
        self.learner_busy = False
        self.shared = costs.cores != float("inf")
        self.jobs: dict[int, list[float]] = {}
        """Work in progress on shared cores, by worker id (-1: the learner): [seconds left unslowed, rate, since,
        forwards per unslowed second]."""
        self.learner_pending = -1
        self.learner_started = 0.0
        self.ready: deque[tuple[int, int, float, float, list[float]]] = deque()
        """Complete groups: (step, version, tokens, trained tokens, the lengths of its rows the update trains)."""
        self.group_share: dict[int, float] = {}
        self.group_rows: dict[int, list[float]] = {}
        self.group_left: dict[int, int] = {}
        self.group_tokens: dict[int, float] = {}
        self.group_version: dict[int, int] = {}
        self.accumulated = 0  # overlapped: groups of the current update already computed
        self.acc_tokens = 0.0
        self.lease: int | None = None
        self.first_start: dict[int, float] = {}
        self.last_finish: dict[int, float] = {}
        self.learner_s: list[float] = []
        self.update_s = 0.0
        self.emitted = self.finished = self.discarded = 0.0
        self.dropped = 0
        self.train_s = 0.0
        self.rounds: dict[str, int] = {}
        self.activity: list[tuple[float, float, dict[str, float]]] = []
        self.done = False

    # ------------------------------------------------------------------------------------------ scheduling

    def at(self, t: float, kind: str, who: int = 0) -> int:
        seq = next(self.seq)
        heapq.heappush(self.events, (t, seq, kind, who))
        return seq

    def work(self, w: _Worker | None, t: float, seconds: float, forwards: float = 0.0) -> None:
        """Start `seconds` of unslowed work of `forwards` forwards on worker `w` (None: the learner) at `t`; it
        ends when done at the rate the cores allow (`rerate`)."""
        if w is not None:
            w.busy = True
        else:
            self.learner_busy, self.learner_started = True, t
        if self.shared:
            self.jobs[-1 if w is None else w.wid] = [seconds, 0.0, t, forwards / seconds if seconds > 0 else 0.0]
            self.rerate(t)
        elif w is not None:
            w.pending = self.at(t + seconds, "worker", w.wid)
        else:
            self.learner_pending = self.at(t + seconds, "learner")

    def rerate(self, t: float) -> None:
        """The work in progress, charged up to `t` at its old rate, rescheduled at the rate the busy set now
        allows (only where the rate changed)."""
        if not self.shared:
            return
        for job in self.jobs.values():
            job[0] = max(0.0, job[0] - (t - job[2]) * job[1])
            job[2] = t
        for key, job in self.jobs.items():
            w = self.workers[key] if key >= 0 else None
            rate = 1.0 / self.slowdown(w, job[3])
            if rate == job[1]:
                continue
            job[1] = rate
            if w is not None:
                w.pending = self.at(t + job[0] / rate, "worker", w.wid)
            else:
                self.learner_pending = self.at(t + job[0] / rate, "learner")

    def slowdown(self, worker: _Worker | None, forwards_per_s: float = 0.0) -> float:
        """How much slower `worker`'s step (None: the learner's update) runs now: `costs.slowdown` with the
        cores the others' busy threads, the background and the drafter's training hold."""
        s = self.setup
        other = s.background_cores + sum(w.busy for w in self.workers if w is not worker) * s.worker_threads
        if worker is None:
            training = self.training_cores(other + s.learner_threads)
            factor = slowdown(self.costs, "learner", s.learner_threads, other + training)
            if self.training():  # what the idle training costs an update that leaves it no core
                factor *= 1 + (self.costs.learner_beside_training - 1) * (1 - training)
            return factor
        other += self.learner_busy * s.learner_threads
        other += self.training_cores(other + s.worker_threads)
        return slowdown(self.costs, "engine", s.worker_threads, other, forwards_per_s)

    def training(self) -> bool:
        """Whether a worker trains the drafter now (holds the lease in idle time)."""
        return self.lease is not None and self.workers[self.lease].training_since is not None

    def training_cores(self, taken: float) -> float:
        """Cores the drafter's training holds beside work that keeps `taken` cores busy: it trains on one
        thread at the lowest priority, so it gets a core only where the others leave one free (streaming on
        two cores: the learner's one thread leaves it one; synchronous: the learner's threads take them all,
        and the update pays `learner_beside_training` instead)."""
        if not self.training():
            return 0.0
        return min(1.0, max(0.0, self.costs.cores - taken))

    def run(self) -> Result:
        self.dispatch(0.0)
        for w in self.workers:
            self.at(0.0, "worker", w.wid)
        while self.events and not self.done:
            t, seq, kind, who = heapq.heappop(self.events)
            if kind == "worker":
                w = self.workers[who]
                if not w.busy or seq == w.pending:  # a wake-up for a busy worker waits for its step's end
                    self.jobs.pop(w.wid, None)
                    self.worker_event(w, t)
            elif kind == "learner":
                if seq == self.learner_pending:  # not an end the work was rescheduled from
                    self.jobs.pop(-1, None)
                    self.learner_done(t)
            elif kind == "announce":
                self.announce(t)
            self.rerate(t)
        if not self.done:
            raise RuntimeError(
                f"the simulation of {self.mode.name} stalled after {self.announced} of {self.setup.steps} steps "
                f"({len(self.queue)} groups queued, {len(self.ready)} ready for the learner): a planner bug"
            )
        times = self.version_times
        spans = [self.last_finish[s] - self.first_start[s] for s in sorted(self.last_finish) if s in self.first_start]
        sd_rounds = sum(n for label, n in self.rounds.items() if label != "plain")
        return Result(
            mode=self.mode.name,
            step_times=[b - a for a, b in itertools.pairwise(times)],
            version_times=times,
            rollout_spans=spans,
            learner_s=self.learner_s,
            emitted=self.emitted,
            finished_tokens=self.finished,
            in_flight_tokens=sum(r.done for w in self.workers for r in w.running + w.parked),
            discarded_tokens=self.discarded,
            dropped_groups=self.dropped,
            drafter_train_s=self.train_s,
            rounds=self.rounds,
            sd_share=sd_rounds / max(sum(self.rounds.values()), 1),
            activity=self.activity,
            workers=len(self.workers),
        )

    # ------------------------------------------------------------------------------------------ policy service

    def dispatch(self, t: float) -> None:
        s = self.setup
        ahead = 1 if self.mode.partial and self.mode.max_staleness == 0 else 0
        while self.dispatched < s.steps and self.announced >= self.dispatched - self.mode.max_staleness - ahead:
            step = self.dispatched
            for g in range(s.prompts):
                self.queue.append(self.group(step, step * s.prompts + g, max(0, step - self.mode.max_staleness)))
            self.dispatched += 1
        self.wake(t)

    def group(self, step: int, gid: int, need: int) -> list[_Row]:
        """The rows of group `gid` of `step`, which start once a worker holds version `need`."""
        s = self.setup
        if s.replay:
            lens, self.group_share[gid] = s.replay[gid % len(s.replay)]
        elif self.rng is not None:
            lens = self.lengths.draw(s.group_size, self.length_rng)
        else:
            lens = [next(self._in_order) for _ in range(s.group_size)]
        self.group_left[gid] = len(lens)
        self.group_tokens[gid] = 0.0
        return [_Row(step, gid, min(x, s.max_response), need) for x in lens]

    def replace(self, step: int, t: float) -> None:
        """A group the learner dropped as stale is sent again (the policy service's replacement), first in the
        queue, to be generated by the policy announced now."""
        self.queue.appendleft(self.group(step, next(self.replacements), self.announced))
        self.wake(t)

    def wake(self, t: float) -> None:
        for w in self.workers:
            if not w.busy:
                self.at(t, "worker", w.wid)

    def announce(self, t: float) -> None:
        self.learner_busy = False
        self.announced += 1
        self.version_times.append(t)
        if self.announced >= self.setup.steps:
            self.done = True
            return
        self.dispatch(t)
        self.try_learn(t)

    # ------------------------------------------------------------------------------------------ workers

    def worker_event(self, w: _Worker, t: float) -> None:
        if w.step is not None:
            self.activity.append((w.began, t, w.parts))
            label = w.step[0]
            self.finish_step(w, t)
            if label == "send":
                self.deliver(w, t)
            elif w.outbox or w.owed:  # the loop's polls and the finished groups' output, before the next hop
                self.send(w, t)
                return
        if w.training_since is not None:  # preempted: the slice in progress ends first
            if self.has_work(w):
                end = t + self.setup.preempt_s
                self.train_s += end - w.training_since
                self.activity.append((w.training_since, t, {"train": 1.0}))
                w.training_since, self.lease = None, None
                w.step = ("train", 0.0)
                self.begin(w, t, {"train": end - t})
                self.work(w, t, end - t)
            return
        self.act(w, t)

    def has_work(self, w: _Worker) -> bool:
        return (
            bool(w.running)
            or self.announced > w.version
            or any(self.startable(w, g) for g in list(self.queue)[:1])
            or bool(w.parked and self.announced > w.version)
        )

    def startable(self, w: _Worker, group: list[_Row]) -> bool:
        need = group[0].draft_of
        return need <= w.version or (self.mode.partial and need - 1 <= w.version)

    def act(self, w: _Worker, t: float) -> None:
        s, costs = self.setup, self.costs
        extra = reverify = 0.0
        if self.announced > w.version and (self.mode.partial or not w.running):
            extra += costs.load_s
            if self.mode.partial:
                rows = w.running + w.parked
                reverify = costs.reverify_s([r.done for r in rows], s.prompt_len)
                extra += reverify
                for r in rows:
                    r.version = self.announced
                    kept = float(int(r.done * s.kept_share)) if self.rng is not None else r.done * s.kept_share
                    self.discarded += r.done - kept
                    r.done = kept
                    r.unseen = s.prompt_len + kept
                w.running += w.parked
                w.parked = []
                complete = [r for r in w.running if r.done >= r.length - 1e-9]
                w.running = [r for r in w.running if r.done < r.length - 1e-9]
                for r in complete:
                    self.row_finished(r, t + extra, w)
            w.version = self.announced
        if self.setup.colocated and self.learner_busy:
            self.go_idle(w, t)
            return
        admitted = 0
        if not (self.announced > w.version and not self.mode.partial):
            while self.queue and self.startable(w, self.queue[0]) and self.room(w, self.queue[0]):
                group = self.queue.popleft()
                for r in group:
                    r.version = w.version
                    r.unseen = s.prompt_len
                    self.first_start.setdefault(r.step, t)
                w.running += group
                admitted += len(group)
        if not w.running:
            if extra:
                w.step = ("load", extra)
                self.begin(w, t, {"load": extra - reverify, "reverify": reverify})
                self.work(w, t, extra)
            elif w.outbox:  # rows a re-verification ended, with nothing to load
                self.send(w, t)
            else:
                self.go_idle(w, t)
            return
        if w.idle_since is not None:
            w.idle_s += t - w.idle_since
            w.idle_since = None
        b = len(w.running)
        done = (r.done for r in w.running)
        ctx = s.prompt_len + (max(done) if costs.padded else statistics.fmean(done))
        arm = self.choose(w, b, ctx)
        repeat = 1
        if arm.kind == "plain" and s.macro_steps > 1:
            left = min(r.length - r.done for r in w.running)
            drafts = [s.ahead_tokens - r.done for r in w.running if r.draft_of > w.version]
            repeat = max(1, min(s.macro_steps, math.ceil(min([left, *drafts]) - 1e-9)))
        accepted = self.accepted(arm, b)
        rounds_s = repeat * costs.round_s(b, arm, ctx + (repeat - 1) / 2, accepted)
        rounds_s += self.switched_s(w, b, arm, ctx + (repeat - 1) / 2, repeat)
        if arm.uses_drafter:  # the drafter catches up on what it has not seen
            rounds_s += costs.catch_up_s([r.unseen for r in w.running])
            for r in w.running:
                r.unseen = 0.0
        if arm.kind != "plain":
            w.plain_run, w.rounded = 0, True
        else:
            w.plain_run += repeat
        prefill = costs.prefill_s(admitted * s.prompt_len)
        seconds = rounds_s + prefill
        w.arm, w.step, w.repeat = arm, (arm.label, seconds + extra), repeat
        self.begin(w, t, {arm.label: rounds_s, "prefill": prefill, "load": extra - reverify, "reverify": reverify})
        self.rounds[arm.label] = self.rounds.get(arm.label, 0) + repeat
        forwards = repeat * (1 + (arm.depth if arm.kind == "drafter" else 0)) + (1 if admitted else 0)
        self.work(w, t, seconds + extra, forwards)

    @staticmethod
    def begin(w: _Worker, t: float, parts: dict[str, float]) -> None:
        """What the step `w` starts at `t` spends its unslowed seconds on (`Result.activity`)."""
        w.began, w.parts = t, {k: v for k, v in parts.items() if v > 0}

    def room(self, w: _Worker, group: list[_Row]) -> bool:
        s = self.setup
        drafting = group[0].draft_of > w.version
        if drafting and s.ahead_rows and len(w.running) >= s.ahead_rows:
            return False
        if len(w.running) + len(group) > s.max_batch:
            return False
        if s.kv_capacity_tokens is not None:
            held = sum(s.prompt_len + r.done for r in w.running)
            if w.running and held + len(group) * s.prompt_len > s.kv_capacity_tokens:
                return False
        return True

    def choose(self, w: _Worker, b: int, ctx: float) -> Arm:
        if not self.arms:
            return self.plain
        on = w.switch.update(b)
        bucket = bucket_of(b, self.setup.edges)
        rate = {a: b * self.acc.mean(a, bucket) / self.judged_s(w, b, a, ctx) for a in [self.plain, *self.arms]}
        candidates = [self.plain, *self.arms] if on or self.setup.above_crossover == "measure" else [self.plain]
        best = max(sorted(candidates, key=lambda a: a.simplicity), key=rate.__getitem__)
        if self.rng is not None and len(candidates) > 1 and self.rng.random() < self.setup.epsilon:
            others = [a for a in candidates if a != best]
            weights = [max(0.1, (rate[a] / rate[best]) ** 4) for a in others]
            return self.rng.choices(others, weights)[0]
        return best

    def judged_s(self, w: _Worker, b: int, arm: Arm, ctx: float) -> float:
        """What the tuner goes by for a step of `arm`: its cost back to back, or with `Setup.judged_as_run` its
        cost if it ran now, after the steps `w` ran (`costs.switch_s`): the tuner measures an arm in the steps it
        runs, and an arm of the other kind than the bucket's usual one only in exploring steps right after it."""
        seconds = self.costs.round_s(b, arm, ctx, self.accepted(arm, b))
        return seconds + self.switched_s(w, b, arm, ctx) if self.setup.judged_as_run else seconds

    def switched_s(self, w: _Worker, b: int, arm: Arm, ctx: float, repeat: int = 1) -> float:
        """What `repeat` steps of `arm` on `w` now cost beyond `round_s` after the steps `w` ran (`costs.switch_s`;
        plain steps before any round pay nothing)."""
        after = w.plain_run if arm.kind != "plain" or w.rounded else None
        return self.costs.switch_s(b, arm, ctx, after, repeat, self.accepted(arm, b))

    def accepted(self, arm: Arm, b: int) -> float:
        """The draft tokens a row accepts in a round of `arm` at `b` rows, on average (`Acceptance.accepted`;
        `costs.round_s` charges what accepting costs: a round's own draw may differ, the cost is the mean's)."""
        return self.acc.accepted(arm, bucket_of(b, self.setup.edges))

    def finish_step(self, w: _Worker, t: float) -> None:
        label, _ = w.step
        w.step, w.busy = None, False
        if label in ("train", "load", "send"):
            return
        arm = w.arm or self.plain
        b = len(w.running)
        bucket = bucket_of(b, self.setup.edges)
        keep = []
        ended = False
        for r in w.running:
            e = min(self.acc.draw(arm, bucket, self.rng) * w.repeat, r.length - r.done)
            if r.draft_of > w.version:
                e = min(e, self.setup.ahead_tokens - r.done)
            r.done += e
            self.emitted += e
            drafting = r.draft_of > w.version
            if drafting and (r.done >= r.length - 1e-9 or r.done >= self.setup.ahead_tokens - 1e-9):
                w.parked.append(r)  # a draft is sent only once re-verified
            elif r.done >= r.length - 1e-9:
                self.row_finished(r, t, w)
                ended = True
            else:
                keep.append(r)
        w.running = keep
        w.hop_steps += w.repeat
        if ended or w.hop_steps >= self.setup.steps_per_hop:  # a hop ends: the loop polls for work
            w.owed += self.costs.hop_s * max(1, w.hop_steps // self.setup.steps_per_hop)
            w.owed += self.costs.finish_s if ended else 0.0
            w.hop_steps = 0

    def row_finished(self, r: _Row, t: float, w: _Worker) -> None:
        self.finished += r.done
        if self.drafter_trains:  # its hidden-state window, for the share streamed
            w.owed += self.costs.window_s * self.setup.hidden_share
        self.last_finish[r.step] = t
        self.group_tokens[r.group] += r.done
        self.group_rows.setdefault(r.group, []).append(r.done)
        self.group_version[r.group] = min(self.group_version.get(r.group, r.version), r.version)
        self.group_left[r.group] -= 1
        if self.group_left[r.group] == 0:
            tokens = self.group_tokens[r.group]
            share = self.group_share.get(r.group, self.setup.trained_share)
            rows = self.group_rows.pop(r.group)
            w.outbox.append((r.step, self.group_version[r.group], tokens, tokens * share, rows if share else []))
            if not self.costs.group_s and not w.owed:  # nothing to send first (its rows' windows: sent before it)
                self.deliver(w, t)

    def send(self, w: _Worker, t: float) -> None:
        """`w`'s loop: the polls it owes and its finished groups' output, then `deliver`."""
        seconds = w.owed + self.costs.group_s * len(w.outbox)
        w.owed = 0.0
        w.step = ("send", seconds)
        self.begin(w, t, {"loop": seconds})
        self.work(w, t, seconds)

    def deliver(self, w: _Worker, t: float) -> None:
        """The groups `w` has sent reach the learner."""
        self.ready.extend(w.outbox)
        w.outbox = []
        self.try_learn(t)

    def go_idle(self, w: _Worker, t: float) -> None:
        if w.idle_since is None:
            w.idle_since = t
        trains = self.drafter_trains and not (self.setup.colocated and self.learner_busy)
        if trains and self.lease is None and w.training_since is None:
            self.lease, w.training_since = w.wid, t

    # ------------------------------------------------------------------------------------------ learner

    def try_learn(self, t: float) -> None:
        if self.learner_busy:
            return
        window = self.mode.max_staleness
        stale = [g for g in self.ready if self.learner_version - g[1] > window]  # wherever it waits in the queue
        if stale:
            self.ready = deque(g for g in self.ready if self.learner_version - g[1] <= window)
            for group in stale:
                self.replace(group[0], t)
            self.dropped += len(stale)
        n = self.setup.prompts
        if self.mode.overlapped:
            if not self.ready or self.accumulated >= n:
                return
            _, _, tokens, trained, rows = self.ready.popleft()
            self.accumulated += 1
            self.acc_tokens += tokens
            seconds = self.learn_s(rows, trained, self.setup.prompt_len + tokens / self.setup.group_size)
            if self.accumulated == n:
                seconds += self.costs.optimizer_s
        else:
            if len(self.ready) < n:
                return
            taken = [self.ready.popleft() for _ in range(n)]
            tokens = sum(g[2] for g in taken)
            ctx = self.setup.prompt_len + tokens / (n * self.setup.group_size)
            trained = sum(g[3] for g in taken)
            seconds = self.learn_s([x for g in taken for x in g[4]], trained, ctx) + self.costs.optimizer_s
            self.accumulated = n
        self.work(None, t, seconds)

    def learn_s(self, rows: list[float], trained: float, context: float) -> float:
        """The forward and backward of an update over `trained` tokens of the rows of lengths `rows` (the groups
        with a signal): the cost model's micro-batched cost of those rows (`CpuCosts.learn_rows_s`), scaled to
        the share of their tokens trained, where it has one; else its cost per token at the mean context."""
        total = sum(rows)
        per_rows = self.costs.learn_rows_s(rows, self.setup.prompt_len) if total > 0 else None
        if per_rows is None:
            return self.costs.learn_s(int(trained), context)
        return per_rows * trained / total

    def learner_done(self, t: float) -> None:
        """A group's (overlapped) or a whole update's work is done; a finished update is published, the learner
        busy until its version is announced (the checkpoint is written on its critical path)."""
        self.update_s += t - self.learner_started
        if self.accumulated >= self.setup.prompts:
            self.accumulated, self.acc_tokens = 0, 0.0
            self.learner_version += 1
            self.learner_s.append(self.update_s)
            self.update_s = 0.0
            self.at(t + self.costs.publish_s, "announce")
        else:
            self.learner_busy = False
            self.try_learn(t)
            if self.setup.colocated and not self.learner_busy:  # the devices it held are the workers' again
                self.wake(t)


def simulate(mode: Mode, setup: Setup, lengths: LengthDist, acceptance: Acceptance, costs: EngineCosts) -> Result:
    """One simulated run of `setup.steps` RL steps in `mode`; deterministic for a seed."""
    if setup.prompts < 1 or setup.group_size < 1 or setup.steps < 1 or setup.workers < 1 or setup.max_batch < 1:
        raise ValueError("prompts, group size, steps, workers and max batch must be positive")
    if setup.group_size > setup.max_batch:
        raise ValueError(f"a group of {setup.group_size} rows does not fit a batch of {setup.max_batch}")
    if not 0.0 <= setup.hidden_share <= 1.0:
        raise ValueError(f"hidden_share {setup.hidden_share!r} is not a share in [0, 1]")
    for lens, share in setup.replay:
        if not lens or len(lens) > setup.max_batch or min(lens) < 1 or not 0.0 <= share <= 1.0:
            raise ValueError(f"a replayed group needs 1 to {setup.max_batch} lengths >= 1 and a share in [0, 1]")
    return _Sim(mode, setup, lengths, acceptance, costs).run()
