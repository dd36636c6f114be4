"""Placement (issue 25): `tlt-stream run` gives each process its own GPUs through CUDA_VISIBLE_DEVICES, the
learner the first `launch.learner_gpus` (under torchrun when more than one), each rollout worker one of the rest;
a CPU-only host keeps today's environment. The plans are read without starting a service; the last test starts
throwaway processes through the real Supervisor to see the variable arrive."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from tlt_stream.basics.config import Config, ConfigError, override
from tlt_stream.commands.cli import build_parser
from tlt_stream.commands.placement import place, visible_gpus
from tlt_stream.commands.run.launch import RunPlan, ServiceCommand, Supervisor, service_commands


def plan_for(tmp_path: Path, gpus: tuple[str, ...], **values: object) -> tuple[RunPlan, Config]:
    (tmp_path / "policy").mkdir(exist_ok=True)
    config = override(Config(run="p1"), {"launch.sd": "off", **values})
    return RunPlan(world=tmp_path, run_dir=tmp_path / "run", config=config, cores=8, gpus=gpus), config


def torchrun_args(argv: list[str]):
    """The learner's command line read by torchrun's own parser (None when it is not a torchrun line)."""
    from torch.distributed.run import get_args_parser

    head = [sys.executable, "-m", "torch.distributed.run"]
    if argv[: len(head)] != head:
        return None
    return get_args_parser().parse_args(argv[len(head) :])


def tlt_args(service: str, argv: list[str]):
    """What the service's `python -m services.X ...` hands to `tlt-stream`, parsed by the real CLI."""
    subcommand = {"policy": "policy", "learner": "learner"}.get(service, "rollout-worker")
    return build_parser().parse_args([subcommand, *argv])


def test_eight_gpus_two_for_the_learner_under_torchrun_and_one_per_worker(tmp_path: Path) -> None:
    gpus = tuple(str(i) for i in range(8))
    plan, config = plan_for(tmp_path, gpus, **{"launch.workers": 6, "launch.learner_gpus": 2})
    commands = {c.name: c for c in service_commands(plan, config)}
    visible = {name: c.env["CUDA_VISIBLE_DEVICES"] for name, c in commands.items()}
    assert visible == {
        "policy": "",  # the policy service never touches a GPU
        **{f"rollout-{i}": str(i + 2) for i in range(6)},
        "learner": "0,1",
    }
    used = [d for devices in visible.values() if devices for d in devices.split(",")]
    assert sorted(used) == sorted(gpus), "every GPU used once, none shared"

    learner = torchrun_args(commands["learner"].argv)
    assert learner is not None and learner.standalone and learner.module
    assert (learner.nproc_per_node, learner.nnodes, learner.training_script) == ("2", "1", "services.learner")
    args = tlt_args("learner", learner.training_script_args)
    assert args.command == "learner" and args.config == str(plan.config_file) and args.run is None, "from the file"
    for i in range(6):  # workers stay one process each, ids and config as before
        argv = commands[f"rollout-{i}"].argv
        assert argv[:3] == [sys.executable, "-m", "services.rollout_worker"]
        args = tlt_args(f"rollout-{i}", argv[3:])
        assert args.command == "rollout-worker" and args.config == str(plan.config_file)


def test_one_learner_gpu_is_a_plain_process_with_its_own_device(tmp_path: Path) -> None:
    plan, config = plan_for(tmp_path, ("0", "1", "2"), **{"launch.workers": 2})
    commands = {c.name: c for c in service_commands(plan, config)}
    assert commands["learner"].argv[:3] == [sys.executable, "-m", "services.learner"]
    assert torchrun_args(commands["learner"].argv) is None
    assert [commands[n].env["CUDA_VISIBLE_DEVICES"] for n in ("learner", "rollout-0", "rollout-1")] == ["0", "1", "2"]


