"""The GRPO learner's section."""

from __future__ import annotations

from typing import Annotated, Literal

from tlt_stream.basics.config.fields import (
    PositiveInt,
    Section,
    check_device,
    doc,
)

__all__ = ["LearnerConfig"]


class LearnerConfig(Section, frozen=True):
    """The GRPO learner: one per run."""

    run_dir: Annotated[
        str | None, doc("Checkpoints and metrics.jsonl (required by the learner; {run} is the run name).")
    ] = None
    policy: Annotated[
        str | None, doc("Initial policy checkpoint, used when run_dir holds none (required by the learner).")
    ] = None
    groups_per_step: Annotated[
        PositiveInt | None, doc("Complete, usable groups per update. None: policy.prompts_per_step.")
    ] = None
    lr: Annotated[float, doc("AdamW learning rate (the field's default for a real model; see the presets).", gt=0)] = (
        1e-6
    )
    warmup_steps: Annotated[
        int,
        doc(
            "The learning rate ramps linearly from lr / warmup_steps to lr over the first updates (a fresh Adam "
            "makes sign-like steps of size lr until its second moments have seen a few gradients).",
            ge=0,
        ),
    ] = 0
    weight_decay: Annotated[float, doc("AdamW weight decay.", ge=0)] = 0.0
    max_grad_norm: Annotated[
        float, doc("Gradients are clipped to this global norm before each step (0: no clipping).", ge=0)
    ] = 1.0
    micro_batch_tokens: Annotated[
        int, doc("Padded tokens per forward/backward; the update does not depend on it, memory and speed do.", ge=1)
    ] = 8192
    clip_low: Annotated[float, doc("PPO ratio lower clip: 1 - clip_low.", ge=0)] = 0.2
    clip_high: Annotated[float, doc("PPO ratio upper clip: 1 + clip_high (DAPO's clip-higher).", ge=0)] = 0.28
    kl_coef: Annotated[float, doc("Weight of the k3 KL penalty to the frozen reference (0: none kept).", ge=0)] = 0.0
    overlong: Annotated[
        Literal["keep", "mask"],
        doc(
            "Responses cut off at rollout.max_len (finish reason length, counted per step as `truncated`): keep "
            "them in the loss, or mask them out of it (DAPO's overlong filtering; their group's advantages stand)."
        ),
    ] = "keep"
    tis_cap: Annotated[
        float | None,
        doc(
            "Truncated importance sampling: each token's loss is weighted by min(p_learner / p_rollout, tis_cap), "
            "correcting for the rollout engine's numerics (another kernel, dtype or engine than the learner's); "
            "the PPO ratio is then taken against the learner's own log-probabilities. None: off (the ratio is "
            "against the rollout's). Each step reports the mismatch either way (logprob_mismatch_mean, _max)."
        ),
    ] = None
    scale_advantages: Annotated[
        bool, doc("Divide group-centred rewards by the group's std (GRPO); false: centring only (Dr. GRPO).")
    ] = True
    compute_dtype: Annotated[
        Literal["auto", "float32", "bfloat16"],
        doc(
            "The dtype of the learner's forward and backward (autocast); its weights and AdamW state stay fp32 "
            "masters whatever this is. auto: bfloat16 on a CUDA device that supports it, else float32. Weights "
            "are published to the rollout workers in rollout.dtype (resolved on the learner's device)."
        ),
    ] = "auto"
    final_norm_lr_scale: Annotated[
        float,
        doc(
            "The final norm's gain (the policy's own inverse temperature) trains at lr x this. Adam moves every "
            "parameter by about lr whatever its size, so a gain of ~1 moves 20-50x less, relatively, than a "
            "weight matrix; the tiny world learns fastest by sharpening (preset tiny-world: x 800).",
            gt=0,
        ),
    ] = 1.0
    accumulate: Annotated[
        bool | Literal["auto"],
        doc(
            "Each update runs a group's forward and backward as soon as the group is complete, unnormalised, and "
            "applies the step once its last group is in: the batch update up to floating-point summation order, "
            "ending one optimizer step (plus the last group's backward) after the step's last sample. A policy "
            "with dropout cannot be accumulated (its update is a random draw, another one when the work is split "
            "differently). auto: accumulate unless the policy has dropout, which the learner then names in one "
            "log line and runs the batch update; true: accumulate, a policy with dropout refused at start; false: "
            "every forward and backward runs after the step's last group (the batch update)."
        ),
    ] = "auto"
    accumulate_threads: Annotated[
        int,
        doc(
            "While the learner accumulates (learner.accumulate): torch threads of a group added while its step "
            "still waits for more groups (on-policy, the rollout generates the step's tail beside it on the same "
            "cores); the group that completes the step and the optimizer step use learner.threads. 0: "
            "learner.threads throughout.",
            ge=0,
        ),
    ] = 1
    accumulate_below_rows: Annotated[
        PositiveInt | None,
        doc(
            "While the learner accumulates (learner.accumulate): a complete group is added at once only while the "
            "rollout workers have fewer than this many rows in flight (the sum of the rows_in_flight their "
            "registry records report); "
            "otherwise complete groups wait and are added when the rows drop below it, or once the step has all "
            "its groups. The same groups, order and update either way; it keeps the learner off the cores while "
            "a busy rollout uses them. None: add every group as it completes."
        ),
    ] = None
    activation_checkpointing: Annotated[
        bool,
        doc(
            "Recompute each decoder layer's activations in the backward pass instead of keeping them (less "
            "memory for about one more forward); the update is the same either way."
        ),
    ] = False
    collective_timeout_s: Annotated[
        float,
        doc(
            "Under torchrun (WORLD_SIZE > 1): how long a rank waits in one collective before giving up (a rank "
            "that died mid-update ends the others after at most this; torchrun usually ends them sooner).",
            gt=0,
        ),
    ] = 600.0
    keep_checkpoints: Annotated[int, doc("Complete checkpoints kept on disk (the newest).", ge=1)] = 3
    log_to: Annotated[
        tuple[Literal["tensorboard", "wandb"], ...],
        doc(
            "Experiment trackers that get every step's figures and sampled responses (RUN_DIR/tensorboard, "
            "RUN_DIR/wandb; pip install 'tlt-stream[tracking]'). metrics.jsonl is written either way."
        ),
    ] = ()
    wandb_project: Annotated[str, doc("The W&B project of the run.")] = "tlt-stream"
    wandb_mode: Annotated[
        Literal["offline", "online", "disabled"],
        doc("offline: written under RUN_DIR/wandb, nothing sent (wandb sync uploads it later); online: sent."),
    ] = "offline"
    log_samples: Annotated[
        int,
        doc(
            "Sampled (prompt, response, reward) per step written to RUN_DIR/samples.jsonl and the log (the "
            "report shows the newest), the first by sample id; 0: none.",
            ge=0,
        ),
    ] = 2
    max_updates: Annotated[
        PositiveInt | None, doc("Stop after this many updates of this process (None: no limit).")
    ] = None
    until_version: Annotated[
        PositiveInt | None,
        doc("Stop at this policy version, counting what a resumed checkpoint holds. None: policy.steps."),
    ] = None
    threads: Annotated[int, doc("Torch CPU threads of the learner process.", ge=1)] = 1
    device: Annotated[str, doc("auto (CUDA when torch sees a device, else CPU), cpu, cuda or cuda:N.")] = "auto"

    def __post_init__(self) -> None:
        check_device(self.device, "learner.device")
        if self.tis_cap is not None and not self.tis_cap >= 1:
            raise ValueError(f"learner.tis_cap must be >= 1 (got {self.tis_cap})")
