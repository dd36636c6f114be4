"""`--device`: how rollout workers and the learner pick where the policy runs, and the one-line refusal of a
device this machine does not have. (The CUDA path itself needs a GPU: see bench/gpu_check.sh.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tlt_stream.model import resolve_device

ROOT = Path(__file__).resolve().parents[2]
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")


def test_auto_picks_cuda_when_torch_sees_one_else_the_cpu() -> None:
    assert resolve_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device(" CPU ") == torch.device("cpu")


@pytest.mark.parametrize("spec", ["tpu", "mps", "gpu0", ""])
def test_unsupported_or_malformed_devices_are_refused(spec: str) -> None:
    with pytest.raises(ValueError, match="--device"):
        resolve_device(spec)


@no_cuda
@pytest.mark.parametrize("spec", ["cuda", "cuda:1"])
def test_cuda_without_a_device_is_refused_with_the_reason(spec: str) -> None:
    with pytest.raises(ValueError, match="sees no CUDA device"):
        resolve_device(spec)


@no_cuda
@pytest.mark.parametrize("service", ["learner", "rollout_worker"])
def test_services_refuse_a_missing_device_in_one_line_before_connecting(service: str, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TLT_DEVICE": "cuda"}
    env.update(TLT_REDIS_URL="redis://127.0.0.1:1/0", TLT_MQTT_URL="mqtt://127.0.0.1:1")  # never reached
    args = ["--run-dir", str(tmp_path), "--policy", str(tmp_path)] if service == "learner" else []
    done = subprocess.run(
        [sys.executable, "-m", f"services.{service}", *args], env=env, capture_output=True, timeout=60, cwd=ROOT
    )
    assert done.returncode == 2
    lines = done.stderr.decode().strip().splitlines()
    assert len(lines) == 1 and "--device cuda" in lines[0] and "sees no CUDA device" in lines[0], lines


def test_run_plans_pass_the_device_to_workers_and_learner(tmp_path: Path) -> None:
    from tlt_stream.basics.config import load_config
    from tlt_stream.commands.run.launch import RunPlan, service_commands, write_service_config

    (tmp_path / "policy").mkdir()
    config = load_config(
        environ={},
        overrides=["run=t", "launch.workers=2", "launch.sd=off"],
        extra={("learner", "device"): "cuda:1", ("rollout", "device"): "cuda:1"},
    )
    plan = RunPlan(world=tmp_path, run_dir=tmp_path / "run", config=config)
    path = write_service_config(plan, config)
    commands = service_commands(plan, config)
    assert [c.name for c in commands] == ["policy", "rollout-0", "rollout-1", "learner"]
    for command in commands:  # every service reads the file, and the file says where each one runs
        assert command.argv[command.argv.index("--config") + 1] == str(path)
        assert "--device" not in command.argv
    seen = load_config(path, environ={})
    assert seen.rollout.device == seen.learner.device == "cuda:1"
