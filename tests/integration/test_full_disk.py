"""A full data volume under the learner service: its run directory on a real file system that fills up (a small
tmpfs, as root), against real streams. The checkpoint and the metrics line are retried until the volume has
room again, said once in the log and reported to the monitor; nothing of an update is acked or published before
its checkpoint exists, and every sample is trained exactly once.

The evidence is not the learner's word: the file system's own answer (a write of the test's refused with
ENOSPC), the test's record of every save and metrics-line attempt and how it ended, the checkpoints' ledgers,
Redis's pending list and version mirror, and the monitor's snapshot (what `tlt-stream monitor` shows)."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.test_learner_service import sample, service
from tlt_stream.basics.config import Config
from tlt_stream.basics.messages import LearnerDiskTrouble, LearnerStats, codec_for
from tlt_stream.bus.connect import connect_redis
from tlt_stream.bus.control import read_mirror
from tlt_stream.bus.producer import StreamProducer
from tlt_stream.bus.streams import Keys
from tlt_stream.rl.checkpoint import complete_checkpoints, latest_checkpoint, restore_checkpoint
from tlt_stream.roles.monitor import prometheus_text, snapshot

pytestmark = [pytest.mark.redis, pytest.mark.mqtt]


@contextlib.contextmanager
def small_volume(path: Path, size: str = "8m") -> Iterator[Path]:
    """A tmpfs of `size` mounted on `path` (skipped where this process cannot mount one)."""
    path.mkdir(parents=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(path)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip() or mounted.returncode}")
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


def fill(volume: Path) -> Path:
    """Fill `volume` to the last byte with one file; returns it (unlinked to free the volume)."""
    filler = volume / "filler"
    with filler.open("ab", buffering=0) as out:
        for chunk in (1 << 20, 1 << 12, 1):
            with contextlib.suppress(OSError):
                while out.write(b"\0" * chunk):
                    pass
    return filler


def refuses_writes(volume: Path) -> bool:
    """The file system's own answer: a new file of one byte is refused with ENOSPC."""
    probe = volume / "probe"
    try:
        with probe.open("wb", buffering=0) as out:
            out.write(b"x")
    except OSError as exc:
        return exc.errno == errno.ENOSPC
    finally:
        probe.unlink(missing_ok=True)
    return False


def attempts_of(record: list[tuple[int, str]], version: int) -> list[str]:
    return [outcome for v, outcome in record if v == version]


async def troubles(redis: Any, keys: Keys) -> list[Any]:
    entries = [codec_for("stats").decode(f[b"m"]) for _, f in await redis.xrange(keys.stream("stats"))]
    return [e for e in entries if isinstance(e, LearnerDiskTrouble | LearnerStats)]


def gauge(text: str, name: str) -> float:
    """The one sample of metric `name` in a Prometheus exposition, read with prometheus_client's parser."""
    (value,) = [s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name]
    return value


async def until(condition: Any, timeout: float = 120.0) -> None:
    """Poll the test's own record (written from the learner's save thread: no event to wait on)."""
    async with asyncio.timeout(timeout):
        while not condition():  # noqa: ASYNC110
            await asyncio.sleep(0.05)


