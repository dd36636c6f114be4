"""Drafts from the group itself: a depth-bounded suffix trie over what a prompt's responses already wrote.

GRPO samples G responses to one prompt, and RL revisits prompts epoch after epoch; by the time the long tail
runs, most siblings have finished, and what they wrote is a cheap and often right guess for what the last
ones write next (Seer drafts from a group's responses; SPEC-RL, RhymeRL and DAS from earlier epochs'). This
is the index those drafts come from, in the form SuffixDecoding uses: every substring of at most
`max_depth` tokens of every indexed document is a path from the root, and each node counts how often its
substring occurred. Appending a token updates the `max_depth` suffixes that end at it (O(max_depth)), so
running responses are indexed as they grow; removing a document walks its substrings again and frees the
nodes no other document holds (memory is bounded by the documents kept).

A draft for a row: the longest suffix of the row's own tokens (up to `max_match`) that the trie holds and
that something followed, then a best-first tree of what followed it, ranked by empirical probability
(count of the child over the counts of its siblings, multiplied down the path). Candidates under one node
are distinct tokens (the trie's children), so the point-mass acceptance rule (`acceptance.accept_tree`)
keeps decoding lossless at any temperature: the drafts only change how many tokens a round accepts.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Sequence

__all__ = ["SuffixTrie"]


class _Node:
    __slots__ = ("children", "count")

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, _Node] = {}


class SuffixTrie:
    """Substrings (up to `max_depth` tokens) of a set of documents, with occurrence counts."""

    def __init__(self, max_depth: int = 24) -> None:
        if max_depth < 2:
            raise ValueError(f"max_depth must be >= 2, got {max_depth}")
        self.max_depth = max_depth
        self.root = _Node()
        self.nodes = 0
        """Nodes held (the root not counted): the trie's memory, about 200 bytes each in CPython."""
        self._docs: dict[Hashable, list[int]] = {}
        self._ends: dict[Hashable, list[_Node]] = {}
        """Per document, the nodes of its suffixes of length 1, 2, ... that end at its last token."""

    def __contains__(self, doc: Hashable) -> bool:
        return doc in self._docs

    @property
    def documents(self) -> list[Hashable]:
        """Document ids, oldest first."""
        return list(self._docs)

    def tokens(self, doc: Hashable) -> list[int]:
        return self._docs[doc]

    def extend(self, doc: Hashable, tokens: Sequence[int]) -> None:
        """Append `tokens` to document `doc` (created when new) and index every new substring."""
        text = self._docs.setdefault(doc, [])
        ends = self._ends.setdefault(doc, [])
        limit = self.max_depth - 1
        root = self.root
        for token in tokens:
            token = int(token)
            grown = []
            for node in (root, *ends[:limit]):
                child = node.children.get(token)
                if child is None:
                    child = node.children[token] = _Node()
                    self.nodes += 1
                child.count += 1
                grown.append(child)
            ends = grown
            text.append(token)
        self._ends[doc] = ends

    def remove(self, doc: Hashable) -> None:
        """Forget document `doc`: every substring count it added is taken back, unused nodes freed."""
        text = self._docs.pop(doc)
        self._ends.pop(doc, None)
        depth = self.max_depth
        for start in range(len(text)):
            node = self.root
            for token in text[start : start + depth]:
                child = node.children[token]
                child.count -= 1
                if child.count == 0:  # its whole subtree counted only this document's occurrences
                    del node.children[token]
                    self.nodes -= _size(child)
                    break
                node = child

    def match(self, context: Sequence[int], max_match: int, min_match: int = 1) -> tuple[_Node | None, int]:
        """The node of the longest suffix of `context` (at most `max_match` tokens, at least `min_match`)
        that the trie holds and that some token followed, and its length; (None, 0) when there is none."""
        longest = min(max_match, len(context), self.max_depth - 1)
        # Present suffixes are nested (a suffix of a present one is present): find the longest, then walk
        # down to shorter ones until one has a continuation.
        lo, hi = 0, longest
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._find(context[len(context) - mid :]) is not None:
                lo = mid
            else:
                hi = mid - 1
        for length in range(lo, min_match - 1, -1):
            node = self._find(context[len(context) - length :]) if length else self.root
            if node is not None and node.children:
                return node, length
        return None, 0

    def _find(self, pattern: Sequence[int]) -> _Node | None:
        node = self.root
        for token in pattern:
            node = node.children.get(int(token))
            if node is None:
                return None
        return node

    def draft(
        self,
        context: Sequence[int],
        *,
        depth: int,
        budget: int,
        max_match: int = 12,
        min_match: int = 1,
        min_prob: float = 0.0,
    ) -> tuple[list[int], list[int], int]:
        """A draft tree after `context`: (tokens, parents, match length). Node i (1-based) holds tokens[i-1]
        and its parent parents[i-1] < i (0 is the root, the context's last token); children of one node are
        distinct and come best first. At most `budget` nodes, `depth` levels, each of empirical probability
        (along its path) at least `min_prob`."""
        if budget < 1 or depth < 1:
            return [], [], 0
        node, matched = self.match(context, max_match, min_match)
        if node is None:
            return [], [], 0
        depth = min(depth, self.max_depth - matched)
        tokens: list[int] = []
        parents: list[int] = []
        heap: list[tuple[float, int, int, int, _Node]] = []  # (-prob, tie, parent index, level, node)
        tie = 0

        def push(parent_index: int, level: int, at: _Node, prob: float) -> None:
            nonlocal tie
            total = sum(child.count for child in at.children.values())
            for token, child in at.children.items():
                p = prob * child.count / total
                if p >= min_prob:
                    heapq.heappush(heap, (-p, tie, parent_index, level, child))
                    tokens_of[tie] = token
                    tie += 1

        tokens_of: dict[int, int] = {}
        push(0, 1, node, 1.0)
        while heap and len(tokens) < budget:
            negative, key, parent_index, level, child = heapq.heappop(heap)
            tokens.append(tokens_of.pop(key))
            parents.append(parent_index)
            if level < depth and child.children:
                push(len(tokens), level + 1, child, -negative)
        return tokens, parents, matched


def _size(node: _Node) -> int:
    """Nodes in the subtree rooted at `node`, itself included."""
    count, stack = 0, [node]
    while stack:
        here = stack.pop()
        count += 1
        stack.extend(here.children.values())
    return count
