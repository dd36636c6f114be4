"""GRPO math against a plain-Python reference: group advantages, the clipped token-mean loss, k3 KL,
exact gradient accumulation, and clear errors."""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections import defaultdict

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tlt_stream.rl.grpo import GrpoLossConfig, group_advantages, grpo_loss, token_logprobs

# --- plain-Python references -------------------------------------------------------------------------


def reference_advantages(
    rewards: list[float], groups: list[int], *, scale: bool, eps: float = 1e-6
) -> tuple[list[float], list[bool]]:
    members: dict[int, list[int]] = defaultdict(list)
    for i, g in enumerate(groups):
        members[g].append(i)
    advantages = [0.0] * len(rewards)
    degenerate = [False] * len(rewards)
    for idx in members.values():
        values = [rewards[i] for i in idx]
        if len(set(values)) == 1:
            for i in idx:
                degenerate[i] = True
            continue
        mu = statistics.fmean(values)
        sd = statistics.pstdev(values)
        for i in idx:
            advantages[i] = (rewards[i] - mu) / (sd + eps) if scale else rewards[i] - mu
    return advantages, degenerate


def reference_loss(
    logp: list[list[float]],
    old: list[list[float]],
    adv: list[float],
    mask: list[list[int]],
    *,
    clip_low: float,
    clip_high: float,
    kl_coef: float = 0.0,
    ref: list[list[float]] | None = None,
    total: int | None = None,
) -> dict[str, float]:
    """Loss, clip fraction and mean k3 to the reference, token by token."""
    total_term, tokens, clipped, kl_sum = 0.0, 0, 0, 0.0
    for b, row in enumerate(mask):
        a = adv[b]
        for t, keep in enumerate(row):
            if not keep:
                continue
            tokens += 1
            ratio = math.exp(logp[b][t] - old[b][t])
            if a > 0 and ratio > 1 + clip_high:
                objective = (1 + clip_high) * a
                clipped += 1
            elif a < 0 and ratio < 1 - clip_low:
                objective = (1 - clip_low) * a
                clipped += 1
            else:
                objective = ratio * a
            term = -objective
            if ref is not None:
                d = ref[b][t] - logp[b][t]
                kl = math.exp(d) - d - 1
                kl_sum += kl
                term += kl_coef * kl
            total_term += term
    return {
        "loss": total_term / (total if total is not None else tokens),
        "clip_fraction": clipped / tokens,
        "kl_ref": kl_sum / tokens,
        "tokens": tokens,
    }


def random_batch(b: int, t: int, seed: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g, dtype=dtype) * 3  # [B, T]
    logp = old + 0.4 * torch.randn(b, t, generator=g, dtype=dtype)
    ref = old + 0.3 * torch.randn(b, t, generator=g, dtype=dtype)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    starts = torch.randint(0, t, (b,), generator=g).minimum(t - lengths)
    pos = torch.arange(t)
    mask = ((pos >= starts[:, None]) & (pos < (starts + lengths)[:, None])).to(dtype)  # [B, T]
    adv = torch.randn(b, generator=g, dtype=dtype)
    return {"logprobs": logp, "old_logprobs": old, "ref_logprobs": ref, "mask": mask, "advantages": adv}


# --- advantages --------------------------------------------------------------------------------------

GROUPS: list[tuple[int, list[float]]] = [
    (7, [1.0, 0.0, 0.0, 1.0]),
    (2, [1.0, 1.0, 1.0]),  # all correct
    (42, [0.5]),  # size 1
    (0, [0.0, 0.0, 0.0, 0.0, 0.0]),  # all wrong
    (13, [0.25, 0.75]),
    (5, [0.1, 0.9, 0.3, 0.3, 0.0, 1.0]),
]


def shuffled_groups(seed: int = 0) -> tuple[list[float], list[int]]:
    flat = [(g, r) for g, rs in GROUPS for r in rs]
    order = torch.randperm(len(flat), generator=torch.Generator().manual_seed(seed)).tolist()
    return [flat[i][1] for i in order], [flat[i][0] for i in order]


