"""The run-inspection commands (`report`, `monitor`, `doctor`, `eval`) on inputs a user may hand them: a
run directory that is missing, a file or damaged, a Redis URL the client cannot use or a Redis that refuses
the reads. Each gets one line on stderr and exit 2 (or 1: a server that cannot be read), never a traceback;
a damaged run keeps its usable rows."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import redis
import redis.exceptions

from tlt_stream.basics.config import BusConfig, Config, ConfigError
from tlt_stream.bus.streams import Keys
from tlt_stream.commands.cli import main
from tlt_stream.commands.report import write_report
from tlt_stream.rl.records import load_metrics, read_jsonl
from tlt_stream.roles.monitor.loop import MonitorOptions
from tlt_stream.roles.monitor.snapshot import check_redis_url, inspect_redis

SECRET = "hunter2secret"


def row(version: int, **figures: object) -> dict:
    """A `metrics.jsonl` line with what the report reads."""
    return {
        "version": version, "reward_mean": 0.25 * version, "response_lens": [10, 20 * version],
        "response_len_p50": 15.0, "response_len_p90": 18.0, "response_len_max": 20.0 * version,
        "learn_seconds": 1.0, "rollout_seconds": 2.0, "accept_length_mean": 1.5, **figures,
    }  # fmt: skip


def lines(*rows: object) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def refused(capsys: pytest.CaptureFixture[str], argv: list[str], code: int = 2) -> str:
    """Run the CLI in-process; it must exit `code` with exactly one line on stderr, which is returned."""
    assert main(argv) == code
    err = capsys.readouterr().err
    assert "Traceback" not in err and SECRET not in err
    assert len(err.strip().splitlines()) == 1, err
    return err


# ---------------------------------------------------------------------------------------------- report


def test_report_names_a_missing_a_file_or_an_empty_run_directory_and_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert "no such run directory" in refused(capsys, ["report", str(tmp_path / "nowhere")])
    (tmp_path / "file").write_text("x")
    assert "not a directory" in refused(capsys, ["report", str(tmp_path / "file")])
    (tmp_path / "empty").mkdir()
    assert "no learner steps recorded yet" in refused(capsys, ["report", str(tmp_path / "empty")])
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(lines(row(1)))
    (run / "report").write_text("in the way")
    assert "cannot make the report directory" in refused(capsys, ["report", str(run)])
    (run / "report").unlink()
    (run / "timeline.jsonl").mkdir()
    assert "timeline.jsonl: cannot read it" in refused(capsys, ["report", str(run)])


def test_a_run_whose_report_cannot_be_written_still_ends_with_its_own_code(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`tlt-stream run` writes the report last: a report it cannot write (here its folder is a file) is said in
    the closing line, and the run ends as it did, not with a traceback after training."""
    from types import SimpleNamespace

    from tlt_stream.basics.config import load_config
    from tlt_stream.commands.run.setup import finish

    (tmp_path / "metrics.jsonl").write_text(lines(row(1)))
    (tmp_path / "report").write_text("in the way")
    plan = SimpleNamespace(run_dir=tmp_path, cores=1)
    assert finish(plan, load_config(), 0, 0, 12.0) == 0  # type: ignore[arg-type]
    err = capsys.readouterr().err
    assert "finished in 12s; the report was not written" in err and f"tlt-stream report {tmp_path}" in err