def test_a_cpu_only_host_places_nothing_and_keeps_todays_command_lines(tmp_path: Path) -> None:
    plan, config = plan_for(tmp_path, (), **{"launch.workers": 3, "launch.learner_gpus": 4})
    commands = service_commands(plan, config)
    assert [c.name for c in commands] == ["policy", "rollout-0", "rollout-1", "rollout-2", "learner"]
    assert all(c.env == {} for c in commands), "no CUDA_VISIBLE_DEVICES on a CPU-only host"
    assert commands[-1].argv[:3] == [sys.executable, "-m", "services.learner"]


def test_too_many_workers_for_the_gpus_left_is_refused_in_one_line(tmp_path: Path) -> None:
    plan, config = plan_for(tmp_path, ("0", "1", "2", "3"), **{"launch.workers": 3, "launch.learner_gpus": 2})
    with pytest.raises(ConfigError, match=r"3 rollout worker\(s\) need one GPU each beside the learner's 2") as err:
        service_commands(plan, config)
    assert "--workers 2 or fewer" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="learner_gpus = 5, but only 4 GPU"):
        place(("0", "1", "2", "3"), workers=1, learner_gpus=5)


def test_a_single_gpu_is_shared_and_cpu_roles_see_none() -> None:
    assert place(("0",), workers=2, learner_gpus=1) == {
        "policy": "",
        "rollout-0": "0",
        "rollout-1": "0",
        "learner": "0",
    }
    # the learner on the CPU: the workers take every GPU, the learner sees none
    assert place(("4", "5"), workers=2, learner_gpus=1, learner_device="cpu") == {
        "policy": "",
        "rollout-0": "4",
        "rollout-1": "5",
        "learner": "",
    }
    cpu_workers = place(("0", "1"), workers=3, learner_gpus=2, rollout_device="cpu")
    assert cpu_workers["learner"] == "0,1" and {cpu_workers[f"rollout-{i}"] for i in range(3)} == {""}


def test_a_device_index_the_process_would_not_see_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"rollout.device = cuda:1 names a GPU its process does not see"):
        place(("0", "1", "2"), workers=2, learner_gpus=1, rollout_device="cuda:1")
    assert place(("0", "1", "2"), workers=1, learner_gpus=2, learner_device="cuda:1")["learner"] == "0,1"


def test_the_gpus_handed_out_are_named_as_the_parent_sees_them() -> None:
    assert visible_gpus(3, {}) == ("0", "1", "2")
    assert visible_gpus(2, {"CUDA_VISIBLE_DEVICES": "3,5,7"}) == ("3", "5"), "torch saw two of the three"
    assert visible_gpus(2, {"CUDA_VISIBLE_DEVICES": "GPU-aa, GPU-bb"}) == ("GPU-aa", "GPU-bb")
    assert visible_gpus(0, {"CUDA_VISIBLE_DEVICES": ""}) == ()
    assert place(visible_gpus(2, {"CUDA_VISIBLE_DEVICES": "6,7"}), workers=1, learner_gpus=1)["rollout-0"] == "7"


def test_the_supervisor_starts_each_process_with_its_own_devices(tmp_path: Path) -> None:
    report = "import os, sys; open(sys.argv[1], 'w').write(os.environ.get('CUDA_VISIBLE_DEVICES', 'unset'))"
    commands = [
        ServiceCommand(name, [sys.executable, "-c", report, str(tmp_path / name)], env)
        for name, env in (("a", {"CUDA_VISIBLE_DEVICES": "2"}), ("b", {"CUDA_VISIBLE_DEVICES": ""}), ("c", {}))
    ]
    bus = override(Config(), {"bus.redis_url": "redis://127.0.0.1:1/0", "bus.mqtt_url": "mqtt://127.0.0.1:1"})

    async def run() -> None:
        supervisor = Supervisor(commands, bus, tmp_path / "logs")
        supervisor.env.pop("CUDA_VISIBLE_DEVICES", None)  # the test process's own, if any
        await supervisor.start()
        for name in ("a", "b", "c"):
            await supervisor.processes[name].wait()
        await supervisor.stop()

    asyncio.run(run())
    assert {n: (tmp_path / n).read_text() for n in "abc"} == {"a": "2", "b": "", "c": "unset"}
