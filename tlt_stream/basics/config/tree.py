"""The configuration tree: one frozen msgspec Struct per section, every setting once, with its one default and
its one docstring (the `Meta` description `tlt-stream config describe` prints).

Sections: `bus` (Redis and MQTT), `policy` (the policy service and the run's RL shape), `rollout` (a rollout
worker), `sd` (speculative decoding), `drafter` (online drafter training), `learner` (the GRPO learner) and
`launch` (what `tlt-stream run` starts). The role loops and the cores read their settings from here; where a
core keeps its own settings dataclass (it is used without a configuration too), its defaults are read from
`DEFAULTS`, never written again, which `tests/unit/test_config_tree.py` checks.

A recipe that belongs to one workload is a named preset (`PRESETS`), applied under whatever the file, the
environment and the flags say: `preset = "tiny-world"`.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from msgspec import Meta, Struct, field

from tlt_stream.basics.config.redact import redact_url

__all__ = [
    "DEFAULTS",
    "PRESETS",
    "BusConfig",
    "Config",
    "DataConfig",
    "DrafterConfig",
    "LaunchConfig",
    "LearnerConfig",
    "PolicyConfig",
    "RolloutConfig",
    "SdConfig",
]


def _doc(text: str, **constraints: Any) -> Meta:
    return Meta(description=text, **constraints)


DEVICE_PATTERN = r"^(auto|cpu|cuda(:\d+)?)$"
PositiveInt = Annotated[int, Meta(ge=1)]
REDIS_SCHEMES = ("redis", "rediss", "unix")
MQTT_SCHEMES = ("mqtt", "mqtts")
ARM_LABEL = (
    r"^(plain|ngram-d[1-9][0-9]*|group-d[1-9][0-9]*v[1-9][0-9]*"
    r"|d[1-9][0-9]*k[1-9][0-9]*v[1-9][0-9]*(\+g[1-9][0-9]*)?|d[1-9][0-9]*k1v[1-9][0-9]*\|g[1-9][0-9]*)$"
)


def _check_device(value: str, name: str) -> None:
    if not re.fullmatch(DEVICE_PATTERN, value):
        raise ValueError(f"{name} must be auto, cpu, cuda or cuda:N (got {value!r})")


def _check_url(value: str | None, schemes: tuple[str, ...], name: str) -> None:
    if value is None:
        return
    scheme = urlsplit(value).scheme
    if scheme not in schemes:
        allowed = ", ".join(f"{s}://" for s in schemes)
        raise ValueError(f"{name} must start with one of {allowed} (got {redact_url(value)!r})")


class _Section(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    pass


class BusConfig(_Section, frozen=True):
    """Where the data plane (Redis streams) and control plane (MQTT) live and how they are used."""

    redis_url: Annotated[
        str | None,
        _doc("Redis URL (redis://, rediss:// for TLS, unix://). None starts an embedded Redis-protocol server."),
    ] = None
    mqtt_url: Annotated[
        str | None,
        _doc("MQTT broker URL (mqtt://user:pass@host:1883, mqtts:// for TLS). None starts an embedded broker."),
    ] = None
    block_ms: Annotated[int, _doc("How long one XREADGROUP blocks waiting for entries, in ms.", ge=1)] = 1000
    read_count: Annotated[int, _doc("Entries fetched per XREADGROUP call.", ge=1, le=10_000)] = 16
    reclaim_idle_ms: Annotated[
        int, _doc("An entry pending this long (its consumer presumed dead) is reclaimed with XAUTOCLAIM.", ge=1)
    ] = 60_000
    max_deliveries: Annotated[
        int, _doc("An entry delivered this many times without an ack is moved to the dead stream.", ge=1)
    ] = 5
    backlog_limit: Annotated[
        int,
        _doc("Un-acked entries a durable stream may hold before its producers wait (backpressure).", ge=1),
    ] = 4096
    hidden_maxlen: Annotated[
        int, _doc("Approximate bound on the `hidden` stream (a lossy drafter-training buffer).", ge=1)
    ] = 2000
    hidden_max_bytes: Annotated[
        int,
        _doc(
            "Approximate bound on the Redis memory the `hidden` stream holds, in bytes: its MAXLEN is lowered to "
            "this over the typical entry size the producer measures (a running mean, allocator overhead included).",
            ge=1024,
        ),
    ] = 256 * 2**20
    stats_maxlen: Annotated[int, _doc("Approximate bound on the `stats` stream.", ge=1)] = 100_000
    dead_maxlen: Annotated[int, _doc("Approximate bound on the `dead` stream.", ge=1)] = 100_000
    max_message_bytes: Annotated[
        int, _doc("Entries larger than this are refused before decoding and dead-lettered.", ge=1024)
    ] = 64 * 2**20
    heartbeat_s: Annotated[float, _doc("Seconds between worker heartbeats.", gt=0)] = 2.0
    heartbeat_ttl_s: Annotated[
        float, _doc("A worker whose heartbeat is older than this disappears from the registry.", gt=0)
    ] = 10.0
    mqtt_keepalive_s: Annotated[int, _doc("MQTT keepalive interval in seconds.", ge=5)] = 30
    reconnect_max_s: Annotated[float, _doc("Cap on the reconnect backoff for Redis and MQTT, seconds.", gt=0)] = 30.0
    redis_retries: Annotated[
        int,
        _doc(
            "Retries of one Redis command (capped backoff, 5 s) before a service gives up on an outage and exits "
            "with code 3 for its supervisor to restart it (40: about three minutes).",
            ge=0,
        ),
    ] = 40
    store_root: Annotated[
        str | None,
        _doc(
            "Checkpoint store: policy and drafter locations announced on the control plane are read only when "
            "they resolve inside this directory (`tlt-stream run` and compose set it). None: not confined."
        ),
    ] = None
    relative_locations: Annotated[
        bool,
        _doc(
            "The learner announces policy locations relative to store_root, and every reader resolves them "
            "under its own store_root, so each node may mount the checkpoint store at a different path. "
            "false: absolute paths (the store at the same path on every node)."
        ),
    ] = False

    def __post_init__(self) -> None:
        _check_url(self.redis_url, REDIS_SCHEMES, "redis_url")
        _check_url(self.mqtt_url, MQTT_SCHEMES, "mqtt_url")
        if self.heartbeat_ttl_s <= self.heartbeat_s:
            raise ValueError("heartbeat_ttl_s must be greater than heartbeat_s")
        if self.relative_locations and self.store_root is None:
            raise ValueError("bus.relative_locations needs bus.store_root")


class PolicyConfig(_Section, frozen=True):
    """The policy service, and the shape of the run's RL steps every role agrees on."""

    steps: Annotated[
        int,
        _doc(
            "RL steps of the run: the policy service dispatches this many, the learner stops at this policy "
            "version (unless learner.until_version says otherwise), `tlt-stream run` ends there.",
            ge=1,
        ),
    ] = 60
    prompts_per_step: Annotated[
        int, _doc("Prompts dispatched per step; also the learner's groups per update (learner.groups_per_step).", ge=1)
    ] = 16
    group_size: Annotated[int, _doc("Samples per prompt (GRPO's G).", ge=1)] = 8
    max_staleness: Annotated[
        int,
        _doc(
            "How many policy versions a sample may lag the learner: the policy service dispatches step s once "
            "version s - max_staleness exists, and the learner drops older groups. 0: on-policy.",
            ge=0,
        ),
    ] = 0
    partial_rollouts: Annotated[
        bool,
        _doc(
            "Lossless partial rollouts. Workers re-verify rows in flight at every new version instead of "
            "draining first (speculative sampling with the old policy as the drafter), so every sample is "
            "exactly on-policy for the version it is stamped with. With max_staleness 0 the policy service "
            "also dispatches step s + 1 one version early, as drafts a worker may start under the version "
            "before in the slots the tail leaves free, sent only once re-verified (with max_staleness > 0 "
            "streaming fills the tail already and the window stays as it is). Torch engine only.",
        ),
    ] = False
    ahead_tokens: Annotated[
        int,
        _doc(
            "With partial_rollouts: how many tokens a draft row may generate before its version arrives (it "
            "then waits, holding no slot). A token count, never a content rule: the proof needs it. Drafts "
            "share every decode step with the tail rows the step waits for: on 2 CPU cores, bench/e2e.py "
            "measured 1.22x of synchronous RL at 64 and 0.69x at 512 (whole responses as drafts).",
            ge=1,
        ),
    ] = 64
    ahead_rows: Annotated[
        int,
        _doc(
            "With partial_rollouts: a worker starts drafts only while fewer rows than this run (0: in any free "
            "slot), and an on-policy request overtakes drafts held back. Set it to the batch past which a decode "
            "step's cost grows about linearly (a GPU's compute-bound knee), so drafts use only capacity a step "
            "gets nearly free. On 2 CPU cores the tiny policy's step at 64 rows costs 3.3x batch 1's (no knee "
            "below the batch): bench/e2e.py measured 16 no better than 0 (0.98x vs 1.07x of synchronous RL).",
            ge=0,
        ),
    ] = 0
    seed: Annotated[int, _doc("Seed of the prompt source (the prompts of step s depend on (seed, s) only).")] = 0
    start_step: Annotated[
        int,
        _doc(
            "The step dispatch starts at when Redis holds no cursor for the run (`run --resume` sets it to the "
            "newest checkpoint's version, so nothing trained is generated again).",
            ge=0,
        ),
    ] = 0


