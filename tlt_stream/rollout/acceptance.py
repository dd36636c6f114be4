"""Lossless acceptance of speculative drafts: which drafted tokens the target keeps, and the next token.

Two proposal kinds, each exact (the emitted tokens follow the target distribution p, whatever the drafter):

- **sampled chain**: draft tokens x_i ~ q_i. Accept x_i with probability min(1, p_i(x_i) / q_i(x_i)); on the
  first rejection sample from norm(max(p_i - q_i, 0)) and stop; if all d are accepted, sample a bonus
  token from p_{d+1}.
- **deterministic tree**: every node's children are point-mass proposals (top-k expansions). At a node,
  try the children in order: accept child x with probability p(x) under the current residual p; on
  rejection set p(x) = 0 and renormalise, then try the next child; when all fail (or the node is a leaf)
  sample from the residual and stop. P(emit y) = p(y) for every y, by induction over the siblings. A token
  that appears twice under one node (merged draft sources) is tried once: its second copy has residual 0.

Greedy rows (temperature 0) use the one-hot argmax of the target: the same rules then accept a candidate
exactly when it is the target's argmax, which makes greedy speculative output token-identical to plain
greedy decoding. Randomness comes from caller-supplied uniforms, so the functions are pure.
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = [
    "DraftTree",
    "TreeStructure",
    "Verdict",
    "accept_chain",
    "accept_tree",
    "greedy_onehot",
    "sample_from",
    "tree_structure",
]


@dataclass(frozen=True)
class TreeStructure:
    """What a draft tree's shape (its `parents`) determines, independent of its tokens. Shapes repeat from
    round to round (a draft source at fixed depth and width, a chain of a given length), so each distinct
    shape is built once and shared (`tree_structure`): the tensors are read-only by contract."""

    ancestor_mask: torch.Tensor
    """`[B, N+1, N+1]` bool: entry (i, j) is True when node j is node i or one of its ancestors."""
    depths: torch.Tensor
    """`[B, N+1]` depth of every node (root 0, its children 1; padding nodes 0)."""
    children: torch.Tensor
    """`[B, N+1, K]` children of each node (root included) in try order, padded with -1."""
    chain_lengths: torch.Tensor | None
    """`[B]` real nodes per row when every row is a chain (padding only at its end), else None."""


class _ShapeCache:
    """A bounded LRU of structures by shape, shared by every engine of the process (threads included). Only
    small batches are kept (at most `max_nodes` nodes over the batch): they are the ones whose shapes
    repeat, and whose round is short enough for the build to matter; the bound keeps memory to a few MB."""

    def __init__(self, max_entries: int = 512, max_nodes: int = 256) -> None:
        self.max_entries, self.max_nodes = max_entries, max_nodes
        self._entries: OrderedDict[tuple, Any] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple, nodes: int, build: Callable[[], Any]) -> Any:
        if nodes > self.max_nodes:
            return build()
        with self._lock:
            found = self._entries.get(key)
            if found is not None:
                self._entries.move_to_end(key)
                return found
        found = build()
        with self._lock:
            self._entries[key] = found
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
        return found


_structures = _ShapeCache()
"""Tree structures by the parents' device, dtype, shape and bytes."""
_chains = _ShapeCache()
"""Chains (their parents and structure) by device, batch, nodes and lengths."""


def tree_structure(parents: torch.Tensor) -> TreeStructure:
    """The structure of a tree with `parents [B, N]`, built on the first sight of this shape (`_ShapeCache`).
    A key costs one small host copy of `parents`."""
    key = (parents.device, parents.dtype, tuple(parents.shape), parents.cpu().numpy().tobytes())
    return _structures.get(key, parents.numel(), lambda: build_structure(parents))


