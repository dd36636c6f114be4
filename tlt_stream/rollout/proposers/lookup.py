"""Model-free draft sources: prompt lookup (`NgramProposer`: the tokens that followed the most recent earlier
occurrence of the sequence's last n-gram, as a chain of point-mass candidates) and, for tests and the
speculative path's own overhead, an oracle that proposes known continuations (`OracleProposer`)."""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf

import torch

from tlt_stream.rollout.acceptance import DraftTree
from tlt_stream.rollout.arms import Arm
from tlt_stream.rollout.proposers.base import Proposal, pad_trees

__all__ = ["NgramProposer", "OracleProposer"]


class NgramProposer:
    """Prompt lookup: propose what followed the latest earlier occurrence of the last n tokens."""

    kinds = frozenset({"ngram"})

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self._history: dict[int, list[int]] = {}
        self._index: dict[int, dict[tuple[int, ...], int]] = {}

    def allocate(self, max_batch: int, max_len: int) -> None:
        """Nothing to allocate: the n-gram index lives in Python."""

    def reset_slot(self, slot: int, prompt: SequenceOf[int] = ()) -> None:
        self._history[slot] = []
        self._index[slot] = {}

    def move_slot(self, src: int, dst: int) -> None:
        self._history[dst] = self._history.pop(src, [])
        self._index[dst] = self._index.pop(src, {})

    def observe_step(self, rows: list[int], tokens: list[int], features: torch.Tensor) -> None:
        for row, token in zip(rows, tokens, strict=True):
            self.observe(row, [token])

    def observe(self, slot: int, tokens: list[int], features: torch.Tensor | None = None) -> None:
        """Index the committed tokens (the features are not needed)."""
        history = self._history.setdefault(slot, [])
        index = self._index.setdefault(slot, {})
        for token in tokens:
            history.append(token)
            end = len(history)
            # Index n-grams ending one token *before* the end, so a lookup of the current suffix finds an
            # earlier occurrence followed by at least one token.
            for n in range(self.min_ngram, self.max_ngram + 1):
                if end - 1 >= n:
                    index[tuple(history[end - 1 - n : end - 1])] = end - 1

    def lookup(self, slot: int, depth: int) -> list[int]:
        history = self._history.get(slot, [])
        index = self._index.get(slot, {})
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if len(history) < n:
                continue
            follow = index.get(tuple(history[-n:]))
            if follow is not None:
                return history[follow : follow + depth]
        return []

    def propose(
        self, batch: int, arm: Arm, temperatures: torch.Tensor, generators: list[torch.Generator | None]
    ) -> Proposal:
        """A chain of up to `depth` looked-up tokens per row, as point-mass candidates; rows with a shorter
        (or no) match are padded with padding nodes (parent -1)."""
        depth = arm.depth
        rows = [self.lookup(b, depth) for b in range(batch)]
        width = max(1, max(len(r) for r in rows))
        tokens = torch.zeros(batch, width, dtype=torch.long)
        for b, row in enumerate(rows):
            tokens[b, : len(row)] = torch.tensor(row, dtype=torch.long)
        return Proposal(DraftTree.chain(tokens, torch.tensor([len(r) for r in rows])))


class OracleProposer:
    """Proposes known continuations: the right token at every level, optionally hidden among `topk - 1`
    random wrong siblings. For tests (deep acceptance, KV compaction) and for measuring the speculative
    path's own overhead (an always-right drafter bounds what SD can gain). `references` maps a prompt
    without its first token to the target's greedy continuation."""

    def __init__(self, references: dict[tuple[int, ...], list[int]], vocab_size: int, seed: int = 0) -> None:
        self.references = references
        self.vocab_size = vocab_size
        self.history: dict[int, list[int]] = {}
        self.rng = torch.Generator().manual_seed(seed)

    def allocate(self, max_batch: int, max_len: int) -> None:
        """Nothing to allocate."""

    def reset_slot(self, slot: int, prompt: SequenceOf[int] = ()) -> None:
        self.history[slot] = []

    def move_slot(self, src: int, dst: int) -> None:
        self.history[dst] = self.history.pop(src)

    def observe(self, slot: int, tokens: list[int], features: torch.Tensor | None = None) -> None:
        self.history[slot].extend(tokens)

    def observe_step(self, rows: list[int], tokens: list[int], features: torch.Tensor) -> None:
        for row, token in zip(rows, tokens, strict=True):
            self.history[row].append(token)

    def _continuation(self, slot: int) -> list[int]:
        seen = self.history[slot]
        for key, reference in self.references.items():
            if seen[: len(key)] == list(key):
                return reference[len(seen) - len(key) :]
        raise KeyError(f"slot {slot}: no reference continuation for this prompt")

    def propose(
        self, batch: int, arm: Arm, temperatures: torch.Tensor, generators: list[torch.Generator | None]
    ) -> Proposal:
        rows: list[tuple[list[int], list[int]]] = []
        for slot in range(batch):
            upcoming = self._continuation(slot)  # what follows the last emitted token (the root)
            tokens: list[int] = []
            parents: list[int] = []
            parent = 0
            for level in range(arm.depth):
                right = upcoming[level] if level < len(upcoming) else 0
                wrong = [int(t) for t in torch.randint(0, self.vocab_size, (arm.topk - 1,), generator=self.rng)]
                siblings = [t for t in wrong if t != right]
                siblings.insert(int(torch.randint(0, len(siblings) + 1, (), generator=self.rng)), right)
                first = len(tokens) + 1
                tokens += siblings
                parents += [parent] * len(siblings)
                parent = first + siblings.index(right)
            rows.append((tokens[: arm.verify], parents[: arm.verify]))
        proposal = pad_trees(rows)
        if arm.topk == 1:  # chains: the vectorised acceptance path
            return Proposal(DraftTree.chain(proposal.tree.tokens, torch.tensor([len(t) for t, _ in rows])))
        return proposal
