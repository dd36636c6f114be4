"""Experiment tracking: the learner's per-step figures and a few sampled responses, to TensorBoard and/or
Weights & Biases, chosen with one setting (`learner.log_to`, `run --log-to tensorboard,wandb`).

Both are optional packages (`pip install 'tlt-stream[tracking]'`); asking for one that is missing stops the
learner at start-up with the command that installs it. W&B runs offline by default (`learner.wandb_mode`):
nothing leaves the machine until you `wandb sync RUN_DIR/wandb/offline-run-*`. The configuration it records
is the redacted one (no passwords from the bus URLs). Everything lives under the run directory:
`RUN_DIR/tensorboard/` and `RUN_DIR/wandb/`. A resumed learner continues the same W&B run (its id is the
run's name) and appends to the same TensorBoard directory; `metrics.jsonl` stays the record of truth.
"""

from __future__ import annotations

import logging
import math
import re
import struct
import time
import zlib
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

__all__ = [
    "TRACKERS",
    "MissingTracker",
    "Tracker",
    "open_trackers",
    "require_trackers",
    "scalars",
    "trackers_for",
    "wandb_records",
]

log = logging.getLogger(__name__)

TRACKERS = ("tensorboard", "wandb")
INSTALL = "pip install 'tlt-stream[tracking]'"
WANDB_FINISH_TIMEOUT = 60.0  # seconds for W&B's service to write a finished run's file (see WandbTracker.close)


class MissingTracker(ValueError):
    """A tracker was asked for whose package is not installed; the message says how to install it."""


def require_trackers(names: Sequence[str]) -> None:
    """Fail fast, before any service starts: `MissingTracker` naming the first package that is missing."""
    for name in dict.fromkeys(names):
        module = "torch.utils.tensorboard" if name == "tensorboard" else name
        try:
            __import__(module)
        except ImportError as exc:
            raise MissingTracker(f"learner.log_to has {name}, which is not installed ({exc}): {INSTALL}") from None


class Tracker(Protocol):
    def log(self, version: int, metrics: Mapping[str, float]) -> None:
        """The figures of policy version `version` (the step axis)."""
        ...

    def log_samples(self, version: int, rows: Sequence[Mapping[str, Any]]) -> None:
        """A few (prompt, response, reward, finish reason) rows of that version."""
        ...

    def close(self) -> None: ...


