"""Crash-safe learner checkpoints: the layout of `step-*` directories, `LATEST`, saving and restoring.

A learner can die at any instant (OOM, preemption, SIGKILL), and what it resumes from must be whole: the
policy weights, the optimizer moments, the RNG streams and the ledger of consumed sample ids that makes
training exactly-once. A checkpoint is therefore written into a `.tmp-*` sibling, every file and directory
fsynced, renamed into place as `step-XXXXXXXX` in one atomic `rename`, and only then named by the `LATEST`
pointer, itself replaced atomically. Replacing `LATEST` is the commit point: a crash before it leaves the
previous checkpoint current, and a complete step directory newer than `LATEST` is a save that crashed after
its rename; the next save discards it. `meta.json` is written last, so a step directory without it is never
taken for a checkpoint. Nothing in a checkpoint is a pickle: tensors are safetensors, the rest JSON, so
loading one can never run code (a `.pt` where safetensors belong is refused, not unpickled).

A sharded learner (`rl/sharded.py`) writes the same layout: rank 0 the policy (gathered whole), the RNG,
the ledger and `meta.json`, committed as above; then every rank its piece of the optimizer state into the
committed step's `optimizer/` (`store/shards.py`), in the background like one process's (below). Any
number of ranks, or one process, resumes from it.

The policy is written once: its safetensors are serialised, hashed and written in one pass
(`store/weights.py`), so the sha256 announced with it (the v2 digest, `store/digest.py`) costs no read back;
`meta.json` says which digest its sha256s are (`policy_digest`; absent in checkpoints from before v2,
which verify as v1).

The optimizer state may be written in the background (`optimizer_writes`, `store/background.py`): the
policy, RNG, ledger and meta are durable and `LATEST` names the step before `save_checkpoint` returns, so the
version can be acked and published while the optimizer snapshot is still being written into the step's
`optimizer/`, which counts only once complete (one process's appears whole or not at all; the ranks' pieces
land one by one, and the set counts when every rank's is there: `store/shards.py` `incomplete`). A step
without one is still a checkpoint (its weights and ledger are exactly-once's state); a resume from it takes
the optimizer moments of the newest checkpoint that has them and says so (`optimizer_source`), and pruning
keeps that checkpoint and never touches a step being written (`_prune`).

The durable writes (`store/durable.py`) and the optimizer/RNG tensors (`store/tensors.py`) are shared with
the drafter; this module is the learner's layout on top of them. Finding checkpoints and telling which count
(`latest_checkpoint`, `optimizer_source`, ...) is `rl/checkpoint_layout.py`, whose names are importable here.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import uuid
from collections.abc import Callable, Collection, Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file

from tlt_stream.basics.errors import CheckpointError
from tlt_stream.basics.failpoints import failpoint
from tlt_stream.model.threads import off_compute_thread
from tlt_stream.rl.checkpoint_layout import (
    LATEST,
    MASTER,
    OPTIMIZER,
    POLICY,
    CheckpointInfo,
    checkpoint_at,
    complete_checkpoints,
    has_optimizer_state,
    latest_checkpoint,
    note_optimizer_source,
    optimizer_source,
    step_of,
)
from tlt_stream.store.background import BackgroundWriter
from tlt_stream.store.digest import DigestScheme, verify_directory
from tlt_stream.store.durable import atomic_directory, atomic_file, remove_dir, write_json
from tlt_stream.store.shards import read_shards, write_shard
from tlt_stream.store.tensors import (
    load_tensors,
    optimizer_state,
    optimizer_tensors,
    rng_tensors,
    save_tensors,
    set_rng_state,
)
from tlt_stream.store.weights import save_policy

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "OPTIMIZER",
    "CheckpointInfo",
    "checkpoint_at",
    "complete_checkpoints",
    "has_optimizer_state",
    "latest_checkpoint",
    "load_optimizer_state",
    "note_optimizer_source",
    "optimizer_source",
    "restore_checkpoint",
    "save_checkpoint",
    "step_of",
]

log = logging.getLogger(__name__)

FORMAT_VERSION = 2
"""2: optimizer and RNG state as safetensors + JSON (1 pickled them with torch.save)."""
DIGEST: DigestScheme = "v2"
"""The digest new checkpoints record (`meta.json` `policy_digest`)."""


# --- durable writes ---------------------------------------------------------------------------------------


def _write_pointer(root: Path, name: str) -> None:
    """Atomically point `root/LATEST` at `name` (`atomic_file`)."""
    atomic_file(root / LATEST, (name + "\n").encode())


# --- save / restore ---------------------------------------------------------------------------------------


def save_checkpoint(
    root: Path | str,
    *,
    step: int,
    model: PreTrainedModel,
    optimizer: torch.optim.Optimizer | None,
    ledger: Iterable[str],
    extra: dict[str, Any] | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
    keep: int = 3,
    publish_dtype: torch.dtype | None = None,
    weights: dict[str, torch.Tensor] | None = None,
    optimizer_writes: BackgroundWriter | None = None,
    start_optimizer_writes: Callable[[Path], None] | None = None,
    in_flight: Collection[Path] = (),
) -> CheckpointInfo:
    """Write `root/step-{step:08d}` atomically, point `root/LATEST` at it, and prune to the newest `keep`.

    The directory holds `policy/` (safetensors, plus the tokenizer when given), the optimizer state,
    `rng.{safetensors,json}` (torch, CUDA and Python `random` generators), `ledger.json` (the sorted consumed
    sample ids) and `meta.json` (step, policy sha256 and its digest scheme, creation time, `extra`, format
    version). With a `publish_dtype` other than the model's (bf16 for a bf16 rollout), `policy/` holds the
    weights cast to it, what workers load, and `master/` the model's own (fp32) weights, what training
    resumes from. Raises ValueError for a step that already exists or is lower than the current
    checkpoint's.

    With `optimizer_writes`, the optimizer state is snapshot (copied) now and written into `optimizer/` in
    the background after `LATEST` names the step (module docstring); without, `optimizer.{safetensors,json}`
    is written inline. A sharded model passes its gathered `weights` (what `model.state_dict()` would be,
    tied tensors once) and, in place of `optimizer`, `start_optimizer_writes(final)`, called once `LATEST`
    names `final` (every rank starts writing its piece into `final/optimizer/` in the background), with
    `optimizer_writes` its own writer and `in_flight` the step directories other ranks may still be writing
    into; pruning spares both.
    """
    if (optimizer is None) == (start_optimizer_writes is None):
        raise ValueError("give either optimizer or start_optimizer_writes")
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
    background = optimizer_writes is not None and optimizer is not None
    # The snapshot is taken before anything else can run: the next optimizer step changes the state in place.
    state = optimizer_tensors(optimizer.state_dict(), copy=background) if optimizer is not None else None

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    current = latest_checkpoint(root)
    if current is not None:
        if step < current.step:
            raise ValueError(f"{root}: step {step} is lower than the latest checkpoint's step {current.step}")
        for stale in complete_checkpoints(root):
            if stale.step > current.step:
                log.warning("%s: discarding %s, a save that crashed before %s named it", root, stale.path.name, LATEST)
                remove_dir(stale.path)
    final = root / f"step-{step:08d}"
    if os.path.lexists(final):
        raise ValueError(f"{final}: checkpoint directory already exists; refusing to overwrite it")

    with atomic_directory(final) as tmp:
        own_dtype = next(model.parameters()).dtype
        master_sha = None
        if publish_dtype is not None and publish_dtype != own_dtype:
            master_sha = save_policy(model, tmp / MASTER, tokenizer, weights)
            sha = save_policy(model, tmp / POLICY, tokenizer, weights, dtype=publish_dtype)
        else:
            sha = save_policy(model, tmp / POLICY, tokenizer, weights)
        if state is not None and not background:
            save_tensors(*state, tmp / OPTIMIZER)
        save_tensors(*rng_tensors(), tmp / "rng")
        write_json(tmp / "ledger.json", ids)
        meta = {
            "format_version": FORMAT_VERSION,
            "step": step,
            "policy_sha256": sha,
            **({"master_sha256": master_sha} if master_sha is not None else {}),
            "policy_digest": DIGEST,
            "optimizer": "inline" if state is not None and not background else "background",
            "created": datetime.now(UTC).isoformat(timespec="seconds"),
            "ledger_size": len(ids),
            "extra": extra,
        }
        write_json(tmp / "meta.json", meta)
        failpoint("learner.checkpoint")  # fault tests: die with the checkpoint whole but not yet named, not durable
    _write_pointer(root, final.name)
    if background:
        assert optimizer_writes is not None and state is not None
        optimizer_writes.submit(final / OPTIMIZER, off_compute_thread(functools.partial(_write_optimizer_state, state)))
    elif start_optimizer_writes is not None:
        start_optimizer_writes(final)
    busy = optimizer_writes.busy if optimizer_writes is not None else None
    _prune(root, keep, busy=[*in_flight, *([busy] if busy is not None else [])])
    return CheckpointInfo(
        path=final, step=step, policy_dir=final / POLICY, policy_sha256=sha, master_sha256=master_sha, digest=DIGEST
    )


def _write_optimizer_state(state: tuple[dict[str, torch.Tensor], dict[str, Any]], tmp: Path) -> None:
    """A background write's body: the snapshot as a one-piece `optimizer/` (`store/shards.py`)."""
    tensors, meta = state
    write_shard(tmp, rank=0, world=1, tensors=tensors, pieces=set(), meta=meta, save_id=uuid.uuid4().hex[:12])
    failpoint("learner.optimizer_write")  # fault tests: die with the state written but not yet named complete


