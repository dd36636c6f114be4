"""Which GPUs each process of a run sees: the learner its own, each rollout worker one of the rest.

A process that imports torch and touches CUDA takes memory on every device it can see, and a role whose device
is `auto` or `cuda` uses the first one; so without placement every service of a run lands on GPU 0. Placement
is decided here once, as data (a `CUDA_VISIBLE_DEVICES` value per service name), by a pure function that
`tlt-stream run` (launch.py) and the compose generator (commands/compose.py) share, and that the tests read
without starting anything.

The rule, for G GPUs, K learner GPUs and N rollout workers:
- G = 0 (a CPU-only host): nothing is placed; every process keeps the environment it was given.
- the learner takes the first K GPUs (K > 1: one torchrun process per GPU), each worker one of the next N;
  N > G - K is refused in one line, except on a single GPU (G = 1), which every process shares;
- a GPU named twice (`CUDA_VISIBLE_DEVICES=0,0,1`) is refused: CUDA shows no GPU at all then, and two
  processes on one GPU is not what the list asked for;
- a role on the CPU (`device = "cpu"`) and the policy service (which never uses a GPU) see none ("").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from tlt_stream.basics.config import ConfigError

__all__ = ["LEARNER", "POLICY", "describe", "place", "visible_gpus", "worker_name"]

POLICY = "policy"
LEARNER = "learner"


def worker_name(i: int) -> str:
    """The service name of rollout worker `i` (process, log file and compose service alike)."""
    return f"rollout-{i}"


def visible_gpus(count: int, environ: Mapping[str, str]) -> tuple[str, ...]:
    """The GPUs this process may hand out, named as `CUDA_VISIBLE_DEVICES` names them: the first `count`
    entries of the variable when it is set (CUDA stops at the first it cannot use; `count` is what torch saw),
    else `0 .. count-1`."""
    listed = environ.get("CUDA_VISIBLE_DEVICES")
    if listed is None:
        return tuple(str(i) for i in range(count))
    names: list[str] = []
    for name in (part.strip() for part in listed.split(",")):
        if not name or name.startswith("-"):  # CUDA stops at an empty or negative entry
            break
        names.append(name)
    _refuse_repeats(names, f"CUDA_VISIBLE_DEVICES={listed}")
    return tuple(names[:count])


def _refuse_repeats(gpus: Sequence[str], where: str) -> None:
    repeated = sorted({name for name in gpus if list(gpus).count(name) > 1})
    if repeated:
        raise ConfigError(
            f"{where} names GPU {', '.join(repeated)} more than once (CUDA then shows no GPU at all): name each "
            "GPU once"
        )


def _on_gpu(device: str) -> bool:
    return device.strip().lower() != "cpu"


def _index(device: str) -> int | None:
    """N of a `cuda:N` device setting, else None."""
    head, _, index = device.strip().lower().partition(":")
    return int(index) if head == "cuda" and index.isdigit() else None


def place(
    gpus: Sequence[str],
    *,
    workers: int,
    learner_gpus: int,
    rollout_device: str = "auto",
    learner_device: str = "auto",
) -> dict[str, str]:
    """The `CUDA_VISIBLE_DEVICES` value of each service of a run (`policy`, `rollout-<i>`, `learner`), or {}
    when nothing is placed (no GPU). Raises ConfigError when the GPUs do not go round or a `cuda:N` device names
    a GPU its process would not see."""
    if not gpus:
        return {}
    _refuse_repeats(gpus, f"the GPU list {','.join(gpus)}")
    if workers < 1 or learner_gpus < 1:
        raise ConfigError(f"placement needs at least one worker and one learner GPU, got {workers} and {learner_gpus}")
    learner: tuple[str, ...] = ()
    if _on_gpu(learner_device):
        if learner_gpus > len(gpus):
            raise ConfigError(
                f"launch.learner_gpus = {learner_gpus}, but only {len(gpus)} GPU(s) are visible "
                f"({','.join(gpus)}): give the learner at most {len(gpus)}"
            )
        learner = tuple(gpus[:learner_gpus])
    rest = gpus[len(learner) :]
    if not _on_gpu(rollout_device):
        rollout: list[tuple[str, ...]] = [()] * workers
    elif workers <= len(rest):
        rollout = [(rest[i],) for i in range(workers)]
    elif len(gpus) == 1:  # one GPU: every process shares it, as on a workstation, whatever the learner's device
        rollout = [tuple(gpus)] * workers
    elif not rest:
        raise ConfigError(
            f"launch.learner_gpus = {learner_gpus} takes every visible GPU ({','.join(gpus)}) and leaves none for "
            f"the rollout workers: use --learner-gpus {len(gpus) - 1} or fewer"
        )
    else:
        raise ConfigError(
            f"{workers} rollout worker(s) need one GPU each beside the learner's {len(learner)}, but {len(gpus)} "
            f"GPU(s) are visible ({','.join(gpus)}): use --workers {max(1, len(rest))} or fewer, or fewer "
            "--learner-gpus"
        )
    for role, device, seen in (("learner", learner_device, learner), ("rollout", rollout_device, rollout[0])):
        index = _index(device)
        if index is not None and index >= len(seen):
            raise ConfigError(
                f"{role}.device = {device} names a GPU its process does not see: each process of a run sees only "
                f"its own GPU(s) ({len(seen)}, CUDA_VISIBLE_DEVICES): use cuda or auto"
            )
    placed = {POLICY: ""}
    placed.update({worker_name(i): ",".join(devices) for i, devices in enumerate(rollout)})
    placed[LEARNER] = ",".join(learner)
    return placed


def describe(placed: Mapping[str, str]) -> str:
    """One line for the log: which service sees which GPUs."""
    return "; ".join(f"{name} {devices or 'none'}" for name, devices in placed.items() if name != POLICY)
