"""What stops `tlt-stream run`, `doctor`, `policy` and `eval` at start: one line on stderr and an exit code,
never a traceback, and never a fragment of a password: a URL whose password is not percent-encoded, a
Redis that cannot be reached or refuses the password, a bad argument, a held-out dataset or a reward that
would fail later; and a held-out evaluation that a reward cannot stop."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.compose_file import missing_binaries, private_redis
from tlt_stream.basics.config import ConfigError, load_config, override

CLI = [sys.executable, "-m", "tlt_stream.commands.cli"]
REWARD_SOURCE = """
def good(response, answer):
    return 1.0

def one_argument(response):
    return 1.0

def wants_difficulty(response, answer, difficulty):
    return float(difficulty)

def takes_any(response, answer, **fields):
    return 1.0

def raises_on_one(response, answer):
    if answer == "4":
        raise ValueError("cannot score this one")
    return 1.0

def not_a_number(response, answer):
    return float("nan")
"""


def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("TLT_")}
    environ.update({"OMP_NUM_THREADS": "1", **(env or {})})
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, env=environ)


def one_line(result: subprocess.CompletedProcess[str], code: int, text: str) -> str:
    """The one line `result` wrote to stderr, checked to hold `text`, after exit code `code` and no traceback."""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert "Traceback" not in result.stderr + result.stdout, result.stderr
    assert result.returncode == code, result.stderr
    assert len(lines) == 1 and text in lines[0], result.stderr
    return lines[0]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A world with the tests' tiny policy (runs take --sd off: no drafter needed)."""
    from tests.worlds import tiny_policy

    world = tmp_path_factory.mktemp("world")
    tiny_policy(world / "policy")
    return world


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Rewards of every shape, and held-out datasets good and bad."""
    folder = tmp_path_factory.mktemp("files")
    (folder / "rewards.py").write_text(REWARD_SOURCE)
    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}]
    (folder / "ok.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (folder / "null.jsonl").write_text(json.dumps({"prompt": "1+1=", "answer": None}) + "\n")
    (folder / "latin1.jsonl").write_bytes('{"prompt": "café", "answer": "2"}\n'.encode("latin-1"))
    return folder


# A URL's password with /, # or ? in it, not percent-encoded: each fragment must stay out of every message.
SPLIT_AT_SLASH = ("redis://app:Qz7/Kx9@db.example:6379/0", ("Qz7", "Kx9"))
SPLIT_AT_HASH = ("redis://app:Pw4@Rt6#Yu8@db.example:6379/0", ("Pw4", "Rt6", "Yu8"))
SPLIT_AT_QUERY = ("mqtt://app:Mn3?Vb5@broker.example:1883", ("Mn3", "Vb5"))


@pytest.mark.parametrize(
    ("url", "fragments"),
    [
        SPLIT_AT_SLASH,
        SPLIT_AT_HASH,
        SPLIT_AT_QUERY,
        ("redis://app:/Lk2@db.example:6379/0", ("Lk2",)),
        ("mqtt://app:Gh6#@broker.example", ("Gh6",)),
        ("redis://app:Zx1@db.example:99999/0", ("Zx1",)),
    ],
)
def test_a_url_that_does_not_parse_is_refused_at_load_naming_its_setting_only(url: str, fragments: tuple) -> None:
    name = "redis_url" if url.startswith("redis") else "mqtt_url"
    with pytest.raises(ConfigError) as raised:
        load_config(environ={f"TLT_{name.upper()}": url})
    message = str(raised.value)
    assert f"{name} does not parse as a URL" in message and "percent-encoded" in message
    assert not [fragment for fragment in fragments if fragment in message]
    assert "db.example" not in message and "broker.example" not in message


@pytest.mark.parametrize(
    "url",
    [
        "redis://app:Qz7%2FKx9@db.example:6379/0",
        "rediss://:p%23w@db.example:6380/2?ssl_cert_reqs=none",
        "redis://[::1]:6379/0",
        "unix:///tmp/redis.sock?db=1",
        "redis://app:p@ss@db.example/0",
    ],
)
def test_urls_that_parse_are_kept(url: str) -> None:
    assert load_config(environ={"TLT_REDIS_URL": url}).bus.redis_url == url


@pytest.mark.parametrize(
    ("command", "setting", "url", "fragments"),
    [
        (["doctor", "--timeout", "1"], "TLT_REDIS_URL", *SPLIT_AT_SLASH),
        (["doctor", "--timeout", "1"], "TLT_REDIS_URL", *SPLIT_AT_HASH),
        (["doctor", "--timeout", "1"], "TLT_MQTT_URL", *SPLIT_AT_QUERY),
        (["policy"], "TLT_REDIS_URL", *SPLIT_AT_SLASH),
        (["run", "--sd", "off"], "TLT_REDIS_URL", *SPLIT_AT_HASH),
    ],
)
def test_commands_refuse_such_a_url_in_one_line_without_a_fragment_of_the_password(
    command: list[str], setting: str, url: str, fragments: tuple, tmp_path: Path
) -> None:
    result = cli(*command, env={setting: url, "TLT_RUN": "start-errors"}, timeout=60)
    one_line(result, 2, "does not parse as a URL")
    assert not [fragment for fragment in fragments if fragment in result.stderr + result.stdout]


def test_doctor_refuses_a_url_option_the_redis_client_cannot_read_in_one_line() -> None:
    url = "redis://app:Wq8secret@127.0.0.1:1/0?socket_timeout=soon"
    result = cli("doctor", "--redis-url", url, "--mqtt-url", "mqtt://127.0.0.1:1", "--timeout", "1", timeout=60)
    one_line(result, 2, "socket_timeout")
    assert "Wq8secret" not in result.stderr + result.stdout


def test_run_refuses_an_unreachable_redis_in_one_line_without_its_password(world: Path, tmp_path: Path) -> None:
    url = "redis://app:Hj5secret@127.0.0.1:1/0"
    result = cli("run", "--world", str(world), "--sd", "off", "--out", str(tmp_path / "run"), "--redis-url", url)
    line = one_line(result, 2, "cannot use Redis at redis://app:***@127.0.0.1:1/0")
    assert "Hj5secret" not in result.stderr + result.stdout, line


@pytest.fixture
def protected_redis(tmp_path: Path) -> Iterator[int]:
    """A Redis of this test's own that asks for a password; its port."""
    if why := missing_binaries("redis-server"):
        pytest.skip(why)
    with private_redis(tmp_path / "redis", "--requirepass", "the-right-one") as port:
        yield port