class DataConfig(_Section, frozen=True):
    """The prompts: the tiny world's task, or a dataset of your own."""

    dataset: Annotated[
        str | None,
        _doc(
            "Training prompts: a JSONL or Parquet file (verl's parquet included) with a prompt and a reference "
            "answer per row, visited in epochs, shuffled by policy.seed. None: the tiny world's task."
        ),
    ] = None
    eval_dataset: Annotated[
        str | None, _doc("Held-out prompts (same format) evaluated before and after training. None: no dataset eval.")
    ] = None
    prompt_field: Annotated[
        str, _doc("The row's prompt: a string or a list of {role, content} messages (dotted for nested records).")
    ] = "prompt"
    answer_field: Annotated[
        str | None,
        _doc(
            "The row's reference answer (dotted for nested records). None: `answer`, else verl's "
            "`reward_model.ground_truth`, whichever the first row has."
        ),
    ] = None
    chat_template: Annotated[
        bool, _doc("Render prompts with the tokenizer's chat template when it has one (a string as one user turn).")
    ] = True
    max_prompt_len: Annotated[
        PositiveInt | None,
        _doc("Prompts longer than this (tokens) are skipped at load and counted. None: half of rollout.max_len."),
    ] = None
    tokenizer: Annotated[
        str | None, _doc("The tokenizer the prompts are encoded with. None: the policy's (learner.policy).")
    ] = None
    pool_size: Annotated[
        PositiveInt | None,
        _doc(
            "The tiny world (no data.dataset): a fixed pool of this many training problems drawn once from "
            "policy.seed, revisited in shuffled epochs as a real dataset's prompts are (group/history drafts "
            "then draw on earlier epochs' responses). None: fresh problems every step."
        ),
    ] = None


