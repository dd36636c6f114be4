"""Deployment inputs unlike the repository's own: a cluster's GPU lists, a hand-written TOML file, compose's
environment, a service started with a wrong flag. Each bad input is one line on stderr naming the setting and
what to do, exit code 2, no traceback; no password is ever printed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tlt_stream.basics.config import ConfigError, load_config
from tlt_stream.commands.cli import main
from tlt_stream.commands.placement import place, visible_gpus

ROOT = Path(__file__).resolve().parents[2]
SECRET = "hunter2-Zq9"


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("TLT_"):
            monkeypatch.delenv(name)


def one_error_line(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """The stderr line of a command that must refuse its input with exit code 2 and print nothing else."""
    assert main(list(argv)) == 2
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err, err
    (line,) = err.strip().splitlines()
    return line


# ----------------------------------------------------------------------------------------- secrets


@pytest.mark.parametrize("password", [f"{SECRET} x", f'{SECRET}"x', f"{SECRET}'x"])
def test_config_show_hides_a_password_holding_a_space_or_a_quote(
    password: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TLT_REDIS_URL", f"redis://app:{password}@db.example:6379/0")
    assert main(["config", "show"]) == 0
    out, err = capsys.readouterr()
    assert SECRET not in out + err
    assert json.loads(out)["bus"]["redis_url"] == "redis://app:***@db.example:6379/0"


@pytest.mark.parametrize(
    "args",
    [
        ["--set", f'bus.redis_url=["redis://app:{SECRET} x@db"]'],  # a wrong type: the error quotes the value
        ["--set", f"bus.redis_url='redis://app:{SECRET} x@db:port'"],  # a TOML string that does not parse
        ["--set", f"redis://app:{SECRET} x@db"],  # no KEY=
        ["--set", f"bus.redis_password={SECRET} x"],  # an unknown key holding a secret
    ],
)
def test_configuration_errors_hide_a_password_holding_a_space(
    args: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    line = one_error_line(capsys, "config", "show", *args)
    assert SECRET not in line and "***" in line, line


def test_a_wrong_typed_url_from_the_environment_is_quoted_without_its_password(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TLT_BUS__REDIS_URL", f'["redis://app:{SECRET}x y@db"]')
    line = one_error_line(capsys, "config", "show")
    assert "TLT_BUS__REDIS_URL" in line and "redis_url" in line and SECRET not in line, line


# ----------------------------------------------------------------------------------------- values


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("[learner]\nlr = inf\n", "learner.lr"),
        ("[rollout]\ntemperature = 1e400\n", "rollout.temperature"),
        ("[sd]\nedges = [1, 2, inf]\n", "sd.edges"),
        ("[policy]\nsteps = 99999999999999999999999\n", "policy.steps"),
        ("[policy]\nseed = -99999999999999999999999\n", "policy.seed"),
    ],
)
def test_infinite_and_oversized_numbers_are_refused_naming_the_key(text: str, key: str, tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=rf"config file {path}: {key}: (must be a finite number|-?\d+ does not fit)"):
        load_config(path, environ={})


def test_an_infinite_number_from_the_environment_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TLT_LEARNER__LR", "1e400")  # TOML reads it as inf
    line = one_error_line(capsys, "config", "show")
    assert "TLT_LEARNER__LR" in line and "learner.lr" in line and "finite" in line, line
    assert load_config(environ={"TLT_POLICY__STEPS": str(2**63 - 1)}).policy.steps == 2**63 - 1


@pytest.mark.parametrize(
    ("where", "key"),
    [
        ({"file": '[launch]\nworld = ""\n'}, "launch.world"),
        ({"file": '[rollout]\nstop = ["</answer>", ""]\n'}, "rollout.stop"),
        ({"environ": {"TLT_BUS__STORE_ROOT": ""}}, "bus.store_root"),
        ({"set": "learner.run_dir="}, "learner.run_dir"),
    ],
)
def test_an_empty_string_is_refused_rather_than_read_as_the_current_directory(
    where: dict, key: str, tmp_path: Path
) -> None:
    path = None
    if "file" in where:
        path = tmp_path / "c.toml"
        path.write_text(where["file"])
    with pytest.raises(ConfigError, match=rf"{key}: is empty") as err:
        load_config(path, environ=where.get("environ", {}), overrides=[where["set"]] if "set" in where else None)
    assert "\n" not in str(err.value)


def test_an_empty_flag_value_names_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    line = one_error_line(capsys, "rollout-worker", "--train-drafter", "")
    assert "--train-drafter: drafter.state_dir: is empty" in line, line


@pytest.mark.parametrize(
    ("environ", "overrides", "shown"),
    [
        ({"TLT___X": "1"}, [], "'.x'"),
        ({"TLT_LEARNER__": "1"}, [], "'learner.'"),
        ({}, ["learner..lr=1"], "learner..lr"),
    ],
)
def test_a_setting_name_with_an_empty_part_is_named_as_such(environ: dict, overrides: list, shown: str) -> None:
    with pytest.raises(ConfigError, match="is not a setting's name") as err:
        load_config(environ=environ, overrides=overrides)
    assert shown in str(err.value) and "learner.lr" in str(err.value)


def test_text_settings_keep_text_that_reads_as_a_number(tmp_path: Path) -> None:
    config = load_config(
        environ={"TLT_RUN": "2024", "TLT_ROLLOUT__WORKER_ID": "42", "TLT_LEARNER__WANDB_PROJECT": "1e3"},
        overrides=["rollout.reward=true"],
    )
    assert (config.run, config.rollout.worker_id, config.learner.wandb_project) == ("2024", "42", "1e3")
    assert config.rollout.reward == "true"
    typed = load_config(environ={"TLT_LEARNER__ACCUMULATE": "false", "TLT_LEARNER__LR": "1", "TLT_RUN": '"r1"'})
    assert typed.learner.accumulate is False and typed.learner.lr == 1.0 and typed.run == "r1"


# ----------------------------------------------------------------------------------------- the config file


def test_an_empty_config_file_name_is_one_line_naming_both_places(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setenv("TLT_CONFIG", "")
    line = one_error_line(capsys, "config", "show")
    assert "empty" in line and "--config" in line and "TLT_CONFIG" in line, line
    line = one_error_line(capsys, "config", "show", "--config", str(tmp_path))
    assert f"config file {tmp_path} is a directory" in line and "Errno" not in line, line


# ----------------------------------------------------------------------------------------- flags


def test_a_bad_value_of_a_setting_flag_names_the_flag_given(capsys: pytest.CaptureFixture[str]) -> None:
    line = one_error_line(capsys, "rollout-worker", "--sd-arm", "bogus")
    assert line.startswith("tlt-stream: configuration error: --sd-arm: sd.arm:"), line
    line = one_error_line(capsys, "learner", "--lr", "fast")
    assert line.startswith("tlt-stream: configuration error: --lr: learner.lr:"), line


def test_a_service_entrypoint_refuses_a_bad_flag_value_in_one_line() -> None:
    result = subprocess.run(
        [sys.executable, "services/learner.py", "--lr", "inf"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={k: v for k, v in os.environ.items() if not k.startswith("TLT_")},
    )
    assert result.returncode == 2 and result.stdout == ""
    (line,) = result.stderr.strip().splitlines()
    assert "--lr: learner.lr: must be a finite number" in line, line


# ----------------------------------------------------------------------------------------- placement


@pytest.mark.parametrize("listed", ["0,0,1", "1, 0,1", "GPU-aa,GPU-aa", "MIG-x,MIG-y,MIG-x"])
def test_a_gpu_listed_twice_is_refused_naming_the_variable(listed: str) -> None:
    with pytest.raises(ConfigError, match=r"CUDA_VISIBLE_DEVICES=.* names GPU .* more than once") as err:
        visible_gpus(3, {"CUDA_VISIBLE_DEVICES": listed})
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="more than once"):
        place(tuple(name.strip() for name in listed.split(",")), workers=1, learner_gpus=1)


def test_gpu_lists_with_gaps_stops_and_device_names_are_kept() -> None:
    assert visible_gpus(3, {"CUDA_VISIBLE_DEVICES": "7,3,5"}) == ("7", "3", "5")
    assert visible_gpus(1, {"CUDA_VISIBLE_DEVICES": "0,-1,0"}) == ("0",), "CUDA stops at a negative id"
    assert visible_gpus(2, {"CUDA_VISIBLE_DEVICES": "MIG-a,MIG-b"}) == ("MIG-a", "MIG-b")


def test_one_gpu_is_shared_by_the_workers_when_the_learner_is_on_the_cpu() -> None:
    placed = place(("3",), workers=3, learner_gpus=1, learner_device="cpu")
    assert placed == {"policy": "", "rollout-0": "3", "rollout-1": "3", "rollout-2": "3", "learner": ""}


def test_a_learner_holding_every_gpu_is_told_to_take_fewer(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError) as err:
        place(("0", "1"), workers=1, learner_gpus=2)
    assert "--learner-gpus 1 or fewer" in str(err.value) and "--workers" not in str(err.value)
    line = one_error_line(capsys, "compose", "--gpus", "4", "--learner-gpus", "4")
    assert "--learner-gpus 3 or fewer" in line, line


# ----------------------------------------------------------------------------------------- compose


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--gpus", "4096"], "--gpus: must be at most 1024"),  # more than a host holds (1e11 ran out of memory)
        (["--gpus", "4x"], "--gpus: must be a whole number >= 1, got '4x'"),
        (["--gpus", "2", "--workers", "one"], "--workers: must be a whole number"),
        (["--gpus", "2", "--base", ""], "--base: is empty"),
    ],
)
def test_compose_refuses_flags_it_cannot_write_an_override_for(
    flags: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["compose", *flags])
    assert exit_.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and said in err.strip().splitlines()[-1], err