@pytest.mark.parametrize("scale", [True, False])
def test_advantages_match_reference(scale: bool) -> None:
    rewards, groups = shuffled_groups()
    assert groups != sorted(groups), "group ids are interleaved"
    adv, degenerate = group_advantages(torch.tensor(rewards), torch.tensor(groups), scale=scale)
    expected, expected_degenerate = reference_advantages(rewards, groups, scale=scale)
    assert adv.dtype == torch.float32 and degenerate.dtype == torch.bool
    assert adv.tolist() == pytest.approx(expected, abs=1e-6)
    assert degenerate.tolist() == expected_degenerate
    assert sum(expected_degenerate) == 3 + 1 + 5


def test_degenerate_groups_are_exactly_zero_even_without_eps() -> None:
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.7, 0.2, 0.7])  # 0.1 * 3 / 3 is not exactly 0.1
    groups = torch.tensor([3, 3, 3, 9, 1, 9])
    adv, degenerate = group_advantages(rewards, groups, eps=0.0)
    assert degenerate.tolist() == [True, True, True, True, True, True]
    assert torch.equal(adv, torch.zeros(6))


def test_single_group_by_default() -> None:
    rewards = [0.0, 1.0, 1.0, 0.0, 1.0]
    adv, degenerate = group_advantages(torch.tensor(rewards))
    expected, _ = reference_advantages(rewards, [0] * 5, scale=True)
    assert adv.tolist() == pytest.approx(expected, abs=1e-6)
    assert not degenerate.any()


def test_integer_rewards_give_float_advantages() -> None:
    adv, _ = group_advantages(torch.tensor([0, 1, 1, 0]), scale=False)
    assert adv.dtype == torch.float32 and adv.tolist() == [-0.5, 0.5, 0.5, -0.5]


@settings(max_examples=40, deadline=None)
@given(
    groups=st.lists(st.lists(st.integers(0, 8), min_size=1, max_size=12), min_size=1, max_size=4),
    scale=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_advantages_are_centred_and_unit_scaled(groups: list[list[int]], scale: bool, seed: int) -> None:
    flat = [(gid * 10, r / 4) for gid, rs in enumerate(groups) for r in rs]  # partial-credit rewards
    order = torch.randperm(len(flat), generator=torch.Generator().manual_seed(seed)).tolist()
    ids = torch.tensor([flat[i][0] for i in order])
    rewards = torch.tensor([flat[i][1] for i in order])
    adv, degenerate = group_advantages(rewards, ids, scale=scale)
    for gid, rs in enumerate(groups):
        members = ids == gid * 10
        values = adv[members].tolist()
        if len(set(rs)) == 1:
            assert degenerate[members].all() and values == [0.0] * len(rs)
            continue
        assert not degenerate[members].any()
        assert abs(statistics.fmean(values)) < 1e-5
        if scale:
            assert statistics.pstdev(values) == pytest.approx(1.0, abs=1e-4)
        else:
            assert statistics.pstdev(values) == pytest.approx(statistics.pstdev([r / 4 for r in rs]), abs=1e-5)


def test_advantage_errors() -> None:
    with pytest.raises(ValueError, match="1-D"):
        group_advantages(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="must match rewards"):
        group_advantages(torch.zeros(4), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="integer"):
        group_advantages(torch.zeros(3), torch.zeros(3))
    with pytest.raises(ValueError, match="finite"):
        group_advantages(torch.tensor([0.0, math.nan]))
    with pytest.raises(ValueError, match="eps"):
        group_advantages(torch.zeros(3), eps=-1.0)


# --- config ------------------------------------------------------------------------------------------


def test_config_defaults_and_validation() -> None:
    from tlt_stream.basics.config import DEFAULTS

    config = GrpoLossConfig()  # the learner's defaults, written once in the configuration tree
    assert (config.clip_low, config.clip_high, config.kl_coef) == (0.2, 0.28, 0.0)
    assert (config.clip_low, config.clip_high) == (DEFAULTS.learner.clip_low, DEFAULTS.learner.clip_high)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.clip_low = 0.3  # type: ignore[misc]
    assert GrpoLossConfig(clip_low=0.2, clip_high=0.28).clip_high == 0.28
    with pytest.raises(ValueError, match="clip_low must be < 1"):
        GrpoLossConfig(clip_low=1.0)
    for bad in ({"clip_low": -0.1}, {"clip_high": -0.1}, {"kl_coef": -1.0}, {"clip_high": math.inf}):
        with pytest.raises(ValueError, match=f"{next(iter(bad))} must be finite and >= 0"):
            GrpoLossConfig(**bad)


# --- token_logprobs ----------------------------------------------------------------------------------


@pytest.mark.parametrize("magnitude", [1.0, 1e4])
def test_token_logprobs_match_log_softmax(magnitude: float) -> None:
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 5, 11, generator=g) * magnitude  # [B, T, V]
    targets = torch.randint(0, 11, (2, 5), generator=g)  # [B, T]
    expected = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[..., None]).squeeze(-1)
    got = token_logprobs(logits, targets)
    assert got.shape == (2, 5) and got.dtype == torch.float32
    assert torch.isfinite(got).all()
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_token_logprobs_upcast_low_precision_logits() -> None:
    logits = torch.randn(1, 4, 7, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    targets = torch.tensor([[0, 6, 3, 3]])
    expected = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[..., None]).squeeze(-1)
    assert torch.allclose(token_logprobs(logits, targets), expected, atol=1e-6)