class RolloutConfig(_Section, frozen=True):
    """A rollout worker: generation, rewards and what it streams."""

    worker_id: Annotated[
        str | None, _doc("The worker's id in the registry and its stream consumer name. None: rollout-HOST-PID.")
    ] = None
    max_batch: Annotated[
        int, _doc("Rows the engine decodes together (requests of several groups share them).", ge=1)
    ] = 128
    max_len: Annotated[
        int, _doc("Prompt + response tokens per row; responses stop at EOS or when they reach it.", ge=2)
    ] = 1408
    max_response_len: Annotated[
        PositiveInt | None,
        _doc("Response tokens per row at most (a response that reaches it is truncated). None: up to max_len."),
    ] = None
    stop: Annotated[
        tuple[str, ...],
        _doc(
            "Stop strings: a response ends with the token that completes one of them (kept, as an EOS token is; "
            "finish reason 'stop'). Every EOS id of the checkpoint stops a response anyway."
        ),
    ] = ()
    temperature: Annotated[
        float,
        _doc("Sampling temperature (RL samples at 1.0); the learner computes its logprobs at the same one.", gt=0),
    ] = 1.0
    steps_per_hop: Annotated[
        int, _doc("Engine steps per trip to the worker thread (fewer trips, a little more latency).", ge=1)
    ] = 8
    reward: Annotated[
        str,
        _doc(
            "Reward: repeated_add (the tiny task), math (math-verify on the last \\boxed{}), exact (the stripped "
            "response equals the answer), or your own function as module:function or path/to/file.py:function, "
            "called as f(response, answer) -> float."
        ),
    ] = "repeated_add"
    reward_workers: Annotated[
        Annotated[int, Meta(ge=0)] | None,
        _doc(
            "Processes that score groups with the reward, so a slow one never blocks generation and a hung one "
            "can be killed. None: none for repeated_add and exact (cheap, inline), one for the others.",
        ),
    ] = None
    reward_timeout_s: Annotated[
        float,
        _doc(
            "A group whose reward runs longer is dropped whole (to `dead`, counted), never scored 0; the "
            "pool's processes are replaced. Inline rewards have no timeout.",
            gt=0,
        ),
    ] = 30.0
    backend: Annotated[
        Literal["torch", "vllm"],
        _doc(
            "Rollout engine: torch (this project's) or vllm (GPU, `pip install 'tlt-stream[vllm]'`, a fixed sd.arm "
            "only; UNVERIFIED, docs/vllm.md)."
        ),
    ] = "torch"
    stream_hidden: Annotated[
        bool, _doc("Stream each sample's hidden-state window to `hidden` (the drafter's training data).")
    ] = True
    hidden_share: Annotated[
        float,
        _doc(
            "Share of samples whose hidden states are streamed, by a stable hash of the sample id (a uniform "
            "sample, long tail included). A quarter: on a CPU the drafter trains on ~2k of the ~19k tokens a "
            "tiny-world step streams, and streaming all of them made rollouts ~8% slower (docs/benchmarks.md, "
            "issue 6).",
            gt=0,
            le=1,
        ),
    ] = 0.25
    hidden_dtype: Annotated[
        Literal["bfloat16", "float16", "float32"], _doc("Wire dtype of the streamed hidden states.")
    ] = "bfloat16"
    max_tasks: Annotated[PositiveInt | None, _doc("Stop after this many prompt groups (None: run on).")] = None
    threads: Annotated[int, _doc("Torch CPU threads of the worker process.", ge=1)] = 1
    device: Annotated[str, _doc("auto (CUDA when torch sees a device, else CPU), cpu, cuda or cuda:N.")] = "auto"
    dtype: Annotated[
        Literal["auto", "float32", "bfloat16"],
        _doc(
            "The rollout engine's weights and KV cache: auto is bfloat16 on CUDA and float32 on the CPU (where "
            "bfloat16 matmuls are slow); the learner keeps fp32 masters whatever this is, and reports the "
            "rollout-vs-learner logprob mismatch it causes."
        ),
    ] = "auto"
    graphs: Annotated[
        Literal["off", "auto", "cuda", "trace"],
        _doc(
            "Replay the policy's decode and verify forwards captured per shape (torch backend): cuda is CUDA "
            "graphs, auto is cuda on a CUDA device and off elsewhere, trace is the CPU stand-in the tests check "
            "(no faster on a CPU). Off by default until bench/gpu_check.py has run on a GPU (UNVERIFIED there)."
        ),
    ] = "off"

    def __post_init__(self) -> None:
        _check_device(self.device, "rollout.device")


