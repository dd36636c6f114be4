"""Draft proposers: who guesses the next tokens for speculative decoding.

- `EagleProposer` drafts with the one-layer EAGLE drafter. It keeps its own KV cache in the same slots as
  the target's; every committed token reaches it as a (token, target feature) pair and is fed in one
  catch-up forward at the start of the next round, whose last output starts the draft. Trees follow
  EAGLE-2: expand the top-k frontier by cumulative draft log-probability level by level, then keep the
  best `verify` nodes of everything drafted (parents always outscore their children, so the kept set is a
  tree). With `topk == 1` at temperature > 0 it drafts a sampled chain and returns q for exact
  speculative sampling.
- `NgramProposer` is model-free prompt lookup: the tokens that followed the most recent earlier
  occurrence of the sequence's last n-gram, as a chain of point-mass candidates.

Both work on running rows 0..B-1 (the engine keeps active slots contiguous) and mirror slot moves.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from tlt_stream.drafter.model import Drafter, load_drafter
from tlt_stream.model.transformer import Transformer
from tlt_stream.rollout.acceptance import DraftTree
from tlt_stream.rollout.arms import Arm
from tlt_stream.rollout.suffix import SuffixAutomaton

__all__ = [
    "SOURCE_EAGLE",
    "SOURCE_GROUP",
    "EagleProposer",
    "GroupProposer",
    "MixedProposer",
    "NgramProposer",
    "OracleProposer",
    "Proposal",
    "Proposer",
    "build_proposer",
    "merge_trees",
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


def build_proposer(source: str, target: Transformer) -> Proposer:
    """`"ngram"` for prompt lookup, else the path of a drafter checkpoint to bind to `target`."""
    if source == "ngram":
        return NgramProposer()
    return EagleProposer(load_drafter(Path(source), target))


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
            tokens, lengths = _pad_chains([tokens for tokens, _ in chains])
            return Proposal(DraftTree.chain(tokens, lengths), sources=_chain_sources(tokens, lengths, SOURCE_GROUP))
        eagle = self.eagle.propose(batch, Arm.drafter(arm.depth, 1, arm.depth), temperatures, generators)
        e_tokens = eagle.tree.tokens.cpu()  # [B, d]: EAGLE's top-1 drafts are a chain, level by level
        d = e_tokens.shape[1]
        tokens, lengths = _pad_chains([chains[b][0] if strong[b] else e_tokens[b].tolist() for b in range(batch)])
        bits = torch.tensor([SOURCE_GROUP if s else SOURCE_EAGLE for s in strong], dtype=torch.uint8)
        sources = _chain_sources(tokens, lengths, 1) * bits[:, None]
        q = None
        if eagle.q is not None:  # EAGLE sampled its chains: the others' q are point masses at their tokens
            q = torch.nn.functional.one_hot(tokens, eagle.q.shape[-1]).to(eagle.q)
            for b in range(batch):
                if not strong[b]:
                    q[b, :d] = eagle.q[b]
        return Proposal(DraftTree.chain(tokens, lengths), q, sources)


def _pad_chains(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Chains of several lengths as `[B, width]` tokens (padded with 0) and their `[B]` lengths."""
    width = max(len(t) for t in rows)
    tokens = torch.tensor([t + [0] * (width - len(t)) for t in rows], dtype=torch.long)
    return tokens, torch.tensor([len(t) for t in rows])


def _chain_sources(tokens: torch.Tensor, lengths: torch.Tensor, bit: int) -> torch.Tensor:
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
