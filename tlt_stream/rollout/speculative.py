"""One speculative round on the target: verify a draft tree in one forward, accept losslessly, commit.

The verify input of row b is `[last token, drafted nodes...]` at positions `length + depth(node)` with the
tree's ancestor mask, so every node sees exactly its own path. The target's distribution p at the root
and at every node then decides, by the rules in `acceptance`, which path survives and which token follows
it; the accepted path's K/V are compacted right after the committed entries (the rest is dropped by not
advancing over it). The emitted tokens carry the target's log-probabilities and the hidden state that
produced each of them, exactly as plain decoding would report them.

At small batches on CPU a round is mostly per-op overhead, so the tree's structure is looked up, not built
(`acceptance.tree_structure`), acceptance walks on the host, and the verdict is copied to the host once.
On an accelerator the verify forward (most of a round's kernels) can be replayed from a CUDA graph captured
per shape (`forward`, `model.graphs.ForwardGraphs`; checked on the CPU through its trace stand-in, never yet
on a GPU). Acceptance stays eager: the greedy chain test, `_judge_tree`'s path width and the per-row
generators of `_uniforms` read the host; they are a dozen kernels against the forward's hundreds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tlt_stream.model.cache import KVCache
from tlt_stream.model.graphs import ForwardGraphs
from tlt_stream.model.transformer import Transformer
from tlt_stream.rollout.acceptance import Verdict, accept_chain, accept_tree, greedy_onehot
from tlt_stream.rollout.proposers import Proposal
from tlt_stream.rollout.sampling import target_logprobs

__all__ = ["RoundOutcome", "verify_round"]


@dataclass(frozen=True)
class RoundOutcome:
    """What one round emitted, per row."""

    tokens: list[list[int]]
    """The accepted drafted tokens followed by the residual or bonus token (at least one per row)."""
    logprobs: list[list[float]]
    """Target log-probability of each emitted token (temperature semantics of `sampling`)."""
    hidden: torch.Tensor
    """`[B, A+1, H]` the target hidden state that produced each emitted token (padded past the row's count)."""
    drafted: int
    """Nodes verified per row."""
    path: list[list[int]]
    """The accepted draft nodes of each row in order (1-based node indices); as many as it accepted."""


def _uniforms(generators: list[torch.Generator | None], greedy: list[bool], shape: tuple[int, ...]) -> torch.Tensor:
    """One block of uniforms per row from the row's own generator (greedy rows need none: zeros)."""
    rows = [
        torch.zeros(shape, dtype=torch.float64)
        if is_greedy or g is None
        else torch.rand(shape, generator=g, dtype=torch.float64, device=g.device).cpu()
        for g, is_greedy in zip(generators, greedy, strict=True)
    ]
    return torch.stack(rows)


def _greedy_chain(logits: torch.Tensor, tokens: torch.Tensor, lengths: torch.Tensor) -> Verdict:
    """Greedy rows, chain drafts: accept while a draft equals the target's argmax; then the argmax.

    The same outcome as the general rule with one-hot targets, without building [B, N+1, V] distributions.
    """
    b, n = tokens.shape
    device = logits.device
    argmax = logits.argmax(dim=-1)  # [B, N+1]
    positions = torch.arange(n, device=device)[None, :]
    ok = (tokens == argmax[:, :n]) & (positions < lengths[:, None])
    count = ok.long().cumprod(dim=1).sum(dim=1)  # [B]
    path = torch.where(positions < count[:, None], positions + 1, torch.zeros_like(positions)).expand(b, n)
    return Verdict(path, count, argmax.gather(1, count[:, None]).squeeze(1), count)


def _accept(
    logits: torch.Tensor,
    logp: torch.Tensor,
    proposal: Proposal,
    temperatures: torch.Tensor,
    generators: list[torch.Generator | None],
) -> Verdict:
    """Apply the lossless acceptance rule that fits the proposal (see `acceptance`); `logp [B, N+1, V]` is
    the target's log-distribution at the sampling temperature (`sampling.target_logprobs`)."""
    tree = proposal.tree
    n = tree.num_nodes
    device = logits.device
    chain = tree.chain_lengths
    greedy = temperatures <= 0
    greedy_rows = greedy.tolist()
    p = logp.exp()
    if any(greedy_rows):
        p = torch.where(greedy.to(device)[:, None, None], greedy_onehot(logits), p)
    if proposal.q is not None or chain is not None:  # chains: the vectorised rule (q None: point masses)
        return accept_chain(
            p,
            proposal.q.to(device) if proposal.q is not None else None,
            tree.tokens.to(device),
            _uniforms(generators, greedy_rows, (n,)).to(device),
            _uniforms(generators, greedy_rows, ()).to(device),
            lengths=None if chain is None else chain.to(device),
        )
    k = tree.children.shape[-1]
    return accept_tree(
        p,
        tree,
        _uniforms(generators, greedy_rows, (n + 1, k)).to(device),
        _uniforms(generators, greedy_rows, ()).to(device),
    )


@torch.inference_mode()
def verify_round(
    model: Transformer,
    cache: KVCache,
    proposal: Proposal,
    last_tokens: torch.Tensor,
    temperatures: torch.Tensor,
    generators: list[torch.Generator | None],
    *,
    forward: ForwardGraphs | None = None,
) -> RoundOutcome:
    """Verify `proposal` for rows 0..B-1 (whose last tokens are not yet in the cache) and commit the result.
    With `forward`, the verify forward is its captured replay (the same semantics, `model.graphs`)."""
    tree = proposal.tree
    b, n = tree.tokens.shape
    device = model.device
    structure = tree.structure  # shared by every tree of this shape (`acceptance.tree_structure`)
    tokens = tree.tokens.to(device)
    ids = torch.cat([last_tokens.to(device)[:, None], tokens], dim=1)  # [B, N+1]
    positions = cache.lengths[:b, None] + structure.depths.to(device)  # [B, N+1]
    mask = structure.ancestor_mask.to(device)
    # [B, N+1, H]; a replay's is the graph's buffer, which only this round reads
    hidden = forward(ids, positions, mask) if forward is not None else model(ids, positions, cache, tree_mask=mask)
    logits = model.logits(hidden).float()  # [B, N+1, V]
    temps = temperatures.to(device)
    chain = structure.chain_lengths
    logp = None  # [B, N+1, V] log p at the sampling temperature (T = 0 rows: at T = 1, see `sampling`)
    if chain is not None and not bool((temps > 0).any()):  # greedy chains compare argmaxes, nothing more
        verdict = _greedy_chain(logits, tokens, chain.to(device))
    else:
        logp = target_logprobs(logits.view(b * (n + 1), -1), temps.repeat_interleave(n + 1)).view(b, n + 1, -1)
        verdict = _accept(logits, logp, proposal, temps, generators)
    # One host copy of the verdict; what follows is per emitted token, a handful per row.
    counts = verdict.count.tolist()
    paths = [row[:c] for row, c in zip(verdict.path.tolist(), counts, strict=True)]
    drafted = tree.tokens.tolist()
    emitted = [
        [drafted[r][node - 1] for node in path] + [token]
        for r, (path, token) in enumerate(zip(paths, verdict.next_token.tolist(), strict=True))
    ]
    # Emitted token j was drawn from the distribution at node sources[j]: the root, then each accepted node.
    width = max(counts) + 1
    sources = torch.tensor([[0, *path] + [0] * (width - 1 - len(path)) for path in paths], device=device)
    # Commit the root and the accepted nodes (node indices are offsets after the committed entries). A path
    # that is the tree's leading chain (always, for chains) already sits right after the root: just advance.
    if all(path == list(range(1, len(path) + 1)) for path in paths):
        cache.advance(verdict.count + 1)
    else:
        cache.compact(b, sources, verdict.count + 1)
    at = torch.tensor(
        [
            [r for r, row in enumerate(emitted) for _ in row],
            [node for path in paths for node in (0, *path)],
            [token for row in emitted for token in row],
        ],
        device=device,
    )  # [3, M]: (row, source node, token) of every emitted token
    if logp is None:  # only the distributions the emitted tokens came from
        lp = target_logprobs(logits[at[0], at[1]], temps[at[0]]).gather(1, at[2, :, None]).squeeze(1)  # [M]
    else:
        lp = logp[at[0], at[1], at[2]]  # [M] log softmax(logits / T) at the token
    flat = lp.tolist()
    logprobs, start = [], 0
    for row in emitted:
        logprobs.append(flat[start : start + len(row)])
        start += len(row)
    rows = torch.arange(b, device=device)[:, None]
    return RoundOutcome(emitted, logprobs, hidden[rows, sources], n, paths)
