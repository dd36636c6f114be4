"""Lossless partial rollouts: re-verify responses sampled under the previous policy under the new one.

A partial response x_1..x_k was sampled from q, the policy it was last verified under, at temperature T.
Once the new policy p is loaded, one forward of p over prompt + x_1..x_k gives p(x_i | x_<i). The tokens
are accepted in order, each with probability min(1, p(x_i) / q(x_i)); at the first rejection j the token
is resampled from norm(max(0, p(.|x_<j) - q(.|x_<j))) and x_{j+1..k} are discarded; if all k are accepted
the next token is drawn from p(.|x_1..x_k) (and a response that had already ended stays ended). This is
the sampled-chain rule of `acceptance.accept_chain`, with the old response as the draft: the result is
distributed exactly as a response of p from scratch, and the kept tokens carry p's log-probabilities.

What the proof needs, and where it is kept:
- q(x_i) is the exact probability x_i was sampled with: at T > 0 the exponential of the behaviour logprob
  the engine recorded (also under speculative decoding, which is lossless for the target); at T = 0 the
  point mass on the token, so a token is kept exactly when it is p's argmax and the resample is p's argmax
  (token-identical to greedy decoding under p, and no old weights are needed).
- The full q(.|x_<j) is needed only at a rejection of a T > 0 row: one forward of the old weights over
  the rejecting rows' prefixes. No `[B, k, V]` tensor is built: the per-token p(x_i) come from the LM head
  in chunks of positions, and full distributions exist only at each row's next position.
- Uniforms come from the row's own generator, which goes on (never re-seeded): per T > 0 row one block of
  k + 1 uniforms, `torch.rand(k + 1)`, the first k for acceptance and the last for the next token.
- Where a draft waits for the new version is a token count (`scheduler.Sequence.ahead_limit`), never what
  it would sample next, and every waiting draft is re-verified (`scheduler.Scheduler.new_version`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tlt_stream.basics.failpoints import failpoint
from tlt_stream.model.cache import KVCache
from tlt_stream.model.transformer import Transformer
from tlt_stream.rollout.acceptance import greedy_onehot, sample_from
from tlt_stream.rollout.sampling import target_logprobs

__all__ = ["VerifyOutcome", "accepted_prefix", "resample", "token_logprobs", "verify_rows"]

LOGIT_CHUNK_ELEMENTS = 1 << 25
"""Logits materialised at once when scoring the old tokens (128 MiB in fp32): ~220 positions of a 150k
vocabulary per LM-head call, the whole response of a tiny one."""


def accepted_prefix(
    p_logp: torch.Tensor,
    q_logp: torch.Tensor,
    is_argmax: torch.Tensor,
    uniforms: torch.Tensor,
    lengths: torch.Tensor,
    greedy: torch.Tensor,
) -> torch.Tensor:
    """How many leading tokens each row keeps: `[B]`.

    `p_logp`, `q_logp [B, K]` the new and the old policy's log-probability of each old token at the row's
    temperature; `is_argmax [B, K]` whether the token is p's argmax (greedy rows: q is a point mass, so a
    token is kept exactly when it is); `uniforms [B, K]` in [0, 1); `lengths [B]` real tokens per row
    (padding is never kept); `greedy [B]` the rows at temperature 0.
    """
    k = p_logp.shape[1]
    valid = torch.arange(k, device=p_logp.device)[None, :] < lengths[:, None]  # [B, K]
    sampled_ok = uniforms.double() * q_logp.double().exp() < p_logp.double().exp()  # u < p(x) / q(x)
    ok = torch.where(greedy[:, None], is_argmax, sampled_ok) & valid
    return ok.long().cumprod(dim=1).sum(dim=1)


def resample(p: torch.Tensor, q: torch.Tensor, rejected: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """The token after the kept prefix, `[B]`: from norm(max(0, p - q)) where the row rejected a token,
    else from p (`p`, `q [B, V]` distributions there, one-hot for greedy rows: the residual is then p's
    argmax; `uniforms [B]`). As in `acceptance.accept_chain`, an empty residual (p = q up to rounding,
    where a rejection has probability ~0) falls back to p."""
    weights = torch.where(rejected[:, None], (p - q).clamp(min=0.0), p)
    empty = weights.sum(dim=1, keepdim=True) <= 0
    return sample_from(torch.where(empty, p, weights), uniforms)


@torch.inference_mode()
def token_logprobs(
    model: Transformer, hidden: torch.Tensor, tokens: torch.Tensor, temperatures: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """For `hidden [M, H]` states and the `tokens [M]` they produced, at `temperatures [M]` (0: reported at
    T = 1, see `sampling`): `(log p(token) [M] float32, token == argmax [M] bool)`, the LM head applied to
    a chunk of positions at a time."""
    chunk = max(1, LOGIT_CHUNK_ELEMENTS // model.spec.vocab_size)
    logp, is_max = [], []
    for start in range(0, hidden.shape[0], chunk):
        logits = model.logits(hidden[start : start + chunk]).float()  # [C, V]
        x = tokens[start : start + chunk, None]
        logp.append(target_logprobs(logits, temperatures[start : start + chunk]).gather(1, x).squeeze(1))
        is_max.append(logits.argmax(dim=-1) == x.squeeze(1))
    return torch.cat(logp), torch.cat(is_max)


@dataclass(frozen=True)
class VerifyOutcome:
    """One re-verification pass, per row."""

    kept: list[int]
    """Leading old tokens kept."""
    kept_logprobs: list[list[float]]
    """The new policy's log-probability of each kept token (temperature semantics of `sampling`)."""
    next_tokens: list[int]
    """The resampled token at the first rejection, or the next token after a fully kept response (unused
    when that response had already ended)."""
    next_logprobs: list[float]
    """The new policy's log-probability of `next_tokens`."""
    hidden: torch.Tensor
    """`[B, T, H]` the new policy's final-norm states over prompt + old tokens (right-padded): position t
    produced input t + 1."""
    rejected_rows: int
    """Rows that rejected a token at T > 0 (each cost the old policy a forward over its prefix)."""


