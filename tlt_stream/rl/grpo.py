"""GRPO math: group-relative advantages, per-token log-probabilities and the clipped policy loss.

GRPO needs no value model: each prompt is sampled G times and a response's advantage is its reward
relative to its own group, A_i = (r_i - mean(group)) / std(group). A group whose responses all earned the
same reward (all right, or all wrong) carries no learning signal; its advantages are exactly 0 and it is
reported as degenerate, so the caller can count it or resample it (DAPO's dynamic sampling).

The loss is PPO's clipped surrogate on the ratio p_new / p_old per response token, with an asymmetric
range [1 - clip_low, 1 + clip_high] ("clip-higher", DAPO) and an optional k3 KL penalty to a frozen
reference. It is averaged over *tokens*, not sequences (DAPO, verl "token-mean"): every response token
weighs the same, so a long reasoning trace is not diluted to the weight of a short one. The denominator
can be fixed to the whole step's token count, so micro-batches accumulate to exactly the full-batch loss.

Everything here is a pure function of tensors: no model, optimizer or I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tlt_stream.basics.config import DEFAULTS as _D

__all__ = ["GrpoLossConfig", "group_advantages", "grpo_loss", "token_logprobs"]


def group_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor | None = None, *, scale: bool = True, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-relative advantages and the mask of degenerate groups.

    `rewards` is `[N]`; `group_ids` is `[N]` integer, equal for samples of one prompt (any values, any order;
    None means a single group). A_i = r_i - mean(group), divided by (population std(group) + eps) when
    `scale`. Groups whose rewards are all equal, size-1 groups included, get A = 0 exactly and are marked
    in the returned bool `[N]` mask. Statistics are computed in float64; the advantages come back in the
    rewards' floating dtype (float32 for integer rewards).
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if eps < 0 or not math.isfinite(eps):
        raise ValueError(f"eps must be finite and >= 0, got {eps}")
    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    n = rewards.shape[0]
    if group_ids is None:
        group_ids = torch.zeros(n, dtype=torch.long, device=rewards.device)
    elif group_ids.shape != rewards.shape:
        raise ValueError(f"group_ids {tuple(group_ids.shape)} must match rewards {tuple(rewards.shape)}")
    elif group_ids.is_floating_point() or group_ids.is_complex() or group_ids.dtype == torch.bool:
        raise ValueError(f"group_ids must be an integer tensor, got {group_ids.dtype}")
    r = rewards.to(torch.float64)
    if not bool(torch.isfinite(r).all()):
        raise ValueError("rewards must be finite")

    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)  # [N], [G]
    g = counts.shape[0]
    size = counts.to(torch.float64)  # [G]
    mean = r.new_zeros(g).index_add_(0, inverse, r) / size  # [G]
    centered = r - mean[inverse]  # [N]
    high = r.new_zeros(g).scatter_reduce_(0, inverse, r, "amax", include_self=False)  # [G]
    low = r.new_zeros(g).scatter_reduce_(0, inverse, r, "amin", include_self=False)  # [G]
    degenerate = (high == low)[inverse]  # [N] all rewards equal, so also every size-1 group
    if scale:
        std = (r.new_zeros(g).index_add_(0, inverse, centered.square()) / size).sqrt()  # [G] population std
        centered = centered / (std[inverse] + eps)
    advantages = torch.where(degenerate, torch.zeros_like(centered), centered)
    return advantages.to(out_dtype), degenerate


@dataclass(frozen=True)
class GrpoLossConfig:
    """The loss's parameters for a loss run without a configuration: the configuration's `learner.clip_low`,
    `learner.clip_high` (DAPO's clip-higher) and `learner.kl_coef` (k3 KL to the reference; 0: none)."""

    clip_low: float = _D.learner.clip_low
    clip_high: float = _D.learner.clip_high
    kl_coef: float = _D.learner.kl_coef

    def __post_init__(self) -> None:
        for name in ("clip_low", "clip_high", "kl_coef"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be finite and >= 0, got {value}")
        if self.clip_low >= 1:
            raise ValueError(f"clip_low must be < 1 (the ratio's lower bound 1 - clip_low > 0), got {self.clip_low}")


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[b, t, targets[b, t]] as `[B, T]` float32, without materialising the log-softmax.

    `logits` is `[B, T, V]` (any float dtype; upcast to float32), `targets` is `[B, T]` token ids.
    """
    if logits.dim() != 3 or targets.shape != logits.shape[:2]:
        raise ValueError(f"need logits [B, T, V] and targets [B, T], got {tuple(logits.shape)}, {tuple(targets.shape)}")
    logits = logits.float()
    picked = logits.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)  # [B, T]
    return picked - torch.logsumexp(logits, dim=-1)  # [B, T]


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    config: GrpoLossConfig,
    ref_logprobs: torch.Tensor | None = None,
    total_tokens: int | None = None,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The clipped GRPO loss, token-mean over response tokens, and its statistics.

    `logprobs` (with grad), `old_logprobs` (the sampling policy), `ref_logprobs` and `mask` are `[B, T]`;
    `mask` is 1 on response tokens and 0 on prompt and padding (bool or 0/1 float); `advantages` is `[B]`.
    Old and reference log-probs and advantages are constants (detached). Per token, with r = exp(logp - old):

        objective = min(r * A, clamp(r, 1 - clip_low, 1 + clip_high) * A)
        kl        = exp(ref - logp) - (ref - logp) - 1                     (k3, an estimate of KL(new || ref))
        loss      = sum over response tokens of (-objective + kl_coef * kl) / denominator

    The denominator is `total_tokens` when given, else this call's response-token count. Give every
    micro-batch of a step the step's total and the micro-batch losses (and gradients) sum to exactly the
    full-batch ones; a micro-batch with no response tokens then contributes 0. Masked positions never
    reach the loss or the gradient, whatever values they hold (even inf).

    Statistics, as python floats over this call's response tokens (0.0 when it has none): "loss" (this
    call's contribution), "clip_fraction" (tokens where the clipped term was selected and differs from the
    unclipped one, i.e. their gradient is cut), "approx_kl_old" (mean k3 estimate of KL(old || new),
    r - 1 - log r: nonnegative, second order in log r), "kl_ref" (mean k3 to the reference; 0.0 without
    one) and "tokens" (the response-token count).

    `token_weights` (`[B, T]`, constants): each token's objective is multiplied by its weight (truncated
    importance sampling's min(p_learner / p_rollout, C)); the KL term is not.
    """
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, T], got shape {tuple(logprobs.shape)}")
    shape = logprobs.shape
    named = {"old_logprobs": old_logprobs, "mask": mask}
    if ref_logprobs is not None:
        named["ref_logprobs"] = ref_logprobs
    for name, tensor in named.items():
        if tensor.shape != shape:
            raise ValueError(f"{name} {tuple(tensor.shape)} must match logprobs {tuple(shape)}")
    if advantages.shape != shape[:1]:
        raise ValueError(f"advantages must be [B] = {tuple(shape[:1])}, got {tuple(advantages.shape)}")
    if config.kl_coef > 0 and ref_logprobs is None:
        raise ValueError(f"kl_coef = {config.kl_coef} > 0 needs ref_logprobs")
    if mask.dtype != torch.bool and not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("mask must hold only 0 and 1 (use advantages, not the mask, to weight tokens)")

    response = mask.bool()  # [B, T]
    count = int(response.sum())
    if total_tokens is not None:
        if not total_tokens > 0:
            raise ValueError(f"total_tokens must be > 0, got {total_tokens}")
        denominator = float(total_tokens)
    elif count == 0:
        raise ValueError("mask selects no tokens: the token-mean loss has a zero denominator")
    else:
        denominator = float(count)

    dtype = logprobs.dtype
    zero = torch.zeros((), dtype=dtype, device=logprobs.device)
    log_ratio = torch.where(response, logprobs - old_logprobs.detach().to(dtype), zero)  # [B, T], 0 off-response
    ratio = log_ratio.exp()
    adv = advantages.detach().to(dtype)[:, None]  # [B, 1]
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - config.clip_low, 1 + config.clip_high) * adv
    per_token = -torch.minimum(unclipped, clipped)  # [B, T]
    if token_weights is not None:
        if token_weights.shape != shape:
            raise ValueError(f"token_weights {tuple(token_weights.shape)} must match logprobs {tuple(shape)}")
        per_token = per_token * torch.where(response, token_weights.detach().to(dtype), zero)
    kl = None
    if ref_logprobs is not None:
        ref_minus_logp = torch.where(response, ref_logprobs.detach().to(dtype) - logprobs, zero)  # [B, T]
        kl = ref_minus_logp.exp() - ref_minus_logp - 1  # [B, T] k3, >= 0
        if config.kl_coef > 0:
            per_token = per_token + config.kl_coef * kl
    loss = torch.where(response, per_token, zero).sum() / denominator

    with torch.no_grad():
        per = 1.0 / count if count else 0.0
        cut = (clipped < unclipped) & response
        kl_old = ratio - 1 - log_ratio  # 0 off-response
        stats = {
            "loss": float(loss.detach()),
            "clip_fraction": float(cut.sum()) * per,
            "approx_kl_old": float(kl_old.sum()) * per,
            "kl_ref": float(torch.where(response, kl, zero).sum()) * per if kl is not None else 0.0,
            "tokens": float(count),
        }
    return loss, stats
