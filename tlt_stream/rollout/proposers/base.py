"""What every draft source shares: the proposal it hands the engine, the surface the engine calls, and the
helpers that turn per-row drafts into one padded tree.

A proposal is a `DraftTree` of candidate nodes (point masses) or a sampled chain with its drafter
distributions q, plus, for trees merged from several sources, which source proposed each node. Sources work
on running rows 0..B-1 (the engine keeps active slots contiguous) and mirror its slot moves.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass
from typing import Protocol

import torch

from tlt_stream.rollout.acceptance import DraftTree
from tlt_stream.rollout.arms import Arm

__all__ = [
    "SOURCE_EAGLE",
    "SOURCE_GROUP",
    "Proposal",
    "Proposer",
    "chain_sources",
    "count_sources",
    "merge_trees",
    "pad_chains",
    "pad_trees",
]


SOURCE_EAGLE, SOURCE_GROUP = 1, 2
"""Bits of `Proposal.sources`: which draft source proposed a node (both, when merged)."""


@dataclass(frozen=True)
class Proposal:
    tree: DraftTree
    q: torch.Tensor | None = None
    """`[B, N, V]` drafter distributions the chain's tokens were sampled from, or None (point masses)."""
    sources: torch.Tensor | None = None
    """`[B, N]` bits SOURCE_EAGLE | SOURCE_GROUP per node, for trees merged from several sources (None: one
    source, the arm's)."""


class Proposer(Protocol):
    """What the engine needs from a draft source. Slots are the engine's (running rows are 0..B-1)."""

    def allocate(self, max_batch: int, max_len: int) -> None: ...

    def reset_slot(self, slot: int, prompt: SequenceOf[int] = ()) -> None:
        """A new request in `slot`; `prompt` is its prompt (the group source keys its drafts by it)."""
        ...

    def move_slot(self, src: int, dst: int) -> None: ...

    def observe(self, slot: int, tokens: list[int], features: torch.Tensor) -> None:
        """Committed pairs: `tokens[i]` was produced by the target from hidden state `features[i]`."""
        ...

    def observe_step(self, rows: list[int], tokens: list[int], features: torch.Tensor) -> None:
        """One plain decode step: row `rows[i]` emitted `tokens[i]` from `features[rows[i]]` (`features` is
        the step's `[B, H]`). The same as `observe` per row, in one call: this runs every decode step, SD on
        or off, so its per-row cost is paid on every token."""
        ...

    def propose(
        self, batch: int, arm: Arm, temperatures: torch.Tensor, generators: list[torch.Generator | None]
    ) -> Proposal: ...


def pad_trees(rows: list[tuple[list[int], list[int]]], sources: list[list[int]] | None = None) -> Proposal:
    """Per-row (tokens, parents) lists as one `DraftTree`, rows padded with padding nodes (parent -1)."""
    width = max(1, max(len(tokens) for tokens, _ in rows))
    pad = [width - len(tokens) for tokens, _ in rows]
    tok = torch.tensor([tokens + [0] * n for (tokens, _), n in zip(rows, pad, strict=True)], dtype=torch.long)
    par = torch.tensor([parents + [-1] * n for (_, parents), n in zip(rows, pad, strict=True)], dtype=torch.long)
    src = None
    if sources is not None:
        src = torch.tensor([bits + [0] * n for bits, n in zip(sources, pad, strict=True)], dtype=torch.uint8)
    return Proposal(DraftTree(tok, par), sources=src)


def pad_chains(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Chains of several lengths as `[B, width]` tokens (padded with 0) and their `[B]` lengths."""
    width = max(len(t) for t in rows)
    tokens = torch.tensor([t + [0] * (width - len(t)) for t in rows], dtype=torch.long)
    return tokens, torch.tensor([len(t) for t in rows])


def chain_sources(tokens: torch.Tensor, lengths: torch.Tensor, bit: int) -> torch.Tensor:
    """`[B, width]` source bits of the chains `tokens` (`lengths` long): `bit` on real nodes, 0 on padding."""
    return ((torch.arange(tokens.shape[1])[None, :] < lengths[:, None]) * bit).to(torch.uint8)


def merge_trees(parts: list[tuple[list[int], list[int], int]]) -> tuple[list[int], list[int], list[int]]:
    """Trees of one row from several sources, (tokens, parents, source bit) each, as one tree: (tokens,
    parents, source bits). A node is the same node when its parent and token are, so a token two sources
    propose under one node appears once, with both bits; the first source's nodes come first under each
    node (tried first). Padding nodes (parent -1) are left out."""
    merged: dict[tuple[int, int], int] = {}  # (merged parent, token) -> merged node
    tokens: list[int] = []
    parents: list[int] = []
    bits: list[int] = []
    for part_tokens, part_parents, source in parts:
        at = {0: 0}  # the part's node -> merged node
        for i, (token, parent) in enumerate(zip(part_tokens, part_parents, strict=True), start=1):
            if parent not in at:  # padding, or below a node left out
                continue
            edge = (at[parent], token)
            node = merged.get(edge)
            if node is None:
                tokens.append(token)
                parents.append(at[parent])
                bits.append(0)
                node = merged[edge] = len(tokens)
            bits[node - 1] |= source
            at[i] = node
    return tokens, parents, bits


_SOURCE_OF_ARM = {"drafter": "eagle", "group": "group", "ngram": "ngram"}
"""The draft source an arm of one source drafts with (the name per-source counts are kept under)."""


def count_sources(
    drafted: Counter[str],
    accepted: Counter[str],
    proposal: Proposal,
    arm: Arm,
    outcome: tuple[list[list[int]], list[int]],
    fallback: str,
) -> None:
    """Add one round's drafted and accepted nodes per draft source to `drafted` and `accepted`. `outcome` is
    each row's accepted path (node numbers) and how many of its nodes were used; `fallback` names the source
    of an arm no source is known for (a test's proposer)."""
    paths, used = outcome
    if proposal.sources is None:
        name = _SOURCE_OF_ARM.get(arm.kind, fallback)
        drafted[name] += int((proposal.tree.parents >= 0).sum())
        accepted[name] += sum(used)
        return
    # Nodes per bit pattern (padding nodes carry none): one transfer, then plain Python every round.
    per_bits = torch.bincount(proposal.sources.view(-1).long(), minlength=4).tolist()
    by_node = proposal.sources.tolist()
    taken = [by_node[b][node - 1] for b, path in enumerate(paths) for node in path[: used[b]]]
    for name, bit in (("eagle", SOURCE_EAGLE), ("group", SOURCE_GROUP)):
        drafted[name] += sum(count for bits, count in enumerate(per_bits) if bits & bit)
        accepted[name] += sum(1 for source in taken if source & bit)
