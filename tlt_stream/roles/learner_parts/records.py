"""What each update leaves behind: a `LearnerStats` entry, a line of `metrics.jsonl`, a few samples to read,
and the same figures in TensorBoard or W&B.

`metrics.jsonl` (in the run directory) is the run's record of what was trained: every applied update has
one line, with its figures, staleness histogram, response lengths and groups. A line a crash cut short is
ended before the next is written, so each stays whole, and an update whose checkpoint exists but whose line
does not (the learner was killed in between) gets its line back from the checkpoint on restart. A line the
disk refuses (a full data volume) is retried until it is written, as the checkpoint is (`disk.py`). A few of
each update's samples, decoded, go to `samples.jsonl` and the log. An experiment tracker that fails, or a
`samples.jsonl` the disk refuses, costs its figures, never the update.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from tlt_stream.basics.config import Config
from tlt_stream.basics.messages import LearnerDiskTrouble, LearnerStats, Sample
from tlt_stream.bus.producer import StreamProducer
from tlt_stream.rl.checkpoint import CheckpointInfo
from tlt_stream.rl.groups import ReadyGroup
from tlt_stream.rl.tracking import Tracker, scalars, trackers_for
from tlt_stream.roles.learner_parts.disk import describe_write_error, until_written

__all__ = ["UpdateRecords"]

log = logging.getLogger("tlt_stream.roles.learner")

REPORT_TIMEOUT_S = 5.0
"""How long a disk trouble report may wait for Redis (`UpdateRecords.disk_trouble`)."""


class UpdateRecords:
    """The learner's records of its updates: the stats stream, the run directory's files, the trackers."""

    def __init__(self, config: Config, run_dir: Path, producer: StreamProducer, tokenizer: Callable[[], Any]) -> None:
        self.config = config
        self.run_dir = run_dir
        self.producer = producer
        self.tokenizer = tokenizer
        """The policy's tokenizer as the checkpoints have it now (None: samples are not decoded)."""
        self.trackers: list[Tracker] = []
        """TensorBoard / W&B (learner.log_to), opened by `open_trackers`, closed by `close_trackers`."""

    def open_trackers(self) -> None:
        if not self.trackers:
            self.trackers = trackers_for(self.config, self.run_dir)

    async def record_update(
        self,
        version: int,
        groups: list[ReadyGroup],
        samples: list[Sample],
        metrics: dict[str, float],
        *,
        histogram: dict[str, Any],
        wait: float,
        stop: asyncio.Event | None = None,
    ) -> None:
        """Version `version`, just made from `groups`, checkpointed and published: its figures to `stats`,
        `metrics.jsonl` (retried until written or `stop`) and the trackers, a few of its `samples` to read, and
        one log line."""
        trained = [g.task_id for g in groups]
        line = {
            "version": version,
            "time": time.time(),
            **metrics,
            "staleness_hist": histogram,
            "response_lens": [s.response_len for s in samples],
            "accept_lengths": [round(s.accept_length or 1.0, 3) for s in samples],
            "rewards": [float(s.reward) for s in samples],
            "trained_groups": trained,
        }
        await until_written(
            lambda: asyncio.to_thread(self._append_metrics, line),
            what="metrics line",
            version=version,
            stop=stop,
            meanwhile="the next update waits for it",
            report=self.disk_trouble,
        )
        # The line before the entry: whoever sees the entry (`tlt-stream run`'s progress) finds the line.
        await self.producer.send_one(
            "stats",
            LearnerStats(
                step=version,
                policy_version=version,
                groups=len(groups),
                samples=len(samples),
                metrics=metrics,
            ),
        )
        rows = self._log_samples(version, samples)
        for tracker in self.trackers:  # a tracker that fails costs its figures, never the update
            try:
                tracker.log(version, scalars(line))
                tracker.log_samples(version, rows)
            except Exception:
                log.exception("experiment tracker %s failed at version %d", type(tracker).__name__, version)
        log.info(
            "version %d: reward %.3f over %d groups (%d degenerate), rollout %.1fs (tail %.1fs), learn %.1fs, "
            "waited %.1fs; rollout-vs-learner logprob |delta| %.2g (max %.2g)",
            version,
            metrics["reward_mean"],
            len(groups),
            int(metrics["degenerate_groups"]),
            metrics["rollout_seconds"],
            metrics["tail_seconds"],
            metrics["learn_seconds"],
            wait,
            metrics.get("logprob_mismatch_mean", 0.0),
            metrics.get("logprob_mismatch_max", 0.0),
        )

    def close_trackers(self) -> None:
        for tracker in self.trackers:
            try:
                tracker.close()
            except Exception:
                log.exception("could not close experiment tracker %s", type(tracker).__name__)
        self.trackers = []

    def _log_samples(self, version: int, samples: list[Sample]) -> list[dict[str, Any]]:
        """A few of the step's samples, readable: RUN_DIR/samples.jsonl and one log line each; the rows."""
        count, tokenizer = self.config.learner.log_samples, self.tokenizer()
        if count <= 0 or tokenizer is None:
            return []
        rows = []
        for sample in sorted(samples, key=lambda s: s.sample_id)[:count]:
            row = {
                "version": version,
                "sample_id": sample.sample_id,
                "prompt": tokenizer.decode(sample.prompt_ids, skip_special_tokens=True),
                "response": tokenizer.decode(sample.token_ids.to_torch().tolist(), skip_special_tokens=True),
                "reward": sample.reward,
                "finish_reason": sample.finish_reason,
            }
            rows.append(row)
            log.info("version %d sample %s (reward %.3g): %r", version, sample.sample_id, sample.reward,
                     row["response"][:200])  # fmt: skip
        try:
            with (self.run_dir / "samples.jsonl").open("a") as out:
                out.writelines(json.dumps(row) + "\n" for row in rows)
        except OSError as exc:  # rows to read, not the run's record: the log has them
            log.warning("version %d: samples.jsonl not written (%s)", version, describe_write_error(exc))
        return rows

    async def disk_trouble(self, trouble: LearnerDiskTrouble) -> None:
        """A failed write of the learner's to `stats` (what the monitor shows), if Redis takes it within a few
        seconds: the report must not hold up the retry it is about."""
        try:
            async with asyncio.timeout(REPORT_TIMEOUT_S):
                await self.producer.send_one("stats", trouble)
        except Exception as exc:
            log.debug("could not report %s trouble to stats: %s", trouble.write, exc)

    def _append_metrics(self, line: dict[str, Any]) -> None:
        """`line` appended whole to `metrics.jsonl`, or not at all: what a full disk let through is taken back."""
        with (self.run_dir / "metrics.jsonl").open("a+b", buffering=0) as out:
            size = out.seek(0, 2)
            torn = False
            if size > 0:
                out.seek(-1, 2)
                torn = out.read(1) != b"\n"  # a line cut short by a crash: end it, so this one stays whole
            data = memoryview((b"\n" if torn else b"") + json.dumps(line).encode() + b"\n")
            try:
                while data:
                    data = data[out.write(data) :]
            except OSError:
                out.truncate(size)
                raise

    def recover_row(self, found: CheckpointInfo, meta: dict[str, Any]) -> None:
        """A learner killed after its checkpoint but before its `metrics.jsonl` line left an update that counts
        (the weights have it) with no row: write the row from the checkpoint, which carries the same figures
        and groups, so the run's record of what was trained stays complete."""
        extra = meta.get("extra", {})
        if "metrics" not in extra:
            return
        from tlt_stream.rl.records import load_metrics  # skips a line torn by the crash: the row is rewritten

        rows = load_metrics(self.run_dir)
        if found.step > (rows[-1]["version"] if rows else 0):
            created = datetime.fromisoformat(meta["created"]).timestamp()
            line = {"version": found.step, "time": created, **extra["metrics"]}
            line["trained_groups"] = extra.get("trained_groups", [])
            try:
                self._append_metrics({**line, "recovered": True})
            except OSError as exc:  # a full disk: the next restart recovers it (its checkpoint is still the newest)
                log.warning("version %d has no metrics line and it could not be written (%s)", found.step,
                            describe_write_error(exc))  # fmt: skip
                return
            log.warning("version %d had no metrics line (killed after its checkpoint): recovered it", found.step)
