"""deploy/slurm (issue 25): the learner under torchrun across nodes with a c10d rendezvous, one rollout worker per
Slurm task and GPU, the policy service on its own. The scripts print their command with TLT_DRY_RUN=1 (one
argument a line); each line is read by torchrun's own parser and `tlt-stream`'s, never by a look-alike."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tlt_stream.commands.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
SLURM = ROOT / "deploy" / "slurm"
BASE = {"TLT_CONFIG": "/shared/run/config.toml", "TLT_REDIS_URL": "redis://h:1/0", "TLT_MQTT_URL": "mqtt://h:1"}


def dry_run(script: str, **env: str) -> list[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("TLT_", "SLURM_"))}
    done = subprocess.run(
        ["bash", str(SLURM / script)],
        env={**clean, **BASE, "TLT_DRY_RUN": "1", **env},
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return done.stdout.splitlines()


def test_the_learner_runs_one_torchrun_agent_per_node_with_a_rendezvous_on_the_first() -> None:
    from torch.distributed.run import get_args_parser

    line = dry_run("learner.sbatch", SLURM_NNODES="3", SLURM_GPUS_ON_NODE="4", SLURM_JOB_ID="42", TLT_RDZV_HOST="n7")
    assert line[0] == "srun" and "--ntasks-per-node=1" in line
    start = line.index("torch.distributed.run") + 1
    assert line[start - 3 : start - 1] == ["python", "-m"]
    run = get_args_parser().parse_args(line[start:])
    assert (run.nnodes, run.nproc_per_node, run.rdzv_backend) == ("3", "4", "c10d")
    assert (run.rdzv_endpoint, run.rdzv_id, run.module) == ("n7:29500", "tlt-42", True)
    assert run.training_script == "services.learner"
    args = build_parser().parse_args(["learner", *run.training_script_args])  # what services.learner forwards
    assert args.command == "learner" and args.config == BASE["TLT_CONFIG"]


def test_each_rollout_task_is_one_worker_on_its_own_gpu_with_its_own_id() -> None:
    line = dry_run("rollout.sbatch", TLT_PYTHON="echo")
    assert line[0] == "srun" and "--gpus-per-task=1" in line and "--gpu-bind=per_task:1" in line
    shell = line[line.index("bash") :]
    assert shell[1] == "-c"
    workers = []
    for task in range(2):  # what each task runs, with `echo` as its python
        env = {**os.environ, **BASE, "SLURM_JOB_ID": "42", "SLURM_PROCID": str(task), "SLURM_CPUS_PER_TASK": "8"}
        out = subprocess.run(shell, env=env, capture_output=True, text=True, timeout=30, check=True).stdout.split()
        assert out[:2] == ["-m", "services.rollout_worker"]
        workers.append(build_parser().parse_args(["rollout-worker", *out[2:]]))
    assert [vars(w)["setting:rollout.worker_id"] for w in workers] == ["rollout-42-0", "rollout-42-1"]
    assert all(w.config == BASE["TLT_CONFIG"] and w.command == "rollout-worker" for w in workers)


def test_the_policy_service_and_the_refusal_without_a_configuration() -> None:
    line = dry_run("policy.sbatch")
    assert line[:4] == ["srun", "python", "-m", "services.policy"]
    assert build_parser().parse_args(["policy", *line[4:]]).config == BASE["TLT_CONFIG"]
    for script in ("learner.sbatch", "rollout.sbatch", "policy.sbatch"):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TLT_", "SLURM_"))}
        done = subprocess.run(["bash", str(SLURM / script)], env=env, capture_output=True, text=True, timeout=30)
        assert done.returncode != 0 and "TLT_CONFIG" in done.stderr, script


@pytest.mark.parametrize("script", ["learner.sbatch", "rollout.sbatch", "policy.sbatch"])
def test_the_scripts_are_valid_bash(script: str) -> None:
    assert subprocess.run(["bash", "-n", str(SLURM / script)], capture_output=True, timeout=30).returncode == 0
