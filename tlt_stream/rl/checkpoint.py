"""Crash-safe learner checkpoints and the policy-version integrity check that rollout workers run.

A learner can die at any instant (OOM, preemption, SIGKILL), and what it resumes from must be whole: the
policy weights, the optimizer moments, the RNG streams and the ledger of consumed sample ids that makes
training exactly-once. A checkpoint is therefore written into a `.tmp-*` sibling, every file and directory
fsynced, renamed into place as `step-XXXXXXXX` in one atomic `rename`, and only then named by the `LATEST`
pointer, itself replaced atomically. Replacing `LATEST` is the commit point: a crash before it leaves the
previous checkpoint current, and a complete step directory newer than `LATEST` is a save that crashed after
its rename; the next save discards it. `meta.json` is written last, so a step directory without it is never
taken for a checkpoint. Nothing in a checkpoint is a pickle: tensors are safetensors, the rest JSON, so
loading one can never run code (a `.pt` where safetensors belong is refused, not unpickled).

Workers load a policy version only after `verify_policy` matches the sha256 the learner published, so a torn
copy or a flipped bit is refused before it can steer rollouts. The hash covers relative names and bytes,
length-prefixed, never mtimes or absolute paths: the same weights hash the same wherever they are copied.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import random
import re
import shutil
import stat
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save

from tlt_stream.errors import CheckpointError

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "CheckpointInfo",
    "ChecksumMismatch",
    "complete_checkpoints",
    "latest_checkpoint",
    "optimizer_state",
    "optimizer_tensors",
    "policy_sha256",
    "restore_checkpoint",
    "save_checkpoint",
    "verify_policy",
]

log = logging.getLogger(__name__)

FORMAT_VERSION = 2
"""2: optimizer and RNG state as safetensors + JSON (1 pickled them with torch.save)."""
LATEST = "LATEST"
POLICY = "policy"
TMP_PREFIX = ".tmp-"
_STEP_DIR = re.compile(r"step-(\d{8,})")
_HASH_DOMAIN = b"tlt-stream policy sha256 v1\0"
_HASH_CHUNK = 1 << 20


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
    """sha256 of `policy_dir` as computed by `policy_sha256`, recorded at save time."""


class ChecksumMismatch(Exception):
    """A policy directory's contents do not hash to the expected sha256."""

    def __init__(self, policy_dir: Path | str, expected: str, found: str) -> None:
        self.policy_dir, self.expected, self.found = Path(policy_dir), expected, found
        super().__init__(f"{policy_dir}: policy sha256 mismatch: expected {expected[:12]}..., found {found[:12]}...")


# --- hashing ----------------------------------------------------------------------------------------------


def _policy_files(root: Path) -> list[str]:
    """Relative POSIX names of every file under `root`, sorted; symlinked files count as their target."""
    names = []

    def vanished(error: OSError) -> None:  # os.walk skips an unreadable directory silently: an empty digest
        raise FileNotFoundError(f"{root}: policy directory vanished or unreadable while hashed ({error})")

    for dirpath, dirnames, filenames in os.walk(root, onerror=vanished):
        for d in dirnames:
            if os.path.islink(os.path.join(dirpath, d)):
                raise ValueError(f"{root}: symlinked directory {d!r} is not supported in a policy directory")
        for f in filenames:
            full = os.path.join(dirpath, f)
            if not stat.S_ISREG(os.stat(full).st_mode):
                raise ValueError(f"{full}: not a regular file")
            names.append(Path(full).relative_to(root).as_posix())
    return sorted(names)