def build_structure(parents: torch.Tensor) -> TreeStructure:
    """`TreeStructure` of `parents [B, N]` computed afresh (what `tree_structure` caches), on the host: one
    numpy row update per node (`parents[b, i-1] < i`, so a node's parent row is complete before its own)."""
    par = parents.cpu().numpy()
    b, n = par.shape
    node = np.arange(n + 1)
    mask = np.zeros((b, n + 1, n + 1), dtype=bool)
    mask[:, node, node] = True
    for i in range(1, n + 1):
        rows = np.flatnonzero(par[:, i - 1] >= 0)
        mask[rows, i] |= mask[rows, par[rows, i - 1]]  # node i sees itself and its parent's ancestors
    is_child = par[:, None, :] == node[None, :, None]  # [B, N+1, N]
    k = max(1, int(is_child.sum(-1).max()))
    order = np.sort(np.where(is_child, node[1:], n + 1), axis=-1)[..., :k]  # [B, N+1, K] in node order
    children = np.where(order <= n, order, -1)
    real = par >= 0
    is_chain = bool(((par == node[None, :-1]) | ~real).all()) and bool((real[:, :-1] >= real[:, 1:]).all())
    device = parents.device
    return TreeStructure(
        torch.from_numpy(mask).to(device),
        torch.from_numpy(mask.sum(-1) - 1).to(device),
        torch.from_numpy(children).to(device),
        torch.from_numpy(real.sum(1)).to(device) if is_chain else None,
    )


def _chain(b: int, n: int, lengths: torch.Tensor | None, device: torch.device) -> tuple[torch.Tensor, TreeStructure]:
    """Parents and structure of a chain per row whose first `lengths[b]` nodes are real (cached by shape)."""
    key = (device, b, n, None if lengths is None else tuple(lengths.tolist()))
    return _chains.get(key, b * n, lambda: _build_chain(b, n, lengths, device))


def _build_chain(
    b: int, n: int, lengths: torch.Tensor | None, device: torch.device
) -> tuple[torch.Tensor, TreeStructure]:
    node = torch.arange(n + 1, device=device)
    limit = lengths.to(device)[:, None] if lengths is not None else torch.full((b, 1), n, device=device)
    real = node[None, :] <= limit  # [B, N+1], root included
    parents = torch.where(real[:, 1:], node[None, :-1], torch.full_like(node[None, :-1], -1)).expand(b, n)
    causal = node[None, :, None] >= node[None, None, :]  # [1, N+1, N+1]
    mask = (causal & real[:, :, None] & real[:, None, :]) | torch.eye(n + 1, dtype=torch.bool, device=device)
    depths = torch.where(real, node[None, :], torch.zeros_like(node[None, :]))
    children = torch.where(real[:, 1:], node[None, 1:], torch.full_like(node[None, 1:], -1))  # [B, N]
    children = torch.cat([children, torch.full((b, 1), -1, device=device, dtype=children.dtype)], dim=1)
    return parents.contiguous(), TreeStructure(mask, depths, children[..., None], real[:, 1:].sum(1))


@dataclass(frozen=True)
class DraftTree:
    """Drafted nodes per row. Node 0 is the root (the last committed token, not a candidate); nodes
    1..N are candidates with `parents[b, i-1] < i`, ordered so that siblings appear in the order they are
    tried (best first). A parent of -1 marks a padding node (rows with fewer drafts than the batch's
    widest): it is never a candidate and sees only itself."""

    tokens: torch.Tensor
    """`[B, N]` candidate token of node i (at column i-1)."""
    parents: torch.Tensor
    """`[B, N]` parent node index of node i, in 0..i-1."""

    @classmethod
    def chain(cls, tokens: torch.Tensor, lengths: torch.Tensor | None = None) -> DraftTree:
        """A chain per row (node i's parent is node i-1) whose first `lengths[b]` nodes are real; the
        structure is known, so it is built directly (once per shape)."""
        b, n = tokens.shape
        parents, structure = _chain(b, n, lengths, tokens.device)
        tree = cls(tokens, parents)
        tree.__dict__["structure"] = structure
        return tree

    @functools.cached_property
    def structure(self) -> TreeStructure:
        return tree_structure(self.parents)

    @property
    def chain_lengths(self) -> torch.Tensor | None:
        """`[B]` real nodes per row when every row is a chain (padding only at its end), else None."""
        return self.structure.chain_lengths

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]

    @property
    def ancestor_mask(self) -> torch.Tensor:
        """`[B, N+1, N+1]` bool: entry (i, j) is True when node j is node i or one of its ancestors."""
        return self.structure.ancestor_mask

    @property
    def depths(self) -> torch.Tensor:
        """`[B, N+1]` depth of every node (root 0, its children 1; padding nodes 0)."""
        return self.structure.depths

    @property
    def children(self) -> torch.Tensor:
        """`[B, N+1, K]` children of each node (root included) in try order, padded with -1."""
        return self.structure.children