async def test_a_full_data_volume_is_retried_reported_and_loses_nothing(
    bus_config: Config, tmp_path: Path, init_policy: Path
) -> None:
    keys = Keys(bus_config.run)
    redis = connect_redis(bus_config.bus.redis_url)
    producer = StreamProducer(redis, keys, bus_config.bus)
    messages = [sample(t, i, float(i == 0)) for t in ("a", "b", "c", "d") for i in (0, 1)]
    with small_volume(tmp_path / "data") as volume:
        run_dir = volume / "run"
        async with service(bus_config, run_dir, init_policy) as learner:
            assert (await learner.start()).version == 0
            learner.checkpoints.trainer.wait_for_writes()  # version 0's optimizer state lands before the fill

            # The test's own record of every save and metrics-line attempt: (version, "ok" or the error).
            saves: list[tuple[int, str]] = []
            lines: list[tuple[int, str]] = []
            save, append, publish = (
                learner.checkpoints.save,
                learner.records._append_metrics,
                learner.checkpoints.publish,
            )
            filler: list[Path] = []

            def recorded_save(extra: dict, ledger: set[str]) -> Any:
                try:
                    info = save(extra, ledger)
                except Exception as exc:
                    saves.append((learner.checkpoints.version, f"{type(exc).__name__}: {exc}"))
                    raise
                saves.append((learner.checkpoints.version, "ok"))
                return info

            def recorded_append(line: dict) -> None:
                try:
                    append(line)
                except OSError as exc:
                    lines.append((line["version"], f"{type(exc).__name__}: {exc}"))
                    raise
                lines.append((line["version"], "ok"))

            async def publish_then_fill(info: Any) -> Any:
                message = await publish(info)
                if info.step == 1:  # the volume fills between version 1's checkpoint and its metrics line
                    filler.append(fill(volume))
                return message

            learner.checkpoints.save = recorded_save  # type: ignore[method-assign]
            learner.records._append_metrics = recorded_append  # type: ignore[method-assign]
            learner.checkpoints.publish = publish_then_fill  # type: ignore[method-assign]

            # 1. The volume full before update 1's checkpoint: the update is kept, its save retried.
            filler.append(fill(volume))
            assert refuses_writes(volume)
            await producer.send("samples", messages[:4])
            running = asyncio.create_task(learner.run(asyncio.Event(), max_updates=2))
            await until(lambda: len(attempts_of(saves, 1)) >= 2 or running.done())
            assert not running.done(), "the learner stopped on a full disk"
            failed = attempts_of(saves, 1)
            assert failed and "ok" not in failed and all("No space left" in f for f in failed), failed
            assert refuses_writes(volume)
            assert latest_checkpoint(run_dir / "checkpoints").step == 0  # type: ignore[union-attr]
            assert (await read_mirror(redis, keys))["policy"].version == 0, "a version went out with no checkpoint"
            assert (await redis.xpending(keys.stream("samples"), "learner"))["pending"] == 4, "nothing acked"
            # What the monitor shows, from Redis alone.
            snap = await snapshot(bus_config, redis=redis)
            disk = snap["learner_disk"]
            assert disk is not None and disk["failing"] and disk["write"] == "checkpoint" and disk["version"] == 1
            assert "(the file system is full)" in disk["error"] and disk["attempts"] >= 1
            assert gauge(prometheus_text(snap), "tlt_learner_disk_failing") == 1

            # 2. Freed: the checkpoint lands and version 1 goes out; then the volume fills again before its
            # metrics line, which is retried without leaving a torn line behind.
            metrics = run_dir / "metrics.jsonl"
            before = metrics.stat().st_size if metrics.exists() else 0
            filler.pop().unlink()
            await until(lambda: len(attempts_of(lines, 1)) >= 2 or running.done())
            assert not running.done(), "the learner stopped on a full disk"
            assert attempts_of(saves, 1)[-1] == "ok" and attempts_of(saves, 1).count("ok") == 1
            assert (await read_mirror(redis, keys))["policy"].version == 1
            assert "ok" not in attempts_of(lines, 1) and refuses_writes(volume)
            assert (metrics.stat().st_size if metrics.exists() else 0) == before, "a torn metrics line was left"
            snap = await snapshot(bus_config, redis=redis)
            assert snap["learner_disk"]["failing"] and snap["learner_disk"]["write"] == "metrics line"
            filler.pop().unlink()

            # 3. Room again: update 2 runs as if nothing had happened, and the run ends.
            await producer.send("samples", messages[4:])
            await asyncio.wait_for(running, timeout=120)
            assert learner.version == 2
            snap = await snapshot(bus_config, redis=redis)
            assert snap["learner_disk"] is not None and not snap["learner_disk"]["failing"]
            assert gauge(prometheus_text(snap), "tlt_learner_disk_failing") == 0

        # The audit: every sample trained exactly once, by one update each; nothing pending; one line each.
        checkpoints = {c.step: c for c in complete_checkpoints(run_dir / "checkpoints")}
        assert sorted(checkpoints) == [0, 1, 2]
        ledgers = {step: restore_checkpoint(c, restore_rng=False)[0] for step, c in checkpoints.items()}
        assert ledgers[0] == set() and ledgers[1] == {m.sample_id for m in messages[:4]}
        assert ledgers[2] == {m.sample_id for m in messages}
        assert attempts_of(saves, 2) == ["ok"], "update 2 saved once"
        assert (await redis.xpending(keys.stream("samples"), "learner"))["pending"] == 0
        rows = [json.loads(line) for line in metrics.read_text().splitlines()]
        assert [row["version"] for row in rows] == [1, 2]
        assert rows[0]["checkpoint_failed_attempts"] == len(attempts_of(saves, 1)) - 1 > 0
        assert rows[1]["checkpoint_failed_attempts"] == 0
        said = await troubles(redis, keys)
        order = [(type(e).__name__, getattr(e, "write", ""), getattr(e, "written", None)) for e in said]
        # failed attempts of the checkpoint, its landing, failed attempts of the metrics line, its landing,
        # then the update's stats entry: the monitor's view in the order it happened
        assert order[0] == ("LearnerDiskTrouble", "checkpoint", False)
        assert ("LearnerDiskTrouble", "checkpoint", True) in order
        assert (
            order.index(("LearnerDiskTrouble", "checkpoint", True))
            < order.index(("LearnerDiskTrouble", "metrics line", False))
            < order.index(("LearnerDiskTrouble", "metrics line", True))
            < order.index(("LearnerStats", "", None))
        )
        assert [e.policy_version for e in said if isinstance(e, LearnerStats)] == [1, 2]
    await redis.aclose()