class SdConfig(_Section, frozen=True):
    """Speculative decoding in the rollout workers, and TLT's adaptive choice of it."""

    drafter: Annotated[
        str | None,
        _doc('A drafter checkpoint directory (EAGLE), "ngram" (prompt lookup), or None: no speculation.'),
    ] = None
    arm: Annotated[
        str,
        _doc(
            "The arm used when SD is not adaptive: d<depth>k<topk>v<tokens verified>, ngram-d<depth>, "
            "group-d<depth>v<nodes>, d<depth>k<topk>v<verified>+g<group nodes> or plain.",
            pattern=ARM_LABEL,
        ),
    ] = "d4k1v4"
    adaptive: Annotated[
        bool,
        _doc("Decide SD per decode step (on/off by running batch, the arm per batch bucket) instead of sd.arm."),
    ] = True
    group: Annotated[
        bool,
        _doc(
            "Draft also from the prompt's own responses: the group's running and finished siblings, earlier "
            "steps' responses to it and the row's own context (a suffix automaton per prompt, no model). With a "
            "drafter: group arms (group-d<depth>v<nodes>), EAGLE + group merged in one tree (d4k2v8+g8) and "
            "per row the group's chain where it matches >= 4 tokens, else EAGLE's (d6k1v6|g12), beside the "
            "drafter's; with ngram, group arms replace prompt lookup (they include it)."
        ),
    ] = False
    group_strong_match: Annotated[
        int,
        _doc(
            "Either arms (d6k1v6|g12) take the group's chain for a row whose last tokens match the group's "
            "responses by at least this many tokens, else EAGLE's chain.",
            ge=1,
        ),
    ] = 4
    collapse_min_drafted: Annotated[
        int,
        _doc(
            "Draft nodes after a policy or drafter swap before a worker judges the swap: an acceptance below "
            "half the previous version's is a collapse (logged, counted, shown; a drafter is gone back from).",
            ge=1,
        ),
    ] = 256
    crossover: Annotated[
        int, _doc("Running batch size above which SD was measured to lose (`bench/sd_speedup.py`).", ge=1)
    ] = 16
    margin: Annotated[
        int, _doc("Hysteresis band: on at batch <= crossover - 1 - margin, off above crossover - 1.", ge=0)
    ] = 2
    epsilon: Annotated[float, _doc("Share of steps the tuner explores an arm other than its best.", ge=0, le=1)] = 0.1
    window: Annotated[
        int,
        _doc(
            "Recent steps per (bucket, arm) the tuner's estimate covers (48 measured better than 16 per bucket in "
            "22 of 28 bucket-workload cells, docs/benchmarks.md).",
            ge=1,
        ),
    ] = 48
    arms: Annotated[
        tuple[Annotated[str, Meta(pattern=ARM_LABEL)], ...],
        _doc("Candidate arms of the tuner; those of another proposer than the worker's are left out."),
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
        tuple[int, ...], _doc("Upper edges of the tuner's batch-size buckets (one arm is chosen per bucket).")
    ] = (1, 2, 4, 8, 16, 32, 64)
    on_new_drafter: Annotated[
        Literal["reset", "decay"], _doc("What a new drafter does to drafter arms' measurements: forget or decay.")
    ] = "decay"
    above_crossover: Annotated[
        Literal["measure", "plain"],
        _doc(
            "Batches above the crossover: plain unless exploring measured an arm faster there (measure), or "
            "plain only (plain: no SD step at all above it)."
        ),
    ] = "measure"
    challenge: Annotated[
        float,
        _doc(
            "Batches above the crossover: the share of steps an arm measured faster than plain there but not yet "
            "confirmed runs until it is confirmed or falls behind (0: only the epsilon exploration measures it).",
            ge=0,
            le=1,
        ),
    ] = 0.5
    context_rows: Annotated[
        int,
        _doc(
            "With the group source, up to this many running rows the tuner judges each arm separately by how "
            "well the rows' last tokens follow the group's responses (none, some, strongly): a group arm is "
            "fast while a row follows a sibling and slow once it leaves it. 0: per batch bucket only.",
            ge=0,
        ),
    ] = 0
    seed: Annotated[int, _doc("Seed of the tuner's exploration.")] = 0