@dataclass(frozen=True)
class Verdict:
    """The outcome of one verification, per row."""

    path: torch.Tensor
    """`[B, A]` accepted node indices in order (padded with 0 past `count`)."""
    count: torch.Tensor
    """`[B]` number of accepted drafted tokens."""
    next_token: torch.Tensor
    """`[B]` the token sampled after the accepted path (residual sample or bonus)."""
    next_from: torch.Tensor
    """`[B]` node whose target distribution `next_token` was drawn from (the last accepted node, or 0)."""


def greedy_onehot(logits: torch.Tensor) -> torch.Tensor:
    """The point-mass target distribution of greedy decoding: one-hot argmax of `logits [..., V]`."""
    probs = torch.zeros_like(logits, dtype=torch.float32)
    return probs.scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)


def sample_from(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw from unnormalised non-negative `weights [B, V]` with `uniforms [B]` in [0, 1)."""
    cdf = weights.double().cumsum(dim=-1)  # [B, V]
    x = uniforms.to(cdf)[:, None] * cdf[:, -1:]
    return torch.searchsorted(cdf, x, right=True).squeeze(1).clamp_(max=weights.shape[-1] - 1)


HOST_WALK_ROWS = 16
"""CPU batches of at most this many rows walk a tree in Python over one host copy of the candidates'
probabilities (`_walk_tree`: a quarter of `_judge_tree`'s tensor ops, cheaper where per-op overhead
dominates); larger batches and accelerators judge every node at once, with no host round trip."""


def accept_tree(
    p: torch.Tensor, tree: DraftTree, sibling_u: torch.Tensor, residual_u: torch.Tensor, *, walk: bool | None = None
) -> Verdict:
    """Accept point-mass candidates down the tree by the residual rule.

    `p [B, N+1, V]`: the target's distribution at the root (index 0) and at every node (probabilities at
    the sampling temperature; one-hot for greedy rows). `sibling_u [B, N+1, K]` and `residual_u [B]` are
    independent uniforms in [0, 1): child j of node a is tried with `sibling_u[b, a, j]`. `walk` picks the
    host walk (True) or the loop-free form (False); None: by device and batch (`HOST_WALK_ROWS`). Both take
    the same path with the same uniforms (up to float rounding at a threshold).
    """
    if walk is None:
        walk = p.device.type == "cpu" and p.shape[0] <= HOST_WALK_ROWS
    return (_walk_tree if walk else _judge_tree)(p, tree, sibling_u, residual_u)


def _walk_tree(p: torch.Tensor, tree: DraftTree, sibling_u: torch.Tensor, residual_u: torch.Tensor) -> Verdict:
    """The walk from the root in plain Python: at the current node, try its children in order (child x
    passes when u * (1 - mass of the siblings tried before it) < p(x)), move to the first that passes, stop
    when none does; then sample from p at the walk's end without every tried candidate."""
    b = p.shape[0]
    device = p.device
    rows = torch.arange(b, device=device)
    mass = p[rows[:, None], tree.parents.clamp(min=0), tree.tokens].tolist()  # [B, N] p(node's token) at its parent
    tokens, kids, u = tree.tokens.tolist(), tree.children.tolist(), sibling_u.tolist()
    paths: list[list[int]] = []
    ends: list[int] = []
    tried_rows: list[int] = []
    tried_tokens: list[int] = []
    for r in range(b):
        node, path = 0, []
        while True:
            tried: list[int] = []  # a token repeated under one node is tried once: its residual is then 0
            before, taken = 0.0, -1
            for j, kid in enumerate(kids[r][node]):
                if kid < 0:
                    break
                x = tokens[r][kid - 1]
                if x in tried:
                    continue
                tried.append(x)
                c = mass[r][kid - 1]
                if u[r][node][j] * (1.0 - before) < c:
                    taken = kid
                    break
                before += c
            if taken < 0:
                break
            path.append(taken)
            node = taken
        paths.append(path)
        ends.append(node)
        tried_rows += [r] * len(tried)
        tried_tokens += tried
    last = torch.tensor(ends, device=device)
    here = p[rows, last].float()  # [B, V]
    residual = here.clone()
    if tried_rows:  # p at the walk's end with every tried candidate removed
        residual[torch.tensor(tried_rows, device=device), torch.tensor(tried_tokens, device=device)] = 0.0
    empty = residual.sum(dim=1, keepdim=True) <= 0  # numerically exhausted: fall back to p
    next_token = sample_from(torch.where(empty, here, residual), residual_u)
    width = max(1, *(len(path) for path in paths))
    path = torch.tensor([path + [0] * (width - len(path)) for path in paths], device=device)
    count = torch.tensor([len(path) for path in paths], device=device)
    return Verdict(path, count, next_token, last)


