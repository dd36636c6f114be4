"""Online drafter training on idle workers: preemptible slices, a state that survives any interruption.

The policy changes every RL step, so the drafter trains continuously, but only in time nobody else needs:
a worker runs `train_slice` while it is idle and must get back to generating within one training step
when work arrives (`should_stop`). Between slices the worker may lose the lease, be preempted or die, and
another worker carries on, so everything that shapes the next step is saved: the drafter's own
parameters, AdamW's moments, the step count (the learning-rate schedule's position) and the batch-sampling
generator. The embedding and LM head are not: they are borrowed from whichever policy version the drafter
is bound to (`rebind`), which is what keeps it aligned with the live policy.

State goes to disk as safetensors (tensors) and JSON (everything else) in a directory written under a
temporary name, fsynced and renamed into place, so a reader sees a whole state or none. The `drafter/`
inside it is a plain drafter checkpoint (`load_drafter`), ready to be published as is, in its policy's
dtype (what an engine drafts with); the trainer itself keeps float32 weights, and for a narrower policy dtype
(bf16) saves them beside it (`master.safetensors`) so training resumes from them. A step whose loss or
gradient is not finite is skipped rather than taken.

`held_out_acceptance` is the guard rail: the expected number of draft tokens accepted per verification,
measured on windows held back from training, so a new drafter replaces the current one only if it is not
worse.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from tlt_stream.basics.config import DEFAULTS, DrafterConfig
from tlt_stream.drafter.buffer import WindowBuffer
from tlt_stream.drafter.model import CONFIG, WEIGHTS, Drafter, save_drafter
from tlt_stream.drafter.train import PackedBatch, Window, eagle_loss, pack_windows
from tlt_stream.model.loader import CheckpointError
from tlt_stream.model.transformer import Transformer
from tlt_stream.store.durable import atomic_directory
from tlt_stream.store.tensors import optimizer_state, optimizer_tensors

__all__ = [
    "OnlineDrafterTrainer",
    "SliceEnd",
    "SliceResult",
    "WindowBuffer",
    "held_out_acceptance",
    "judgeable",
    "lr_at",
]

log = logging.getLogger(__name__)

STATE_FORMAT = 1
DRAFTER_DIR = "drafter"
OPTIMIZER = "optimizer.safetensors"
RNG = "rng.safetensors"
TRAINER = "trainer.json"
MASTER = "master.safetensors"
"""The float32 weights training resumes from, beside a `drafter/` saved in the policy's narrower dtype."""


