"""The EAGLE drafter as a draft source.

It keeps its own KV cache in the same slots as the target's; every committed token reaches it as a (token,
target feature) pair and is fed in one catch-up forward at the start of the next round, whose last output
starts the draft. Trees follow EAGLE-2: expand the top-k frontier by cumulative draft log-probability level
by level, then keep the best `verify` nodes of everything drafted (parents always outscore their children,
so the kept set is a tree). With `topk == 1` at temperature > 0 it drafts a sampled chain and returns q for
exact speculative sampling.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf

import torch

from tlt_stream.drafter.model import Drafter
from tlt_stream.rollout.acceptance import DraftTree
from tlt_stream.rollout.arms import Arm
from tlt_stream.rollout.proposers.base import Proposal

__all__ = ["EagleProposer"]


def _draft_probs(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """Drafter distribution at each row's temperature (temperature 0 rows: softmax at 1, used for ranking)."""
    t = torch.where(temperatures > 0, temperatures, torch.ones_like(temperatures)).to(logits)
    shape = (-1,) + (1,) * (logits.dim() - 1)
    return torch.softmax(logits.float() / t.view(shape), dim=-1)


class EagleProposer:
    """Drafts with an EAGLE drafter; owns the drafter's KV cache (slot-aligned with the target's)."""

    kinds = frozenset({"drafter"})
    """The arm kinds it drafts (`adaptive.arm_kinds`)."""

    def __init__(self, drafter: Drafter) -> None:
        self.drafter = drafter
        self._cache = None
        self._pending_tokens: dict[int, list[int]] = {}
        self._pending_features: dict[int, list[torch.Tensor]] = {}

    def allocate(self, max_batch: int, max_len: int) -> None:
        self._cache = self.drafter.new_cache(max_batch, max_len)

    @property
    def cache(self):
        if self._cache is None:
            raise RuntimeError("EagleProposer.allocate() was not called (the engine calls it)")
        return self._cache

    def reset_slot(self, slot: int, prompt: SequenceOf[int] = ()) -> None:
        self.cache.reset_slot(slot)
        self._pending_tokens[slot] = []
        self._pending_features[slot] = []

    def move_slot(self, src: int, dst: int) -> None:
        self.cache.move_slot(src, dst)
        self._pending_tokens[dst] = self._pending_tokens.pop(src, [])
        self._pending_features[dst] = self._pending_features.pop(src, [])

    def observe(self, slot: int, tokens: list[int], features: torch.Tensor) -> None:
        self._pending_tokens.setdefault(slot, []).extend(tokens)
        self._pending_features.setdefault(slot, []).append(features.reshape(len(tokens), -1))

    def observe_step(self, rows: list[int], tokens: list[int], features: torch.Tensor) -> None:
        per_row = features[:, None].unbind(0)  # B views of [1, H] in one call
        for row, token in zip(rows, tokens, strict=True):
            self._pending_tokens.setdefault(row, []).append(token)
            self._pending_features.setdefault(row, []).append(per_row[row])

    @torch.inference_mode()
    def propose(
        self, batch: int, arm: Arm, temperatures: torch.Tensor, generators: list[torch.Generator | None]
    ) -> Proposal:
        root_hidden = self._catch_up(batch)  # [B, H]: predicted feature at the last token's position
        root_logits = self.drafter.logits(root_hidden)  # [B, V]
        sampled_chain = arm.topk == 1 and bool((temperatures > 0).any())
        if sampled_chain:
            return self._chain(root_hidden, root_logits, arm, temperatures, generators)
        return self._tree(root_hidden, root_logits, arm, temperatures)

    @torch.inference_mode()
    def propose_tree(self, batch: int, arm: Arm, temperatures: torch.Tensor) -> DraftTree:
        """The top-k tree of point-mass candidates at any temperature (no sampled chain, so no q): what a
        tree merged with another source's candidates is built from."""
        root_hidden = self._catch_up(batch)
        return self._tree(root_hidden, self.drafter.logits(root_hidden), arm, temperatures).tree

    def _catch_up(self, batch: int) -> torch.Tensor:
        """Feed every row's pending (token, feature) pairs; return the last output per row `[B, H]`."""
        counts = [len(self._pending_tokens.get(b, [])) for b in range(batch)]
        if min(counts) == 0:
            raise RuntimeError("a row has no pending pair: every running sequence has emitted a token")
        c = max(counts)
        device = self.cache.lengths.device
        h = self.drafter.spec.hidden_size
        tokens = torch.zeros(batch, c, dtype=torch.long, device=device)
        features = torch.zeros(batch, c, h, dtype=self.drafter.fc.weight.dtype, device=device)
        for b in range(batch):
            tokens[b, : counts[b]] = torch.tensor(self._pending_tokens[b], device=device)
            features[b, : counts[b]] = torch.cat(self._pending_features[b]).to(features.dtype)
            self._pending_tokens[b] = []
            self._pending_features[b] = []
        num_new = torch.tensor(counts, device=device)
        positions = self.cache.lengths[:batch, None] + 1 + torch.arange(c, device=device)  # pair i -> x_{i+1}
        out = self.drafter(
            tokens, features, positions, self.cache, num_new=None if min(counts) == c else num_new
        )  # [B, C, H]
        self.cache.advance(num_new)
        return out[torch.arange(batch, device=device), num_new - 1]

    def _chain(
        self,
        hidden: torch.Tensor,
        logits: torch.Tensor,
        arm: Arm,
        temperatures: torch.Tensor,
        generators: list[torch.Generator | None],
    ) -> Proposal:
        """Sample `depth` tokens one after another; greedy rows take the argmax (q one-hot)."""
        b = hidden.shape[0]
        device = hidden.device
        greedy = (temperatures <= 0).to(device)
        tokens, qs = [], []
        base = self.cache.lengths[:b]
        uniforms = torch.stack(
            [
                torch.rand(arm.depth, generator=g, dtype=torch.float64)
                if g is not None
                else torch.zeros(arm.depth, dtype=torch.float64)
                for g in generators
            ]
        ).to(device)  # [B, depth]
        for level in range(arm.depth):
            q = _draft_probs(logits, temperatures)  # [B, V]
            u = uniforms[:, level].contiguous()
            sampled = torch.searchsorted(q.double().cumsum(-1), u[:, None], right=True)
            x = torch.where(greedy, logits.argmax(-1), sampled.squeeze(1).clamp(max=q.shape[-1] - 1))
            q = torch.where(greedy[:, None], torch.nn.functional.one_hot(x, q.shape[-1]).float(), q)
            tokens.append(x)
            qs.append(q)
            if level + 1 == arm.depth:
                break
            hidden = self.drafter(
                x[:, None], hidden[:, None], (base + 1 + level)[:, None], self.cache, spec_offset=level
            )[:, 0]
            logits = self.drafter.logits(hidden)
        return Proposal(DraftTree.chain(torch.stack(tokens, 1)), torch.stack(qs, 1))

    def _tree(self, hidden: torch.Tensor, logits: torch.Tensor, arm: Arm, temperatures: torch.Tensor) -> Proposal:
        b = hidden.shape[0]
        k = arm.topk
        device = hidden.device
        logq = torch.log(_draft_probs(logits, temperatures).clamp_min(1e-30))  # [B, V]
        scores, tokens = logq.topk(k, dim=-1)  # [B, k]
        cand_tokens, cand_scores, cand_parents, cand_levels = [tokens], [scores], [torch.zeros_like(tokens)], [1]
        frontier_ids = torch.arange(1, k + 1, device=device).expand(b, k)  # candidate ids (1-based)
        frontier_hidden = hidden[:, None].expand(b, k, hidden.shape[-1])  # parents' predicted features
        frontier_tokens, frontier_scores = tokens, scores
        anc = torch.eye(k, dtype=torch.bool, device=device).expand(b, k, k)  # [B, k, spec entries]
        base = self.cache.lengths[:b]
        next_id = k + 1
        for level in range(1, arm.depth):
            out = self.drafter(
                frontier_tokens,
                frontier_hidden,
                (base + level)[:, None].expand(b, k),
                self.cache,
                tree_mask=anc,
                spec_offset=(level - 1) * k,
            )  # [B, k, H]
            logq = torch.log(_draft_probs(self.drafter.logits(out), temperatures).clamp_min(1e-30))  # [B, k, V]
            child_scores, child_tokens = logq.topk(k, dim=-1)  # [B, k, k]
            child_scores = child_scores + frontier_scores[..., None]
            flat_scores = child_scores.reshape(b, k * k)
            flat_tokens = child_tokens.reshape(b, k * k)
            flat_parent = frontier_ids[..., None].expand(b, k, k).reshape(b, k * k)
            cand_tokens.append(flat_tokens)
            cand_scores.append(flat_scores)
            cand_parents.append(flat_parent)
            cand_levels.append(level + 1)
            ids = torch.arange(next_id, next_id + k * k, device=device).expand(b, k * k)
            next_id += k * k
            if level + 1 == arm.depth:
                break
            best = flat_scores.topk(k, dim=-1).indices  # [B, k] next frontier among the children
            parent_slot = best // k  # which frontier node each came from
            frontier_ids = ids.gather(1, best)
            frontier_tokens = flat_tokens.gather(1, best)
            frontier_scores = flat_scores.gather(1, best)
            frontier_hidden = out.gather(1, parent_slot[..., None].expand(b, k, out.shape[-1]))
            parent_anc = anc.gather(1, parent_slot[..., None].expand(b, k, anc.shape[-1]))
            anc = torch.cat([parent_anc, torch.eye(k, dtype=torch.bool, device=device).expand(b, k, k)], dim=-1)
        return Proposal(_select_tree(cand_tokens, cand_scores, cand_parents, cand_levels, arm.verify))