class DrafterConfig(_Section, frozen=True):
    """Online drafter training in the rollout workers' idle time (TLT's adaptive drafter)."""

    train: Annotated[
        bool, _doc("Train the drafter online in idle time (needs an EAGLE sd.drafter and a state_dir).")
    ] = True
    state_dir: Annotated[
        str | None,
        _doc(
            "Where training states go, shared by every worker of the run (a volume on a cluster; {run} is the run "
            "name). None: no training."
        ),
    ] = None
    slice_seconds: Annotated[
        float, _doc("Longest training slice before the state is committed and the drafter evaluated.", gt=0)
    ] = 3.0
    min_windows: Annotated[int, _doc("Windows the buffer must hold before training starts.", ge=1)] = 16
    holdout_percent: Annotated[
        int, _doc("Share of windows (by sample id) held back to evaluate drafters, never trained on.", ge=1, le=99)
    ] = 10
    holdout_max: Annotated[int, _doc("Newest held-back windows kept for evaluation.", ge=1)] = 24
    accept_depth: Annotated[int, _doc("Chain depth of the held-out acceptance measurement.", ge=1)] = 4
    tolerance: Annotated[
        float, _doc("A new drafter is adopted when its held-out acceptance >= the current one's - tolerance.", ge=0)
    ] = 0.0
    judge_every_steps: Annotated[
        int,
        _doc(
            "Judge (and maybe publish) the drafter once this many training steps passed since the last judgement "
            "(judging after every slice spent half of short idle periods judging; docs/benchmarks.md, issue 6).",
            ge=1,
        ),
    ] = 16
    lease_ttl_ms: Annotated[int, _doc("The drafter-training lease's time to live (one trainer at a time).", ge=100)] = (
        15_000
    )
    recent_tokens: Annotated[int, _doc("Tokens of the newest windows the training buffer keeps.", ge=1)] = 60_000
    reservoir_tokens: Annotated[
        int, _doc("Tokens of the buffer's uniform reservoir over everything seen (against forgetting).", ge=0)
    ] = 60_000
    lr: Annotated[
        float,
        _doc(
            "Peak AdamW learning rate. 1e-4 continues a converged warm-up drafter without harming it (3e-4 took "
            "the tiny world's from 4.68 to 4.30 tokens per round; docs/benchmarks.md, issue 6).",
            gt=0,
        ),
    ] = 1e-4
    lr_warmup_steps: Annotated[int, _doc("Linear warm-up of the drafter's learning rate, in steps.", ge=0)] = 20
    lr_schedule: Annotated[Literal["constant", "cosine"], _doc("After warm-up: constant, or cosine decay.")] = (
        "constant"
    )
    lr_total_steps: Annotated[int, _doc("Steps of the cosine decay.", ge=1)] = 10_000
    lr_min_ratio: Annotated[float, _doc("The cosine decay ends at lr x this.", ge=0, le=1)] = 0.1
    betas: Annotated[tuple[float, float], _doc("AdamW betas.")] = (0.9, 0.95)
    weight_decay: Annotated[float, _doc("AdamW weight decay.", ge=0)] = 0.01
    clip: Annotated[float, _doc("Gradient-norm clipping threshold.", gt=0)] = 1.0
    unroll: Annotated[int, _doc("Training-time-test steps of the EAGLE loss.", ge=1)] = 3
    row_tokens: Annotated[int, _doc("Pairs per packed training row.", ge=2)] = 256
    batch_pairs: Annotated[int, _doc("Training pairs drawn from the buffer per step (whole windows).", ge=1)] = 1024
    seed: Annotated[int, _doc("Seed of the training order.")] = 0