def test_token_logprobs_shape_errors() -> None:
    with pytest.raises(ValueError, match=r"logits \[B, T, V\]"):
        token_logprobs(torch.zeros(2, 5), torch.zeros(2, 5, dtype=torch.long))
    with pytest.raises(ValueError, match=r"targets \[B, T\]"):
        token_logprobs(torch.zeros(2, 5, 3), torch.zeros(2, 4, dtype=torch.long))


# --- clipped loss ------------------------------------------------------------------------------------

RATIOS = [0.5, 0.75, 0.95, 1.0, 1.1, 1.35]  # below, inside and above [0.8, 1.28]


def test_clipped_loss_matches_reference_on_both_sides() -> None:
    config = GrpoLossConfig(clip_low=0.2, clip_high=0.28)
    old = torch.tensor([[-1.0, -0.5, -2.0, -0.3, -1.5, -0.7], [-0.2, -2.5, -1.1, -0.9, -0.4, -3.0]])  # [B, T]
    logp = (old + torch.tensor(RATIOS).log()).requires_grad_(True)
    adv = torch.tensor([1.5, -0.7])
    mask = torch.ones(2, 6)
    loss, stats = grpo_loss(logp, old, adv, mask, config=config)
    expected = reference_loss(logp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), clip_low=0.2, clip_high=0.28)
    assert stats["loss"] == pytest.approx(expected["loss"], rel=1e-5)
    assert loss.item() == pytest.approx(expected["loss"], rel=1e-5)
    assert stats["clip_fraction"] == pytest.approx(3 / 12) == expected["clip_fraction"]  # 1.35 (A>0); 0.5, 0.75 (A<0)
    assert stats["tokens"] == 12.0 and stats["kl_ref"] == 0.0
    # d/dlogp of -r*A/N is -r*A/N where the unclipped term is selected, and 0 where the clip is active
    loss.backward()
    grad = logp.grad.tolist()
    for b, a in enumerate(adv.tolist()):
        for t, r in enumerate(RATIOS):
            active = (a > 0 and r > 1.28) or (a < 0 and r < 0.8)
            assert grad[b][t] == pytest.approx(0.0 if active else -r * a / 12, abs=1e-7)


def test_random_loss_matches_reference_with_kl() -> None:
    config = GrpoLossConfig(clip_low=0.1, clip_high=0.3, kl_coef=0.05)
    batch = random_batch(4, 9, seed=5)
    _, stats = grpo_loss(**batch, config=config)
    expected = reference_loss(
        batch["logprobs"].tolist(),
        batch["old_logprobs"].tolist(),
        batch["advantages"].tolist(),
        batch["mask"].tolist(),
        clip_low=0.1,
        clip_high=0.3,
        kl_coef=0.05,
        ref=batch["ref_logprobs"].tolist(),
    )
    assert stats["loss"] == pytest.approx(expected["loss"], rel=1e-5, abs=1e-7)
    assert stats["clip_fraction"] == pytest.approx(expected["clip_fraction"])
    assert stats["kl_ref"] == pytest.approx(expected["kl_ref"], rel=1e-5)
    assert stats["tokens"] == expected["tokens"]
    assert stats["approx_kl_old"] > 0


