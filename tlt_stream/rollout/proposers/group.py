"""Drafts from the group itself: the responses to the row's own prompt (`rollout.suffix`)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass

import torch

from tlt_stream.rollout.arms import Arm
from tlt_stream.rollout.proposers.base import SOURCE_GROUP, Proposal, pad_trees
from tlt_stream.rollout.suffix import SuffixAutomaton

__all__ = ["GroupProposer"]


@dataclass
class _GroupRow:
    index: SuffixAutomaton
    doc: int
    history: list[int]
    """The row's prompt and response so far: the context a draft continues."""
    skip: int
    """Prompt tokens still to come through `observe` (the engine observes prompt[1:] + response)."""


class GroupProposer:
    """Drafts from the responses to the row's own prompt (`rollout.suffix`): its group's running and finished
    siblings, earlier steps' and epochs' responses to the same prompt, and the row's own prompt and response.
    The index is one suffix automaton per prompt (keyed by the prompt's tokens, so siblings and later visits
    of the prompt share it), kept in an LRU cache bounded by `max_nodes` automaton states and `max_docs`
    responses per prompt. Model-free: a draft costs Python dictionary walks, no forward."""

    def __init__(
        self,
        *,
        max_match: int = 12,
        min_match: int = 1,
        min_prob: float = 0.0,
        max_nodes: int = 500_000,
        max_docs: int = 64,
        strong_match: int = 4,
    ) -> None:
        if not 1 <= min_match <= max_match:
            raise ValueError(f"need 1 <= min_match <= max_match, got {min_match}, {max_match}")
        if strong_match < 1:
            raise ValueError(f"strong_match must be >= 1, got {strong_match}")
        self.max_match, self.min_match, self.min_prob = max_match, min_match, min_prob
        self.strong_match = strong_match
        """Match length (tokens) from which an `either` arm takes the group's chain instead of the drafter's."""
        self.max_nodes, self.max_docs = max_nodes, max_docs
        self.indexes: OrderedDict[tuple[int, ...], SuffixAutomaton] = OrderedDict()
        self.kinds = frozenset({"group"})
        """The arm kinds it drafts."""
        self._rows: dict[int, _GroupRow] = {}
        self._next_doc = 0

    @property
    def nodes(self) -> int:
        """Automaton states held over every cached prompt."""
        return sum(index.nodes for index in self.indexes.values())

    def allocate(self, max_batch: int, max_len: int) -> None:
        """Nothing to allocate: the indexes grow with what is indexed."""

    def reset_slot(self, slot: int, prompt: SequenceOf[int] = ()) -> None:
        key = tuple(int(t) for t in prompt)
        index, doc = self._new_response(key, ())
        self._rows[slot] = _GroupRow(index, doc, list(key), max(0, len(key) - 1))
        self._bound(index)

    def remember(self, prompt: SequenceOf[int], response: SequenceOf[int]) -> None:
        """A finished response to `prompt` produced elsewhere (another worker, an earlier run): history the
        prompt's next rows draft from."""
        index, _ = self._new_response(tuple(int(t) for t in prompt), [int(t) for t in response])
        self._bound(index)

    def _new_response(self, key: tuple[int, ...], response: SequenceOf[int]) -> tuple[SuffixAutomaton, int]:
        """A new document in the index of prompt `key` (created, with the prompt itself as a document: the
        row's own context, prompt lookup), holding `response` after the prompt's tail, so that a sibling's
        first tokens are found after it; (the index, the document's id)."""
        index = self.indexes.get(key)
        if index is None:
            index = self.indexes[key] = SuffixAutomaton()
            index.extend("prompt", key)
        self.indexes.move_to_end(key)
        doc = self._next_doc
        self._next_doc += 1
        index.extend(doc, [*key[-self.max_match :], *response])
        return index, doc

    def _bound(self, current: SuffixAutomaton) -> None:
        live = {row.doc for row in self._rows.values() if row.index is current}
        in_use = {id(row.index) for row in self._rows.values()}
        finished = [d for d in current.documents if d != "prompt" and d not in live]
        for doc in finished[: max(0, len(finished) - self.max_docs)]:  # the oldest responses go first
            current.remove(doc)
        total = self.nodes
        for key in list(self.indexes):
            if total <= self.max_nodes:
                break
            index = self.indexes[key]
            if id(index) not in in_use:  # a prompt no running row uses, least recently started first
                total -= index.nodes
                del self.indexes[key]

    def move_slot(self, src: int, dst: int) -> None:
        self._rows[dst] = self._rows.pop(src)

    def observe(self, slot: int, tokens: list[int], features: torch.Tensor | None = None) -> None:
        row = self._rows[slot]
        if row.skip:
            n = min(row.skip, len(tokens))
            tokens, row.skip = tokens[n:], row.skip - n
        if tokens:
            row.history.extend(tokens)
            row.index.extend(row.doc, tokens)

    def observe_step(self, rows: list[int], tokens: list[int], features: torch.Tensor) -> None:
        for row, token in zip(rows, tokens, strict=True):
            self.observe(row, [token])

    def drafts(self, batch: int, depth: int, budget: int) -> list[tuple[list[int], list[int]]]:
        """(tokens, parents) per running row 0..batch-1."""
        out = []
        for slot in range(batch):
            row = self._rows[slot]
            tokens, parents, _ = row.index.draft(
                row.history,
                depth=depth,
                budget=budget,
                max_match=self.max_match,
                min_match=self.min_match,
                min_prob=self.min_prob,
            )
            out.append((tokens, parents))
        return out

    contexts = 3
    """Levels of `context`."""

    def context(self, batch: int) -> int:
        """How well running rows 0..batch-1 follow what the prompt's responses wrote, before a step: per row 0
        (its last tokens match less than half `strong_match` tokens of something that was continued), 1 (less
        than `strong_match`) or 2, the rows' mean rounded. The adaptive tuner judges arms per level: a group
        arm's speed depends on it for as long as a row follows a sibling. It reads committed tokens only, so
        an arm chosen by it keeps decoding lossless."""
        half = max(1, self.strong_match // 2)
        total = 0
        for slot in range(batch):
            row = self._rows[slot]
            _, matched = row.index.match(row.history, self.max_match, self.min_match)
            total += 2 if matched >= self.strong_match else 1 if matched >= half else 0
        return (2 * total + batch) // (2 * batch)  # the mean, halves rounded up

    def chains(self, batch: int, length: int) -> list[tuple[list[int], int]]:
        """(most frequent continuation of at most `length` tokens, match length) per running row."""
        return [
            self._rows[slot].index.chain(
                self._rows[slot].history, length=length, max_match=self.max_match, min_match=self.min_match
            )
            for slot in range(batch)
        ]

    def propose(
        self, batch: int, arm: Arm, temperatures: torch.Tensor, generators: list[torch.Generator | None]
    ) -> Proposal:
        rows = self.drafts(batch, arm.depth, arm.verify)
        return pad_trees(rows, [[SOURCE_GROUP] * len(t) for t, _ in rows])
