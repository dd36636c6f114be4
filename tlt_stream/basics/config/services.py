"""The sections every role shares: the bus (Redis and MQTT), the policy service and the run's step shape, the
prompts, and what `tlt-stream run` starts."""

from __future__ import annotations

from typing import Annotated, Literal

from tlt_stream.basics.config.fields import (
    MQTT_SCHEMES,
    REDIS_SCHEMES,
    PositiveInt,
    Section,
    check_url,
    doc,
)

__all__ = ["BusConfig", "DataConfig", "LaunchConfig", "PolicyConfig"]


class BusConfig(Section, frozen=True):
    """Where the data plane (Redis streams) and control plane (MQTT) live and how they are used."""

    redis_url: Annotated[
        str | None,
        doc("Redis URL (redis://, rediss:// for TLS, unix://). None starts an embedded Redis-protocol server."),
    ] = None
    mqtt_url: Annotated[
        str | None,
        doc("MQTT broker URL (mqtt://user:pass@host:1883, mqtts:// for TLS). None starts an embedded broker."),
    ] = None
    block_ms: Annotated[int, doc("How long one XREADGROUP blocks waiting for entries, in ms.", ge=1)] = 1000
    read_count: Annotated[int, doc("Entries fetched per XREADGROUP call.", ge=1, le=10_000)] = 16
    reclaim_idle_ms: Annotated[
        int, doc("An entry pending this long (its consumer presumed dead) is reclaimed with XAUTOCLAIM.", ge=1)
    ] = 60_000
    max_deliveries: Annotated[
        int, doc("An entry delivered this many times without an ack is moved to the dead stream.", ge=1)
    ] = 5
    backlog_limit: Annotated[
        int,
        doc("Un-acked entries a durable stream may hold before its producers wait (backpressure).", ge=1),
    ] = 4096
    hidden_maxlen: Annotated[
        int, doc("Approximate bound on the `hidden` stream (a lossy drafter-training buffer).", ge=1)
    ] = 2000
    hidden_max_bytes: Annotated[
        int,
        doc(
            "Approximate bound on the Redis memory the `hidden` stream holds, in bytes: its MAXLEN is lowered to "
            "this over the typical entry size the producer measures (a running mean, allocator overhead included).",
            ge=1024,
        ),
    ] = 256 * 2**20
    stats_maxlen: Annotated[int, doc("Approximate bound on the `stats` stream.", ge=1)] = 100_000
    dead_maxlen: Annotated[int, doc("Approximate bound on the `dead` stream.", ge=1)] = 100_000
    max_message_bytes: Annotated[
        int, doc("Entries larger than this are refused before decoding and dead-lettered.", ge=1024)
    ] = 64 * 2**20
    heartbeat_s: Annotated[float, doc("Seconds between worker heartbeats.", gt=0)] = 2.0
    heartbeat_ttl_s: Annotated[
        float, doc("A worker whose heartbeat is older than this disappears from the registry.", gt=0)
    ] = 10.0
    mqtt_keepalive_s: Annotated[int, doc("MQTT keepalive interval in seconds.", ge=5)] = 30
    reconnect_max_s: Annotated[float, doc("Cap on the reconnect backoff for Redis and MQTT, seconds.", gt=0)] = 30.0
    redis_retries: Annotated[
        int,
        doc(
            "Retries of one Redis command (capped backoff, 5 s) before a service gives up on an outage and exits "
            "with code 3 for its supervisor to restart it (40: about three minutes).",
            ge=0,
        ),
    ] = 40
    store_root: Annotated[
        str | None,
        doc(
            "Checkpoint store: policy and drafter locations announced on the control plane are read only when "
            "they resolve inside this directory (`tlt-stream run` and compose set it). None: not confined."
        ),
    ] = None
    relative_locations: Annotated[
        bool,
        doc(
            "The learner announces policy locations relative to store_root, and every reader resolves them "
            "under its own store_root, so each node may mount the checkpoint store at a different path. "
            "false: absolute paths (the store at the same path on every node)."
        ),
    ] = False

    def __post_init__(self) -> None:
        check_url(self.redis_url, REDIS_SCHEMES, "redis_url")
        check_url(self.mqtt_url, MQTT_SCHEMES, "mqtt_url")
        if self.heartbeat_ttl_s <= self.heartbeat_s:
            raise ValueError("heartbeat_ttl_s must be greater than heartbeat_s")
        if self.relative_locations and self.store_root is None:
            raise ValueError("bus.relative_locations needs bus.store_root")