def test_masked_positions_change_nothing() -> None:
    config = GrpoLossConfig(kl_coef=0.1)
    batch = random_batch(3, 8, seed=6)
    mask = batch["mask"]
    assert (mask == 0).any()
    outputs = []
    for fill in (None, 200.0, -math.inf):
        logp = batch["logprobs"].clone()
        if fill is not None:
            logp[mask == 0] = fill
        logp.requires_grad_(True)
        loss, stats = grpo_loss(**{**batch, "logprobs": logp}, config=config)
        loss.backward()
        assert torch.isfinite(logp.grad).all()
        assert torch.equal(logp.grad[mask == 0], torch.zeros(int((mask == 0).sum())))
        outputs.append((loss.detach(), logp.grad, stats))
    for loss, grad, stats in outputs[1:]:
        assert torch.equal(loss, outputs[0][0]) and torch.equal(grad, outputs[0][1]) and stats == outputs[0][2]


def test_bool_and_float_masks_agree() -> None:
    batch = random_batch(3, 7, seed=7)
    config = GrpoLossConfig()
    loss_float, _ = grpo_loss(**batch, config=config)
    loss_bool, _ = grpo_loss(**{**batch, "mask": batch["mask"].bool()}, config=config)
    assert torch.equal(loss_float, loss_bool)


def test_token_mean_weighs_a_long_sequence_more() -> None:
    old = torch.full((2, 10), -1.0)
    logp = old.clone().requires_grad_(True)  # ratio 1 everywhere
    mask = torch.zeros(2, 10)
    mask[0, :8] = 1  # long response
    mask[1, 2:4] = 1  # short response
    adv = torch.tensor([1.0, -1.0])
    loss, _ = grpo_loss(logp, old, adv, mask, config=GrpoLossConfig())
    expected = reference_loss(logp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), clip_low=0.2, clip_high=0.2)
    assert loss.item() == pytest.approx(expected["loss"]) == pytest.approx(-(8 - 2) / 10)
    assert loss.item() != pytest.approx(0.0), "a sequence-mean would cancel the two rows out"
    loss.backward()
    assert torch.allclose(logp.grad[mask == 1].abs(), torch.full((10,), 0.1)), "every token weighs 1/10"
    assert logp.grad[0].abs().sum() == pytest.approx(4 * logp.grad[1].abs().sum())


# --- KL ----------------------------------------------------------------------------------------------


def test_kl_is_zero_when_reference_equals_policy() -> None:
    batch = random_batch(3, 6, seed=8)
    logp = batch["logprobs"].requires_grad_(True)
    loss_kl, stats = grpo_loss(**{**batch, "ref_logprobs": logp.detach()}, config=GrpoLossConfig(kl_coef=0.5))
    (grad_kl,) = torch.autograd.grad(loss_kl, logp)
    loss_plain, _ = grpo_loss(**{**batch, "ref_logprobs": None}, config=GrpoLossConfig())
    (grad_plain,) = torch.autograd.grad(loss_plain, logp)
    assert stats["kl_ref"] == 0.0
    assert torch.allclose(loss_kl, loss_plain) and torch.allclose(grad_kl, grad_plain)


def test_kl_reported_but_not_added_when_coef_is_zero() -> None:
    batch = random_batch(2, 5, seed=9)
    _, stats = grpo_loss(**batch, config=GrpoLossConfig())
    _, no_ref = grpo_loss(**{**batch, "ref_logprobs": None}, config=GrpoLossConfig())
    assert stats["kl_ref"] > 0 and no_ref["kl_ref"] == 0.0
    assert stats["loss"] == no_ref["loss"]


def test_kl_gradient_matches_analytic_form_and_finite_differences() -> None:
    kl_coef = 0.3
    config = GrpoLossConfig(kl_coef=kl_coef)
    batch = random_batch(2, 4, seed=10, dtype=torch.float64)
    batch["advantages"] = torch.zeros(2, dtype=torch.float64)  # isolate the KL term
    mask = batch["mask"]
    n = int(mask.sum())
    logp = batch["logprobs"].clone().requires_grad_(True)
    loss, _ = grpo_loss(**{**batch, "logprobs": logp}, config=config)
    (grad,) = torch.autograd.grad(loss, logp)
    b, t = (int(i) for i in mask.nonzero()[0])
    lp, ref = logp[b, t].item(), batch["ref_logprobs"][b, t].item()
    assert float(grad[b, t]) == pytest.approx(kl_coef * (1 - math.exp(ref - lp)) / n, rel=1e-9)
    h = 1e-6
    shifted = []
    for step in (h, -h):
        moved = batch["logprobs"].clone()
        moved[b, t] += step
        shifted.append(float(grpo_loss(**{**batch, "logprobs": moved}, config=config)[0]))
    assert float(grad[b, t]) == pytest.approx((shifted[0] - shifted[1]) / (2 * h), rel=1e-6)


