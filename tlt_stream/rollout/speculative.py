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


def _uniforms(generators: list[torch.Generator | None], greedy: list[bool], shape: tuple[int, ...]) -> torch.Tensor:
    """One block of uniforms per row from the row's own generator (greedy rows need none: zeros)."""
    rows = [
        torch.zeros(shape, dtype=torch.float64)
        if is_greedy or g is None
        else torch.rand(shape, generator=g, dtype=torch.float64)
        for g, is_greedy in zip(generators, greedy, strict=True)
    ]
    return torch.stack(rows)


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
    ids = torch.cat([last_tokens.to(device)[:, None], tree.tokens.to(device)], dim=1)  # [B, N+1]
    positions = cache.lengths[:b, None] + tree.depths.to(device)  # [B, N+1]
    hidden = model(ids, positions, cache, tree_mask=tree.ancestor_mask.to(device))  # [B, N+1, H]
    logits = model.logits(hidden).float()  # [B, N+1, V]
    vocab = logits.shape[-1]
    temps = temperatures.to(device)
    logp = target_logprobs(logits.reshape(b * (n + 1), vocab), temps.repeat_interleave(n + 1)).view(b, n + 1, vocab)
    greedy = temps <= 0
    p = torch.where(greedy[:, None, None], greedy_onehot(logits), logp.exp())  # target distributions
    greedy_rows = greedy.tolist()
    verdict: Verdict
    if proposal.q is not None:
        verdict = accept_chain(
            p,
            proposal.q.to(device),
            tree.tokens.to(device),
            _uniforms(generators, greedy_rows, (n,)).to(device),
            _uniforms(generators, greedy_rows, ()).to(device),
        )
    else:
        k = tree.children.shape[-1]
        verdict = accept_tree(
            p,
            tree,
            _uniforms(generators, greedy_rows, (n + 1, k)).to(device),
            _uniforms(generators, greedy_rows, ()).to(device),
        )
    count = verdict.count  # [B]
    rows = torch.arange(b, device=device)
    # Commit the root and the accepted nodes: node indices are offsets after the committed entries.
    src = torch.cat([torch.zeros(b, 1, dtype=torch.long, device=device), verdict.path], dim=1)  # [B, A+1]
    cache.compact(b, src, count + 1)
    # Emitted token j came from the distribution at sources[j]: the root, then each accepted node.
    sources = src  # [B, A+1]
    path_tokens = tree.tokens.to(device).gather(1, (verdict.path - 1).clamp(min=0))  # [B, A]
    emitted = torch.cat([path_tokens, torch.zeros(b, 1, dtype=torch.long, device=device)], dim=1)
    emitted.scatter_(1, count[:, None], verdict.next_token[:, None])  # next token right after the path
    lp = logp[rows[:, None], sources, emitted]  # [B, A+1]
    source_hidden = hidden[rows[:, None], sources]  # [B, A+1, H]
    counts = (count + 1).tolist()
    tokens = [row[:c] for row, c in zip(emitted.tolist(), counts, strict=True)]
    logprobs = [row[:c] for row, c in zip(lp.tolist(), counts, strict=True)]
    return RoundOutcome(tokens, logprobs, source_hidden, n)
