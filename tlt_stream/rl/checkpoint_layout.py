"""Where a learner's checkpoints are and which of them count: the `step-*` directories under a root, the
`LATEST` pointer, and the checkpoint a resume takes its optimizer moments from.

A checkpoint is a `step-XXXXXXXX` directory with a `meta.json` (written last: without it a directory is no
checkpoint); `LATEST` names the current one. Its optimizer state counts only once complete (one process's
`optimizer/` appears whole; a sharded learner's pieces count when every rank's is there:
`store/shards.py` `incomplete`), so a resume from a step without one takes the newest older complete
state and says so. Reading only, besides clearing the `.tmp-` leftovers of crashed saves when asked: the
writes are `rl/checkpoint.py`'s, which re-exports these names.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from tlt_stream.store.digest import DigestScheme
from tlt_stream.store.durable import TMP_PREFIX
from tlt_stream.store.shards import incomplete
from tlt_stream.store.tensors import refuse_pickle

__all__ = [
    "LATEST",
    "MASTER",
    "OPTIMIZER",
    "POLICY",
    "CheckpointInfo",
    "checkpoint_at",
    "complete_checkpoints",
    "has_optimizer_state",
    "latest_checkpoint",
    "note_optimizer_source",
    "optimizer_source",
    "step_of",
]

log = logging.getLogger(__name__)

LATEST = "LATEST"
POLICY = "policy"
OPTIMIZER = "optimizer"
"""`optimizer.{safetensors,json}` written inline; an `optimizer/` directory of per-rank pieces written in the
background (one piece when by one process), a state only once complete."""
MASTER = "master"
"""fp32 master weights, written beside `policy/` when the policy is published in another dtype."""
_STEP_DIR = re.compile(r"step-(\d{8,})")


@dataclass(frozen=True)
class CheckpointInfo:
    """A complete checkpoint on disk."""

    path: Path
    """The `step-XXXXXXXX` directory."""
    step: int
    """The learner step it was saved at."""
    policy_dir: Path
    """The Hugging Face policy directory inside it (config.json + safetensors), what workers load."""
    policy_sha256: str
    """sha256 of `policy_dir` as computed by `directory_sha256`, recorded at save time."""
    master_sha256: str | None = None
    """sha256 of `master/`, the fp32 weights training resumes from when `policy/` holds a cast copy (None:
    `policy/` holds the learner's own weights)."""
    digest: DigestScheme = "v1"
    """The scheme of both sha256s (`meta.json` `policy_digest`; v1 in checkpoints written before v2)."""

    @property
    def master_dir(self) -> Path:
        """The weights training resumes from: `master/` when there is one, else `policy/`."""
        return self.path / MASTER if self.master_sha256 is not None else self.policy_dir


def step_of(path: Path) -> int | None:
    """The step a `step-XXXXXXXX` directory is named for (None for any other name)."""
    match = _STEP_DIR.fullmatch(path.name)
    return int(match.group(1)) if match else None


def _read_info(path: Path) -> CheckpointInfo | None:
    """The checkpoint in `path`, or None when it is not a complete one (no or unreadable meta.json)."""
    step = step_of(path)
    if step is None or path.is_symlink() or not path.is_dir():
        return None
    try:
        meta = json.loads((path / "meta.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    if not isinstance(meta, dict) or meta.get("step") != step or not isinstance(meta.get("policy_sha256"), str):
        return None
    master = meta.get("master_sha256")
    digest = meta.get("policy_digest", "v1")
    if digest not in ("v1", "v2"):
        return None
    return CheckpointInfo(
        path=path,
        step=step,
        policy_dir=path / POLICY,
        policy_sha256=meta["policy_sha256"],
        master_sha256=master if isinstance(master, str) else None,
        digest=digest,
    )


def has_optimizer_state(path: Path) -> bool:
    """Whether checkpoint directory `path` holds a complete optimizer state (a background write not yet
    finished, failed or killed leaves none; so does any rank's piece missing). A pickle where it belongs is
    refused (ValueError), never taken for a missing state: a resume must not quietly start from fresh
    moments beside a file it will not read."""
    if (path / OPTIMIZER).is_dir():
        return incomplete(path / OPTIMIZER) is None
    refuse_pickle(path / OPTIMIZER)
    return (path / f"{OPTIMIZER}.safetensors").is_file()


def optimizer_source(info: CheckpointInfo) -> CheckpointInfo | None:
    """The checkpoint whose optimizer state a resume from `info` loads: `info` when its state is complete,
    else the newest older complete checkpoint with one, else None (fresh moments)."""
    if has_optimizer_state(info.path):
        return info
    older = [c for c in _complete_checkpoints(info.path.parent) if c.step < info.step and has_optimizer_state(c.path)]
    return older[-1] if older else None


def note_optimizer_source(info: CheckpointInfo, source: CheckpointInfo | None) -> int:
    """Say (a warning) when a resume from `info` takes older optimizer moments; the step they are from (-1:
    none, fresh moments)."""
    if source is None:
        log.warning("%s has no optimizer state and no older checkpoint has one: AdamW starts from fresh "
                    "moments (the weights and the ledger are the checkpoint's)", info.path)  # fmt: skip
        return -1
    if source.step != info.step:
        log.warning("%s has no optimizer state (its background write did not finish): resuming with the "
                    "optimizer moments of step %d, %d update(s) older (the weights and the ledger are step %d's)",
                    info.path, source.step, info.step - source.step, info.step)  # fmt: skip
    return source.step


def complete_checkpoints(root: Path | str) -> list[CheckpointInfo]:
    """Every complete checkpoint under `root`, oldest first (none when `root` is not a directory)."""
    root = Path(root)
    return _complete_checkpoints(root) if root.is_dir() else []


def checkpoint_at(root: Path | str, step: int) -> CheckpointInfo:
    """The complete checkpoint of `step` under `root` (FileNotFoundError when there is none)."""
    info = _read_info(Path(root) / f"step-{step:08d}")
    if info is None:
        raise FileNotFoundError(f"{root}: no complete checkpoint of step {step}")
    return info


def _complete_checkpoints(root: Path) -> list[CheckpointInfo]:
    """Every complete checkpoint under `root`, oldest first."""
    infos = [info for p in root.iterdir() if (info := _read_info(p)) is not None]
    return sorted(infos, key=lambda info: info.step)


def _read_pointer(root: Path) -> str | None:
    try:
        name = (root / LATEST).read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return None
    if not _STEP_DIR.fullmatch(name):
        log.warning("%s: ignoring malformed %s pointer %r", root, LATEST, name[:40])
        return None
    return name


def latest_checkpoint(root: Path | str, *, clean: bool = False) -> CheckpointInfo | None:
    """The checkpoint named by `root/LATEST`, else the newest complete `step-*` directory, else None.

    `clean=True` deletes the `.tmp-*` leftovers of crashed saves; use it only while no save is running.
    """
    root = Path(root)
    if not root.is_dir():
        return None
    if clean:  # also background writes a crash cut short, inside step directories and their optimizer/
        here = [root, *root.glob("step-*"), *root.glob(f"step-*/{OPTIMIZER}")]
        for leftover in [p for d in here for p in d.glob(f"{TMP_PREFIX}*")]:
            if leftover.is_dir() and not leftover.is_symlink():
                shutil.rmtree(leftover, ignore_errors=True)
            else:
                leftover.unlink(missing_ok=True)
    name = _read_pointer(root)
    if name is not None:
        info = _read_info(root / name)
        if info is not None:
            return info
        log.warning("%s: %s names %s, missing or incomplete; using the newest complete one", root, LATEST, name)
    complete = _complete_checkpoints(root)
    return complete[-1] if complete else None
