"""Drafts from the group itself: a suffix automaton over what a prompt's responses already wrote.

GRPO samples G responses to one prompt, and RL revisits prompts epoch after epoch; by the time the long tail
runs, most siblings have finished, and what they wrote is a cheap and often right guess for what the last
ones write next (Seer drafts from a group's responses; SPEC-RL, RhymeRL and DAS from earlier epochs'). This
is the index those drafts come from: a generalized suffix automaton (Blumer et al.) over a set of documents
that grow token by token, interleaved, as a batch's rows do. Each state is a class of substrings that end at
the same positions; its `count` is how many positions that is, over the documents kept. Appending a token
is the automaton's amortised O(1) extension plus one count per state on the new prefix's suffix-link path
(the distinct classes among its suffixes: a few for varied text, more for repetitive text), where a
depth-bounded suffix trie (SuffixDecoding's form, this module's first version) updated every suffix up to
its depth, dozens of node updates per token of every running row, on every decode step.

Removing a document walks its prefixes' suffix-link paths again and takes its counts back, so a state only a
removed document reached has count 0 and counts as absent; the automaton is rebuilt from the documents kept
once removed text outweighs them, so memory follows the documents kept (at most ~4x their tokens in states).

A draft for a row: the longest suffix of the row's own tokens (up to `max_match`) that occurs and that
something followed, then a best-first tree of what followed it, ranked by empirical probability (count of
the child over the counts of its siblings, multiplied down the path). Candidates under one node are distinct
tokens (the state's transitions), so the point-mass acceptance rule (`acceptance.accept_tree`) keeps decoding
lossless at any temperature: the drafts only change how many tokens a round accepts.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Sequence

__all__ = ["SuffixAutomaton"]

REBUILD_MIN = 256
"""Removed tokens below this never trigger a rebuild (a rebuild costs one extension per kept token)."""


class SuffixAutomaton:
    """Every substring of a set of documents, with occurrence counts, as a generalized suffix automaton.

    States are indices into parallel lists: `_len` (the longest substring of the class), `_link` (suffix
    link), `_next` (transitions, token -> state) and `_count` (end positions in the documents kept). State 0
    is the root (the empty string)."""

    def __init__(self, *, rebuild_min: int = REBUILD_MIN) -> None:
        self.rebuild_min = rebuild_min
        self._docs: dict[Hashable, list[int]] = {}
        self._reset()

    def _reset(self) -> None:
        self._len: list[int] = [0]
        self._link: list[int] = [-1]
        self._next: list[dict[int, int]] = [{}]
        self._count: list[int] = [0]
        self._ends: dict[Hashable, list[int]] = {}
        """Per document, the state of each of its prefixes (whose longest substring that prefix stays)."""
        self._dead = 0
        """Tokens of removed documents still in the automaton (their states hold count 0)."""

    @property
    def nodes(self) -> int:
        """States held (the root not counted): the automaton's memory, a list slot each and a small dict."""
        return len(self._len) - 1

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
        last = ends[-1] if ends else 0
        for token in tokens:
            token = int(token)
            last = self._append(last, token)
            ends.append(last)
            text.append(token)

    def _append(self, last: int, c: int) -> int:
        """Extend the prefix whose state is `last` by token `c`; the new prefix's state (its counts taken)."""
        length, link, nxt, count = self._len, self._link, self._next, self._count
        q = nxt[last].get(c)
        if q is not None:  # the longer prefix already occurs (in another document): reuse or split its class
            end = q if length[q] == length[last] + 1 else self._split(last, q, c)
        else:
            end = len(length)
            length.append(length[last] + 1)
            link.append(0)
            nxt.append({})
            count.append(0)
            p = last
            while p != -1 and c not in nxt[p]:
                nxt[p][c] = end
                p = link[p]
            if p != -1:
                q = nxt[p][c]
                link[end] = q if length[p] + 1 == length[q] else self._split(p, q, c)
        state = end
        while state > 0:  # one more end position for every class on the new prefix's suffix-link path
            count[state] += 1
            state = link[state]
        return end

    def _split(self, p: int, q: int, c: int) -> int:
        """Split state `q`: its substrings of at most len(p) + 1 tokens (reached from `p` by `c`) become a new
        state, q's suffix link; the new state (same end positions as q so far)."""
        length, link, nxt, count = self._len, self._link, self._next, self._count
        clone = len(length)
        length.append(length[p] + 1)
        link.append(link[q])
        nxt.append(dict(nxt[q]))
        count.append(count[q])
        while p != -1 and nxt[p].get(c) == q:
            nxt[p][c] = clone
            p = link[p]
        link[q] = clone
        return clone

    def remove(self, doc: Hashable) -> None:
        """Forget document `doc`: every count it added is taken back; rebuilt once removed text dominates."""
        text = self._docs.pop(doc)
        link, count = self._link, self._count
        for state in self._ends.pop(doc):
            while state > 0:
                count[state] -= 1
                state = link[state]
        self._dead += len(text)
        if self._dead > max(self.rebuild_min, sum(map(len, self._docs.values()))):
            self._rebuild()

    def _rebuild(self) -> None:
        docs = self._docs
        self._docs = {}
        self._reset()
        for doc, text in docs.items():
            self.extend(doc, text)

    def count(self, pattern: Sequence[int]) -> int:
        """Occurrences of `pattern` (non-empty) in the documents kept."""
        state = self._find(pattern)
        return self._count[state] if state > 0 else 0

    def _find(self, pattern: Sequence[int]) -> int:
        """The state of `pattern` (0: empty; -1: absent from the documents kept)."""
        state, nxt, count = 0, self._next, self._count
        for token in pattern:
            state = nxt[state].get(int(token), -1)
            if state < 0 or count[state] == 0:
                return -1
        return state

    def _live(self, state: int) -> bool:
        """Whether something in the documents kept followed `state`'s substrings."""
        count = self._count
        return any(count[t] for t in self._next[state].values())

    def match(self, context: Sequence[int], max_match: int, min_match: int = 1) -> tuple[int | None, int]:
        """The state of the longest suffix of `context` (at most `max_match` tokens, at least `min_match`)
        that occurs and that some token followed, and its length; (None, 0) when there is none."""
        length, link, nxt, count = self._len, self._link, self._next, self._count
        state, matched = 0, 0
        for token in context[len(context) - min(max_match, len(context)) :]:
            token = int(token)
            while True:
                t = nxt[state].get(token, -1)
                if t >= 0 and count[t]:
                    state, matched = t, matched + 1
                    break
                if state == 0:
                    matched = 0
                    break
                state = link[state]
                matched = length[state]
        while matched >= min_match and not self._live(state):  # no continuation: a shorter suffix may have one
            if state == 0:
                break
            state = link[state]
            matched = length[state]
        if matched < min_match or not self._live(state):
            return None, 0
        return state, matched

    def chain(
        self, context: Sequence[int], *, length: int, max_match: int = 12, min_match: int = 1
    ) -> tuple[list[int], int]:
        """The most frequent continuation after `context`, token by token, at most `length` tokens (ties: the
        continuation seen first); (tokens, match length). Empty when nothing matches."""
        state, matched = self.match(context, max_match, min_match)
        tokens: list[int] = []
        if state is None:
            return tokens, 0
        nxt, count = self._next, self._count
        while len(tokens) < length:
            best, best_state, best_count = -1, -1, 0
            for token, t in nxt[state].items():
                if count[t] > best_count:
                    best, best_state, best_count = token, t, count[t]
            if best_state < 0:
                break
            tokens.append(best)
            state = best_state
        return tokens, matched

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
        state, matched = self.match(context, max_match, min_match)
        if state is None:
            return [], [], 0
        nxt, count = self._next, self._count
        tokens: list[int] = []
        parents: list[int] = []
        heap: list[tuple[float, int, int, int, int, int]] = []  # (-prob, tie, token, parent index, level, state)
        tie = 0

        def push(parent_index: int, level: int, at: int, prob: float) -> None:
            nonlocal tie
            children = [(token, t, count[t]) for token, t in nxt[at].items() if count[t]]
            total = sum(n for _, _, n in children)
            for token, t, n in children:
                p = prob * n / total
                if p >= min_prob:
                    heapq.heappush(heap, (-p, tie, token, parent_index, level, t))
                    tie += 1

        push(0, 1, state, 1.0)
        while heap and len(tokens) < budget:
            negative, _, token, parent_index, level, at = heapq.heappop(heap)
            tokens.append(token)
            parents.append(parent_index)
            if level < depth:
                push(len(tokens), level + 1, at, -negative)
        return tokens, parents, matched