def policy_sha256(policy_dir: Path | str) -> str:
    """Deterministic sha256 of a directory's files: their relative names (sorted) and bytes, each length-prefixed.

    Files are streamed in 1 MiB chunks. The digest ignores mtimes, permissions and where the directory lives.
    """
    root = Path(policy_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: policy directory does not exist")
    digest = hashlib.sha256(_HASH_DOMAIN)
    for name in _policy_files(root):
        encoded = name.encode("utf-8", "surrogateescape")
        digest.update(len(encoded).to_bytes(8, "big"))
        digest.update(encoded)
        with open(root / name, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            digest.update(size.to_bytes(8, "big"))
            read = 0
            while chunk := f.read(_HASH_CHUNK):
                digest.update(chunk)
                read += len(chunk)
        if read != size:
            raise OSError(f"{root / name}: file changed size while it was being hashed")
    return digest.hexdigest()


def verify_policy(policy_dir: Path | str, expected_sha256: str) -> None:
    """Raise `ChecksumMismatch` unless `policy_dir` hashes to `expected_sha256` (FileNotFoundError if missing)."""
    found = policy_sha256(policy_dir)
    if found != expected_sha256.strip().lower():
        raise ChecksumMismatch(policy_dir, expected_sha256, found)


# --- durable writes ---------------------------------------------------------------------------------------


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """fsync every file, then every directory bottom-up, so the whole tree is on disk before it is renamed."""
    for dirpath, _, filenames in os.walk(root, topdown=False):
        for f in filenames:
            fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def _write_json(path: Path, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _save_tensors(tensors: dict[str, torch.Tensor], meta: dict[str, Any], stem: Path) -> None:
    """`stem.safetensors` + `stem.json`, each fsynced: no pickle anywhere in a checkpoint."""
    data = save(tensors)
    with open(stem.with_suffix(".safetensors"), "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    _write_json(stem.with_suffix(".json"), meta)


def _load_tensors(stem: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    pickled = stem.with_suffix(".pt")
    if pickled.exists() and not stem.with_suffix(".safetensors").exists():
        raise ValueError(f"{pickled}: a pickle; tlt-stream loads only safetensors + JSON (it never unpickles)")
    try:
        tensors = load_file(stem.with_suffix(".safetensors"))
        meta = json.loads(stem.with_suffix(".json").read_text(encoding="utf-8"))
    except (OSError, ValueError, SafetensorError) as exc:
        raise ValueError(f"{stem}: unreadable checkpoint part ({exc})") from exc
    return tensors, meta


def _write_pointer(root: Path, name: str) -> None:
    """Atomically point `root/LATEST` at `name`: temp file, fsync, `os.replace`, fsync `root`."""
    tmp = root / f"{TMP_PREFIX}{LATEST}-{uuid.uuid4().hex[:12]}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(name + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, root / LATEST)
    except Exception:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(root)


@contextlib.contextmanager
def atomic_directory(final: Path) -> Iterator[Path]:
    """Build a directory that appears whole or not at all.

    Yields a temporary sibling of `final` (named `.tmp-...`, which readers skip) to fill. On a clean exit
    every file and directory in it is fsynced, it is renamed to `final` and the parent is fsynced. On an
    error it is removed; a process that dies meanwhile leaves only the `.tmp-` directory behind.
    """
    tmp = final.with_name(f"{TMP_PREFIX}{final.name}-{uuid.uuid4().hex[:12]}")
    tmp.mkdir()
    try:
        yield tmp
        _fsync_tree(tmp)
        os.rename(tmp, final)
    except Exception:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_dir(final.parent)


def _remove_dir(path: Path) -> None:
    """Delete a checkpoint directory: first renamed to a `.tmp-` name (atomic), so no half-deleted one remains."""
    trash = path.with_name(f"{TMP_PREFIX}trash-{path.name}-{uuid.uuid4().hex[:12]}")
    os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


# --- reading ----------------------------------------------------------------------------------------------


def _step_of(path: Path) -> int | None:
    match = _STEP_DIR.fullmatch(path.name)
    return int(match.group(1)) if match else None


def _read_info(path: Path) -> CheckpointInfo | None:
    """The checkpoint in `path`, or None when it is not a complete one (no or unreadable meta.json)."""
    step = _step_of(path)
    if step is None or path.is_symlink() or not path.is_dir():
        return None
    try:
        meta = json.loads((path / "meta.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    if not isinstance(meta, dict) or meta.get("step") != step or not isinstance(meta.get("policy_sha256"), str):
        return None
    return CheckpointInfo(path=path, step=step, policy_dir=path / POLICY, policy_sha256=meta["policy_sha256"])


def complete_checkpoints(root: Path | str) -> list[CheckpointInfo]:
    """Every complete checkpoint under `root`, oldest first (none when `root` is not a directory)."""
    root = Path(root)
    return _complete_checkpoints(root) if root.is_dir() else []


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
    if clean:
        for leftover in root.glob(f"{TMP_PREFIX}*"):
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


# --- save / restore ---------------------------------------------------------------------------------------


def optimizer_tensors(state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """An optimizer `state_dict` as safetensors tensors (`state.{param}.{slot}`) and JSON for the rest."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for index, slots in state["state"].items():
        for slot, value in slots.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state.{index}.{slot}"] = value.detach().cpu().contiguous()
            else:
                scalars.setdefault(str(index), {})[slot] = value
    groups = [{k: list(v) if isinstance(v, tuple) else v for k, v in group.items()} for group in state["param_groups"]]
    return tensors, {"scalars": scalars, "param_groups": groups}


def optimizer_state(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict[str, Any]:
    """The inverse of `optimizer_tensors`: a `state_dict` an optimizer loads."""
    state: dict[int, dict[str, Any]] = {}
    for key, tensor in tensors.items():
        _, index, slot = key.split(".", 2)
        state.setdefault(int(index), {})[slot] = tensor
    for index, slots in meta["scalars"].items():
        state.setdefault(int(index), {}).update(slots)
    groups = [{k: tuple(v) if k == "betas" else v for k, v in group.items()} for group in meta["param_groups"]]
    return {"state": state, "param_groups": groups}


def _rng_tensors() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The RNG streams as tensors (torch, each CUDA device) and JSON (Python's `random`)."""
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors.update({f"cuda.{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    version, internal, gauss = random.getstate()
    return tensors, {"python": [version, list(internal), gauss]}


def _set_rng_state(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    torch.set_rng_state(tensors["torch"])
    version, internal, gauss = meta["python"]
    random.setstate((version, tuple(internal), gauss))
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            if f"cuda.{i}" in tensors:
                torch.cuda.set_rng_state(tensors[f"cuda.{i}"], i)


def save_checkpoint(
    root: Path | str,
    *,
    step: int,
    model: PreTrainedModel,
    optimizer: torch.optim.Optimizer,
    ledger: Iterable[str],
    extra: dict[str, Any] | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
    keep: int = 3,
) -> CheckpointInfo:
    """Write `root/step-{step:08d}` atomically, point `root/LATEST` at it, and prune to the newest `keep`.

    The directory holds `policy/` (safetensors, plus the tokenizer when given),
    `optimizer.{safetensors,json}`, `rng.{safetensors,json}` (torch, CUDA and Python `random` generators),
    `ledger.json` (the sorted consumed sample ids) and `meta.json` (step, policy sha256, creation time,
    `extra`, format version). Raises ValueError for a step that already exists or is lower than the current
    checkpoint's.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep must be an int >= 1, got {keep!r}")
    ids = list(ledger)
    bad = next((i for i in ids if not isinstance(i, str)), None)
    if bad is not None:
        raise ValueError(f"ledger sample ids must be str, got {type(bad).__name__} {bad!r}")
    ids = sorted(set(ids))
    extra = dict(extra or {})
    try:
        json.dumps(extra)
    except (TypeError, ValueError) as e:
        raise ValueError(f"extra must be JSON-serialisable: {e}") from None

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    current = latest_checkpoint(root)
    if current is not None:
        if step < current.step:
            raise ValueError(f"{root}: step {step} is lower than the latest checkpoint's step {current.step}")
        for stale in _complete_checkpoints(root):
            if stale.step > current.step:
                log.warning("%s: discarding %s, a save that crashed before %s named it", root, stale.path.name, LATEST)
                _remove_dir(stale.path)
    final = root / f"step-{step:08d}"
    if os.path.lexists(final):
        raise ValueError(f"{final}: checkpoint directory already exists; refusing to overwrite it")

    with atomic_directory(final) as tmp:
        policy = tmp / POLICY
        model.save_pretrained(policy, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(policy)
        sha = policy_sha256(policy)
        _save_tensors(*optimizer_tensors(optimizer.state_dict()), tmp / "optimizer")
        _save_tensors(*_rng_tensors(), tmp / "rng")
        _write_json(tmp / "ledger.json", ids)
        meta = {
            "format_version": FORMAT_VERSION,
            "step": step,
            "policy_sha256": sha,
            "created": datetime.now(UTC).isoformat(timespec="seconds"),
            "ledger_size": len(ids),
            "extra": extra,
        }
        _write_json(tmp / "meta.json", meta)
    _write_pointer(root, final.name)

    for old in _complete_checkpoints(root)[:-keep]:
        if old.path != final:
            try:
                _remove_dir(old.path)
            except OSError as e:
                log.warning("%s: could not prune %s: %s", root, old.path.name, e)
    return CheckpointInfo(path=final, step=step, policy_dir=final / POLICY, policy_sha256=sha)


def _safetensors_files(policy_dir: Path) -> list[Path]:
    index = policy_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()
        return [policy_dir / shard for shard in sorted(set(shards))]
    files = sorted(policy_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{policy_dir}: no safetensors weights")
    return files


def _load_weights(model: torch.nn.Module, policy_dir: Path) -> None:
    """Load the policy's safetensors into `model`; a key may be absent only if it is tied to a loaded one."""
    state: dict[str, torch.Tensor] = {}
    for file in _safetensors_files(policy_dir):
        state.update(load_file(file))
    own = model.state_dict(keep_vars=True)
    loaded_ids = {id(own[k]) for k in state if k in own}
    missing = [k for k, v in own.items() if k not in state and id(v) not in loaded_ids]
    unexpected = sorted(set(state) - set(own))
    if missing or unexpected:
        raise ValueError(
            f"{policy_dir}: weights do not match the model: missing {missing[:3]}"
            f"{' ...' if len(missing) > 3 else ''}, unexpected {unexpected[:3]}{' ...' if len(unexpected) > 3 else ''}"
        )
    for k, tensor in state.items():
        if tensor.shape != own[k].shape:
            raise ValueError(f"{policy_dir}: {k} has shape {tuple(tensor.shape)}, the model {tuple(own[k].shape)}")
    model.load_state_dict(state, strict=False)


def restore_checkpoint(
    info: CheckpointInfo,
    *,
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    restore_rng: bool = True,
    verified: bool = False,
) -> tuple[set[str], dict[str, Any]]:
    """Verify the policy hash, load what is given (weights, optimizer state, RNG streams); return (ledger, meta).

    Raises `ChecksumMismatch` when the policy files no longer hash to the recorded sha256. `verified=True`
    skips that one check for a caller that has just made it (hashing a real policy costs a full read).
    """
    meta = json.loads((info.path / "meta.json").read_text(encoding="utf-8"))
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{info.path}: checkpoint format {meta.get('format_version')!r}, expected {FORMAT_VERSION}")
    if not verified:
        verify_policy(info.policy_dir, info.policy_sha256)
    if model is not None:
        _load_weights(model, info.policy_dir)
    if optimizer is not None:
        state = optimizer_state(*_load_tensors(info.path / "optimizer"))  # refuses a pickle on its own
        try:
            optimizer.load_state_dict(state)
        except ValueError as exc:  # e.g. a different number of parameter groups
            raise CheckpointError(
                f"{info.path}: its optimizer state does not fit this learner ({exc}); resume with the settings "
                "it was written with (final_norm_lr_scale 1 vs other values changes the parameter groups)"
            ) from None
    if restore_rng:
        _set_rng_state(*_load_tensors(info.path / "rng"))
    ledger = json.loads((info.path / "ledger.json").read_text(encoding="utf-8"))
    return set(ledger), meta
