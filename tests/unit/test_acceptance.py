"""Acceptance rules are exactly distribution-preserving, for good, random and adversarial drafts.

Statistical tests draw many independent verifications in one vectorised call (fixed seed) and compare the
empirical distribution of the first two emitted tokens with the target's exact joint distribution with a
chi-square test at a false-alarm rate of 1e-4 per test.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from tlt_stream.rollout.acceptance import (
    DraftTree,
    accept_chain,
    accept_tree,
    build_structure,
    greedy_onehot,
    tree_structure,
)

V = 5
ALPHA_Z = 3.719  # one-sided standard normal quantile for alpha = 1e-4


def chi2_threshold(df: int) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile at 1 - 1e-4."""
    return df * (1 - 2 / (9 * df) + ALPHA_Z * math.sqrt(2 / (9 * df))) ** 3


def target(prefix: tuple[int, ...]) -> torch.Tensor:
    """A fixed, prefix-dependent target distribution over V tokens (deterministic, varied, no zeros)."""
    g = torch.Generator().manual_seed(1000 + hash(prefix) % 10_000)
    logits = torch.randn(V, generator=g) * 1.5
    return torch.softmax(logits, dim=0)


def pair_counts(first: torch.Tensor, second: torch.Tensor, count: torch.Tensor, g: torch.Generator) -> dict:
    """Counts of (first, second) emitted tokens. Rows that accepted nothing emitted one token this round;
    their second token would come from the target in the next round, so it is drawn exactly from it."""
    second = second.clone()
    for a in range(V):
        rows = (count == 0) & (first == a)
        if bool(rows.any()):
            second[rows] = torch.multinomial(target((a,)), int(rows.sum()), replacement=True, generator=g)
    observed: dict = {}
    for a, b in zip(first.tolist(), second.tolist(), strict=True):
        observed[(a, b)] = observed.get((a, b), 0) + 1
    return observed


def chi_square(observed: dict, expected: dict, n: int) -> tuple[float, int]:
    stat, cells = 0.0, 0
    for key, prob in expected.items():
        e = prob * n
        stat += (observed.get(key, 0) - e) ** 2 / e
        cells += 1
    assert sum(observed.values()) == n
    assert set(observed) <= set(expected), "emitted a pair the target gives no mass"
    return stat, cells - 1


def joint_two() -> dict:
    p0 = target(())
    return {(a, b): float(p0[a] * target((a,))[b]) for a, b in itertools.product(range(V), repeat=2)}


def tree_case(batch: int) -> tuple[DraftTree, torch.Tensor, list[tuple[int, ...]]]:
    """Root with children [3, 1, 4]; node 1 (token 3) has children [0, 2]; node 3 (token 4) has [4]."""
    tokens = torch.tensor([3, 1, 4, 0, 2, 4]).expand(batch, 6)
    parents = torch.tensor([0, 0, 0, 1, 1, 3]).expand(batch, 6)
    prefixes = [(), (3,), (1,), (4,), (3, 0), (3, 2), (4, 4)]
    p = torch.stack([target(pre) for pre in prefixes])  # [N+1, V]
    return DraftTree(tokens, parents), p.expand(batch, -1, -1), prefixes


def test_tree_structure_helpers() -> None:
    tree, _, _ = tree_case(1)
    assert tree.depths.tolist() == [[0, 1, 1, 1, 2, 2, 2]]
    assert tree.children[0].tolist() == [
        [1, 2, 3],
        [4, 5, -1],
        [-1, -1, -1],
        [6, -1, -1],
        [-1] * 3,
        [-1] * 3,
        [-1] * 3,
    ]
    mask = tree.ancestor_mask[0]
    assert mask[4].nonzero().flatten().tolist() == [0, 1, 4]
    assert mask[6].nonzero().flatten().tolist() == [0, 3, 6]