class PolicyConfig(Section, frozen=True):
    """The policy service, and the shape of the run's RL steps every role agrees on."""

    steps: Annotated[
        int,
        doc(
            "RL steps of the run: the policy service dispatches this many, the learner stops at this policy "
            "version (unless learner.until_version says otherwise), `tlt-stream run` ends there.",
            ge=1,
        ),
    ] = 60
    prompts_per_step: Annotated[
        int, doc("Prompts dispatched per step; also the learner's groups per update (learner.groups_per_step).", ge=1)
    ] = 16
    group_size: Annotated[int, doc("Samples per prompt (GRPO's G).", ge=1)] = 8
    max_staleness: Annotated[
        int,
        doc(
            "How many policy versions a sample may lag the learner: the policy service dispatches step s once "
            "version s - max_staleness exists, and the learner drops older groups. 0: on-policy.",
            ge=0,
        ),
    ] = 0
    partial_rollouts: Annotated[
        bool,
        doc(
            "Lossless partial rollouts. Workers re-verify rows in flight at every new version instead of "
            "draining first (speculative sampling with the old policy as the drafter), so every sample is "
            "exactly on-policy for the version it is stamped with. With max_staleness 0 the policy service "
            "also dispatches step s + 1 one version early, as drafts a worker may start under the version "
            "before in the slots the tail leaves free, sent only once re-verified (with max_staleness > 0 "
            "streaming fills the tail already and the window stays as it is). On vLLM the rows are "
            "re-verified on the worker's copy of the policy and added to vLLM again (docs/vllm.md).",
        ),
    ] = False
    ahead_tokens: Annotated[
        int,
        doc(
            "With partial_rollouts: how many tokens a draft row may generate before its version arrives (it "
            "then waits, holding no slot). A token count, never a content rule: the proof needs it. Drafts "
            "share every decode step with the tail rows the step waits for, so where a step's cost grows with "
            "the batch (a CPU) long drafts slow the tail.",
            ge=1,
        ),
    ] = 64
    ahead_rows: Annotated[
        int,
        doc(
            "With partial_rollouts: a worker starts drafts only while fewer rows than this run (0: in any free "
            "slot), and an on-policy request overtakes drafts held back. Set it to the batch past which a decode "
            "step's cost grows about linearly (a GPU's compute-bound knee), so drafts use only capacity a step "
            "gets nearly free. A CPU has no such knee below the batch.",
            ge=0,
        ),
    ] = 0
    seed: Annotated[int, doc("Seed of the prompt source (the prompts of step s depend on (seed, s) only).")] = 0
    start_step: Annotated[
        int,
        doc(
            "The step dispatch starts at when Redis holds no cursor for the run (`run --resume` sets it to the "
            "newest checkpoint's version, so nothing trained is generated again).",
            ge=0,
        ),
    ] = 0


class DataConfig(Section, frozen=True):
    """The prompts: the tiny world's task, or a dataset of your own."""

    dataset: Annotated[
        str | None,
        doc(
            "Training prompts: a JSONL, JSON, CSV, TSV or Parquet file (verl's parquet included) with a prompt and "
            "a reference answer per row, visited in epochs, shuffled by policy.seed. None: the tiny world's task."
        ),
    ] = None
    eval_dataset: Annotated[
        str | None, doc("Held-out prompts (same format) evaluated before and after training. None: no dataset eval.")
    ] = None
    prompt_field: Annotated[
        str, doc("The row's prompt: a string or a list of {role, content} messages (dotted for nested records).")
    ] = "prompt"
    answer_field: Annotated[
        str | None,
        doc(
            "The row's reference answer (dotted for nested records). None: `answer`, else verl's "
            "`reward_model.ground_truth`, whichever the first row has."
        ),
    ] = None
    chat_template: Annotated[
        bool, doc("Render prompts with the tokenizer's chat template when it has one (a string as one user turn).")
    ] = True
    enable_thinking: Annotated[
        bool | None,
        doc(
            "Passed to the chat template as enable_thinking (Qwen3: false renders an empty <think></think> "
            "block after the assistant header, so responses answer at once). None: the template's own default."
        ),
    ] = None
    max_prompt_len: Annotated[
        PositiveInt | None,
        doc(
            "Prompts longer than this (tokens) are skipped at load and counted. None: 1024, at most half of "
            "rollout.max_len."
        ),
    ] = None
    tokenizer: Annotated[
        str | None, doc("The tokenizer the prompts are encoded with. None: the policy's (learner.policy).")
    ] = None
    pool_size: Annotated[
        PositiveInt | None,
        doc(
            "The tiny world (no data.dataset): a fixed pool of this many training problems drawn once from "
            "policy.seed, revisited in shuffled epochs as a real dataset's prompts are (group/history drafts "
            "then draw on earlier epochs' responses). None: fresh problems every step."
        ),
    ] = None


class LaunchConfig(Section, frozen=True):
    """`tlt-stream run`: the whole pipeline as processes on one machine."""

    workers: Annotated[int, doc("Rollout worker processes.", ge=1)] = 1
    learner_gpus: Annotated[
        int,
        doc(
            "GPUs of the learner on a machine with GPUs: the first this many it sees (one torchrun process each "
            "when more than 1); each rollout worker gets one GPU of the rest (CUDA_VISIBLE_DEVICES). On one GPU "
            "every process shares it; on the CPU nothing is placed.",
            ge=1,
        ),
    ] = 1
    world: Annotated[
        str,
        doc(
            "Tiny world directory (policy/, drafter/): built or finished when missing or unfinished, when it is "
            "the default; one given is used as it is."
        ),
    ] = "artifacts/world"
    policy: Annotated[
        str | None,
        doc(
            "A policy checkpoint of your own (a Hugging Face directory) instead of the tiny world: no bootstrap, "
            "no tiny-world preset (the learner's defaults are the field's)."
        ),
    ] = None
    drafter: Annotated[
        str | None,
        doc("With launch.policy: its EAGLE drafter directory. None: sd eagle falls back to n-gram drafts."),
    ] = None
    sd: Annotated[
        Literal["off", "eagle", "ngram"],
        doc("Rollout speculative decoding: eagle (the world's drafter, adaptive SD, trained online), ngram or off."),
    ] = "eagle"
    eval: Annotated[int, doc("Held-out prompts evaluated before and after training (0: skip).", ge=0)] = 256
    eval_every: Annotated[
        int, doc("Also evaluate every this many policy versions during the run (0: before and after only).", ge=0)
    ] = 0