class LearnerConfig(_Section, frozen=True):
    """The GRPO learner: one per run."""

    run_dir: Annotated[
        str | None, _doc("Checkpoints and metrics.jsonl (required by the learner; {run} is the run name).")
    ] = None
    policy: Annotated[
        str | None, _doc("Initial policy checkpoint, used when run_dir holds none (required by the learner).")
    ] = None
    groups_per_step: Annotated[
        PositiveInt | None, _doc("Complete, usable groups per update. None: policy.prompts_per_step.")
    ] = None
    lr: Annotated[float, _doc("AdamW learning rate (the field's default for a real model; see the presets).", gt=0)] = (
        1e-6
    )
    warmup_steps: Annotated[
        int,
        _doc(
            "The learning rate ramps linearly from lr / warmup_steps to lr over the first updates (a fresh Adam "
            "makes sign-like steps of size lr until its second moments have seen a few gradients).",
            ge=0,
        ),
    ] = 0
    weight_decay: Annotated[float, _doc("AdamW weight decay.", ge=0)] = 0.0
    max_grad_norm: Annotated[
        float, _doc("Gradients are clipped to this global norm before each step (0: no clipping).", ge=0)
    ] = 1.0
    micro_batch_tokens: Annotated[
        int, _doc("Padded tokens per forward/backward; the update does not depend on it, memory and speed do.", ge=1)
    ] = 8192
    clip_low: Annotated[float, _doc("PPO ratio lower clip: 1 - clip_low.", ge=0)] = 0.2
    clip_high: Annotated[float, _doc("PPO ratio upper clip: 1 + clip_high (DAPO's clip-higher).", ge=0)] = 0.28
    kl_coef: Annotated[float, _doc("Weight of the k3 KL penalty to the frozen reference (0: none kept).", ge=0)] = 0.0
    overlong: Annotated[
        Literal["keep", "mask"],
        _doc(
            "Responses cut off at rollout.max_len (finish reason length, counted per step as `truncated`): keep "
            "them in the loss, or mask them out of it (DAPO's overlong filtering; their group's advantages stand)."
        ),
    ] = "keep"
    tis_cap: Annotated[
        float | None,
        _doc(
            "Truncated importance sampling: each token's loss is weighted by min(p_learner / p_rollout, tis_cap), "
            "correcting for the rollout engine's numerics (another kernel, dtype or engine than the learner's); "
            "the PPO ratio is then taken against the learner's own log-probabilities. None: off (the ratio is "
            "against the rollout's). Each step reports the mismatch either way (logprob_mismatch_mean, _max)."
        ),
    ] = None
    scale_advantages: Annotated[
        bool, _doc("Divide group-centred rewards by the group's std (GRPO); false: centring only (Dr. GRPO).")
    ] = True
    compute_dtype: Annotated[
        Literal["auto", "float32", "bfloat16"],
        _doc(
            "The dtype of the learner's forward and backward (autocast); its weights and AdamW state stay fp32 "
            "masters whatever this is. auto: bfloat16 on a CUDA device that supports it, else float32. Weights "
            "are published to the rollout workers in rollout.dtype (resolved on the learner's device)."
        ),
    ] = "auto"
    final_norm_lr_scale: Annotated[
        float,
        _doc(
            "The final norm's gain (the policy's own inverse temperature) trains at lr x this. Adam moves every "
            "parameter by about lr whatever its size, so a gain of ~1 moves 20-50x less, relatively, than a "
            "weight matrix; the tiny world learns fastest by sharpening (preset tiny-world: x 800).",
            gt=0,
        ),
    ] = 1.0
    activation_checkpointing: Annotated[
        bool,
        _doc(
            "Recompute each decoder layer's activations in the backward pass instead of keeping them (less "
            "memory for about one more forward); the update is the same either way."
        ),
    ] = False
    collective_timeout_s: Annotated[
        float,
        _doc(
            "Under torchrun (WORLD_SIZE > 1): how long a rank waits in one collective before giving up (a rank "
            "that died mid-update ends the others after at most this; torchrun usually ends them sooner).",
            gt=0,
        ),
    ] = 600.0
    keep_checkpoints: Annotated[int, _doc("Complete checkpoints kept on disk (the newest).", ge=1)] = 3
    log_to: Annotated[
        tuple[Literal["tensorboard", "wandb"], ...],
        _doc(
            "Experiment trackers that get every step's figures and sampled responses (RUN_DIR/tensorboard, "
            "RUN_DIR/wandb; pip install 'tlt-stream[tracking]'). metrics.jsonl is written either way."
        ),
    ] = ()
    wandb_project: Annotated[str, _doc("The W&B project of the run.")] = "tlt-stream"
    wandb_mode: Annotated[
        Literal["offline", "online", "disabled"],
        _doc("offline: written under RUN_DIR/wandb, nothing sent (wandb sync uploads it later); online: sent."),
    ] = "offline"
    log_samples: Annotated[
        int,
        _doc(
            "Sampled (prompt, response, reward) per step written to RUN_DIR/samples.jsonl and the log (the "
            "report shows the newest), the first by sample id; 0: none.",
            ge=0,
        ),
    ] = 2
    max_updates: Annotated[
        PositiveInt | None, _doc("Stop after this many updates of this process (None: no limit).")
    ] = None
    until_version: Annotated[
        PositiveInt | None,
        _doc("Stop at this policy version, counting what a resumed checkpoint holds. None: policy.steps."),
    ] = None
    threads: Annotated[int, _doc("Torch CPU threads of the learner process.", ge=1)] = 1
    device: Annotated[str, _doc("auto (CUDA when torch sees a device, else CPU), cpu, cuda or cuda:N.")] = "auto"

    def __post_init__(self) -> None:
        _check_device(self.device, "learner.device")
        if self.tis_cap is not None and not self.tis_cap >= 1:
            raise ValueError(f"learner.tis_cap must be >= 1 (got {self.tis_cap})")