# --- gradient accumulation ---------------------------------------------------------------------------


def test_micro_batches_accumulate_to_the_full_batch_gradient() -> None:
    torch.manual_seed(11)
    b, t, v, d = 6, 7, 13, 8
    policy = torch.nn.Linear(d, v)
    g = torch.Generator().manual_seed(12)
    features = torch.randn(b, t, d, generator=g)  # [B, T, D]
    targets = torch.randint(0, v, (b, t), generator=g)  # [B, T]
    batch = random_batch(b, t, seed=13)
    with torch.no_grad():
        current = token_logprobs(policy(features), targets)
    batch["old_logprobs"] = current + 0.3 * torch.randn(b, t, generator=g)
    batch["ref_logprobs"] = current + 0.2 * torch.randn(b, t, generator=g)
    del batch["logprobs"]
    config = GrpoLossConfig(clip_low=0.2, clip_high=0.28, kl_coef=0.1)

    def run(rows: slice, total_tokens: int | None) -> float:
        logp = token_logprobs(policy(features[rows]), targets[rows])
        micro = {k: x[rows] for k, x in batch.items()}
        loss, stats = grpo_loss(logp, **micro, config=config, total_tokens=total_tokens)
        loss.backward()
        return stats["loss"]

    full_loss = run(slice(None), None)
    full_grads = [p.grad.clone() for p in policy.parameters()]
    policy.zero_grad()
    total = int(batch["mask"].sum())
    micro_loss = sum(run(rows, total) for rows in (slice(0, 2), slice(2, 3), slice(3, 6)))
    assert micro_loss == pytest.approx(full_loss, rel=1e-5)
    for p, full in zip(policy.parameters(), full_grads, strict=True):
        assert torch.allclose(p.grad, full, rtol=1e-5, atol=1e-7)


def test_padding_only_micro_batch_contributes_zero() -> None:
    batch = random_batch(2, 5, seed=14)
    batch["mask"] = torch.zeros(2, 5)
    logp = batch.pop("logprobs").requires_grad_(True)
    loss, stats = grpo_loss(logp, **batch, config=GrpoLossConfig(), total_tokens=17)
    loss.backward()
    assert loss.item() == 0.0 and stats["tokens"] == 0.0 and stats["clip_fraction"] == 0.0
    assert torch.equal(logp.grad, torch.zeros(2, 5))


# --- errors ------------------------------------------------------------------------------------------


def test_loss_errors() -> None:
    config = GrpoLossConfig()
    batch = random_batch(2, 5, seed=15)
    cases: list[tuple[dict[str, object], str]] = [
        ({"logprobs": torch.zeros(10)}, r"logprobs must be \[B, T\]"),
        ({"old_logprobs": torch.zeros(2, 4)}, "old_logprobs .* must match logprobs"),
        ({"ref_logprobs": torch.zeros(3, 5)}, "ref_logprobs .* must match logprobs"),
        ({"mask": torch.ones(2, 6)}, "mask .* must match logprobs"),
        ({"advantages": torch.zeros(3)}, r"advantages must be \[B\]"),
        ({"advantages": torch.zeros(2, 1)}, r"advantages must be \[B\]"),
        ({"mask": torch.zeros(2, 5)}, "zero denominator"),
        ({"mask": torch.full((2, 5), 0.5)}, "only 0 and 1"),
        ({"total_tokens": 0}, "total_tokens must be > 0"),
    ]
    for change, message in cases:
        with pytest.raises(ValueError, match=message):
            grpo_loss(**{**batch, **change}, config=config)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs ref_logprobs"):
        grpo_loss(**{**batch, "ref_logprobs": None}, config=GrpoLossConfig(kl_coef=0.1))
