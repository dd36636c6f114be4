"""Samples into the learner's micro-batches, and micro-batches dealt over ranks.

A micro-batch is prompt + response, right-padded, of about `micro_batch_tokens` padded tokens; the rows are
taken longest first so rows of like length share a batch. Response token j of a row sits at position
p + j and is predicted by the logits at p + j - 1, so the behaviour logprobs and the response mask live on
the shifted grid `[B, W - 1]`. A sharded update deals its samples to the ranks by tokens and every rank runs
as many forward/backward rounds as the longest share: the shorter shares are topped up with idle batches
(one row, no response token) that add nothing to the loss or the gradient but take part in FSDP's
collectives. Pure tensor code: no model, no process group.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from tlt_stream.basics.messages import Sample
from tlt_stream.rl.shapes import split_by_width

__all__ = ["BATCH_KEYS", "deal_by_tokens", "micro_batches", "with_idle"]

BATCH_KEYS = ("ids", "attention", "old", "mask", "advantages")
"""A micro-batch's tensors, in the order they are handed to another rank."""


def micro_batches(
    samples: list[Sample], advantages: torch.Tensor, used: list[int], *, tokens: int, device: torch.device
) -> Iterator[dict[str, torch.Tensor]]:
    """Right-padded batches of the samples at positions `used`, longest first, about `tokens` padded tokens
    each (one row at least), on `device`."""
    widths = [len(samples[i].prompt_ids) + samples[i].response_len for i in used]
    for positions in split_by_width(widths, tokens):
        take, width = [used[j] for j in positions], widths[positions[0]]
        ids = torch.zeros(len(take), width, dtype=torch.long)  # [B, W]
        attention = torch.zeros(len(take), width, dtype=torch.long)  # [B, W]
        old = torch.zeros(len(take), width - 1)  # [B, W - 1]
        mask = torch.zeros(len(take), width - 1, dtype=torch.bool)  # [B, W - 1]
        for row, i in enumerate(take):
            s = samples[i]
            p, n = len(s.prompt_ids), s.response_len
            ids[row, :p] = torch.tensor(s.prompt_ids)
            ids[row, p : p + n] = s.token_ids.to_torch().long()
            attention[row, : p + n] = 1
            old[row, p - 1 : p - 1 + n] = s.logprobs.to_torch()
            mask[row, p - 1 : p - 1 + n] = True
        batch = {"ids": ids, "attention": attention, "old": old, "mask": mask, "advantages": advantages[take]}
        yield {name: tensor.to(device) for name, tensor in batch.items()}


def with_idle(
    batches: list[dict[str, torch.Tensor]], rounds: int, device: torch.device
) -> list[dict[str, torch.Tensor]]:
    """`batches` and idle ones up to `rounds`: a one-row batch without response tokens adds nothing to the
    loss or the gradient, but runs the round's collectives on a rank whose share is shorter."""
    idle = {
        "ids": torch.zeros(1, 2, dtype=torch.long, device=device),
        "attention": torch.ones(1, 2, dtype=torch.long, device=device),
        "old": torch.zeros(1, 1, device=device),
        "mask": torch.zeros(1, 1, dtype=torch.bool, device=device),
        "advantages": torch.zeros(1, dtype=torch.float64, device=device),
    }
    return batches + [idle] * (rounds - len(batches))


def deal_by_tokens(lengths: list[int], parts: int) -> list[list[int]]:
    """Positions 0..len(lengths)-1 dealt into `parts` lists of about equal total length: longest first, each
    to the list with the fewest tokens so far (the lowest index on a tie), so every rank does about the same
    work; a list may stay empty when there are fewer items than parts."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    dealt: list[list[int]] = [[] for _ in range(parts)]
    load = [0] * parts
    for position in sorted(range(len(lengths)), key=lambda j: lengths[j], reverse=True):
        target = min(range(parts), key=lambda r: (load[r], r))
        dealt[target].append(position)
        load[target] += lengths[position]
    return dealt