class LaunchConfig(_Section, frozen=True):
    """`tlt-stream run`: the whole pipeline as processes on one machine."""

    workers: Annotated[int, _doc("Rollout worker processes.", ge=1)] = 1
    learner_gpus: Annotated[
        int,
        _doc(
            "GPUs of the learner on a machine with GPUs: the first this many it sees (one torchrun process each "
            "when more than 1); each rollout worker gets one GPU of the rest (CUDA_VISIBLE_DEVICES). On one GPU "
            "every process shares it; on the CPU nothing is placed.",
            ge=1,
        ),
    ] = 1
    world: Annotated[
        str,
        _doc(
            "Tiny world directory (policy/, drafter/): built or finished when missing or unfinished, when it is "
            "the default; one given is used as it is."
        ),
    ] = "artifacts/world"
    policy: Annotated[
        str | None,
        _doc(
            "A policy checkpoint of your own (a Hugging Face directory) instead of the tiny world: no bootstrap, "
            "no tiny-world preset (the learner's defaults are the field's)."
        ),
    ] = None
    drafter: Annotated[
        str | None,
        _doc("With launch.policy: its EAGLE drafter directory. None: sd eagle falls back to n-gram drafts."),
    ] = None
    sd: Annotated[
        Literal["off", "eagle", "ngram"],
        _doc("Rollout speculative decoding: eagle (the world's drafter, adaptive SD, trained online), ngram or off."),
    ] = "eagle"
    eval: Annotated[int, _doc("Held-out prompts evaluated before and after training (0: skip).", ge=0)] = 256
    eval_every: Annotated[
        int, _doc("Also evaluate every this many policy versions during the run (0: before and after only).", ge=0)
    ] = 0