def _judge_tree(p: torch.Tensor, tree: DraftTree, sibling_u: torch.Tensor, residual_u: torch.Tensor) -> Verdict:
    """The walk with no data-dependent loop: every node's children are judged at once (which child of each
    node would be taken if the walk got there), a node is reached when it and all its ancestors are the
    child taken at their parent (one product with the ancestor mask), and the walk's end is the deepest
    reached node. No host round trip per level: the form for accelerators and large batches."""
    b, n1, _ = p.shape
    device = p.device
    rows = torch.arange(b, device=device)
    children = tree.children  # [B, N+1, K]
    k = children.shape[-1]
    valid = children >= 0
    tokens = torch.cat([torch.zeros(b, 1, dtype=tree.tokens.dtype, device=device), tree.tokens], dim=1)
    kid_tokens = tokens.gather(1, children.clamp(min=0).view(b, -1)).view(b, n1, k)  # [B, N+1, K]
    # A token repeated under one node (two draft sources proposing it) is tried once: after its first copy
    # is rejected its residual mass is 0, so a later copy must never be accepted. Counting it twice would
    # accept a token of p = 0.5 with probability 1.
    earlier = torch.ones(k, k, dtype=torch.bool, device=device).tril(-1)  # [K, K]: sibling i tried before j
    repeat = ((kid_tokens[..., :, None] == kid_tokens[..., None, :]) & valid[..., None, :] & earlier).any(-1)
    c = p.gather(2, kid_tokens).float() * (valid & ~repeat)  # [B, N+1, K] p(x_j), 0 for a repeat
    before = c.cumsum(dim=-1) - c  # mass of the siblings tried before x_j
    accept = valid & (sibling_u[..., :k] * (1.0 - before) < c)  # u < p(x_j) / (1 - sum_{i<j} p(x_i))
    took = accept.any(dim=-1)  # [B, N+1]
    taken = torch.where(took, children.gather(2, accept.int().argmax(dim=-1, keepdim=True)).squeeze(-1), -1)
    # taken[b, a]: the child the walk would move to from node a (-1: it would stop there).
    is_taken = torch.zeros(b, n1 + 1, dtype=torch.bool, device=device)
    is_taken[rows[:, None].expand(b, n1), taken + 1] = True  # column 0 collects the -1s
    is_taken = is_taken[:, 1:]  # [B, N+1] by node (the root is never anyone's child)
    is_taken[:, 0] = True
    mask = tree.ancestor_mask  # [B, N+1, N+1]
    reached = ~(mask & ~is_taken[:, None, :]).any(dim=-1)  # every ancestor-or-self was the child taken
    depths = tree.depths
    count = reached[:, 1:].sum(dim=1)  # [B] the reached nodes are one path, one per depth
    last = torch.where(reached, depths, torch.full_like(depths, -1)).argmax(dim=1)  # [B] the walk's end
    slot = torch.where(reached[:, 1:], depths[:, 1:] - 1, torch.full_like(depths[:, 1:], n1 - 1))
    path = torch.zeros(b, n1, dtype=torch.long, device=device)
    path.scatter_(1, slot, torch.where(reached[:, 1:], torch.arange(1, n1, device=device), 0).expand(b, n1 - 1))
    here = p[rows, last].float()  # [B, V]
    last_kids = kid_tokens[rows, last]  # [B, K]
    tried = torch.zeros_like(here).scatter_add_(1, last_kids, valid[rows, last].float()) > 0
    residual = here.masked_fill(tried, 0.0)  # p at the walk's end with every tried candidate removed
    empty = residual.sum(dim=1, keepdim=True) <= 0  # numerically exhausted: fall back to p
    residual = torch.where(empty, here, residual)
    next_token = sample_from(residual, residual_u)
    width = max(1, int(count.max()))
    return Verdict(path[:, :width], count, next_token, last)