@pytest.mark.parametrize("walk", [False, True])
def test_tree_acceptance_preserves_the_target_distribution(walk: bool) -> None:
    n = 200_000
    tree, p, _ = tree_case(n)
    g = torch.Generator().manual_seed(0)
    verdict = accept_tree(p, tree, torch.rand(n, 7, 3, generator=g), torch.rand(n, generator=g), walk=walk)
    first_two = torch.where(
        verdict.count >= 1,
        tree.tokens.gather(1, (verdict.path[:, 0] - 1).clamp(min=0)[:, None]).squeeze(1),
        verdict.next_token,
    )
    second = torch.full_like(first_two, -1)
    has2 = verdict.count >= 2
    second[has2] = tree.tokens[has2].gather(1, (verdict.path[has2, 1] - 1)[:, None]).squeeze(1)
    one = verdict.count == 1
    second[one] = verdict.next_token[one]
    observed = pair_counts(first_two, second, verdict.count, g)
    stat, df = chi_square(observed, joint_two(), n)
    assert stat < chi2_threshold(df), (stat, chi2_threshold(df))
    assert float(verdict.count.float().mean()) > 0.3, "candidates are accepted at a useful rate"


@pytest.mark.parametrize("walk", [False, True])
def test_tree_greedy_accepts_exactly_the_argmax_path(walk: bool) -> None:
    tree, p, _ = tree_case(1)
    logits = torch.log(p[0])
    onehot = greedy_onehot(logits)[None]
    verdict = accept_tree(onehot, tree, torch.rand(1, 7, 3), torch.rand(1), walk=walk)
    # follow argmax through the tree by hand
    emitted, node = [], 0
    children = {0: [1, 2, 3], 1: [4, 5], 3: [6]}
    while True:
        best = int(logits[node].argmax())
        match = [c for c in children.get(node, []) if int(tree.tokens[0, c - 1]) == best]
        if not match:
            emitted.append(best)
            break
        emitted.append(best)
        node = match[0]
    got = [int(tree.tokens[0, int(i) - 1]) for i in verdict.path[0, : int(verdict.count[0])]] + [
        int(verdict.next_token[0])
    ]
    assert got == emitted


@pytest.mark.parametrize("drafter", ["close", "uniform", "adversarial"])
def test_chain_speculative_sampling_preserves_the_target_distribution(drafter: str) -> None:
    n, d = 200_000, 2
    g = torch.Generator().manual_seed(1)
    p0 = target(())
    if drafter == "close":
        q0 = torch.softmax(torch.log(p0) + 0.3 * torch.randn(V, generator=g), 0)
    elif drafter == "uniform":
        q0 = torch.full((V,), 1.0 / V)
    else:  # puts most mass where the target has least
        q0 = torch.softmax(-5 * torch.log(p0), 0)
    x1 = torch.multinomial(q0, n, replacement=True, generator=g)  # [n]
    q1_by_token = torch.stack([torch.softmax(torch.randn(V, generator=g), 0) for _ in range(V)])
    q1 = q1_by_token[x1]  # drafter's second distribution depends on its first token
    x2 = torch.multinomial(q1, 1, generator=g).squeeze(1)
    p_by_prefix = {(a,): target((a,)) for a in range(V)}
    p1 = torch.stack([p_by_prefix[(a,)] for a in range(V)])[x1]
    p2 = torch.stack([target((a, b)) for a in range(V) for b in range(V)]).view(V, V, V)[x1, x2]
    p = torch.stack([p0.expand(n, V), p1, p2], dim=1)  # [n, 3, V]
    q = torch.stack([q0.expand(n, V), q1], dim=1)
    draft = torch.stack([x1, x2], dim=1)
    verdict = accept_chain(p, q, draft, torch.rand(n, d, generator=g), torch.rand(n, generator=g))
    first = torch.where(verdict.count >= 1, x1, verdict.next_token)
    second = torch.where(verdict.count >= 2, x2, torch.where(verdict.count == 1, verdict.next_token, -1))
    observed = pair_counts(first, second, verdict.count, g)
    stat, df = chi_square(observed, joint_two(), n)
    assert stat < chi2_threshold(df), (drafter, stat, chi2_threshold(df))
    rate = float(verdict.count.float().mean())
    if drafter == "close":
        assert rate > 1.0
    if drafter == "adversarial":
        assert rate < 0.5


