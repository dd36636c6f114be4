"""EAGLE and the group source side by side, in one proposer: per arm one source, or both merged in one tree,
or per row whichever source's chain fits."""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf

import torch

from tlt_stream.drafter.model import Drafter
from tlt_stream.rollout.acceptance import DraftTree
from tlt_stream.rollout.arms import Arm
from tlt_stream.rollout.proposers.base import (
    SOURCE_EAGLE,
    SOURCE_GROUP,
    Proposal,
    chain_sources,
    merge_trees,
    pad_chains,
    pad_trees,
)
from tlt_stream.rollout.proposers.eagle import EagleProposer
from tlt_stream.rollout.proposers.group import GroupProposer

__all__ = ["MixedProposer"]


class MixedProposer:
    """EAGLE and the group source side by side: `drafter` arms draft with EAGLE, `group` arms with the group
    source, `mixed` arms merge EAGLE's top-k tree (point masses: its sampled chain's q is given up) and the
    group's tree into one, a token proposed by both under one node kept once, verified in one forward;
    `either` arms give each row one source's chain (`_either`)."""

    def __init__(self, eagle: EagleProposer, group: GroupProposer) -> None:
        self.eagle, self.group = eagle, group
        self.kinds = frozenset({"drafter", "group", "mixed", "either"})

    contexts = GroupProposer.contexts

    @property
    def drafter(self) -> Drafter:
        return self.eagle.drafter

    def context(self, batch: int) -> int:
        """The group source's `context`: EAGLE's speed does not depend on the group, the other arms' does."""
        return self.group.context(batch)

    def allocate(self, max_batch: int, max_len: int) -> None:
        self.eagle.allocate(max_batch, max_len)
        self.group.allocate(max_batch, max_len)

    def reset_slot(self, slot: int, prompt: SequenceOf[int] = ()) -> None:
        self.eagle.reset_slot(slot, prompt)
        self.group.reset_slot(slot, prompt)

    def move_slot(self, src: int, dst: int) -> None:
        self.eagle.move_slot(src, dst)
        self.group.move_slot(src, dst)

    def observe(self, slot: int, tokens: list[int], features: torch.Tensor) -> None:
        self.eagle.observe(slot, tokens, features)
        self.group.observe(slot, tokens, features)

    def observe_step(self, rows: list[int], tokens: list[int], features: torch.Tensor) -> None:
        self.eagle.observe_step(rows, tokens, features)
        self.group.observe_step(rows, tokens, features)

    def propose(
        self, batch: int, arm: Arm, temperatures: torch.Tensor, generators: list[torch.Generator | None]
    ) -> Proposal:
        if arm.kind == "group":
            return self.group.propose(batch, arm, temperatures, generators)
        if arm.kind == "drafter":
            return self.eagle.propose(batch, arm, temperatures, generators)
        if arm.kind == "either":
            return self._either(batch, arm, temperatures, generators)
        if arm.kind != "mixed":
            raise ValueError(f"MixedProposer drafts drafter, group, mixed and either arms, not {arm.label}")
        eagle = self.eagle.propose_tree(batch, Arm.drafter(arm.depth, arm.topk, arm.verify), temperatures)
        groups = self.group.drafts(batch, arm.group_nodes, arm.group_nodes)
        e_tokens, e_parents = eagle.tokens.tolist(), eagle.parents.tolist()
        rows, sources = [], []
        for b in range(batch):
            tokens, parents, bits = merge_trees(
                [
                    (groups[b][0], groups[b][1], SOURCE_GROUP),  # exact continuations first
                    (e_tokens[b], e_parents[b], SOURCE_EAGLE),
                ]
            )
            rows.append((tokens, parents))
            sources.append(bits)
        return pad_trees(rows, sources)

    def _either(
        self, batch: int, arm: Arm, temperatures: torch.Tensor, generators: list[torch.Generator | None]
    ) -> Proposal:
        """Per row, the group's chain where its match is strong, else EAGLE's chain. Where every row takes the
        group's, EAGLE does not draft (its pending pairs wait for its next round). A group row among EAGLE's
        sampled chains carries q one-hot at its tokens (a point mass: accepted with probability p(x), residual
        p without x), so one chain rule verifies both; which source a row takes depends on its committed
        tokens only, never on what the target will sample, so the round stays lossless."""
        chains = self.group.chains(batch, arm.group_nodes)
        strong = [bool(tokens) and matched >= self.group.strong_match for tokens, matched in chains]
        if all(strong):
            tokens, lengths = pad_chains([tokens for tokens, _ in chains])
            return Proposal(DraftTree.chain(tokens, lengths), sources=chain_sources(tokens, lengths, SOURCE_GROUP))
        eagle = self.eagle.propose(batch, Arm.drafter(arm.depth, 1, arm.depth), temperatures, generators)
        e_tokens = eagle.tree.tokens.cpu()  # [B, d]: EAGLE's top-1 drafts are a chain, level by level
        d = e_tokens.shape[1]
        tokens, lengths = pad_chains([chains[b][0] if strong[b] else e_tokens[b].tolist() for b in range(batch)])
        bits = torch.tensor([SOURCE_GROUP if s else SOURCE_EAGLE for s in strong], dtype=torch.uint8)
        sources = chain_sources(tokens, lengths, 1) * bits[:, None]
        q = None
        if eagle.q is not None:  # EAGLE sampled its chains: the others' q are point masses at their tokens
            q = torch.nn.functional.one_hot(tokens, eagle.q.shape[-1]).to(eagle.q)
            for b in range(batch):
                if not strong[b]:
                    q[b, :d] = eagle.q[b]
        return Proposal(DraftTree.chain(tokens, lengths), q, sources)
