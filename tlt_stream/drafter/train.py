"""Training the EAGLE drafter on the target's own hidden states: packed windows, unrolled EAGLE loss.

A window is a token sequence x_0..x_{L-1} with the target's final-norm hidden states f_0..f_{L-1} (f_i is
the state whose logits predicted x_{i+1}). The drafter sees the pair (x_i, f_{i-1}) at position i and must
predict f_i (SmoothL1) and, through the frozen LM head, the target's next-token distribution
softmax(lm_head(f_i)) (soft cross-entropy, weight 0.1), on positions whose next token is a response token.

Drafting runs several steps ahead on the drafter's *own* predicted features, and a drafter trained only
one step ahead drifts (acceptance fell off past depth 3-4 here). So the loss is unrolled: step k feeds,
at every position, the drafter's step-(k-1) prediction for the previous position instead of the true
feature, with weight decay^(k-1). Windows are packed into rows with block-diagonal causal attention and
positions reset per window, so nothing attends across samples.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tlt_stream.drafter.model import Drafter

__all__ = ["DrafterTrainer", "PackedBatch", "Window", "eagle_loss", "pack_windows"]


@dataclass(frozen=True)
class Window:
    tokens: torch.Tensor
    """`[L]` token ids."""
    features: torch.Tensor
    """`[L, H]` target hidden states at those positions."""
    prompt_len: int = 0
    """Leading context tokens: pairs whose next token lies in the prompt are not trained on."""

    def __post_init__(self) -> None:
        if self.tokens.dim() != 1 or self.features.dim() != 2 or self.features.shape[0] != self.tokens.shape[0]:
            raise ValueError(
                f"window needs tokens [L] and features [L, H], got {self.tokens.shape}, {self.features.shape}"
            )

    @property
    def num_pairs(self) -> int:
        return max(0, self.tokens.shape[0] - 1)


@dataclass(frozen=True)
class PackedBatch:
    tokens: torch.Tensor  # [R, T] x_i
    features: torch.Tensor  # [R, T, H] f_{i-1}
    targets: torch.Tensor  # [R, T, H] f_i
    positions: torch.Tensor  # [R, T] i, reset per window
    segments: torch.Tensor  # [R, T] window index within the row, -1 for padding
    loss_mask: torch.Tensor  # [R, T] float

    @property
    def attention_mask(self) -> torch.Tensor:
        """`[R, 1, T, T]` bool: causal within a window, nothing across windows (padding sees itself)."""
        t = self.tokens.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool, device=self.tokens.device).tril()
        same = self.segments[:, :, None] == self.segments[:, None, :]
        own = torch.eye(t, dtype=torch.bool, device=self.tokens.device)
        return ((same & causal) | own).unsqueeze(1)


def pack_windows(windows: Sequence[Window], row_tokens: int) -> list[PackedBatch]:
    """Greedy first-fit packing of windows' pairs into rows of `row_tokens` pairs, one batch per `rows`
    rows (all rows of a batch share the longest row's width). Windows longer than a row are cut into
    row-sized chunks (each chunk keeps its true features, so nothing is lost but cross-chunk attention)."""
    if row_tokens < 2:
        raise ValueError("row_tokens must be >= 2")
    chunks: list[tuple[Window, int, int]] = []  # (window, first pair, last pair exclusive)
    for window in windows:
        n = window.num_pairs
        for start in range(0, n, row_tokens):
            chunks.append((window, start, min(n, start + row_tokens)))
    chunks.sort(key=lambda c: c[2] - c[1], reverse=True)
    rows: list[list[tuple[Window, int, int]]] = []
    room: list[int] = []
    for chunk in chunks:
        size = chunk[2] - chunk[1]
        for r, free in enumerate(room):
            if free >= size:
                rows[r].append(chunk)
                room[r] -= size
                break
        else:
            rows.append([chunk])
            room.append(row_tokens - size)
    return [_build_row_batch(rows, row_tokens)] if rows else []


def _build_row_batch(rows: list[list[tuple[Window, int, int]]], row_tokens: int) -> PackedBatch:
    width = max(sum(end - start for _, start, end in row) for row in rows)
    r, h = len(rows), rows[0][0][0].features.shape[1]
    tokens = torch.zeros(r, width, dtype=torch.long)
    features = torch.zeros(r, width, h)
    targets = torch.zeros(r, width, h)
    positions = torch.zeros(r, width, dtype=torch.long)
    segments = torch.full((r, width), -1, dtype=torch.long)
    loss_mask = torch.zeros(r, width)
    for i, row in enumerate(rows):
        at = 0
        for seg, (window, start, end) in enumerate(row):
            n = end - start
            pair = torch.arange(start, end) + 1  # pair index i = position of x_i, 1..L-1
            tokens[i, at : at + n] = window.tokens[pair]
            features[i, at : at + n] = window.features[pair - 1].float()
            targets[i, at : at + n] = window.features[pair].float()
            positions[i, at : at + n] = pair - start  # reset per chunk
            segments[i, at : at + n] = seg
            loss_mask[i, at : at + n] = (pair + 1 >= window.prompt_len).float()  # next token is a response token
            at += n
    return PackedBatch(tokens, features, targets, positions, segments, loss_mask)


def eagle_loss(
    drafter: Drafter, batch: PackedBatch, *, unroll: int = 3, ce_weight: float = 0.1, decay: float = 0.8
) -> tuple[torch.Tensor, dict[str, float]]:
    """The unrolled EAGLE loss on one packed batch; also top-1 agreement with the target per unroll step."""
    mask = batch.attention_mask
    weight = batch.loss_mask
    denom = weight.sum().clamp_min(1.0)
    with torch.no_grad():
        target_logp = torch.log_softmax(drafter.logits(batch.targets).float(), dim=-1)  # [R, T, V]
        target_top = target_logp.argmax(-1)
    same_segment = (batch.segments[:, 1:] == batch.segments[:, :-1]) & (batch.segments[:, 1:] >= 0)
    features = batch.features
    total = torch.zeros(())
    stats: dict[str, float] = {}
    for k in range(unroll):
        pred = drafter.dense(batch.tokens, features, batch.positions, mask)  # [R, T, H]
        regression = F.smooth_l1_loss(pred.float(), batch.targets, reduction="none").mean(-1)  # [R, T]
        logq = torch.log_softmax(drafter.logits(pred).float(), dim=-1)
        cross_entropy = -(target_logp.exp() * logq).sum(-1)  # soft CE against the target distribution
        step = ((regression + ce_weight * cross_entropy) * weight).sum() / denom
        total = total + decay**k * step
        agree = ((logq.argmax(-1) == target_top).float() * weight).sum() / denom
        stats[f"loss_{k + 1}"] = float(step.detach())
        stats[f"top1_{k + 1}"] = float(agree)
        if k + 1 < unroll:  # next step: each position is fed the prediction made for the position before
            shifted = torch.where(same_segment[..., None], pred[:, :-1].detach(), batch.features[:, 1:])
            features = torch.cat([batch.features[:, :1], shifted], dim=1)
    stats["loss"] = float(total.detach())
    return total, stats


class DrafterTrainer:
    """AdamW (betas 0.9/0.95, weight decay 0.01), gradient clipping at 1.0, warmup then cosine decay.

    The step counter and optimizer state are plain tensors (`state_dict`), so training resumes exactly.
    """

    def __init__(
        self,
        drafter: Drafter,
        *,
        lr: float = 1e-3,
        total_steps: int = 1000,
        warmup: int = 20,
        unroll: int = 3,
        clip: float = 1.0,
    ) -> None:
        self.drafter = drafter
        params = [p for p in drafter.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
        self.base_lr = lr
        self.total_steps = total_steps
        self.warmup = warmup
        self.unroll = unroll
        self.clip = clip
        self.step_count = 0

    def lr_at(self, step: int) -> float:
        if step < self.warmup:
            return self.base_lr * (step + 1) / self.warmup
        progress = min(1.0, (step - self.warmup) / max(1, self.total_steps - self.warmup))
        return self.base_lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    def step(self, batch: PackedBatch) -> dict[str, float]:
        self.drafter.train()
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr_at(self.step_count)
        loss, stats = eagle_loss(self.drafter, batch, unroll=self.unroll)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), self.clip)
        self.optimizer.step()
        self.step_count += 1
        stats["grad_norm"] = float(norm)
        stats["lr"] = self.optimizer.param_groups[0]["lr"]
        return stats

    def state_dict(self) -> dict[str, object]:
        """A snapshot (deep copy): later steps do not change it, so it can be written out asynchronously."""
        return {"optimizer": copy.deepcopy(self.optimizer.state_dict()), "step": self.step_count}

    def load_state_dict(self, state: dict[str, object]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])  # type: ignore[arg-type]
        self.step_count = int(state["step"])  # type: ignore[arg-type]


def batches(windows: Sequence[Window], *, row_tokens: int, rows_per_batch: int, seed: int) -> Iterable[PackedBatch]:
    """Shuffle windows (seeded) and pack them `rows_per_batch` rows at a time, forever."""
    g = torch.Generator().manual_seed(seed)
    per_batch = max(1, rows_per_batch * row_tokens)
    while True:
        order = torch.randperm(len(windows), generator=g).tolist()
        group: list[Window] = []
        size = 0
        for i in order:
            group.append(windows[i])
            size += windows[i].num_pairs
            if size >= per_batch:
                yield from pack_windows(group, row_tokens)
                group, size = [], 0
        if group:
            yield from pack_windows(group, row_tokens)
