"""The streams of the data plane, their retention, and every Redis key of a run (all under `tlt:{run}:`)."""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass

from tlt_stream.basics.config import BusConfig

__all__ = [
    "ALL_RUNS_GLOB",
    "RUN_MAX_BYTES",
    "STREAMS",
    "Keys",
    "StreamSpec",
    "check_run",
    "run_glob",
    "run_of_key",
    "run_problem",
    "spec",
]

RUN_MAX_BYTES = 65_535 - 1024
"""The longest run name, in UTF-8 bytes: an MQTT topic (`tlt/{run}/sd_config`) and an MQTT client id
(`tlt-{run}-{role}-...`) hold at most 65535 bytes each, and both add their own text to the name."""

_GLOB_SPECIALS = frozenset("*?[]\\")


def run_problem(run: str) -> str | None:
    """Why `run` cannot name a run on servers other runs share, or None when it can.

    Redis keys are `tlt:{run}:...`, so a name holding `:` would make one run's keys another's (`a` would own
    `tlt:a:b:versions` of run `a:b`, and a scan of `tlt:a:*` would find them); MQTT topics are `tlt/{run}/...`,
    which may not hold the wildcards `+` and `#`, a control character (the broker drops the connection) or text
    that is not UTF-8. Nor a `/`: a broker's ACL grants each role its kind as `tlt/+/{kind}`
    (deploy/mosquitto.acl), which run `a/b`'s topics are a level too deep to match, and the broker drops a
    publish its ACL refuses without a word (MQTT 3.1.1 acknowledges it all the same). The configuration
    allows a narrower alphabet still (`run`'s pattern); this is what the bus itself needs, for a name that
    reaches it some other way.
    """
    if not run:
        return "is empty"
    if ":" in run:
        return "holds ':', the separator of Redis keys (run 'a' would own the keys of run 'a:b')"
    if "/" in run:
        return "holds '/': its topics would be a level deeper than a broker's ACL grants roles (tlt/+/<kind>)"
    if "+" in run or "#" in run:
        return "holds an MQTT wildcard ('+' or '#'), which no topic may contain"
    if any(unicodedata.category(c) == "Cc" for c in run):
        return "holds a control character, which MQTT brokers refuse in a topic"
    try:
        size = len(run.encode())
    except UnicodeEncodeError:
        return "is not valid UTF-8 (it holds a lone surrogate)"
    if size > RUN_MAX_BYTES:
        return f"is {size} bytes long: at most {RUN_MAX_BYTES} fit in an MQTT topic"
    return None


def check_run(run: str) -> str:
    """`run`, when it can name a run (`run_problem`); else a ValueError of one line naming the `run` setting."""
    problem = run_problem(run)
    if problem is not None:
        shown = repr(run) if len(run) <= 80 else f"{run[:60]!r}... ({len(run)} characters)"
        raise ValueError(f"run {shown}: {problem}; use letters, digits, '_', '.' and '-'")
    return run


KEY_ROOT = "tlt:"
"""Every run's keys start with it, then the run's name and a ':' (`Keys.prefix`)."""
ALL_RUNS_GLOB = KEY_ROOT + "*"
"""A Redis SCAN pattern matching the keys of every run."""


def run_of_key(key: str) -> str | None:
    """The run a key belongs to (`Keys.prefix`'s inverse), or None for a key no run could have written."""
    if not key.startswith(KEY_ROOT):
        return None
    name, colon, _ = key[len(KEY_ROOT) :].partition(":")
    return name if colon and run_problem(name) is None else None


def run_glob(run: str) -> str:
    """A Redis SCAN pattern matching every key of run `run` and no other run's: the run's key prefix with
    the glob's own characters (`*`, `?`, `[`, `]`, `\\`) escaped, then `*`."""
    prefix = Keys(run).prefix
    return "".join(f"\\{c}" if c in _GLOB_SPECIALS else c for c in prefix) + "*"