def test_chain_greedy_is_exact_match() -> None:
    logits = torch.randn(3, 4, V)  # 3 rows, root + 3 drafted positions
    onehot = greedy_onehot(logits)
    argmax = logits.argmax(-1)
    draft = argmax[:, :3].clone()
    draft[1, 1] = (draft[1, 1] + 1) % V  # row 1 diverges at position 2
    draft[2, 0] = (draft[2, 0] + 1) % V  # row 2 diverges at once
    q = greedy_onehot(torch.nn.functional.one_hot(draft, V).float())
    verdict = accept_chain(onehot, q, draft, torch.rand(3, 3), torch.rand(3))
    assert verdict.count.tolist() == [3, 1, 0]
    assert verdict.next_token.tolist() == [int(argmax[0, 3]), int(argmax[1, 1]), int(argmax[2, 0])]


@pytest.mark.parametrize("walk", [False, True])
def test_a_token_drafted_twice_under_one_node_is_tried_once(walk: bool) -> None:
    """Two sources proposing the same token under a node: root children [3, 3, 1, 3], node 2 (the second 3)
    with a child of its own. Without the rule a token of p = 0.5 would be accepted with probability 1."""
    n = 200_000
    tokens = torch.tensor([3, 3, 1, 3, 2]).expand(n, 5)
    parents = torch.tensor([0, 0, 0, 0, 2]).expand(n, 5)
    prefixes = [(), (3,), (3,), (1,), (3,), (3, 2)]
    p = torch.stack([target(pre) for pre in prefixes]).expand(n, -1, -1)
    tree = DraftTree(tokens, parents)
    g = torch.Generator().manual_seed(1)
    verdict = accept_tree(p, tree, torch.rand(n, 6, 4, generator=g), torch.rand(n, generator=g), walk=walk)
    accepted = verdict.path[:, 0]
    assert not bool(((verdict.count >= 1) & (accepted != 1) & (accepted != 3)).any()), "a repeat is never taken"
    drafted = tokens.gather(1, (accepted - 1).clamp(min=0)[:, None]).squeeze(1)
    first = torch.where(verdict.count >= 1, drafted, verdict.next_token)
    observed = {a: int((first == a).sum()) for a in range(V)}
    expected = {a: float(target(())[a]) for a in range(V)}
    stat = sum((observed[a] - expected[a] * n) ** 2 / (expected[a] * n) for a in range(V))
    assert stat < chi2_threshold(V - 1), (observed, expected)


def walk_tree(p: torch.Tensor, tokens: list[int], parents: list[int], sibling_u: torch.Tensor, residual_u: float):
    """The residual rule walked node by node in plain Python, one row: the reference for `accept_tree`."""
    children: dict[int, list[int]] = {}
    for i, parent in enumerate(parents, start=1):
        if parent >= 0:
            children.setdefault(parent, []).append(i)
    node, path = 0, []
    while True:
        residual = p[node].double().clone()
        tried: set[int] = set()
        moved = False
        for j, kid in enumerate(children.get(node, [])):
            x = tokens[kid - 1]
            if x in tried:
                continue  # a repeat: residual mass 0, never taken
            mass = float(residual[x]) / float(residual.sum())
            tried.add(x)
            if float(sibling_u[node, j]) < mass:
                path.append(kid)
                node, moved = kid, True
                break
            residual[x] = 0.0
        if not moved:
            if float(residual.sum()) <= 0:
                residual = p[node].double()
            cdf = residual.cumsum(0)
            token = int(torch.searchsorted(cdf, residual_u * cdf[-1], right=True).clamp(max=len(cdf) - 1))
            return path, token


