"""One GRPO update over complete groups: the learner's compute, free of streams and processes.

`LearnerCore.step(groups)` turns the groups' samples into padded micro-batches of about
`micro_batch_tokens` tokens, recomputes the policy's log-probabilities of the response tokens (logits
divided by the rollout temperature, as the behaviour logprobs were), and accumulates the clipped
token-mean GRPO loss (`grpo.py`) with every micro-batch normalised by the *step's* response-token count,
so the update is the full-batch update whatever the micro-batch size. Then gradient clipping and one
AdamW step. Groups whose rewards are all equal carry no signal (their advantages are exactly 0); they are
left out of the batch and counted. The service around it (`roles/learner.py`) owns reading, acking,
checkpointing and publishing.

Sharded over torchrun's ranks (`rl/sharded.py`), the same core runs on every rank: rank 0 plans the update
(advantages, the used samples, the step's token count), deals the samples out so each rank gets about the
same number of tokens, and hands each its micro-batches (`rl/ranks.py`); every rank then runs the same
number of forward/backward rounds (FSDP's all-gathers and reduce-scatters are collectives), its losses still
divided by the whole step's token count, so the summed gradient, and the update, is the single process's.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from tlt_stream.basics.config import DEFAULTS as _D
from tlt_stream.basics.config import Config
from tlt_stream.rl.groups import ReadyGroup
from tlt_stream.rl.grpo import GrpoLossConfig, group_advantages, grpo_loss, token_logprobs
from tlt_stream.rl.metrics import length_summary
from tlt_stream.rl.ranks import RanksOutOfStep

if TYPE_CHECKING:
    from tlt_stream.rl.ranks import RankLink

__all__ = [
    "LearnerCore",
    "LearnerSettings",
    "compute_dtype_on",
    "deal_by_tokens",
    "final_norm_gain",
    "load_for_training",
]

BATCH_KEYS = ("ids", "attention", "old", "mask", "advantages")
"""A micro-batch's tensors, in the order they are handed to another rank."""