@dataclass(frozen=True)
class StreamSpec:
    """How one stream is written and kept.

    A durable stream is never trimmed past entries a consumer group has not acked, and its producers wait
    when the un-acked backlog passes `bus.backlog_limit`. A buffer stream is bounded with `MAXLEN ~` and
    may drop its oldest entries by design.
    """

    name: str
    durable: bool
    group: str | None
    """The consumer group that reads it (None: read by XRANGE/XREAD only)."""

    def maxlen(self, bus: BusConfig) -> int | None:
        if self.durable:
            return None
        return {"hidden": bus.hidden_maxlen, "stats": bus.stats_maxlen, "dead": bus.dead_maxlen}[self.name]


STREAMS: dict[str, StreamSpec] = {
    s.name: s
    for s in (
        StreamSpec("prompts", durable=True, group="rollout"),
        StreamSpec("samples", durable=True, group="learner"),
        StreamSpec("hidden", durable=False, group="drafter"),
        StreamSpec("stats", durable=False, group=None),
        StreamSpec("dead", durable=False, group=None),
    )
}


def spec(stream: str) -> StreamSpec:
    try:
        return STREAMS[stream]
    except KeyError:
        raise KeyError(f"unknown stream {stream!r}; known: {', '.join(STREAMS)}") from None


@dataclass(frozen=True)
class Keys:
    """Every Redis key (and pub/sub channel) of one run."""

    run: str

    def __post_init__(self) -> None:
        check_run(self.run)

    @property
    def prefix(self) -> str:
        return f"{KEY_ROOT}{self.run}:"

    @property
    def dispatch(self) -> str:
        """Hash: the policy service's dispatch cursor (`next_step` whose prompts it sends, `dispatched_by`)."""
        return f"{self.prefix}dispatch"

    def stream(self, name: str) -> str:
        spec(name)
        return f"{self.prefix}stream:{name}"

    def acked_channel(self, name: str) -> str:
        """Pub/sub channel a consumer notifies after acking, to wake producers waiting on backpressure."""
        return f"{self.prefix}acked:{name}"

    @property
    def versions(self) -> str:
        """Hash mirroring the retained MQTT control messages (policy, drafter, sd_config)."""
        return f"{self.prefix}versions"

    @property
    def workers(self) -> str:
        """Sorted set: worker id -> time of its last heartbeat."""
        return f"{self.prefix}workers"

    def worker(self, worker_id: str) -> str:
        """Hash with one worker's state; expires when its heartbeats stop."""
        return f"{self.prefix}worker:{worker_id}"

    @property
    def dropped(self) -> str:
        """Hash: task id of a group the learner dropped as too stale -> its step (written once per task, so a
        restarted learner that drops it again changes nothing); the policy service sends each one again."""
        return f"{self.prefix}dropped"

    @property
    def lost(self) -> str:
        """Hash: task id of a group none of whose samples can be trained -> its step: the task dead-lettered by a
        worker (a prompt that fails the checks, a reward that raised or hung) or every member dead-lettered by
        the learner. Written before the dead letter; the policy service sends another prompt in its place."""
        return f"{self.prefix}lost"

    @property
    def dead_members(self) -> str:
        """Hash: sample id of a group member the learner dead-lettered -> what it said of its group (task, index,
        group size, version, step), written before its entry is acked. A restarted learner counts them again,
        so their groups still complete (they are acked, never delivered again); forgotten once the group's fate
        is durable (trained and checkpointed, dropped or lost, each recorded)."""
        return f"{self.prefix}dead_members"

    @property
    def replaced(self) -> str:
        """Hash: dropped task id -> the task id the policy service sent in its place (with that XADD, atomically)."""
        return f"{self.prefix}replaced"

    @property
    def dead_counts(self) -> str:
        """Hash: stream name -> entries ever dead-lettered from it (the dead stream itself is bounded)."""
        return f"{self.prefix}dead_counts"