@pytest.mark.parametrize("walk", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_tree_acceptance_equals_the_node_by_node_walk(seed: int, walk: bool) -> None:
    """Random trees (repeats, padding, several widths) and random targets, one-hot greedy rows among them:
    the loop-free form and the host walk of `accept_tree` take exactly the path and the token the
    reference walk takes with the same uniforms."""
    g = torch.Generator().manual_seed(seed)
    b, n = 64, 9
    tokens = torch.randint(0, 4, (b, n), generator=g)  # 4 of V tokens: repeats under a node are common
    parents = torch.empty(b, n, dtype=torch.long)
    for row in range(b):
        real = int(torch.randint(0, n + 1, (), generator=g))
        for i in range(n):
            parents[row, i] = int(torch.randint(0, i + 1, (), generator=g)) if i < real else -1
    p = torch.softmax(torch.randn(b, n + 1, V, generator=g) * 2, dim=-1)
    p[::3] = greedy_onehot(torch.log(p[::3]))
    tree = DraftTree(tokens, parents)
    k = tree.children.shape[-1]
    sibling_u, residual_u = torch.rand(b, n + 1, k, generator=g), torch.rand(b, generator=g)
    verdict = accept_tree(p, tree, sibling_u, residual_u, walk=walk)
    for row in range(b):
        path, token = walk_tree(
            p[row], tokens[row].tolist(), parents[row].tolist(), sibling_u[row], float(residual_u[row])
        )
        count = int(verdict.count[row])
        assert verdict.path[row, :count].tolist() == path, row
        assert not bool(verdict.path[row, count:].any())
        assert int(verdict.next_token[row]) == token, row
        assert int(verdict.next_from[row]) == (path[-1] if path else 0)


def reference_structure(parents: list[int]) -> tuple[list[list[bool]], list[int], list[list[int]]]:
    """Ancestor mask, depths and children of one row, by following parent links in plain Python."""
    n = len(parents)
    mask = [[False] * (n + 1) for _ in range(n + 1)]
    depths = [0] * (n + 1)
    children: list[list[int]] = [[] for _ in range(n + 1)]
    for i in range(n + 1):
        node = i
        while True:
            mask[i][node] = True
            parent = parents[node - 1] if node > 0 else -1
            if parent < 0:
                break
            depths[i] += 1
            node = parent
        if i > 0 and parents[i - 1] >= 0:
            children[parents[i - 1]].append(i)
    return mask, depths, children


def random_parents(g: torch.Generator, b: int, n: int) -> torch.Tensor:
    parents = torch.full((b, n), -1, dtype=torch.long)
    for row in range(b):
        real = int(torch.randint(0, n + 1, (), generator=g))
        for i in range(real):
            parents[row, i] = int(torch.randint(0, i + 1, (), generator=g))
    return parents


@pytest.mark.parametrize("seed", range(4))
def test_a_cached_tree_structure_equals_a_fresh_one(seed: int) -> None:
    """Every shape the proposers produce (random trees with padding, chains, widths 1..16, batches 1..32):
    the cached structure is the same as one built afresh and as plain parent-following; a second lookup
    returns the cached one (small batches; large ones are built each time)."""
    g = torch.Generator().manual_seed(seed)
    for b, n in itertools.product([1, 2, 5, 32], [1, 3, 8, 16]):
        for parents in (random_parents(g, b, n), DraftTree.chain(torch.zeros(b, n, dtype=torch.long)).parents):
            cached = tree_structure(parents)
            kept = b * n <= 256  # larger batches are built every time, not kept
            assert (tree_structure(parents.clone()) is cached) == kept, (b, n)
            fresh = build_structure(parents)
            for name in ("ancestor_mask", "depths", "children"):
                assert torch.equal(getattr(cached, name), getattr(fresh, name)), (b, n, name)
            for row in range(b):
                mask, depths, children = reference_structure(parents[row].tolist())
                assert cached.ancestor_mask[row].tolist() == mask
                assert cached.depths[row].tolist() == depths
                k = cached.children.shape[-1]
                assert cached.children[row].tolist() == [kids + [-1] * (k - len(kids)) for kids in children]


@pytest.mark.parametrize("b", [1, 3])
def test_a_cached_chain_equals_a_fresh_tree_of_its_parents(b: int) -> None:
    """`DraftTree.chain` (its own builder, cached by lengths) against the general structure of its parents."""
    for n in range(1, 13):
        for lengths in (None, torch.randint(0, n + 1, (b,))):
            chain = DraftTree.chain(torch.zeros(b, n, dtype=torch.long), lengths)
            fresh = build_structure(chain.parents)
            assert DraftTree.chain(torch.ones(b, n, dtype=torch.long), lengths).structure is chain.structure
            for name in ("ancestor_mask", "depths", "children", "chain_lengths"):
                assert torch.equal(getattr(chain.structure, name), getattr(fresh, name)), (n, lengths, name)
