"""One GRPO update over complete groups: the learner's compute, free of streams and processes.

`LearnerCore.step(groups)` turns the groups' samples into padded micro-batches of about
`micro_batch_tokens` tokens (`batches.py`), recomputes the policy's log-probabilities of the response tokens
(logits divided by the rollout temperature, as the behaviour logprobs were), and accumulates the clipped
token-mean GRPO loss (`grpo.py`) with every micro-batch normalised by the *step's* response-token count,
so the update is the full-batch update whatever the micro-batch size. Then gradient clipping and one
AdamW step. Groups whose rewards are all equal carry no signal (their advantages are exactly 0); they are
left out of the batch and counted. The service around it (`roles/learner.py`) owns reading, acking,
checkpointing and publishing. The same pieces (`plan`, `backward`, `apply`) build an update group by group
as the groups complete, unnormalised until the last one is in (`accumulate.py`).

Sharded over torchrun's ranks (`rl/sharded.py`), the same core runs on every rank: rank 0 plans the update
(advantages, the used samples, the step's token count), deals the samples out so each rank gets about the
same number of tokens, and hands each its micro-batches (`rl/ranks.py`); every rank then runs the same
number of forward/backward rounds (FSDP's all-gathers and reduce-scatters are collectives), its losses still
divided by the whole step's token count, so the summed gradient, and the update, is the single process's.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import torch

from tlt_stream.basics.config import DEFAULTS as _D
from tlt_stream.basics.config import Config
from tlt_stream.basics.messages import Sample
from tlt_stream.rl.batches import BATCH_KEYS, deal_by_tokens, micro_batches, with_idle
from tlt_stream.rl.groups import ReadyGroup
from tlt_stream.rl.grpo import GrpoLossConfig, group_advantages, grpo_loss, token_logprobs
from tlt_stream.rl.metrics import length_summary
from tlt_stream.rl.ranks import RanksOutOfStep

if TYPE_CHECKING:
    from tlt_stream.rl.ranks import RankLink

__all__ = [
    "LearnerCore",
    "LearnerSettings",
    "LossSums",
    "StepPlan",
    "compute_dtype_on",
    "deal_by_tokens",
    "final_norm_gain",
    "load_for_training",
]


@dataclass(frozen=True)
class LearnerSettings:
    """The learner core's parameters, for a core run without a configuration (tests, benchmarks): each field
    is the configuration's `learner.<name>` (`temperature` is `rollout.temperature`, so the recomputed
    log-probabilities are those the samples were drawn with), with its default and its meaning there."""

    lr: float = _D.learner.lr
    weight_decay: float = _D.learner.weight_decay
    max_grad_norm: float = _D.learner.max_grad_norm
    micro_batch_tokens: int = _D.learner.micro_batch_tokens
    clip_low: float = _D.learner.clip_low
    clip_high: float = _D.learner.clip_high
    kl_coef: float = _D.learner.kl_coef
    tis_cap: float | None = _D.learner.tis_cap
    overlong: str = _D.learner.overlong
    compute_dtype: str = _D.learner.compute_dtype
    temperature: float = _D.rollout.temperature
    scale_advantages: bool = _D.learner.scale_advantages
    final_norm_lr_scale: float = _D.learner.final_norm_lr_scale
    warmup_steps: int = _D.learner.warmup_steps
    activation_checkpointing: bool = _D.learner.activation_checkpointing
    reference: str | None = _D.learner.policy
    """The frozen reference of the KL term (`kl_coef` > 0): the initial policy's checkpoint, `learner.policy`,
    also when the learner resumes from a later checkpoint (None: the checkpoint a fresh start builds from)."""

    def __post_init__(self) -> None:
        if not (self.lr > 0 and self.micro_batch_tokens > 0 and self.temperature > 0 and self.max_grad_norm >= 0):
            raise ValueError("need lr > 0, micro_batch_tokens > 0, temperature > 0 and max_grad_norm >= 0")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if not self.final_norm_lr_scale > 0:
            raise ValueError(f"final_norm_lr_scale must be > 0, got {self.final_norm_lr_scale}")
        if self.compute_dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"compute_dtype must be auto, float32 or bfloat16, got {self.compute_dtype!r}")

    @classmethod
    def from_config(cls, config: Config) -> LearnerSettings:
        """The parameters of the configuration's `learner` section, with the rollout's temperature."""
        mine = {"temperature", "reference"}
        own = {f.name: getattr(config.learner, f.name) for f in fields(cls) if f.name not in mine}
        return cls(**own, temperature=config.rollout.temperature, reference=config.learner.policy)

    def lr_at(self, update: int) -> float:
        """The learning rate of update number `update` (0-based), a pure function so a resumed learner
        continues the schedule from its checkpoint's version."""
        if self.warmup_steps == 0:
            return self.lr
        return self.lr * min(1.0, (update + 1) / self.warmup_steps)

    @property
    def loss_config(self) -> GrpoLossConfig:
        return GrpoLossConfig(clip_low=self.clip_low, clip_high=self.clip_high, kl_coef=self.kl_coef)


