"""One speculative round on the target: verify a draft tree in one forward, accept losslessly, commit.

The verify input of row b is `[last token, drafted nodes...]` at positions `length + depth(node)` with the
tree's ancestor mask, so every node sees exactly its own path. The target's distribution p at the root
and at every node then decides, by the rules in `acceptance`, which path survives and which token follows
it; the accepted path's K/V are compacted right after the committed entries (the rest is dropped by not
advancing over it). The emitted tokens carry the target's log-probabilities and the hidden state that
produced each of them, exactly as plain decoding would report them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tlt_stream.model.cache import KVCache
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
    path: torch.Tensor
    """`[B, A]` the accepted draft nodes in order (1-based node indices; 0 past `count`)."""
    count: torch.Tensor
    """`[B]` drafted tokens accepted per row."""


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
) -> RoundOutcome:
    """Verify `proposal` for rows 0..B-1 (whose last tokens are not yet in the cache) and commit the result."""
    tree = proposal.tree
    b, n = tree.tokens.shape
    device = model.device
    tokens = tree.tokens.to(device)
    ids = torch.cat([last_tokens.to(device)[:, None], tokens], dim=1)  # [B, N+1]
    positions = cache.lengths[:b, None] + tree.depths.to(device)  # [B, N+1]
    hidden = model(ids, positions, cache, tree_mask=tree.ancestor_mask.to(device))  # [B, N+1, H]
    logits = model.logits(hidden).float()  # [B, N+1, V]
    temps = temperatures.to(device)
    chain = tree.chain_lengths
    logp = None  # [B, N+1, V] log p at the sampling temperature (T = 0 rows: at T = 1, see `sampling`)
    if chain is not None and not bool((temps > 0).any()):  # greedy chains compare argmaxes, nothing more
        verdict = _greedy_chain(logits, tokens, chain.to(device))
    else:
        logp = target_logprobs(logits.view(b * (n + 1), -1), temps.repeat_interleave(n + 1)).view(b, n + 1, -1)
        verdict = _accept(logits, logp, proposal, temps, generators)
    count = verdict.count  # [B]
    # Commit the root and the accepted nodes (node indices are offsets after the committed entries). A
    # chain's accepted prefix already sits right after the root, so committing it is just advancing.
    sources = torch.cat([torch.zeros(b, 1, dtype=torch.long, device=device), verdict.path], dim=1)  # [B, A+1]
    if tree.chain_lengths is not None:
        cache.advance(count + 1)
    else:
        cache.compact(b, sources, count + 1)
    # Emitted token j was drawn from the distribution at sources[j]: the root, then each accepted node.
    emitted = torch.cat([tokens.gather(1, (verdict.path - 1).clamp(min=0)), verdict.next_token[:, None]], dim=1)
    emitted.scatter_(1, count[:, None], verdict.next_token[:, None])  # the next token right after the path
    rows = torch.arange(b, device=device)[:, None]
    if logp is None:  # only the distributions the emitted tokens came from
        a = sources.shape[1]
        at = logits[rows, sources].view(b * a, -1)  # [B*(A+1), V]
        logp_at = target_logprobs(at, temps.repeat_interleave(a)).view(b, a, -1)
    else:
        logp_at = logp[rows, sources]  # [B, A+1, V]
    lp = logp_at.gather(2, emitted[..., None]).squeeze(-1)  # [B, A+1] log softmax(logits / T) at the token
    counts = (count + 1).tolist()
    out_tokens = [row[:c] for row, c in zip(emitted.tolist(), counts, strict=True)]
    out_logprobs = [row[:c] for row, c in zip(lp.tolist(), counts, strict=True)]
    return RoundOutcome(out_tokens, out_logprobs, hidden[rows, sources], n, verdict.path, count)