def _select_tree(
    tokens: list[torch.Tensor],
    scores: list[torch.Tensor],
    parents: list[torch.Tensor],
    levels: list[int],
    verify: int,
) -> DraftTree:
    """Keep the `verify` best candidates (ancestor-closed) and renumber them level by level, best first."""
    all_tokens = torch.cat(tokens, dim=1)  # [B, M]; candidate id i+1 at column i
    all_scores = torch.cat(scores, dim=1)
    all_parents = torch.cat(parents, dim=1)
    level_of = torch.cat([torch.full_like(t, lvl) for t, lvl in zip(tokens, levels, strict=True)], dim=1)
    b, m = all_tokens.shape
    n = min(verify, m)
    # Rank by score, ties to the shallower node, so a parent always ranks before its children.
    key = all_scores.double() - level_of.double() * 1e-9
    keep = key.topk(n, dim=-1).indices  # [B, n] candidate columns
    order_key = level_of.gather(1, keep).double() * 1e6 - key.gather(1, keep)
    keep = keep.gather(1, order_key.argsort(dim=1))  # level by level, best first within a level
    new_index = torch.zeros(b, m + 1, dtype=torch.long, device=all_tokens.device)  # candidate id -> node
    new_index.scatter_(1, keep + 1, torch.arange(1, n + 1, device=all_tokens.device).expand(b, n))
    kept_parents = all_parents.gather(1, keep)  # candidate ids (0 = root)
    node_parents = new_index.gather(1, kept_parents)
    return DraftTree(all_tokens.gather(1, keep), node_parents)