@dataclass
class LossSums:
    """One rank's raw figures over the micro-batches it ran for an update; the update's figures are these,
    summed over ranks and divided by its response-token count (`loss` is already over `backward`'s divisor)."""

    loss: float = 0.0
    clipped: float = 0.0
    """Response tokens whose gradient the PPO clip cut."""
    kl_old: float = 0.0
    """Sum over response tokens of the k3 estimate of KL(old || new)."""
    kl_ref: float = 0.0
    mismatch: float = 0.0
    """Sum over response tokens of |learner logprob - rollout logprob|."""
    mismatch_max: float = 0.0
    tis: float = 0.0
    """Sum over response tokens of the truncated importance weights."""


@dataclass(frozen=True)
class StepPlan:
    """What an update over some groups trains on: every sample, its advantage, the positions of those that
    count (not degenerate, not empty, not masked) and their response tokens, and the figures known before
    any forward pass."""

    samples: list[Sample]
    advantages: torch.Tensor
    """[N] float64, within each group."""
    used: list[int]
    total: int
    figures: dict[str, float]


def final_norm_gain(model: Any) -> torch.nn.Parameter:
    """The gain of the norm just before the LM head of a transformers causal LM (`model.model.norm`, as in
    Llama and Qwen2), or ValueError naming what was found instead."""
    norm = getattr(getattr(model, "model", None), "norm", None)
    gain = getattr(norm, "weight", None)
    if not isinstance(gain, torch.nn.Parameter):
        raise ValueError(
            f"final_norm_lr_scale needs a final norm with a gain at model.model.norm.weight; "
            f"{type(model).__name__} has {type(norm).__name__ if norm is not None else 'none'}"
        )
    return gain