def test_run_refuses_a_wrong_redis_password_in_one_line_without_it(
    world: Path, tmp_path: Path, protected_redis: int
) -> None:
    url = f"redis://:Wrong7pass@127.0.0.1:{protected_redis}/0"
    result = cli("run", "--world", str(world), "--sd", "off", "--out", str(tmp_path / "run"), "--redis-url", url)
    one_line(result, 2, "cannot use Redis at redis://:***@127.0.0.1")
    assert "Wrong7pass" not in result.stderr + result.stdout


@pytest.mark.parametrize("temperature", ["-1", "nan", "inf", "warm"])
def test_eval_refuses_a_temperature_it_cannot_sample_at(world: Path, temperature: str) -> None:
    result = cli("eval", "--model", str(world / "policy"), "--n", "1", f"--temperature={temperature}", timeout=60)
    one_line(result, 2, "tlt-stream eval: error: argument --temperature: must be")


@pytest.mark.parametrize(
    ("args", "text"),
    [
        (("plan", "--rollout-gpus", "x"), "tlt-stream plan: error: argument --rollout-gpus: invalid"),
        (("plan", "--model-size", "-7B"), "tlt-stream plan: error: argument --model-size: expected one argument"),
        (("run", "--steps"), "tlt-stream run: error: argument --steps: expected one argument"),
        (("nope",), "tlt-stream: error: argument COMMAND: invalid choice: 'nope'"),
        ((), "tlt-stream: error: the following arguments are required: COMMAND"),
    ],
)
def test_a_usage_error_is_one_line_naming_the_help(args: tuple[str, ...], text: str) -> None:
    """argparse printed the command's whole usage block (a dozen lines for `plan`) above the one that says
    what is wrong."""
    line = one_line(cli(*args, timeout=60), 2, text)
    assert line.endswith("--help)"), line