def accept_chain(
    p: torch.Tensor,
    q: torch.Tensor | None,
    draft: torch.Tensor,
    accept_u: torch.Tensor,
    residual_u: torch.Tensor,
    lengths: torch.Tensor | None = None,
) -> Verdict:
    """Speculative sampling for a chain of drafted tokens, fully vectorised (the residual and the draw, not
    the walk of the accepted prefix, dominate its cost).

    `p [B, d+1, V]` target probabilities at the root and after each draft token; `q [B, d, V]` the drafter
    distributions the draft tokens `draft [B, d]` were sampled from, or None for point-mass proposals
    (then acceptance is u < p(x) and the residual is p without x: the tree rule for one child per node);
    `lengths [B]` the real drafts per row (the rest is padding, never accepted); `accept_u [B, d]`,
    `residual_u [B]` uniforms in [0, 1). Node i of the returned path is draft position i (1-based).
    """
    b, d = draft.shape
    device = p.device
    rows = torch.arange(b, device=device)
    positions = torch.arange(d, device=device)[None, :]
    valid = positions < (lengths[:, None] if lengths is not None else d)  # [B, d]
    p_x = p[:, :d].gather(2, draft[..., None]).squeeze(-1).float()  # [B, d]
    q_x = q.gather(2, draft[..., None]).squeeze(-1).float() if q is not None else torch.ones_like(p_x)
    ok = (accept_u * q_x < p_x) & valid  # u < p(x)/q(x), i.e. accept with probability min(1, p/q)
    count = ok.long().cumprod(dim=1).sum(dim=1)  # [B] accepted prefix length
    p_next = p[rows, count].float()  # [B, V] distribution after the accepted prefix
    rejected = count < valid.sum(dim=1)  # stopped at a real draft (else: bonus token)
    at = count.clamp(max=d - 1)
    if q is not None:
        q_next = q[rows, at].float()
    else:
        q_next = torch.zeros_like(p_next).scatter_(1, draft[rows, at][:, None], 1.0)
    residual = torch.where(rejected[:, None], (p_next - q_next).clamp_(min=0.0), p_next)
    empty = residual.sum(dim=1, keepdim=True) <= 0
    residual = torch.where(empty, p_next, residual)
    next_token = sample_from(residual, residual_u)
    path = torch.where(positions < count[:, None], positions + 1, torch.zeros_like(positions)).expand(b, d)
    return Verdict(path, count, next_token, count)