class LearnerCore:
    """The policy (a transformers causal LM), its optimizer and, with a KL term, a frozen reference. With
    `ranks`, this process is one rank of a sharded learner: `model` is already sharded (`rl/sharded.py`),
    rank 0 calls `step` and every other rank `follow` when rank 0 says so."""

    def __init__(
        self, model: Any, settings: LearnerSettings, *, reference: Any = None, ranks: RankLink | None = None
    ) -> None:
        if settings.kl_coef > 0 and reference is None:
            raise ValueError("kl_coef > 0 needs a frozen reference model")
        self.model = model
        self.settings = settings
        self.reference = reference
        self.ranks = ranks
        if reference is not None:
            reference.eval().requires_grad_(False)
        if settings.activation_checkpointing:  # per decoder layer, non-reentrant (works under FSDP2)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        groups: list[dict[str, Any]] = [{"params": list(model.parameters()), "lr_scale": 1.0}]
        self._gain: torch.nn.Parameter | None = None
        if settings.final_norm_lr_scale != 1.0:
            gain = self._gain = final_norm_gain(model)
            rest = [p for p in model.parameters() if p is not gain]
            groups = [{"params": rest, "lr_scale": 1.0}, {"params": [gain], "lr_scale": settings.final_norm_lr_scale}]
        self.optimizer = torch.optim.AdamW(
            groups, lr=settings.lr, weight_decay=settings.weight_decay, betas=(0.9, 0.999)
        )
        self.updates = 0
        self.device = next(model.parameters()).device
        self.compute_dtype = compute_dtype_on(settings.compute_dtype, self.device)
        """What forward and backward run in (autocast); the parameters stay in their own dtype (fp32)."""

    def step(self, groups: list[ReadyGroup]) -> dict[str, float]:
        """One update over `groups`; returns its metrics (rewards, lengths, loss statistics, timings). Sharded,
        rank 0 calls it and hands every rank its share of the micro-batches."""
        started = time.perf_counter()
        plan = self.plan(groups)
        metrics = dict(plan.figures)
        if not plan.used:  # nothing to learn from: no update, and no optimizer step that would decay weights
            metrics.update(loss=0.0, clip_fraction=0.0, approx_kl_old=0.0, kl_ref=0.0, grad_norm=0.0, updated=0.0)
            metrics["learn_seconds"] = time.perf_counter() - started
            return metrics
        self.optimizer.zero_grad(set_to_none=True)
        sums = LossSums()
        self.backward(plan, sums, total=plan.total)
        metrics.update(self.apply(sums, plan.total, scale=1.0))
        metrics["learn_seconds"] = time.perf_counter() - started
        return metrics

    def plan(self, groups: list[ReadyGroup]) -> StepPlan:
        """The update's samples, their advantages (within each group), which of them count and the figures
        that need no forward pass; ValueError for groups no update can take."""
        samples = [s for g in groups for s in g.samples]
        if not samples:
            raise ValueError("a learner step needs at least one group")
        if any(not s.prompt_ids for s in samples):
            raise ValueError("every sample needs at least one prompt token (the first response token's context)")
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
        group_ids = torch.tensor([i for i, g in enumerate(groups) for _ in g.samples])
        advantages, degenerate = group_advantages(rewards, group_ids, scale=self.settings.scale_advantages)
        used = [i for i in range(len(samples)) if not degenerate[i] and samples[i].response_len > 0]
        if self.settings.overlong == "mask":  # DAPO's overlong filtering: a cut-off response teaches nothing
            used = [i for i in used if samples[i].finish_reason != "length"]
        total = sum(samples[i].response_len for i in used)
        figures = {
            "groups": float(len(groups)),
            "samples": float(len(samples)),
            "reward_mean": float(rewards.mean()),
            "accuracy": float((rewards > 0).double().mean()),
            **length_summary(samples),
            "degenerate_groups": float(len({int(g) for g, d in zip(group_ids, degenerate, strict=True) if d})),
            "truncated": float(sum(s.finish_reason == "length" for s in samples)),
            "trained_tokens": float(total),
        }
        return StepPlan(samples, advantages, used, total, figures)

    def backward(self, plan: StepPlan, sums: LossSums, *, total: int | None) -> None:
        """Forward and backward over `plan`'s used samples, adding to the gradients and to `sums`: each loss
        divided by `total` (the update's response tokens), or, with None, not divided at all (the update is
        accumulated and `apply` scales it). Sharded, rank 0 deals the samples out by tokens and every rank runs
        as many rounds as the longest share (STEP, or ACCUMULATE without a total)."""
        if not plan.used:
            return
        self.model.train()
        denominator = 1 if total is None else total
        if self.ranks is None:
            self._backward(self._micro_batches(plan, plan.used), denominator, sums)
            return
        lengths = [len(plan.samples[i].prompt_ids) + plan.samples[i].response_len for i in plan.used]
        parts = deal_by_tokens(lengths, self.ranks.world)  # [rank] -> positions in `used`
        shares = [
            [[b[k] for k in BATCH_KEYS] for b in self._micro_batches(plan, [plan.used[j] for j in part])]
            for part in parts
        ]
        try:
            mine, rounds = self.ranks.hand_out(shares, total)
            batches = [dict(zip(BATCH_KEYS, tensors, strict=True)) for tensors in mine]
            self._backward(with_idle(batches, rounds, self.device), denominator, sums)
        except Exception as exc:  # a collective broke half-way: the ranks are no longer in step
            raise RanksOutOfStep(f"update {self.updates + 1} failed across ranks: {exc}") from exc

    def follow(self, total: int, rounds: int, sums: LossSums | None = None) -> None:
        """A rank other than 0, told STEP (with the update's `total`: backward, then apply) or ACCUMULATE (`sums`:
        only the backward, unnormalised, adding to the step's gradients): its share of what rank 0 hands out."""
        assert self.ranks is not None
        shares = self.ranks.receive_share()
        mine = [{k: t.to(self.device) for k, t in zip(BATCH_KEYS, tensors, strict=True)} for tensors in shares]
        self.model.train()
        if sums is None:
            self.optimizer.zero_grad(set_to_none=True)
        own = LossSums() if sums is None else sums
        self._backward(with_idle(mine, rounds, self.device), 1 if sums is not None else total, own)
        if sums is None:
            self.apply(own, total, scale=1.0)

    def _backward(self, batches: Iterable[dict[str, torch.Tensor]], denominator: int, sums: LossSums) -> None:
        """Forward and backward over `batches`, each loss divided by `denominator`, gradients added to what the
        parameters hold; this rank's raw figures added to `sums`."""
        for batch in batches:
            logprobs = self._logprobs(self.model, batch)
            with torch.no_grad():  # rollout vs learner on the same tokens: engine numerics, dtype, staleness
                delta = (logprobs.detach() - batch["old"]).abs()[batch["mask"]]
                sums.mismatch += float(delta.sum())
                sums.mismatch_max = max(sums.mismatch_max, float(delta.max()) if delta.numel() else 0.0)
            ref = None
            if self.reference is not None:
                with torch.no_grad():
                    ref = self._logprobs(self.reference, batch)
            old, weights = batch["old"], None
            if self.settings.tis_cap is not None:  # the ratio against the learner's own, the rollout's corrected
                old = logprobs.detach()
                weights = (old - batch["old"]).exp().clamp(max=self.settings.tis_cap)
                sums.tis += float(weights[batch["mask"]].sum())
            loss, stats = grpo_loss(
                logprobs,
                old,
                batch["advantages"],
                batch["mask"],
                config=self.settings.loss_config,
                ref_logprobs=ref,
                total_tokens=denominator,
                token_weights=weights,
            )
            loss.backward()
            sums.loss += stats["loss"]
            sums.clipped += stats["clip_fraction"] * stats["tokens"]
            sums.kl_old += stats["approx_kl_old"] * stats["tokens"]
            sums.kl_ref += stats["kl_ref"] * stats["tokens"]

    def apply(self, sums: LossSums, total: int, *, scale: float) -> dict[str, float]:
        """`_apply`; sharded, a collective that breaks in it leaves the ranks out of step (`RanksOutOfStep`),
        while a non-finite norm, which every rank sees alike, is an ordinary failed update."""
        if self.ranks is None:
            return self._apply(sums, total, scale=scale)
        try:
            return self._apply(sums, total, scale=scale)
        except FloatingPointError:
            raise
        except Exception as exc:
            raise RanksOutOfStep(f"update {self.updates + 1} failed across ranks: {exc}") from exc

    def _apply(self, sums: LossSums, total: int, *, scale: float) -> dict[str, float]:
        """Finish an update whose gradients the parameters hold: multiply them (and the summed loss) by `scale`
        (1 when each loss was already divided by `total`; 1 / `total` for an accumulated update), clip by the
        global gradient norm, take one AdamW step; the figures summed over ranks and divided by `total`. A
        non-finite norm applies nothing (FloatingPointError); the gradients are cleared either way."""
        figures = [sums.loss, sums.clipped, sums.kl_old, sums.kl_ref, sums.mismatch, sums.tis]
        mismatch_max = sums.mismatch_max
        if self.ranks is not None:  # each rank summed its share: the step's figures are the sums over ranks
            figures = self.ranks.sum(figures)
            mismatch_max = self.ranks.max(mismatch_max)
        loss, clipped, kl_old, kl_ref, mismatch, tis = figures
        params = list(self.model.parameters())
        if scale != 1.0:  # the accumulated sum becomes the token mean (DTensor grads scale their local piece)
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(scale)
        if self.settings.max_grad_norm > 0:  # sharded grads (DTensors): the norm is the global one
            norm = torch.nn.utils.clip_grad_norm_(params, self.settings.max_grad_norm)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        grad_norm = float(_whole(norm))
        if not math.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError(f"non-finite gradient norm ({grad_norm}); the update was not applied")
        lr = self.settings.lr_at(self.updates)
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.model.eval()
        self.updates += 1
        metrics = {
            "loss": loss * scale,
            "clip_fraction": clipped / total,
            "approx_kl_old": kl_old / total,
            "kl_ref": kl_ref / total,
            "grad_norm": grad_norm,
            "lr": lr,
            "updated": 1.0,
            "logprob_mismatch_mean": mismatch / total,
            "logprob_mismatch_max": mismatch_max,
        }
        if self.settings.tis_cap is not None:
            metrics["tis_weight_mean"] = tis / total
        if self._gain is not None:  # the policy's inverse temperature, in effect: watch it sharpen
            metrics["final_norm_gain"] = float(_whole(self._gain.detach().float().mean()))
        return metrics

    def _micro_batches(self, plan: StepPlan, used: list[int]) -> Iterator[dict[str, torch.Tensor]]:
        return micro_batches(
            plan.samples, plan.advantages, used, tokens=self.settings.micro_batch_tokens, device=self.device
        )

    def _logprobs(self, model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """`[B, W-1]`: the log-probability of each next token at the rollout's temperature where the batch's
        `mask` marks a response token, 0 before the first response token of the batch. The vocabulary-wide
        logits, the step's largest tensors (`[B, positions, V]` in fp32), are made only from that first
        response position on (`logits_to_keep`: not over the prompts) and scaled in place."""
        device = batch["ids"].device
        targets = batch["ids"][:, 1:]  # [B, W-1]
        answered = batch["mask"].any(0).nonzero()
        first = int(answered[0]) if answered.numel() else targets.shape[1] - 1  # an idle batch: one position
        with torch.autocast(device.type, dtype=self.compute_dtype, enabled=self.compute_dtype != torch.float32):
            keep = targets.shape[1] + 1 - first
            out = model(input_ids=batch["ids"], attention_mask=batch["attention"], use_cache=False, logits_to_keep=keep)
            logits = out.logits[:, :-1]  # [B, W-1-first, V]: the positions first..W-2
        logits = logits.float()  # log-softmax and the temperature in fp32, whatever the matmuls ran in
        if self.settings.temperature != 1.0:
            logits = logits.div_(self.settings.temperature)
        picked = token_logprobs(logits, targets[:, first:])
        return torch.cat([picked.new_zeros(picked.shape[0], first), picked], dim=1) if first else picked


def _whole(value: torch.Tensor) -> torch.Tensor:
    """A scalar as a plain tensor: a DTensor (a sharded model's norm, mean) gathered, anything else as it is."""
    from torch.distributed.tensor import DTensor

    return value.full_tensor() if isinstance(value, DTensor) else value


def compute_dtype_on(name: str, device: torch.device | str) -> torch.dtype:
    """The learner's compute dtype setting on `device`: auto is bfloat16 on a CUDA device that supports it,
    else float32 (bfloat16 matmuls are slow on most CPUs); an explicit value is taken as it is."""
    from tlt_stream.model.loader import resolve_dtype

    dtype = resolve_dtype(name, device)  # auto: bfloat16 on CUDA, else float32
    if name == "auto" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        return torch.float32
    return dtype


def load_for_training(source: Any, device: str = "cpu") -> Any:
    """A Hugging Face checkpoint as the learner's model: fp32 weights whatever dtype the checkpoint was saved
    in. transformers 5 loads a bf16 checkpoint as bf16, and AdamW on bf16 weights rounds an RL-sized update
    (lr ~1e-6 on weights of ~1e-2) to nothing: the run would look like it trains while the weights stand
    still. The fp32 weights are the master copy the optimizer state belongs to."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(source, use_safetensors=True, dtype=torch.float32).to(device)