def _prune(root: Path, keep: int, *, busy: Collection[Path]) -> None:
    """Delete all but the newest `keep` checkpoints, never the newest one with a complete optimizer state
    (what a resume falls back to while the newest's is being written) nor one a path in `busy` is in (being
    written into)."""
    complete = complete_checkpoints(root)
    keepers = {c.path for c in complete[-keep:]}
    with_state = [c.path for c in complete if has_optimizer_state(c.path)]
    keepers.update(with_state[-1:])
    keepers.update(c.path for c in complete if any(p == c.path or c.path in p.parents for p in busy))
    for old in complete:
        if old.path not in keepers:
            try:
                remove_dir(old.path)
            except OSError as e:
                log.warning("%s: could not prune %s: %s", root, old.path.name, e)


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
    """Verify the policy's (and master weights') hash, load what is given (weights, from the fp32 master copy
    when there is one; optimizer state; RNG streams); return (ledger, meta).

    The optimizer state is `optimizer_source(info)`'s: `info`'s own, or, when its background write did not
    finish, the newest older one (said in a warning; meta's `optimizer_step` is the step it came from, -1
    for none). Raises `ChecksumMismatch` when the policy files no longer hash to the recorded sha256.
    `verified=True` skips that one check for a caller that has just made it (hashing costs a full read).
    """
    meta = json.loads((info.path / "meta.json").read_text(encoding="utf-8"))
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{info.path}: checkpoint format {meta.get('format_version')!r}, expected {FORMAT_VERSION}")
    if not verified:
        verify_directory(info.policy_dir, info.policy_sha256, scheme=info.digest)
        if info.master_sha256 is not None:
            verify_directory(info.master_dir, info.master_sha256, scheme=info.digest)
    if model is not None:
        _load_weights(model, info.master_dir)
    if optimizer is not None:
        source = optimizer_source(info)
        meta["optimizer_step"] = note_optimizer_source(info, source)
        if source is not None:
            load_optimizer_state(optimizer, source.path)
    if restore_rng:
        set_rng_state(*load_tensors(info.path / "rng"))
    ledger = json.loads((info.path / "ledger.json").read_text(encoding="utf-8"))
    return set(ledger), meta


def load_optimizer_state(optimizer: torch.optim.Optimizer, path: Path) -> None:
    """The whole optimizer state of checkpoint `path` into `optimizer` (pieces joined when sharded)."""
    if (path / OPTIMIZER).is_dir():  # per-rank pieces (or one background-written piece): joined
        state = optimizer_state(*read_shards(path / OPTIMIZER, rank=None, world=1))
    else:
        state = optimizer_state(*load_tensors(path / OPTIMIZER))  # refuses a pickle on its own
    try:
        optimizer.load_state_dict(state)
    except ValueError as exc:  # e.g. a different number of parameter groups
        raise CheckpointError(
            f"{path}: its optimizer state does not fit this learner ({exc}); resume with the settings "
            "it was written with (final_norm_lr_scale 1 vs other values changes the parameter groups)"
        ) from None
