"""The `stats` stream's entries: worker states, rollout and learner figures, SD arm measurements, drafter
training slices."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Annotated, Literal

from msgspec import Meta

if TYPE_CHECKING:
    pass

from tlt_stream.basics.messages.wire import Entry, NonNegInt, Version

__all__ = [
    "DrafterStats",
    "LearnerDiskTrouble",
    "LearnerStats",
    "RolloutStats",
    "SdArmReport",
    "StatsEntry",
    "WorkerState",
    "WorkerStatus",
]


# ---------------------------------------------------------------------------------------------------- stats


class WorkerStatus(enum.StrEnum):
    GENERATING = "GENERATING"
    IDLE = "IDLE"
    TRAINING_DRAFTER = "TRAINING_DRAFTER"
    LOADING = "LOADING"
    STOPPED = "STOPPED"


class WorkerState(Entry, tag="worker_state"):
    """A worker changed state (the timeline of GENERATING / IDLE / TRAINING_DRAFTER / ...)."""

    worker_id: str
    state: WorkerStatus
    previous: WorkerStatus | None = None
    reason: str = ""


class RolloutStats(Entry, tag="rollout"):
    """A rollout worker's measurements over one reporting interval."""

    worker_id: str
    policy_version: NonNegInt
    drafter_version: Version
    batch_size: NonNegInt
    tokens: NonNegInt
    seconds: Annotated[float, Meta(ge=0)]
    target_forwards: NonNegInt = 0
    sd_on: bool = False
    drafted: dict[str, NonNegInt] = {}
    """Draft nodes verified in the interval, per source (eagle, group, ngram; a node two sources proposed
    counts for both)."""
    accepted: dict[str, NonNegInt] = {}
    """Drafted tokens accepted and emitted in the interval, per source (as `drafted`)."""
    collapses: NonNegInt = 0
    """Swaps after which the worker's acceptance collapsed, since it started (`rollout.collapse`)."""
    kept_tokens: NonNegInt = 0
    """Partial rollouts: tokens of rows in flight (drafts generated ahead of their version, or rows running
    at a version change) that a re-verification under the new version kept, in the interval."""
    discarded_tokens: NonNegInt = 0
    """Partial rollouts: such tokens a re-verification discarded (the first rejected one and all after it)."""
    ahead_seconds: Annotated[float, Meta(ge=0)] = 0.0
    """Partial rollouts: generation seconds in the interval with a draft group in flight, i.e. time the tail
    of one step was filled with the next step's work."""
    load_latency_s: dict[str, Annotated[float, Meta(ge=0)]] = {}
    """Policy versions loaded since the last report (by version number, as a string): wall-clock seconds from
    the version's `PolicyVersion.published_at` to this worker having it loaded (publisher and worker clocks:
    skew shifts it; a negative difference is reported as 0)."""
    loop_s: dict[str, Annotated[float, Meta(ge=0)]] = {}
    """The worker's seconds outside its engine hops in the interval, per part of its loop, over the passes
    that ran a hop (`roles/worker/reports.py`, `LOOP_PARTS`): what generating costs beside `seconds`."""


class SdArmReport(Entry, tag="sd_arm"):
    """Measured throughput of one speculative-decoding arm in one batch-size bucket."""

    worker_id: str
    drafter_version: Version
    bucket: NonNegInt
    depth: NonNegInt
    topk: NonNegInt
    verify: NonNegInt
    tokens: NonNegInt
    seconds: Annotated[float, Meta(ge=0)]
    proposer: Literal["plain", "ngram", "drafter", "group", "mixed", "either"] = "drafter"
    """What drafted: no SD (depth 0), prompt lookup, the trained drafter, the group/history source, the
    drafter and the group source in one tree, or either one's chain per row."""
    steps: NonNegInt = 0
    group: NonNegInt = 0
    """Group-source nodes beside the drafter's (proposer mixed) or instead of them (either)."""
    rows: NonNegInt = 0
    """Running rows summed over the `steps`: `tokens / rows` is the tokens one row's round emitted (0: a
    worker that does not count them)."""
    contexts: NonNegInt = 0
    """The longest running row's context at each step's start, summed over the `steps`: `contexts / steps` is
    the context the steps attended over (0: a worker or engine that does not count it)."""


class LearnerStats(Entry, tag="learner"):
    """One learner update."""

    step: NonNegInt
    policy_version: NonNegInt
    groups: NonNegInt
    samples: NonNegInt
    metrics: dict[str, float] = {}


class LearnerDiskTrouble(Entry, tag="learner_disk"):
    """A write of the learner's that must land (an update's checkpoint, its metrics line) failed: one entry per
    failed attempt, and one more once it was written (`written`). Until then nothing of the update is acked or
    published (`roles/learner_parts/disk.py`)."""

    write: str
    """What failed to be written: `checkpoint` or `metrics line`."""
    version: NonNegInt
    """The policy version the write is for."""
    attempts: NonNegInt
    """Failed attempts so far."""
    error: str
    """The newest error, one line (`describe_write_error`: says when the file system is full)."""
    since: float
    """Wall-clock time of the first failed attempt."""
    written: bool = False


class DrafterStats(Entry, tag="drafter_train"):
    """One drafter-training slice on an idle worker and, when it was judged, whether its drafter was adopted."""

    worker_id: str
    fence: NonNegInt
    """The lease's fencing token the slice trained under."""
    policy_version: Version
    """The policy version whose embedding, LM head and hidden states the slice trained against."""
    step: NonNegInt
    """The trainer's step count after the slice (it survives preemption and changes of holder)."""
    steps: NonNegInt
    seconds: Annotated[float, Meta(ge=0)]
    loss: float
    end: str
    """Why the slice ended: preempted, time, steps or no_data."""
    windows: NonNegInt = 0
    """Windows in the training buffer."""
    preempt_latency_s: Annotated[float, Meta(ge=0)] = 0.0
    """From new work arriving to the slice returning (0 when not preempted)."""
    judged: bool = False
    """Whether the slice's drafter was judged on the held-out windows (every `judge_every_steps` steps);
    the four fields below are its verdict, and mean nothing when it was not."""
    judge_s: Annotated[float, Meta(ge=0)] = 0.0
    """Seconds the judgement (two held-out measurements, and publishing) took."""
    accept_new: float = 0.0
    """Held-out acceptance (expected draft tokens accepted per verification) of the slice's drafter."""
    accept_current: float = 0.0
    """The same for the drafter in use when the slice ended."""
    adopted: bool = False
    drafter_version: Version = -1
    """The version published for this slice's drafter (-1: not published)."""


StatsEntry = WorkerState | RolloutStats | SdArmReport | LearnerStats | LearnerDiskTrouble | DrafterStats