@pytest.mark.parametrize(
    ("flags", "text"),
    [
        (["--eval-dataset", "{files}/null.jsonl"], "null.jsonl: row 1: field 'answer' must be a non-empty"),
        (["--eval-dataset", "{files}/absent.jsonl"], "absent.jsonl: dataset file does not exist"),
        (["--eval-dataset", "{files}/latin1.jsonl"], "latin1.jsonl: row 1: not UTF-8 text"),
        (["--reward", "{files}/absent.py:good"], "absent.py does not exist"),
        (["--reward", "no_such_reward_module:good"], "importing no_such_reward_module failed"),
        (["--reward", "{files}/rewards.py:absent"], "has no function 'absent'"),
        (["--reward", "{files}/rewards.py:one_argument"], "cannot be called as f(response, answer)"),
        (
            ["--eval-dataset", "{files}/ok.jsonl", "--reward", "{files}/rewards.py:wants_difficulty"],
            "missing a required argument: 'difficulty'",
        ),
    ],
)
def test_run_refuses_a_held_out_dataset_or_a_reward_that_would_fail_later_before_any_service(
    world: Path, files: Path, tmp_path: Path, flags: list[str], text: str
) -> None:
    out = tmp_path / "run"
    given = [flag.format(files=files) for flag in flags]
    result = cli("run", "--world", str(world), "--sd", "off", "--steps", "1", "--eval", "2", "--out", str(out), *given)
    one_line(result, 2, text)
    assert not (out / "logs").exists(), "refused before any service started"


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_run_refuses_the_vllm_backend_without_vllm_before_any_service(world: Path, tmp_path: Path) -> None:
    """The workers refused it, each after start-up, and `run` then exited 1 naming a service's exit code."""
    out = tmp_path / "run"
    result = cli("run", "--world", str(world), "--sd", "off", "--steps", "1", "--eval", "0", "--out", str(out),
                 "--set", "rollout.backend=vllm")  # fmt: skip
    one_line(result, 2, "rollout.backend = vllm needs vLLM, which is not installed: pip install")
    assert not (out / "logs").exists(), "refused before any service started"


def test_the_reward_call_is_checked_the_way_the_workers_make_it() -> None:
    from tlt_stream.commands.run.setup import check_reward_call
    from tlt_stream.rl.rewards import REWARDS

    namespace: dict = {}
    exec(REWARD_SOURCE, namespace)  # the test's own reward functions
    for name, fn in REWARDS.items():  # the built-ins take (response, answer), rows with fields or not
        check_reward_call(fn, name, [{}, {"source": "x"}])
    check_reward_call(namespace["wants_difficulty"], "f", [{"difficulty": 2, "source": "x"}])
    check_reward_call(namespace["takes_any"], "f", [{"difficulty": 2}, {}])
    with pytest.raises(ValueError, match=r"missing a required argument: 'difficulty' \(the rows' other fields: "):
        check_reward_call(namespace["wants_difficulty"], "f", [{"difficulty": 2}, {"source": "x"}])


def eval_config(files: Path, reward: str) -> object:
    from tlt_stream.basics.config import Config

    values = {
        "data.eval_dataset": str(files / "ok.jsonl"),
        "rollout.reward": f"{files / 'rewards.py'}:{reward}",
        "rollout.max_len": 64,
        "rollout.max_response_len": 4,
    }
    return override(Config(), values)


