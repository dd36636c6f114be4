"""Lossless partial rollouts on vLLM, built on the client's side of the engine (no change to vLLM).

The torch engine re-verifies every row in flight under a new policy inside its own cache
(`rollout/reverify.py`). vLLM's requests cannot be cut and resumed in place (docs/vllm.md: the missing
`rewind_requests`), so the backend does it around vLLM:

1. With `VllmSettings(partial_rollouts=True)` every request streams its tokens and their behaviour log-probs
   (vLLM's processed log-probs: log softmax(logits / T), the distribution each token was sampled from), so
   the client always knows each row's response so far (`requests.py`). A draft (`ahead_limit`) is sent with
   `max_tokens` capped at its limit and parks on the client when vLLM ends it.
2. At a new version (`VllmEngine.load_policy(path, reverify=True)`) every request in vLLM is aborted; the
   tokens the client has seen are the row's (tokens vLLM sampled but had not delivered are dropped: where a row
   is cut is a matter of timing, never of what it sampled). vLLM loads the new weights in place and drops its
   prefix cache (no KV of the old weights is ever reused).
3. `reverify_rows` judges each row with `reverify.verify_rows` on the client's copy of the policy (the new
   weights; the old ones kept until every row is judged, for the residual of T > 0 rows): each old token
   accepted with min(1, p_new / q), q its recorded behaviour probability; at the first rejection a token from
   norm(max(0, p_new - p_old)); after a fully kept response that had not ended, a token from p_new. Greedy rows
   keep exactly p_new's argmax chain. Acceptance uniforms come from a generator of the client's, seeded from
   the request's seed and its re-verification count (`derived_seed`).
4. Each row that goes on is added to vLLM again: prompt + kept tokens + the new token as its prompt (vLLM
   computes their KV under the new weights: the cost of doing this outside vLLM), the remaining token budget,
   and a fresh seed derived from the request's seed, the re-verification count and the cut, so its
   continuation draws from a stream of its own (reusing the request's seed would replay the draws that chose
   the kept tokens). A row that had ended and kept every token stays ended.

The response is then distributed as one of the newest policy from scratch, and its kept tokens carry that
policy's log-probs (the rule of `reverify`: its proof needs nothing vLLM-specific beyond exact behaviour
log-probs, which tests/vllm checks at every temperature).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tlt_stream.basics.common import stable_int
from tlt_stream.model.transformer import Transformer
from tlt_stream.rollout.reverify import verify_rows
from tlt_stream.rollout.vllm.requests import Pending

__all__ = ["Judged", "derived_seed", "reverify_rows"]


def derived_seed(seed: int | None, *parts: object) -> int | None:
    """A seed of its own for `parts` of a request seeded `seed` (None: unseeded, vLLM draws its own)."""
    return None if seed is None else stable_int(repr((int(seed), *parts)), 15)


@dataclass(frozen=True)
class Judged:
    """One re-verification of rows (`reverify_rows`), per row."""

    kept_logprobs: list[list[float]]
    next_tokens: list[int]
    next_logprobs: list[float]
    passes: int
    """Forwards of the new policy (batches of rows)."""
    old_policy_rows: int
    """Rows whose rejection needed the old policy's distribution."""


def _generator(row: Pending, device: torch.device) -> torch.Generator | None:
    if row.temperature <= 0:
        return None
    seed = derived_seed(row.seed, "accept", row.reverifications)
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


@torch.inference_mode()
def reverify_rows(
    model: Transformer, q_model: Transformer | None, rows: Sequence[Pending], *, max_tokens: int = 16_384
) -> Judged:
    """Judge `rows` (each with at least one token) under `model`, the new policy; `q_model` the old one (needed
    when a T > 0 row rejects a token). Batches of at most `max_tokens` padded tokens, each in a cache of its
    own (`verify_rows` into slots 0..)."""
    order = sorted(range(len(rows)), key=lambda i: len(rows[i].prompt_ids) + len(rows[i].token_ids))
    kept: list[list[float]] = [[] for _ in rows]
    tokens, logprobs = [0] * len(rows), [0.0] * len(rows)
    passes = old_rows = 0
    start = 0
    while start < len(order):
        end = start + 1
        while end < len(order):  # longest last: the batch's padded width is its last row's
            width = len(rows[order[end]].prompt_ids) + len(rows[order[end]].token_ids)
            if (end - start + 1) * width > max_tokens:
                break
            end += 1
        batch = [rows[i] for i in order[start:end]]
        width = max(len(r.prompt_ids) + len(r.token_ids) for r in batch)
        out = verify_rows(
            model,
            model.new_cache(len(batch), width),
            0,
            [r.prompt_ids for r in batch],
            [r.token_ids for r in batch],
            [r.logprobs for r in batch],
            [r.temperature for r in batch],
            [_generator(r, model.device) for r in batch],
            q_model,
        )
        for b, i in enumerate(order[start:end]):
            kept[i], tokens[i], logprobs[i] = out.kept_logprobs[b], out.next_tokens[b], out.next_logprobs[b]
        passes += 1
        old_rows += out.rejected_rows
        start = end
    return Judged(kept, tokens, logprobs, passes, old_rows)