def scalars(line: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """The finite numbers of a metrics line (lists, strings and the clock left out), keyed `prefix/key`."""
    out = {}
    for key, value in line.items():
        if key in ("time", "version") or isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if math.isfinite(value):
            out[f"{prefix}{key}"] = float(value)
    return out


class TensorBoardTracker:
    def __init__(self, logdir: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise MissingTracker(f"learner.log_to has tensorboard, which is not installed ({exc}): {INSTALL}") from None
        self.writer = SummaryWriter(log_dir=str(logdir))

    def log(self, version: int, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, global_step=version)
        self.writer.flush()

    def log_samples(self, version: int, rows: Sequence[Mapping[str, Any]]) -> None:
        if not rows:
            return
        lines = ["| sample | reward | finish | prompt | response |", "|---|---|---|---|---|"]
        for r in rows:
            cells = [r["sample_id"], f"{r['reward']:.3g}", r["finish_reason"], r["prompt"], r["response"]]
            lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
        self.writer.add_text("samples", "\n".join(lines), global_step=version)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    def __init__(self, root: Path, *, run: str, project: str, mode: str, config: Mapping[str, Any], job: str) -> None:
        try:
            import wandb
        except ImportError as exc:
            raise MissingTracker(f"learner.log_to has wandb, which is not installed ({exc}): {INSTALL}") from None
        self.wandb = wandb
        root.mkdir(parents=True, exist_ok=True)
        run_id = re.sub(r"[^A-Za-z0-9_-]", "-", f"{run}-{job}")
        self.run = wandb.init(
            project=project,
            dir=str(root),
            mode=mode,
            id=run_id,
            name=f"{run} ({job})",
            group=run,
            job_type=job,
            resume="allow",
            config=dict(config),
            settings=wandb.Settings(console="off", save_code=False, silent=True),
        )
        self.run_file = Path(self.run.settings.sync_file)

    def log(self, version: int, metrics: Mapping[str, float]) -> None:
        self.run.log(dict(metrics), step=version)

    def log_samples(self, version: int, rows: Sequence[Mapping[str, Any]]) -> None:
        if not rows:
            return
        columns = ["sample_id", "prompt", "response", "reward", "finish_reason"]
        table = self.wandb.Table(columns=columns, data=[[r[c] for c in columns] for r in rows])
        self.run.log({"samples": table}, step=version)

    def close(self) -> None:
        """Finish the run and return once its `run-*.wandb` file holds everything logged.

        `run.finish()` alone does not promise that: it waits for the service (wandb-core) to answer the exit
        record, then only publishes "finish" for the stream, unanswered. The service keeps the log's current
        32 KiB block in memory (offline, nothing else makes it flush) and writes it when it closes that
        stream, later. The exit record is the last one the run writes, after the handler has flushed the
        last step's history, so the file is whole once it holds the exit record."""
        self.run.finish()
        if self.run_file.exists():  # none when W&B is disabled or could not open it (then wandb said why)
            _wait_for_exit_record(self.run_file, WANDB_FINISH_TIMEOUT)


# A run's `.wandb` file is a LevelDB-style log: a 7-byte header (":W&B", 2 magic bytes, a version), then 32 KiB
# blocks of chunks, each crc32 (IEEE, of the type byte and the data) + length + type, a record split
# FIRST/MIDDLE/LAST across blocks; a block's tail too short for a chunk header is zeros.
_HEADER, _BLOCK, _CHUNK = 7, 32768, 7
_FULL, _LAST = 1, 4


def _records(data: bytes, base: int, pos: int) -> Iterator[tuple[bytes, int]]:
    """(record, offset just past it) for each whole record of `data`, the file's bytes from offset `base`, from
    offset `pos` (a record boundary at or after `base`), stopping at the first chunk that is not all there
    yet or fails its crc (the writer's last block still in flight)."""
    pending = b""
    while True:
        left = _BLOCK - pos % _BLOCK
        if left < _CHUNK:
            pos += left
            continue
        at = pos - base
        if at + _CHUNK > len(data):
            return
        crc, length, kind = struct.unpack_from("<IHB", data, at)
        end = at + _CHUNK + length
        if end > len(data) or zlib.crc32(data[at + 6 : end]) != crc:
            return
        pending += data[at + _CHUNK : end]
        pos = base + end
        if kind in (_FULL, _LAST):
            yield pending, pos
            pending = b""


def wandb_records(run_file: Path) -> list[Any]:
    """The whole protobuf records (`wandb_internal_pb2.Record`) of a W&B `run-*.wandb` file, as it stands."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = run_file.read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{run_file} is not a W&B run file")
    return [pb.Record.FromString(record) for record, _ in _records(data, 0, _HEADER)]


def _wait_for_exit_record(run_file: Path, timeout: float) -> None:
    """Until `run_file` holds its exit record, reading on from the last whole record; TimeoutError after
    `timeout` seconds. The service gives no acknowledgement to wait on instead (see `WandbTracker.close`)."""
    from wandb.proto import wandb_internal_pb2 as pb

    deadline = time.monotonic() + timeout
    pos, pause = _HEADER, 0.005
    with run_file.open("rb") as file:
        while True:
            file.seek(pos)
            for record, end in _records(file.read(), pos, pos):
                if pb.Record.FromString(record).WhichOneof("record_type") == "exit":
                    return
                pos = end
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"W&B's service did not finish writing {run_file} within {timeout:g}s of run.finish() "
                    f"(no exit record after byte {pos}): wandb-core is stuck or gone, the run's last records are lost"
                )
            time.sleep(pause)
            pause = min(2 * pause, 0.25)


def _cell(value: object) -> str:
    text = str(value).replace("|", "\\|").replace("\n", " ")
    return text if len(text) <= 300 else text[:300] + "..."


def open_trackers(
    names: Sequence[str],
    run_dir: Path,
    *,
    run: str,
    config: Mapping[str, Any],
    project: str = "tlt-stream",
    mode: str = "offline",
    job: str = "learner",
) -> list[Tracker]:
    """The trackers named (each at most once), writing under `run_dir`; `MissingTracker` when a package is
    missing, ValueError for an unknown name. `job` tells the learner's figures from the evaluations'."""
    unknown = sorted(set(names) - set(TRACKERS))
    if unknown:
        raise ValueError(f"unknown tracker(s) {unknown}: choose from {list(TRACKERS)}")
    out: list[Tracker] = []
    try:
        for name in dict.fromkeys(names):
            if name == "tensorboard":
                out.append(TensorBoardTracker(run_dir / "tensorboard" / job))
            else:
                out.append(WandbTracker(run_dir, run=run, project=project, mode=mode, config=config, job=job))
    except BaseException:
        for tracker in out:
            tracker.close()
        raise
    if out:
        log.info("tracking %s to %s under %s (%s)", job, ", ".join(dict.fromkeys(names)), run_dir, mode)
    return out


def trackers_for(config: Any, run_dir: Path, *, job: str = "learner") -> list[Tracker]:
    """The trackers `config.learner.log_to` names for this run, writing under `run_dir` (none when it names
    none), with the run's configuration, its secrets redacted."""
    import msgspec

    from tlt_stream.basics.config import redact_config

    own = config.learner
    return open_trackers(
        own.log_to,
        run_dir,
        run=config.run,
        config=redact_config(msgspec.to_builtins(config)),
        project=own.wandb_project,
        mode=own.wandb_mode,
        job=job,
    )