def _pad(rows: list[torch.Tensor], fill: float | bool) -> torch.Tensor:
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=fill)


@torch.inference_mode()
def _old_distribution(
    q_model: Transformer, prefixes: list[list[int]], temperatures: torch.Tensor, cache_dtype: torch.dtype
) -> torch.Tensor:
    """The old policy's next-token distribution after each prefix, `[R, V]`, in one right-padded forward
    on a cache of its own."""
    device = q_model.device
    lens = [len(p) for p in prefixes]
    t = max(lens)
    ids = torch.zeros(len(prefixes), t, dtype=torch.long)
    for r, prefix in enumerate(prefixes):
        ids[r, : lens[r]] = torch.tensor(prefix)
    cache = KVCache.for_model(q_model.spec, len(prefixes), t, dtype=cache_dtype, device=device)
    num_new = torch.tensor(lens, device=device)
    positions = torch.arange(t, device=device).expand(len(prefixes), t)
    hidden = q_model(ids.to(device), positions, cache, num_new=None if min(lens) == t else num_new)  # [R, T, H]
    last = hidden[torch.arange(len(prefixes), device=device), num_new - 1]  # [R, H]
    return target_logprobs(q_model.logits(last), temperatures).exp()  # [R, V]


@torch.inference_mode()
def verify_rows(
    model: Transformer,
    cache: KVCache,
    first_slot: int,
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    old_logprobs: Sequence[Sequence[float]],
    temperatures: Sequence[float],
    generators: Sequence[torch.Generator | None],
    q_model: Transformer | None,
) -> VerifyOutcome:
    """Re-verify rows under `model` (the new policy p) in one right-padded prefill over prompt + response
    into cache slots `first_slot ..` (their lengths are left at 0: the caller commits what it keeps).

    `responses[b]` (k >= 1 tokens) were sampled from q at `temperatures[b]` with behaviour logprobs
    `old_logprobs[b]`; `q_model` holds q's weights (needed only when a T > 0 row rejects a token).
    """
    b = len(prompts)
    device = model.device
    n_prompt = [len(p) for p in prompts]
    k = [len(r) for r in responses]
    lens = [n + m for n, m in zip(n_prompt, k, strict=True)]
    t = max(lens)
    ids = torch.zeros(b, t, dtype=torch.long)
    for row in range(b):
        ids[row, : lens[row]] = torch.tensor([*prompts[row], *responses[row]])
    num_new = torch.tensor(lens, device=device)  # [B]
    cache.lengths[first_slot : first_slot + b] = 0
    positions = torch.arange(t, device=device).expand(b, t)
    hidden = model(
        ids.to(device), positions, cache, num_new=None if min(lens) == t else num_new, first_slot=first_slot
    )  # [B, T, H]
    failpoint("rollout.reverify")  # fault tests: die here, the new weights in, the rows' caches half rebuilt

    # p(x_i | x_<i) for every old token: state n - 1 + i produced x_{i+1}.
    rows = torch.repeat_interleave(torch.arange(b), torch.tensor(k))  # [M]
    at = torch.cat([torch.arange(n - 1, n - 1 + m) for n, m in zip(n_prompt, k, strict=True)])  # [M]
    temps = torch.tensor([float(x) for x in temperatures])  # [B]
    tokens = torch.tensor([x for r in responses for x in r], device=device)  # [M]
    p_flat, max_flat = token_logprobs(model, hidden[rows.to(device), at.to(device)], tokens, temps[rows])
    p_logp = _pad(list(p_flat.split(k)), 0.0)  # [B, K]
    is_argmax = _pad(list(max_flat.split(k)), False)
    q_logp = _pad([torch.tensor(lp, dtype=torch.float32) for lp in old_logprobs], 0.0).to(device)
    greedy = temps <= 0
    blocks = [
        torch.zeros(m + 1, dtype=torch.float64)
        if g is None or temp <= 0
        else torch.rand(m + 1, generator=g, dtype=torch.float64, device=g.device).cpu()
        for g, temp, m in zip(generators, temps.tolist(), k, strict=True)
    ]
    accept_u = _pad([u[:-1] for u in blocks], 0.0).to(device)  # [B, K]
    next_u = torch.stack([u[-1] for u in blocks]).to(device)  # [B]
    lengths = torch.tensor(k, device=device)
    kept = accepted_prefix(p_logp, q_logp, is_argmax, accept_u, lengths, greedy.to(device))  # [B]

    # The distributions at each row's next position: p there, and q where a T > 0 row rejected.
    kept_list = kept.tolist()
    here = hidden[torch.arange(b, device=device), torch.tensor(n_prompt, device=device) - 1 + kept]  # [B, H]
    p_logits = model.logits(here).float()  # [B, V]
    p_next = target_logprobs(p_logits, temps).exp()
    rejected = kept < lengths  # [B]
    q_next = torch.zeros_like(p_next)
    rejected_at = [responses[r][c] if c < k[r] else 0 for r, c in enumerate(kept_list)]
    if bool(greedy.any()):
        greedy_d = greedy.to(device)
        p_next = torch.where(greedy_d[:, None], greedy_onehot(p_logits), p_next)
        point = torch.zeros_like(q_next).scatter_(1, torch.tensor(rejected_at, device=device)[:, None], 1.0)
        q_next = torch.where(greedy_d[:, None], point, q_next)
    sampled_rejects = [r for r in range(b) if kept_list[r] < k[r] and not bool(greedy[r])]
    if sampled_rejects:
        if q_model is None:
            raise RuntimeError("a sampled row rejected a token but the old policy's weights were not kept")
        prefixes = [[*prompts[r], *responses[r][: kept_list[r]]] for r in sampled_rejects]
        q_rows = _old_distribution(q_model, prefixes, temps[sampled_rejects], cache.k.dtype)
        q_next[torch.tensor(sampled_rejects, device=device)] = q_rows.to(q_next)
    next_tokens = resample(p_next, q_next, rejected, next_u)  # [B]
    next_logp = target_logprobs(p_logits, temps).gather(1, next_tokens[:, None]).squeeze(1)
    return VerifyOutcome(
        kept=kept_list,
        kept_logprobs=[row[:c] for row, c in zip(p_logp.tolist(), kept_list, strict=True)],
        next_tokens=next_tokens.tolist(),
        next_logprobs=next_logp.tolist(),
        hidden=hidden,
        rejected_rows=len(sampled_rejects),
    )
