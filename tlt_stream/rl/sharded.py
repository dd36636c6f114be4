"""The learner's policy and checkpoints whatever the number of ranks: one process, or FSDP2 under torchrun.

`Trainer` is what the learner service holds: `build` (load and, sharded, shard the policy), `restore`,
`save` and, through its `LearnerCore`, `step` (or an update accumulated group by group: `rl/accumulate.py`).
On one process these are the plain calls. Sharded, rank 0's service calls them and each first tells the
other ranks (`rl/ranks.py`) to do the same, in the same order, since every one of them is a collective: the
other ranks sit in `follow`, doing what they are told.

Sharding is FSDP2 (`fully_shard`): each decoder layer its own unit, then the root (embeddings, final norm,
the head, tied or not). Parameters and AdamW state stay fp32 masters; with a bf16 compute dtype they are
gathered in bf16 for forward and backward and gradients reduced in fp32. Gradients are *summed* over ranks,
not averaged: each rank's loss is already divided by the whole update's token count, so the sum is the
single process's gradient, and clipping by the (global) norm of the sharded gradients clips the same.

A checkpoint stays one directory, written without a pickle. A save is two agreements (`agree`) besides
the command and the gather of the whole weights: every rank agrees that it is at the step being saved
(each has by then taken a CPU snapshot of its optimizer piece, which the next update cannot change); rank
0 writes the policy, the RNG, the ledger of consumed samples and `meta.json`, renames the directory and
moves `LATEST` (the commit, as one process's), then every rank agrees that it is committed. Only rank 0
holds and writes the ledger, so exactly-once is the single process's argument unchanged.

The optimizer pieces are then written in the background, as one process's state is (`rl/checkpoint.py`,
`store/background.py`): each rank on its own thread lands its piece in the committed step's `optimizer/`
(rank 0 also the index), while the next updates run. No collective says when they are done: the
filesystem does. Each piece lands atomically and records its rank, the world and the save, and the state
counts only when the index and all `world` pieces of the same save are there (`store/shards.py`
`incomplete`), so a rank that dies mid-write leaves a step without optimizer state, and a resume takes the
newest complete one and says so. Each rank has at most one write in flight and starts the next only after
its previous one has ended, so while rank 0 saves a step, the ranks can be writing into that step or the
one saved before it; pruning (rank 0) spares both (the earlier until its set is complete) and the newest
complete state. A rank leaving waits for its write.

A rank's write that fails is logged by that rank and leaves its step incomplete; rank 0 hears of it at the
next collective the ranks make anyway: each rank's failures so far ride on a save's first agreement and on
the last one, after STOP, once every rank's write has ended (`agree_reporting`). Rank 0 logs each new one
(rank, step, error) and counts every rank's in the update's metrics (`write_figures`).
"""

from __future__ import annotations

import logging
import secrets
from pathlib import Path
from typing import Any

import torch

from tlt_stream.basics.failpoints import failpoint
from tlt_stream.model.threads import off_compute_thread
from tlt_stream.rl.checkpoint import (
    OPTIMIZER,
    CheckpointInfo,
    checkpoint_at,
    has_optimizer_state,
    note_optimizer_source,
    optimizer_source,
    restore_checkpoint,
    save_checkpoint,
    step_of,
)
from tlt_stream.rl.learner import LearnerCore, LearnerSettings, LossSums, compute_dtype_on, load_for_training
from tlt_stream.rl.ranks import Command, RankLink, RanksOutOfStep, WriteFailures
from tlt_stream.store.background import BackgroundWriter
from tlt_stream.store.shards import piece, rank_file, read_shards, write_shard
from tlt_stream.store.tensors import load_tensors, optimizer_state, optimizer_tensors

__all__ = ["Trainer", "follow", "full_weights", "shard_policy"]

log = logging.getLogger(__name__)