def test_a_reward_that_raises_on_a_held_out_row_scores_it_0_and_the_evaluation_goes_on(
    world: Path, files: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from tlt_stream.commands.run.launch import evaluate_version

    config = eval_config(files, "raises_on_one")
    row = evaluate_version(tmp_path, 0, world / "policy", n=2, seed=0, threads=1, config=config)
    assert (row["prompts"], row["accuracy"], row["mean_reward"]) == (2, 0.5, 0.5)
    warnings = [r.getMessage() for r in caplog.records if "raised on" in r.getMessage()]
    assert len(warnings) == 1 and "1 of 2 rows" in warnings[0] and "cannot score this one" in warnings[0]


def test_a_reward_that_returns_no_number_scores_its_rows_0_in_valid_json(
    world: Path, files: Path, tmp_path: Path
) -> None:
    """A reward returning NaN fails as one that raises (`call_reward`): each row scores 0, and `eval.jsonl`
    stays JSON (a NaN mean once reached it as `NaN`)."""
    from tlt_stream.commands.run.launch import evaluate_version

    config = eval_config(files, "not_a_number")
    evaluate_version(tmp_path, 0, world / "policy", n=2, seed=0, threads=1, config=config)
    line = (tmp_path / "eval.jsonl").read_text().strip()
    row = json.loads(line, parse_constant=lambda name: pytest.fail(f"eval.jsonl holds {name}, not JSON"))
    assert row["mean_reward"] == 0.0 and row["accuracy"] == 0.0


def test_a_long_run_name_stays_a_valid_one_with_the_runs_time_stamp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new run's name gets its start time appended; a configured name of 49-64 characters became 65-80,
    which the run's own config.toml then refused, so every service exited at start-up."""
    from tlt_stream.basics.config.tree import RUN_MAX_CHARS
    from tlt_stream.commands.cli import build_parser
    from tlt_stream.commands.run.setup import settings_of

    for name in [n for n in os.environ if n.startswith("TLT_")]:
        monkeypatch.delenv(name)
    long = "r" * RUN_MAX_CHARS
    args = build_parser().parse_args(["run", "--set", f"run={long}", "--out", str(tmp_path / "run")])
    config, _, _ = settings_of(args)
    assert len(config.run) == RUN_MAX_CHARS and config.run.startswith("r" * 40) and config.run != long
    written = tmp_path / "config.toml"
    written.write_text(f'run = "{config.run}"\n')
    assert load_config(written, environ={}).run == config.run  # as the services read RUN_DIR/config.toml


def test_run_counts_the_held_out_prompts_it_leaves_out_as_over_the_prompt_limit(
    world: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It said so of the training prompts only, then "held-out accuracy ... (2 prompts)" of a file of 3."""
    from transformers import AutoTokenizer

    from tlt_stream.basics.config import Config, override
    from tlt_stream.commands.run.setup import check_plan

    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "9" * 100, "answer": "9"}, {"prompt": "2+2=", "answer": "4"}]
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text("".join(json.dumps(row) + "\n" for row in rows))
    lengths = [len(AutoTokenizer.from_pretrained(world / "policy")(row["prompt"])["input_ids"]) for row in rows]
    assert lengths[1] > 48 > 2 * max(lengths[0], lengths[2]), "over any limit at 48 tokens a row, and the others not"
    settings = {"launch.policy": str(world / "policy"), "data.eval_dataset": str(held_out), "rollout.max_len": 48}
    config = override(Config(), {**settings, "rollout.reward": "exact", "launch.eval": 3, "run": "named-7"})
    check_plan(config, tmp_path / "run", True, 1)
    err = capsys.readouterr().err
    assert f"{held_out}: 2 held-out prompts, 1 over the prompt limit skipped (data.max_prompt_len)" in err
    assert f"run named-7, run dir {tmp_path / 'run'}" in err  # the name monitor, doctor and purge take