def lr_at(config: DrafterConfig, step: int) -> float:
    """The drafter's learning rate at `step`: linear warm-up to `lr` over `lr_warmup_steps`, then constant or a
    cosine decay to `lr_min_ratio * lr` at `lr_total_steps`."""
    base = config.lr
    if step < config.lr_warmup_steps:
        return base * (step + 1) / config.lr_warmup_steps
    if config.lr_schedule == "constant":
        return base
    span = max(1, config.lr_total_steps - config.lr_warmup_steps)
    progress = min(1.0, (step - config.lr_warmup_steps) / span)
    return base * (config.lr_min_ratio + (1 - config.lr_min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def _schedule(config: DrafterConfig) -> dict[str, Any]:
    """What a saved state records of the learning-rate schedule it was trained with."""
    return {
        "base_lr": config.lr,
        "warmup_steps": config.lr_warmup_steps,
        "kind": config.lr_schedule,
        "total_steps": config.lr_total_steps,
        "min_ratio": config.lr_min_ratio,
    }


class SliceEnd(enum.StrEnum):
    PREEMPTED = "preempted"
    """`should_stop()` said so (checked before every step)."""
    STEPS = "steps"
    TIME = "time"
    NO_DATA = "no_data"


@dataclass(frozen=True)
class SliceResult:
    steps: int
    seconds: float
    loss: float | None
    """Mean loss over the slice's steps (None when it ran none)."""
    end: SliceEnd
    last: dict[str, float]
    """The last step's statistics (`eagle_loss`'s, plus lr and grad_norm)."""


class OnlineDrafterTrainer:
    """AdamW on the drafter's trainable parameters over batches drawn from a `WindowBuffer`."""

    def __init__(
        self,
        drafter: Drafter,
        buffer: WindowBuffer,
        config: DrafterConfig = DEFAULTS.drafter,
        *,
        policy_version: int = -1,
    ) -> None:
        if not drafter.bound:
            raise ValueError("bind the drafter to the current policy (drafter.bind(target)) before training it")
        # AdamW steps at the drafter's learning rate are far below bf16's resolution (a weight of 0.05 moves in
        # steps of 2.4e-4, a norm gain of 1 in steps of 7.8e-3): in bf16 most weights would never change. The
        # trainer keeps float32 weights; the borrowed embedding and head stay in the policy's dtype.
        self.drafter = drafter.float()
        self.buffer = buffer
        self.config = config
        self.policy_version = policy_version
        named = [(n, p) for n, p in drafter.named_parameters() if p.requires_grad]
        self.param_names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.optimizer = torch.optim.AdamW(
            self.params, lr=lr_at(config, 0), betas=config.betas, weight_decay=config.weight_decay
        )
        self.generator = torch.Generator().manual_seed(config.seed)
        self.step_count = 0

    @property
    def lr(self) -> float:
        """The learning rate the next step will use."""
        return lr_at(self.config, self.step_count)

    def rebind(self, target: Transformer, policy_version: int) -> None:
        """Borrow a new policy version's frozen embedding and LM head (the trainable state is unchanged)."""
        self.drafter.bind(target)
        self.policy_version = policy_version

    # ------------------------------------------------------------------------------------------ training

    def train_step(self) -> dict[str, float] | None:
        """One optimizer step on a packed batch drawn from the buffer; None when the buffer is empty."""
        windows = self.buffer.sample(self.config.batch_pairs, self.generator)
        if not windows:
            return None
        (batch,) = pack_windows(windows, self.config.row_tokens)
        batch = _to_drafter(batch, self.drafter.fc.weight)
        lr = self.lr
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.drafter.train()
        loss, stats = eagle_loss(self.drafter, batch, unroll=self.config.unroll)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.config.clip)
        skipped = not (math.isfinite(stats["loss"]) and math.isfinite(float(norm)))
        if skipped:  # one bad batch would turn every weight and moment into NaN for good: leave them as they are
            self.optimizer.zero_grad(set_to_none=True)
            log.warning("drafter step %d: non-finite loss or gradient; the step was skipped", self.step_count)
        else:
            self.optimizer.step()
            self.step_count += 1
        stats.update(
            lr=lr,
            grad_norm=float(norm),
            pairs=float(batch.loss_mask.sum()),
            windows=float(len(windows)),
            skipped=float(skipped),
        )
        return stats

    def train_slice(
        self,
        *,
        max_steps: int | None = None,
        max_seconds: float | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> SliceResult:
        """Train until a budget is spent, the buffer is empty, or `should_stop()` (asked before every step,
        so new work waits at most for the step in progress)."""
        if max_steps is None and max_seconds is None:
            raise ValueError("give train_slice a budget: max_steps, max_seconds or both")
        start = time.monotonic()
        losses: list[float] = []
        last: dict[str, float] = {}
        while True:
            if should_stop is not None and should_stop():
                end = SliceEnd.PREEMPTED
                break
            if max_steps is not None and len(losses) >= max_steps:
                end = SliceEnd.STEPS
                break
            if max_seconds is not None and time.monotonic() - start >= max_seconds:
                end = SliceEnd.TIME
                break
            stats = self.train_step()
            if stats is None:
                end = SliceEnd.NO_DATA
                break
            losses.append(stats["loss"])
            last = stats
        finite = [x for x in losses if math.isfinite(x)]
        loss = sum(finite) / len(finite) if finite else None
        return SliceResult(len(losses), time.monotonic() - start, loss, end, last)

    # ------------------------------------------------------------------------------------------ state

    def save_state(self, directory: Path | str, *, metadata: dict[str, Any] | None = None) -> Path:
        """Write the training state to `directory` (which must not exist) atomically; returns it."""
        final = Path(directory)
        if os.path.lexists(final):
            raise FileExistsError(f"{final}: refusing to overwrite an existing drafter state")
        metadata = dict(metadata or {})
        try:
            json.dumps(metadata)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"metadata must be JSON-serialisable: {exc}") from None
        final.parent.mkdir(parents=True, exist_ok=True)
        with atomic_directory(final) as tmp:
            about = {"policy_version": self.policy_version, "step": self.step_count}
            # `drafter/` holds what an engine bound to the policy drafts with (`load_drafter` casts to its dtype)
            serve = self.drafter.policy_dtype
            save_drafter(self.drafter, tmp / DRAFTER_DIR, metadata=about, dtype=serve)
            if serve != torch.float32:  # rounded there: training resumes from the float32 weights
                save_file(_own_weights(self.drafter), str(tmp / MASTER))
            tensors, optimizer_meta = optimizer_tensors(self.optimizer.state_dict())
            save_file(tensors, str(tmp / OPTIMIZER))
            save_file({"batch_generator": self.generator.get_state()}, str(tmp / RNG))
            trainer = json.dumps(
                {
                    "format": STATE_FORMAT,
                    "step": self.step_count,
                    "policy_version": self.policy_version,
                    "schedule": _schedule(self.config),
                    "param_names": self.param_names,
                    "optimizer": optimizer_meta,
                    "metadata": metadata,
                }
            )
            (tmp / TRAINER).write_text(trainer, encoding="utf-8")
        return final

    def load_state(self, directory: Path | str) -> dict[str, Any]:
        """Restore a state written by `save_state` into this trainer; returns its `metadata`.

        The binding stays the caller's: the drafter keeps the embedding and LM head (and `policy_version`)
        of the policy it is bound to now, whatever policy the saved state was trained against.
        """
        path = Path(directory)
        for name in (TRAINER, OPTIMIZER, RNG, f"{DRAFTER_DIR}/{WEIGHTS}", f"{DRAFTER_DIR}/{CONFIG}"):
            if not (path / name).is_file():
                raise CheckpointError(f"{path}: not a drafter training state ({name} is missing)")
        try:
            meta = json.loads((path / TRAINER).read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{path / TRAINER}: invalid JSON ({exc})") from None
        if meta.get("format") != STATE_FORMAT:
            raise CheckpointError(f"{path}: drafter state format {meta.get('format')!r}, expected {STATE_FORMAT}")
        if meta["param_names"] != self.param_names:
            raise CheckpointError(f"{path}: trainable parameters {meta['param_names']} differ from {self.param_names}")
        device = self.params[0].device
        master = path / MASTER if (path / MASTER).is_file() else path / DRAFTER_DIR / WEIGHTS
        weights = load_file(str(master), device=str(device))
        own = self.drafter.state_dict()
        if set(weights) != set(own) or any(weights[k].shape != own[k].shape for k in own):
            raise CheckpointError(f"{path}: drafter weights do not match this drafter's shapes")
        if meta["schedule"] != (schedule := _schedule(self.config)):
            log.warning("%s: saved with schedule %s; continuing with %s", path, meta["schedule"], schedule)
        moments = optimizer_state(load_file(str(path / OPTIMIZER), device=str(device)), meta["optimizer"])
        self.drafter.load_state_dict(weights)
        self.optimizer.load_state_dict(moments)
        self.generator.set_state(load_file(str(path / RNG))["batch_generator"])
        self.step_count = int(meta["step"])
        return dict(meta["metadata"])


def _own_weights(drafter: Drafter) -> dict[str, torch.Tensor]:
    return {k: v.detach().contiguous() for k, v in drafter.state_dict().items()}


def _to_drafter(batch: PackedBatch, weight: torch.Tensor) -> PackedBatch:
    """The batch on the drafter's device, its hidden states in the dtype of the drafter's own weights."""
    moved = {f.name: getattr(batch, f.name).to(weight.device) for f in dataclasses.fields(batch)}
    moved["features"] = moved["features"].to(weight.dtype)
    moved["targets"] = moved["targets"].to(weight.dtype)
    return PackedBatch(**moved)


# ---------------------------------------------------------------------------------------------- guard rail


def _ahead(x: torch.Tensor, k: int, fill: int | bool) -> torch.Tensor:
    """`out[:, s] = x[:, s + k]`, `fill` past the end."""
    if k == 0:
        return x
    out = torch.full_like(x, fill)
    out[:, :-k] = x[:, k:]
    return out


def judgeable(window: Window) -> bool:
    """Whether `held_out_acceptance` has a chain to measure on `window`: a position past its first whose next
    token is a response token (pair i, i >= 1, predicts x_{i+1}; the prompt's tokens are not judged). A window of
    two tokens, or of prompt only, leaves nothing to judge on."""
    length = int(window.tokens.shape[0])
    return length >= 3 and length > window.prompt_len


@torch.no_grad()
def held_out_acceptance(drafter: Drafter, windows: Sequence[Window], depth: int, *, batch_pairs: int = 8192) -> float:
    """Expected draft tokens accepted per verification on `windows` (add 1 for the target's bonus token).

    From every response position s, the drafter drafts a chain of `depth` tokens with the same unrolled
    features as training (step k is fed its own step-(k-1) prediction); draft k is accepted when it equals
    the window's actual next token and drafts 1..k-1 were. Against tokens the policy sampled, that is an
    unbiased estimate of the acceptance probability p(draft) of speculative sampling with top-1 drafts,
    and at temperature 0 it is exact. Chains stop at a window's end, the same for every drafter compared.
    """
    if depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth}")
    usable = [w for w in windows if judgeable(w)]  # the others hold no start: they would add nothing
    if not usable:
        raise ValueError("held_out_acceptance needs a window of at least 3 tokens with a response position to judge")
    was_training = drafter.training
    drafter.eval()
    accepted, starts = 0.0, 0.0
    try:
        for group in _groups(usable, batch_pairs):
            (batch,) = pack_windows(group, max(w.num_pairs for w in group))
            chain, valid = _chains(drafter, _to_drafter(batch, drafter.fc.weight), depth)
            accepted += float(chain.sum())
            starts += float(valid.sum())
    finally:
        drafter.train(was_training)
    if starts == 0:
        raise ValueError("held_out_acceptance found no response positions with a next token")
    return accepted / starts


def _groups(windows: list[Window], pairs: int) -> Iterator[list[Window]]:
    group: list[Window] = []
    size = 0
    for window in windows:
        if group and size + window.num_pairs > pairs:
            yield group
            group, size = [], 0
        group.append(window)
        size += window.num_pairs
    if group:
        yield group


def _chains(drafter: Drafter, batch: PackedBatch, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`chain [R, T]`: accepted drafts of the chain starting at each position; `valid [R, T]`: the starts."""
    seg = batch.segments
    same_next = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] >= 0)  # [R, T-1]: t and t+1 in one window
    next_token = _ahead(batch.tokens, 1, -1)  # [R, T] x_{t+1}
    valid = (batch.loss_mask > 0) & torch.cat([same_next, torch.zeros_like(same_next[:, :1])], dim=1)
    mask = batch.attention_mask
    features = batch.features
    alive = valid.float()  # [R, T] chain from start s accepted so far
    chain = torch.zeros_like(alive)
    for k in range(depth):
        pred = drafter.dense(batch.tokens, features, batch.positions, mask)  # [R, T, H]
        hit = (drafter.logits(pred).argmax(-1) == next_token) & valid  # draft k+1 at each position
        reach = _ahead(hit, k, False)  # the chain from s drafts at s + k (it ended at its window's end)
        alive = alive * reach.float()
        chain += alive
        shifted = torch.where(same_next[..., None], pred[:, :-1], batch.features[:, 1:])
        features = torch.cat([batch.features[:, :1], shifted], dim=1)
    return chain, valid