@dataclass(frozen=True)
class LearnerSettings:
    lr: float = _D.learner.lr
    """AdamW learning rate."""
    weight_decay: float = _D.learner.weight_decay
    """AdamW weight decay."""
    max_grad_norm: float = _D.learner.max_grad_norm
    """Gradients are clipped to this global norm before each step (0 disables clipping)."""
    micro_batch_tokens: int = _D.learner.micro_batch_tokens
    """Padded tokens per forward/backward; the update does not depend on it, only memory and speed do."""
    clip_low: float = _D.learner.clip_low
    """PPO ratio lower clip: 1 - clip_low."""
    clip_high: float = _D.learner.clip_high
    """PPO ratio upper clip: 1 + clip_high (DAPO clip-higher)."""
    kl_coef: float = _D.learner.kl_coef
    """Weight of the k3 KL penalty to the frozen reference (0: no reference is kept)."""
    tis_cap: float | None = _D.learner.tis_cap
    """Truncated importance sampling's cap C (None: off); see the configuration's learner.tis_cap."""
    overlong: str = _D.learner.overlong
    """"keep" trains on responses cut off at the length limit; "mask" leaves them out of the loss (DAPO)."""
    compute_dtype: str = _D.learner.compute_dtype
    """Autocast dtype of forward and backward ("auto": bfloat16 on a CUDA device that has it, else float32);
    the weights and optimizer state are fp32 masters whatever it is."""
    temperature: float = _D.rollout.temperature
    """The rollout sampling temperature; logits are divided by it so ratios compare like with like."""
    scale_advantages: bool = _D.learner.scale_advantages
    """Divide group-centred rewards by the group's std (GRPO); False keeps only the centring (Dr. GRPO)."""
    final_norm_lr_scale: float = _D.learner.final_norm_lr_scale
    """The final norm's gain (the RMSNorm just before the LM head) trains at `lr` times this. That gain
    scales every logit, so it is the policy's own inverse temperature, and RL's most consistent signal on a
    sampled policy is to sharpen it; but Adam moves every parameter by about `lr` per step whatever its
    size, and a gain of ~1 moves 20-50x less, relatively, than a weight matrix of ~0.05. Measured on the
    tiny world (docs/benchmarks.md, issue 5): 50 turns +3 points in 189 updates into far more."""
    warmup_steps: int = _D.learner.warmup_steps
    """The learning rate ramps linearly from lr / warmup_steps to lr over the first updates. A fresh Adam
    makes sign-like steps of size lr on every parameter until its second moments have seen a few noisy
    gradients; on a small policy those first steps alone can undo what supervised training taught."""

    activation_checkpointing: bool = _D.learner.activation_checkpointing
    """Recompute each decoder layer's activations in the backward pass (less memory, the same update)."""

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
        """The learner's settings from the configuration tree (section learner; the temperature is the
        rollout's, so the recomputed logprobs are those the samples were drawn with)."""
        own = config.learner
        return cls(
            lr=own.lr,
            weight_decay=own.weight_decay,
            max_grad_norm=own.max_grad_norm,
            micro_batch_tokens=own.micro_batch_tokens,
            clip_low=own.clip_low,
            clip_high=own.clip_high,
            kl_coef=own.kl_coef,
            tis_cap=own.tis_cap,
            overlong=own.overlong,
            temperature=config.rollout.temperature,
            scale_advantages=own.scale_advantages,
            final_norm_lr_scale=own.final_norm_lr_scale,
            warmup_steps=own.warmup_steps,
            compute_dtype=own.compute_dtype,
            activation_checkpointing=own.activation_checkpointing,
        )

    def lr_at(self, update: int) -> float:
        """The learning rate of update number `update` (0-based), a pure function so a resumed learner
        continues the schedule from its checkpoint's version."""
        if self.warmup_steps == 0:
            return self.lr
        return self.lr * min(1.0, (update + 1) / self.warmup_steps)

    @property
    def loss_config(self) -> GrpoLossConfig:
        return GrpoLossConfig(clip_low=self.clip_low, clip_high=self.clip_high, kl_coef=self.kl_coef)


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
        samples = [s for g in groups for s in g.samples]
        if not samples:
            raise ValueError("a learner step needs at least one group")
        if any(not s.prompt_ids for s in samples):
            raise ValueError("every sample needs at least one prompt token (the first response token's context)")
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
        group_ids = torch.tensor([i for i, g in enumerate(groups) for _ in g.samples])
        advantages, degenerate = group_advantages(rewards, group_ids, scale=self.settings.scale_advantages)
        metrics: dict[str, float] = {
            "groups": float(len(groups)),
            "samples": float(len(samples)),
            "reward_mean": float(rewards.mean()),
            "accuracy": float((rewards > 0).double().mean()),
            **length_summary(samples),
            "degenerate_groups": float(len({int(g) for g, d in zip(group_ids, degenerate, strict=True) if d})),
            "truncated": float(sum(s.finish_reason == "length" for s in samples)),
        }
        used = [i for i in range(len(samples)) if not degenerate[i] and samples[i].response_len > 0]
        if self.settings.overlong == "mask":  # DAPO's overlong filtering: a cut-off response teaches nothing
            used = [i for i in used if samples[i].finish_reason != "length"]
        total = sum(samples[i].response_len for i in used)
        metrics["trained_tokens"] = float(total)
        if not used:  # nothing to learn from: no update, and no optimizer step that would decay weights
            metrics.update(loss=0.0, clip_fraction=0.0, approx_kl_old=0.0, kl_ref=0.0, grad_norm=0.0, updated=0.0)
            metrics["learn_seconds"] = time.perf_counter() - started
            return metrics
        if self.ranks is None:
            metrics.update(self._train(self._micro_batches(samples, advantages, used), total))
        else:
            lengths = [len(samples[i].prompt_ids) + samples[i].response_len for i in used]
            parts = deal_by_tokens(lengths, self.ranks.world)  # [rank] -> positions in `used`
            shares = [
                [[b[k] for k in BATCH_KEYS] for b in self._micro_batches(samples, advantages, [used[j] for j in part])]
                for part in parts
            ]
            try:
                mine, rounds = self.ranks.hand_out(shares, total)
                batches = [dict(zip(BATCH_KEYS, tensors, strict=True)) for tensors in mine]
                metrics.update(self._train(self._with_idle(batches, rounds), total))
            except FloatingPointError:  # every rank saw the same global norm and skipped the update
                raise
            except Exception as exc:  # a collective broke half-way: the ranks are no longer in step
                raise RanksOutOfStep(f"update {self.updates + 1} failed across ranks: {exc}") from exc
        metrics["learn_seconds"] = time.perf_counter() - started
        return metrics

    def follow(self, total: int, rounds: int) -> None:
        """A rank other than 0, told STEP: its share of the update rank 0 hands out."""
        assert self.ranks is not None
        shares = self.ranks.receive_share()
        mine = [{k: t.to(self.device) for k, t in zip(BATCH_KEYS, tensors, strict=True)} for tensors in shares]
        self._train(self._with_idle(mine, rounds), total)

    def _with_idle(self, batches: list[dict[str, torch.Tensor]], rounds: int) -> list[dict[str, torch.Tensor]]:
        """`batches` and empty ones up to `rounds`: a one-row batch without response tokens adds nothing to
        the loss or the gradient, but runs the round's collectives on a rank whose share is shorter."""
        idle = {
            "ids": torch.zeros(1, 2, dtype=torch.long, device=self.device),
            "attention": torch.ones(1, 2, dtype=torch.long, device=self.device),
            "old": torch.zeros(1, 1, device=self.device),
            "mask": torch.zeros(1, 1, dtype=torch.bool, device=self.device),
            "advantages": torch.zeros(1, dtype=torch.float64, device=self.device),
        }
        return batches + [idle] * (rounds - len(batches))

    def _train(self, batches: Iterable[dict[str, torch.Tensor]], total: int) -> dict[str, float]:
        """Forward and backward over `batches`, each loss divided by the whole update's `total` response tokens,
        then clipping by the global gradient norm and one AdamW step; the figures summed over ranks."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        sums = {"loss": 0.0, "clip_fraction": 0.0, "approx_kl_old": 0.0, "kl_ref": 0.0}
        mismatch_sum, mismatch_max, tis_sum = 0.0, 0.0, 0.0
        for batch in batches:
            logprobs = self._logprobs(self.model, batch)
            with torch.no_grad():  # rollout vs learner on the same tokens: engine numerics, dtype, staleness
                delta = (logprobs.detach() - batch["old"]).abs()[batch["mask"]]
                mismatch_sum += float(delta.sum())
                mismatch_max = max(mismatch_max, float(delta.max()) if delta.numel() else 0.0)
            ref = None
            if self.reference is not None:
                with torch.no_grad():
                    ref = self._logprobs(self.reference, batch)
            old, weights = batch["old"], None
            if self.settings.tis_cap is not None:  # the ratio against the learner's own, the rollout's corrected
                old = logprobs.detach()
                weights = (old - batch["old"]).exp().clamp(max=self.settings.tis_cap)
                tis_sum += float(weights[batch["mask"]].sum())
            loss, stats = grpo_loss(
                logprobs,
                old,
                batch["advantages"],
                batch["mask"],
                config=self.settings.loss_config,
                ref_logprobs=ref,
                total_tokens=total,
                token_weights=weights,
            )
            loss.backward()
            sums["loss"] += stats["loss"]
            for key in ("clip_fraction", "approx_kl_old", "kl_ref"):
                sums[key] += stats[key] * stats["tokens"] / total  # token-weighted means over the step
        if self.ranks is not None:  # each rank summed its share: the step's figures are the sums over ranks
            *summed, mismatch_sum, tis_sum = self.ranks.sum([*sums.values(), mismatch_sum, tis_sum])
            sums = dict(zip(sums, summed, strict=True))
            mismatch_max = self.ranks.max(mismatch_max)
        params = list(self.model.parameters())
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
        metrics = {**sums, "grad_norm": grad_norm, "lr": lr, "updated": 1.0}
        metrics["logprob_mismatch_mean"] = mismatch_sum / total
        metrics["logprob_mismatch_max"] = mismatch_max
        if self.settings.tis_cap is not None:
            metrics["tis_weight_mean"] = tis_sum / total
        if self._gain is not None:  # the policy's inverse temperature, in effect: watch it sharpen
            metrics["final_norm_gain"] = float(_whole(self._gain.detach().float().mean()))
        return metrics

    def _micro_batches(self, samples: list, advantages: torch.Tensor, used: list[int]):
        """Right-padded batches of prompt + response, longest first, about `micro_batch_tokens` each, on the
        policy's device."""
        order = sorted(used, key=lambda i: len(samples[i].prompt_ids) + samples[i].response_len, reverse=True)
        while order:
            width = len(samples[order[0]].prompt_ids) + samples[order[0]].response_len
            count = max(1, self.settings.micro_batch_tokens // width)
            take, order = order[:count], order[count:]
            ids = torch.zeros(len(take), width, dtype=torch.long)
            attention = torch.zeros(len(take), width, dtype=torch.long)
            # Response token j of row b sits at position p + j and is predicted by the logits at p + j - 1,
            # so old logprobs and the mask live on the shifted grid [B, width - 1].
            old = torch.zeros(len(take), width - 1)
            mask = torch.zeros(len(take), width - 1, dtype=torch.bool)
            for row, i in enumerate(take):
                s = samples[i]
                p, n = len(s.prompt_ids), s.response_len
                ids[row, :p] = torch.tensor(s.prompt_ids)
                ids[row, p : p + n] = s.token_ids.to_torch().long()
                attention[row, : p + n] = 1
                old[row, p - 1 : p - 1 + n] = s.logprobs.to_torch()
                mask[row, p - 1 : p - 1 + n] = True
            batch = {"ids": ids, "attention": attention, "old": old, "mask": mask, "advantages": advantages[take]}
            yield {name: tensor.to(self.device) for name, tensor in batch.items()}

    def _logprobs(self, model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        device = batch["ids"].device
        with torch.autocast(device.type, dtype=self.compute_dtype, enabled=self.compute_dtype != torch.float32):
            out = model(input_ids=batch["ids"], attention_mask=batch["attention"], use_cache=False)
            logits = out.logits[:, :-1]  # [B, W-1, V]
        logits = logits.float()  # log-softmax and the temperature in fp32, whatever the matmuls ran in
        if self.settings.temperature != 1.0:
            logits = logits / self.settings.temperature
        return token_logprobs(logits, batch["ids"][:, 1:])


def _whole(value: torch.Tensor) -> torch.Tensor:
    """A scalar as a plain tensor: a DTensor (a sharded model's norm, mean) gathered, anything else as it is."""
    from torch.distributed.tensor import DTensor

    return value.full_tensor() if isinstance(value, DTensor) else value


def deal_by_tokens(lengths: list[int], parts: int) -> list[list[int]]:
    """Positions 0..len(lengths)-1 dealt into `parts` lists of about equal total length: longest first, each
    to the list with the fewest tokens so far (the lowest index on a tie), so every rank does about the same
    work; a list may stay empty when there are fewer items than parts."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    dealt: list[list[int]] = [[] for _ in range(parts)]
    load = [0] * parts
    for position in sorted(range(len(lengths)), key=lambda j: lengths[j], reverse=True):
        target = min(range(parts), key=lambda r: (load[r], r))
        dealt[target].append(position)
        load[target] += lengths[position]
    return dealt


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