RUN_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"


class Config(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The whole configuration of a tlt-stream run; one TOML file, one table per section."""

    run: Annotated[
        str,
        _doc("Run name: every Redis key is prefixed `tlt:{run}:`, every MQTT topic `tlt/{run}/`.", pattern=RUN_PATTERN),
    ] = "default"
    preset: Annotated[
        str | None,
        _doc(
            "A workload's recipe (`tlt-stream config describe` lists them), applied under every value given "
            'explicitly. `tlt-stream run` on the tiny world uses tiny-world unless told otherwise ("none").'
        ),
    ] = None
    bus: Annotated[BusConfig, _doc("Redis streams and MQTT.")] = field(default_factory=BusConfig)
    policy: Annotated[PolicyConfig, _doc("The policy service and the run's step shape.")] = field(
        default_factory=PolicyConfig
    )
    data: Annotated[DataConfig, _doc("Prompts and datasets.")] = field(default_factory=DataConfig)
    rollout: Annotated[RolloutConfig, _doc("Rollout workers.")] = field(default_factory=RolloutConfig)
    sd: Annotated[SdConfig, _doc("Speculative decoding.")] = field(default_factory=SdConfig)
    drafter: Annotated[DrafterConfig, _doc("Online drafter training.")] = field(default_factory=DrafterConfig)
    learner: Annotated[LearnerConfig, _doc("The GRPO learner.")] = field(default_factory=LearnerConfig)
    launch: Annotated[LaunchConfig, _doc("`tlt-stream run`.")] = field(default_factory=LaunchConfig)

    @property
    def key_prefix(self) -> str:
        return f"tlt:{self.run}:"

    @property
    def topic_prefix(self) -> str:
        return f"tlt/{self.run}/"

    def expand(self, path: str) -> str:
        """A path setting with `{run}` replaced by the run name (compose: `/data/runs/{run}`)."""
        return path.replace("{run}", self.run)

    @property
    def groups_per_step(self) -> int:
        """The learner's groups per update: its own setting, else the policy's prompts per step."""
        return self.learner.groups_per_step or self.policy.prompts_per_step

    @property
    def until_version(self) -> int:
        """The policy version the learner stops at."""
        return self.learner.until_version or self.policy.steps


DEFAULTS = Config()
"""Every default, for the cores' own settings dataclasses to read (never to write a second time)."""


PRESETS: dict[str, dict[str, Any]] = {
    "tiny-world": {
        "learner": {"lr": 2.5e-5, "warmup_steps": 20, "final_norm_lr_scale": 800.0},
    },
}
"""Named recipes. tiny-world: the tiny world's policy learns mostly by sharpening, which the final norm's gain
does fastest (here at lr 2e-2), while the matrices, at an eighth of the earlier lr 2e-4, are damaged least:
+15.2 held-out points in 160 steps and +16.8 in 200, against +14.5 in 221 for lr 1e-4 with x 200 and +7.4 for
lr 2e-4 with x 50 (docs/benchmarks.md, issue 5); 20 warm-up updates keep the first Adam steps from undoing what
supervised training taught."""