def test_a_line_torn_mid_character_or_of_another_shape_is_skipped_not_fatal(tmp_path: Path) -> None:
    text = lines(row(1), row(2, note="héllo")).encode()
    whole = json.dumps(row(3, note="héllo"), ensure_ascii=False).encode()
    torn = text + whole[: whole.index(b"\xc3") + 1]  # a killed writer cut the line inside the é
    (tmp_path / "metrics.jsonl").write_bytes(torn + b"\n[1, 2]\nnull\n\xff\xfe garbage\n" + lines(row(4)).encode())
    assert [r["version"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 4]
    with (tmp_path / "metrics.jsonl").open("a") as out:
        out.write(lines({"version": "5"}, {"version": True}, {"reward_mean": 1.0}, {"version": 5.0}))
    assert [r["version"] for r in load_metrics(tmp_path)] == [1, 2, 4], "only integer versions are steps"


def test_the_report_draws_what_is_usable_from_rows_of_the_wrong_types(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    metrics = [
        row(1),
        row(2, reward_mean="high", response_lens=7, learn_seconds=None, accept_length_drafter_x=2.0),
        row(3, reward_mean=math.nan, checkpoint_seconds=math.inf, stale_dropped_groups=math.nan),
        row(4, response_len_p50="?", accept_length_drafter_0=2.5, stale_dropped_groups=1.0, stale_dropped_len_mean=9),
    ]
    (tmp_path / "metrics.jsonl").write_text(lines(*metrics) + '{"version": 5, "reward_me')  # a killed writer
    rollout = {"kind": "rollout", "worker_id": "w0", "policy_version": 1, "batch_size": 4, "sd_on": True}
    timeline = [
        {"kind": "worker_state", "worker_id": "w0", "state": "GENERATING", "created_at": 1.0},
        {**rollout, "created_at": 2.0, "drafted": {"eagle": 10}, "accepted": {"eagle": 4}},
        {**rollout, "created_at": 3.0, "sd_on": "yes", "batch_size": "big", "kept_tokens": "7"},
        {**rollout, "created_at": 4.0, "policy_version": None, "drafted": [1], "accepted": {"eagle": "x"}},
        {"kind": "rollout", "created_at": 5.0},  # a report from before most fields
        {"kind": "worker_state", "worker_id": 7, "state": "IDLE", "created_at": 6.0},
        {"kind": "worker_state", "worker_id": "w1", "state": "IDLE", "created_at": "soon"},
        {"worker_id": "w0", "created_at": 7.0},
        [1, 2],
    ]
    (tmp_path / "timeline.jsonl").write_text(lines(*timeline))
    evals = [{"version": 0, "accuracy": 0.5}, {"version": 4, "accuracy": "x"}, {"version": 4}, {"accuracy": 0.9}]
    (tmp_path / "eval.jsonl").write_text(lines(*evals))
    (tmp_path / "samples.jsonl").write_text(lines({"version": 4, "reward": "?"}, {"response": "<b>"}))
    assert main(["report", str(tmp_path)]) == 0
    assert "Traceback" not in capsys.readouterr().err
    page = (tmp_path / "report" / "report.html").read_text()
    items = dict(re_items(page))
    assert items["steps"] == "4" and items["last version"] == "4" and items["last reward"] == "1.000"
    assert items["held-out accuracy"] == "0.500 (v0)"
    assert items["draft acceptance by source"] == "eagle 0.40 (4 of 10 drafted)"
    assert "&lt;b&gt;" in page
    for name in ("reward", "lengths", "time", "speculation", "workers"):
        assert (tmp_path / "report" / f"{name}.png").stat().st_size > 0


def re_items(page: str) -> list[tuple[str, str]]:
    import re

    return re.findall(r"<li><b>([^<]*)</b>: ([^<]*)</li>", page)


def test_a_missing_last_reward_reads_as_a_dash(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text(lines(row(1), row(2, reward_mean=None)))
    items = dict(re_items(write_report(tmp_path).read_text()))
    assert items["last reward"] == "-"


# ---------------------------------------------------------------------------------------------- monitor and doctor


@pytest.mark.parametrize("query", ["socket_timeout=abc", "no_such_option=1"])
def test_a_redis_url_the_client_cannot_use_is_one_line_and_exit_2(
    query: str, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"redis://app:{SECRET}@127.0.0.1:1/0?{query}"
    with pytest.raises(ValueError, match=query.split("=")[0]) as why:
        check_redis_url(url)
    assert SECRET not in str(why.value)
    check_redis_url("redis://app:pw@127.0.0.1:1/0?socket_timeout=3")
    for extra in (["--once"], ["--once", "--json"], ["--json"]):
        err = refused(capsys, ["monitor", *extra, "--redis-url", url])
        assert "the Redis client cannot use the URL redis://app:***@127.0.0.1:1/0" in err


def test_doctor_refuses_such_a_url_without_leaving_a_client_half_open() -> None:
    """A subprocess: an MQTT client cancelled mid-connect prints its noise when the process exits."""
    url = f"redis://app:{SECRET}@127.0.0.1:1/0?no_such_option=1"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "tlt_stream.commands.cli",
            "doctor",
            "--redis-url",
            url,
            "--mqtt-url",
            "mqtt://127.0.0.1:1",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "no_such_option" in result.stderr and SECRET not in result.stderr


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "soon"])
def test_doctor_refuses_a_timeout_that_would_read_every_server_as_down(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["doctor", "--timeout", value, "--redis-url", "redis://127.0.0.1:1/0", "--mqtt-url", "mqtt://127.0.0.1:1"])
    assert exited.value.code == 2
    assert "argument --timeout" in capsys.readouterr().err


@pytest.mark.parametrize("options", [{"interval": math.inf}, {"window_s": math.inf}, {"timeout": math.nan}])
def test_monitor_options_must_be_finite(options: dict) -> None:
    with pytest.raises(ConfigError, match="finite"):
        MonitorOptions(**options)


class Silent:
    """A Redis client whose every command fails with an exception that has no text (a timeout, a TLS
    handshake with a server that does not speak TLS)."""

    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    async def ping(self) -> None:
        raise self.exc


@pytest.mark.parametrize(
    ("exc", "said"), [(TimeoutError(), "no answer in time"), (redis.exceptions.ConnectionError(), "ConnectionError")]
)
async def test_an_error_without_text_still_says_what_went_wrong(exc: Exception, said: str) -> None:
    config = Config(run="r", bus=msgspec.convert({"redis_url": "redis://127.0.0.1:1/0"}, BusConfig))
    report = await inspect_redis(config, 1.0, redis=Silent(exc))  # type: ignore[arg-type]
    assert report["reachable"] is False
    assert report["error"] == f"cannot reach Redis at redis://127.0.0.1:1/0: {said}"


def test_a_redis_that_refuses_the_reads_is_one_line_not_a_traceback(
    bus_config: Config, capsys: pytest.CaptureFixture[str]
) -> None:
    """A key of the run holding another kind of value (a run name shared with another program): Redis answers
    WRONGTYPE, as it answers NOPERM to a user whose ACL lacks a command."""
    url = bus_config.bus.redis_url
    assert url is not None
    client = redis.Redis.from_url(url)
    try:
        client.set(Keys(bus_config.run).stream("prompts"), "not a stream")
        run = ["--run", bus_config.run, "--redis-url", url]
        err = refused(capsys, ["monitor", "--once", "--json", *run], code=1)
        assert f"refused a read of run {bus_config.run!r}: WRONGTYPE" in err
        err = refused(capsys, ["doctor", "--json", *run, "--mqtt-url", str(bus_config.bus.mqtt_url)], code=1)
        assert "WRONGTYPE" in err
    finally:
        client.delete(Keys(bus_config.run).stream("prompts"))
        client.close()


# ---------------------------------------------------------------------------------------------- eval


def test_eval_of_a_policy_with_truncated_weights_is_one_line_and_exit_2(
    init_policy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    weights = init_policy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    err = refused(capsys, ["eval", "--model", str(init_policy), "--n", "1"])
    assert f"{init_policy}: unreadable safetensors weights" in err