def shard_policy(model: Any, *, compute_dtype: torch.dtype) -> None:
    """Shard a transformers causal LM over the process group in place (FSDP2): every `model.model.layers[i]`,
    then the root; bf16 (or any non-fp32) compute gathers parameters in it and reduces gradients in fp32."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or not len(layers):
        raise ValueError(f"sharding needs decoder layers at model.model.layers; {type(model).__name__} has none")
    mixed = compute_dtype != torch.float32
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32) if mixed else None
    for layer in layers:
        fully_shard(layer, **({"mp_policy": policy} if policy else {}))
    fully_shard(model, **({"mp_policy": policy} if policy else {}))
    for module in model.modules():
        if isinstance(module, FSDPModule):  # summed, not averaged, and as a plain SUM (gloo has no PREMUL_SUM)
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def full_weights(model: Any) -> dict[str, torch.Tensor]:
    """Every rank calls it: the whole weights on rank 0's CPU (the other ranks get {}), each tensor under its
    first name only (a tied head is the embedding's tensor, saved once, as `save_pretrained` does)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    whole = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    seen: set[int] = set()
    out = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in seen and name in whole:
            out[name] = whole[name]
        seen.add(id(tensor))
    return out


class Trainer:
    """The policy in training and its checkpoints: one process (`link` None) or one rank of a sharded learner."""

    def __init__(self, settings: LearnerSettings, device: str, link: RankLink | None = None) -> None:
        self.settings = settings
        self.device = device
        self.link = link
        self.core: LearnerCore | None = None
        self.optimizer_writes = BackgroundWriter("optimizer-write")
        """This process's optimizer state (or, sharded, its piece), written while the next update runs."""
        self._saved: Path | None = None
        """Rank 0: the step directory of the previous save, which another rank may still be writing into."""
        self._frozen: tuple[Path, Any] | None = None
        """The KL reference loaded (`_reference`) and where from."""
        self.rank_failures: dict[int, WriteFailures] = {}
        """Rank 0: the other ranks' failed optimizer writes as each last reported them (a count only grows, so
        the newest report replaces the one before: none is lost or counted twice)."""

    @property
    def _commands(self) -> bool:
        """Whether this process tells other ranks what to do (rank 0 of several)."""
        return self.link is not None and self.link.leader

    def build(self, source: Path, *, step: int = -1) -> LearnerCore:
        """The policy from `source` (fp32 masters), sharded when there are ranks, and the core around it;
        `step` is the checkpoint `source` belongs to (-1: the initial policy), what the other ranks load."""
        if self._commands:
            assert self.link is not None
            self.link.command(Command.BUILD, step)
        model = load_for_training(source, self.device)
        if self.link is not None:
            shard_policy(model, compute_dtype=compute_dtype_on(self.settings.compute_dtype, self.device))
        reference = self._reference(source, step) if self.settings.kl_coef > 0 else None
        self.core = LearnerCore(model, self.settings, reference=reference, ranks=self.link)
        self.core.updates = max(step, 0)
        return self.core

    def _reference(self, source: Path, step: int) -> Any:
        """The KL term's frozen reference: the initial policy (`settings.reference`; without one, `source` when it
        is the initial policy), loaded once, sharded like the policy when there are ranks. A resume from a later
        checkpoint must not take that checkpoint for the reference: the KL would then pull towards the policy
        being trained, not the one training started from."""
        where = self.settings.reference if self.settings.reference is not None else (source if step < 0 else None)
        if where is None:
            raise ValueError(
                f"kl_coef = {self.settings.kl_coef} needs its frozen reference, the initial policy (learner.policy), "
                f"also when resuming from a checkpoint (step {step})"
            )
        if self._frozen is not None and self._frozen[0] == Path(where):
            return self._frozen[1]
        reference = load_for_training(where, self.device)
        if self.link is not None:
            shard_policy(reference, compute_dtype=compute_dtype_on(self.settings.compute_dtype, self.device))
        self._frozen = (Path(where), reference)
        return reference

    def restore(self, info: CheckpointInfo, *, source_step: int | None = None) -> tuple[set[str], dict[str, Any]]:
        """Load the optimizer state for a resume from `info` into the core built from it (each rank its piece;
        `optimizer_source`'s, whose step rank 0 tells the others as `source_step`) and return (ledger, meta,
        with `optimizer_step`); the caller has verified the policy's digest."""
        assert self.core is not None
        if self.link is None:
            return restore_checkpoint(info, optimizer=self.core.optimizer, verified=True)
        if source_step is None:
            source = optimizer_source(info)
            source_step = note_optimizer_source(info, source)
        if self.link.leader:
            self.link.command(Command.RESTORE, info.step, source_step)
        if source_step >= 0:
            _load_optimizer_piece(self.core.optimizer, checkpoint_at(info.path.parent, source_step).path, self.link)
        self.core.updates = info.step
        if not self.link.leader:
            return set(), {}
        ledger, meta = restore_checkpoint(info, verified=True)
        return ledger, {**meta, "optimizer_step": source_step}

    def save(
        self,
        root: Path,
        *,
        step: int,
        ledger: set[str],
        extra: dict[str, Any],
        tokenizer: Any,
        keep: int,
        publish_dtype: torch.dtype,
    ) -> CheckpointInfo:
        """Checkpoint `step` under `root` (see `rl/checkpoint.py`); sharded, with every rank's optimizer piece."""
        assert self.core is not None
        common = {"step": step, "ledger": ledger, "extra": extra, "tokenizer": tokenizer, "keep": keep}
        common["publish_dtype"] = publish_dtype
        if self.link is None:
            return save_checkpoint(
                root, model=self.core.model, optimizer=self.core.optimizer, optimizer_writes=self.optimizer_writes,
                **common,
            )  # fmt: skip
        link, nonce = self.link, secrets.randbits(48)
        link.command(Command.SAVE, step, nonce)
        weights = full_weights(self.core.model)
        snapshot = _local_optimizer_state(self.core.optimizer)
        if not self._agree_step(step):  # every rank is at this step, its snapshot taken
            raise RanksOutOfStep(f"a rank is not at step {step}: the ranks are out of step")
        released = False

        def start_writes(final: Path) -> None:
            nonlocal released
            released = True
            if not link.agree(True):  # barrier: committed; every rank may write into it
                raise RanksOutOfStep(f"checkpoint {step}: a rank did not take part in its commit")
            self._write_piece_behind(final, snapshot, nonce)

        # The previous save's pieces may still be being written by a rank (never older ones: each rank ends
        # a write before it starts the next); spared until they are all there.
        in_flight = [self._saved] if self._saved is not None and not has_optimizer_state(self._saved) else []
        try:
            info = save_checkpoint(
                root,
                model=self.core.model,
                optimizer=None,
                weights=weights,
                optimizer_writes=self.optimizer_writes,
                start_optimizer_writes=start_writes,
                in_flight=in_flight,
                **common,
            )
        except Exception:
            if not released:  # failed before the commit: release the other ranks, with nothing to write
                link.agree(False)
            raise
        self._saved = info.path
        return info

    def save_share(self, root: Path, *, step: int, nonce: int) -> None:
        """A rank other than 0, told SAVE: its part of rank 0's `save`."""
        assert self.core is not None and self.link is not None
        full_weights(self.core.model)
        snapshot = _local_optimizer_state(self.core.optimizer)
        if not self._agree_step(step):
            return  # the ranks disagree: rank 0 raises
        if self.link.agree(True):  # False: rank 0 could not commit the step; nothing to write into
            self._write_piece_behind(root / f"step-{step:08d}", snapshot, nonce)

    def wait_for_writes(self) -> float:
        """Block until the background optimizer write (if any) is durable or has failed; seconds waited."""
        return self.optimizer_writes.wait()

    def stop(self) -> None:
        """Leaving: the background optimizer write finishes first; rank 0 lets the other ranks leave too (each
        waits for its own write: `follow`) and hears how their last writes went (`leave`)."""
        self.wait_for_writes()
        if self._commands:
            assert self.link is not None
            self.link.command(Command.STOP)
            try:  # a rank gone, or its write past the collective timeout, costs its last report, not the exit
                self.leave()
            except RuntimeError as exc:
                log.warning("the other ranks' last optimizer write reports did not arrive (%s)", exc)

    def leave(self) -> None:
        """Every rank, after STOP: wait for this rank's write, then agree once more, each rank saying how its
        writes went (rank 0 logs and counts the others' new failures)."""
        assert self.link is not None
        self.wait_for_writes()
        _, reports = self.link.agree_reporting(True, self.own_failures())
        self._note_failures(reports)

    def own_failures(self) -> WriteFailures:
        """This process's failed optimizer writes so far, and the newest one's step and error."""
        writes = self.optimizer_writes
        count, failed = writes.failures, writes.last_failure  # the count first: the report is at least as new
        if failed is None:
            return WriteFailures(count)
        step = next((n for p in (failed.target, *failed.target.parents) if (n := step_of(p)) is not None), -1)
        return WriteFailures(count, step, failed.error or "")

    def write_figures(self) -> dict[str, float]:
        """The background optimizer writes in an update's metrics: this process's newest finished write
        (`optimizer_write_seconds`), the failures of every rank (`optimizer_write_failures`: this process's as
        they happen, another rank's as it last reported them) and, once one has failed, the newest failure's
        rank and step (`optimizer_write_failed_rank`, `optimizer_write_failed_step`)."""
        writes = self.optimizer_writes
        out = {} if writes.last is None else {"optimizer_write_seconds": writes.last.seconds}
        every = {**self.rank_failures, self.link.rank if self.link is not None else 0: self.own_failures()}
        out["optimizer_write_failures"] = float(sum(f.count for f in every.values()))
        failed = [(f.step, rank) for rank, f in every.items() if f.count]
        if failed:
            step, rank = max(failed)
            out.update(optimizer_write_failed_step=float(step), optimizer_write_failed_rank=float(rank))
        return out

    def _note_failures(self, reports: list[WriteFailures]) -> None:
        """Rank 0: take the other ranks' reports, logging each rank's failures new since its previous one."""
        assert self.link is not None
        if not self.link.leader:
            return
        for rank, said in enumerate(reports[1:], start=1):
            before = self.rank_failures.get(rank, WriteFailures())
            if said.count <= before.count:
                continue
            self.rank_failures[rank] = said
            log.error(
                "rank %d: its background optimizer write of step %d failed (%s; %d failed on that rank so far): "
                "that step has no complete optimizer state and a resume from it takes older moments",
                rank, said.step, said.error, said.count,
            )  # fmt: skip

    def _agree_step(self, step: int) -> bool:
        """Every rank agrees that it is at `step`; the same collective carries each rank's write failures."""
        assert self.core is not None and self.link is not None
        mine = self.core.updates == step
        if not mine:
            log.error("rank %d is at update %d, asked to save step %d", self.link.rank, self.core.updates, step)
        agreed, reports = self.link.agree_reporting(mine, self.own_failures())
        self._note_failures(reports)
        return agreed

    def _write_piece_behind(self, final: Path, snapshot: tuple[dict, dict[str, Any], set[str]], nonce: int) -> None:
        """Start writing this rank's optimizer piece into committed checkpoint `final` on the background
        writer (after its previous write has ended). A write that fails (or whose checkpoint was pruned under
        it) is logged and counted, not raised: the step is committed either way, only without optimizer state."""
        assert self.link is not None
        tensors, meta, pieces = snapshot
        rank, world = self.link.rank, self.link.world

        def write(target: Path) -> None:
            _write_piece(target.parent, rank=rank, world=world, tensors=tensors, pieces=pieces, meta=meta,
                         save_id=f"{nonce:012x}")  # fmt: skip

        self.optimizer_writes.submit(rank_file(final / OPTIMIZER, rank), off_compute_thread(write), directory=False)


def follow(trainer: Trainer, *, root: Path, init_policy: Path) -> None:
    """A rank other than 0: do what rank 0 says, in order, until it says STOP. `root` is the run's checkpoint
    directory and `init_policy` the initial policy (the same configuration as rank 0's)."""
    link = trainer.link
    assert link is not None and not link.leader
    accumulated: LossSums | None = None  # this rank's figures of the update being accumulated
    while True:
        kind, (first, second, _) = link.next_command()
        match kind:
            case Command.STOP:
                trainer.leave()
                return
            case Command.BUILD:
                trainer.build(init_policy if first < 0 else checkpoint_at(root, first).master_dir, step=first)
            case Command.RESTORE:
                trainer.restore(checkpoint_at(root, first), source_step=second)
            case Command.STEP:
                assert trainer.core is not None
                try:
                    trainer.core.follow(first, second)
                except FloatingPointError as exc:  # every rank saw the same global norm: rank 0 retries
                    log.warning("rank %d: %s", link.rank, exc)
            case Command.SAVE:
                trainer.save_share(root, step=first, nonce=second)
            case Command.ACCUMULATE:
                assert trainer.core is not None
                if accumulated is None:  # the update's first group: its gradients start from nothing
                    trainer.core.optimizer.zero_grad(set_to_none=True)
                    accumulated = LossSums()
                trainer.core.follow(0, first, accumulated)
            case Command.APPLY:
                assert trainer.core is not None
                sums, accumulated = accumulated or LossSums(), None
                try:
                    trainer.core.apply(sums, first, scale=1.0 / first)
                except FloatingPointError as exc:  # every rank saw the same global norm: rank 0 retries
                    log.warning("rank %d: %s", link.rank, exc)
            case Command.DISCARD:
                assert trainer.core is not None
                trainer.core.optimizer.zero_grad(set_to_none=True)
                accumulated = None


def _write_piece(directory: Path, **shard: Any) -> None:
    """A background write's body: this rank's piece (and rank 0's index) into `directory`; the checkpoint
    around it already committed."""
    failpoint("learner.optimizer_write")  # fault tests: die before this rank's piece has landed
    write_shard(directory, **shard)


def _local_optimizer_state(optimizer: torch.optim.Optimizer) -> tuple[dict, dict[str, Any], set[str]]:
    """This rank's optimizer state as (CPU copies of its tensors, a snapshot the next step cannot change; the
    JSON part; names of the tensors that are dim-0 pieces)."""
    from torch.distributed.tensor import DTensor

    state = optimizer.state_dict()
    pieces = set()
    local: dict[int, dict[str, Any]] = {}
    for index, slots in state["state"].items():
        local[index] = {}
        for slot, value in slots.items():
            if isinstance(value, DTensor):
                value = value.to_local()
                pieces.add(f"state.{index}.{slot}")
            local[index][slot] = value
    tensors, meta = optimizer_tensors({"state": local, "param_groups": state["param_groups"]}, copy=True)
    return tensors, meta, pieces


def _load_optimizer_piece(optimizer: torch.optim.Optimizer, path: Path, link: RankLink) -> None:
    """Load this rank's piece of the optimizer state in checkpoint `path`, whatever number of ranks (or one
    process) wrote it: a whole tensor is cut to this rank's piece, and each piece wrapped as its parameter's."""
    from torch.distributed.tensor import DTensor

    if (path / OPTIMIZER).is_dir():
        tensors, meta = read_shards(path / OPTIMIZER, rank=link.rank, world=link.world)
    else:
        tensors, meta = load_tensors(path / OPTIMIZER)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for key, tensor in tensors.items():
        _, index, _ = key.split(".", 2)
        param = params[int(index)]
        if not isinstance(param, DTensor) or tensor.dim() == 0:  # a step count: the same on every rank
            continue
        own = param.to_local()
        mine = tensor if tensor.shape == own.shape else piece(tensor, link.rank, link.world)
        if mine.shape != own.shape:
            raise ValueError(f"{path}: {key} has shape {tuple(tensor.shape)}, parameter {tuple(param.shape)}")
        tensors[key] = DTensor.from_local(
            mine.to(own.device), param.device_mesh, param.placements, run_check=False, shape=param.shape,
            stride=param.stride(),
        )  # fmt: skip
    optimizer.load_state_dict(optimizer_state(tensors, meta))
