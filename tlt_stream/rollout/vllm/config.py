"""This project's SD arms and sampling settings as the dicts vLLM takes: pure code, no vllm import.

`rollout/vllm/backend.py` passes these to `vllm.LLM(**llm_kwargs(...))` and `vllm.SamplingParams(**...)`;
CI tests them without vLLM. Fields were read in vLLM 0.33.0 (`vllm/config/speculative.py`
`SpeculativeConfig`, `vllm/engine/arg_utils.py` `EngineArgs`, `vllm/sampling_params.py` `SamplingParams`);
the pyproject extra allows `vllm>=0.10`, so version-dependent keys are emitted only when the caller passes
the field names its installed vLLM has (`available`), and a setting that needs a missing one is refused.

**Arms** (`arms.Arm`, or its label: `plain`, `ngram-d4`, `d4k1v4`):

- `plain`: no `speculative_config` (plain decoding);
- `dNk1vN` (EAGLE chain): `{"method": "eagle", "model": EXPORT_DIR, "num_speculative_tokens": N,
  "draft_sample_method": "greedy" at T = 0, "probabilistic" at T > 0}` (probabilistic = our sampled chain:
  drafts drawn from q at the request's temperature, accepted with min(1, p/q));
- `ngram-dN`: `{"method": "ngram", "num_speculative_tokens": N, "prompt_lookup_min": 1,
  "prompt_lookup_max": 3}` (our `NgramProposer` defaults);
- `group-dNvN` (group/history drafts): `{"method": "custom_class", "model": GROUP_PROPOSER,
  "num_speculative_tokens": N}`, this project's suffix index as vLLM's custom proposer (`group.py`); mixed
  EAGLE + group arms are refused (one draft source per engine);
- `dNkKvV` with K > 1 (trees): refused, vLLM has no EAGLE tree drafting (0.10's experimental
  `speculative_token_tree` is gone in 0.33);
- `dNk1vV` with V < N: refused, vLLM verifies every drafted token.

Approximations, each recorded in the translation's `notes`: without `draft_sample_method` (older vLLM)
drafts are greedy at every temperature (still lossless, acceptance differs); vLLM's n-gram lookup takes the
*earliest* occurrence of the longest suffix match, ours the latest.

**Adaptive SD** (`tuner.SdSwitch`, per-bucket arm tables): vLLM's `num_speculative_tokens_per_batch_size`
(`[(first batch, last batch, K), ...]`, K = 0 for no drafting) maps the running batch size to a draft length,
which is the switch plus a per-bucket chain length (`dynamic_schedule`). It is fixed when the engine is
built; the switch's hysteresis band cannot be expressed (the schedule is a function of the batch size), so
the band is resolved to "off"; one method per engine (EAGLE or n-gram, not both); the epsilon-greedy
exploration between arms does not exist (vLLM's scheduler picks K). With K = 0 vLLM still runs the draft's
forward over the step's tokens (it keeps the draft's KV in sync).

**Sampling** (`sampling_params`): `temperature` as is (vLLM: below 1e-5 is greedy; ours: 0); `top_p = 1`,
`top_k` off (full vocabulary: the learner recomputes log-probs over the full vocabulary at the rollout
temperature, `rl/learner.py`); `seed` per request; `max_tokens`; `ignore_eos = True` with
`stop_token_ids = eos_ids` (stops exactly at our EOS ids, not at the model's generation config);
`logprobs = 0` (the sampled token's log-prob only) with the engine's `logprobs_mode = "processed_logprobs"`:
log softmax(logits / T), and at T = 0 the raw log-softmax (vLLM's sampler and rejection sampler both use
temperature 1 for greedy rows), which is `rollout/sampling.py`'s convention; `detokenize = False`.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tlt_stream.rollout.arms import Arm
from tlt_stream.rollout.switch import DEFAULT_EDGES
from tlt_stream.rollout.vllm.group import GROUP_PROPOSER

__all__ = [
    "GREEDY_EPS",
    "NGRAM_LOOKUP",
    "SpecTranslation",
    "UnsupportedSetting",
    "as_arm",
    "dynamic_schedule",
    "expressible",
    "llm_kwargs",
    "sampling_params",
    "speculative_config",
]

GREEDY_EPS = 1e-5
"""vLLM samples greedily below this temperature (`vllm/v1/sample/sampler.py` `_SAMPLING_EPS`)."""
NGRAM_LOOKUP = (1, 3)
"""(min, max) n-gram lengths of `proposers.NgramProposer`'s defaults."""


class UnsupportedSetting(ValueError):
    """A setting vLLM cannot express (the message says why and what to use instead)."""


@dataclass(frozen=True)
class SpecTranslation:
    """A vLLM `speculative_config` dict and the approximations it makes (empty when exact)."""

    config: dict[str, Any]
    notes: tuple[str, ...] = ()


def as_arm(arm: Arm | str) -> Arm:
    """The `Arm` itself, or the one a label names (`plain`, `ngram-d4`, `d4k1v4`)."""
    return arm if isinstance(arm, Arm) else Arm.from_label(arm)


def expressible(arm: Arm | str) -> str | None:
    """None when vLLM can run `arm`, else the reason it cannot (one line)."""
    a = as_arm(arm)
    if a.kind in ("mixed", "either"):
        return (
            f"arm {a.label}: vLLM runs one draft source per engine, so EAGLE and group drafts do not merge; "
            f"use an EAGLE chain or group-d{a.depth}v{a.depth}"
        )
    if a.kind == "group" and a.verify != a.depth:
        return f"arm {a.label}: vLLM verifies one chain per row, so verify must equal depth: group-d{a.depth}v{a.depth}"
    if a.kind == "drafter" and a.topk > 1:
        return f"arm {a.label}: vLLM has no EAGLE tree drafting (top-k > 1); use a chain such as d{a.depth}k1v{a.depth}"
    if a.kind == "drafter" and a.verify != a.depth:
        return (
            f"arm {a.label}: vLLM verifies every drafted token, so verify must equal depth; "
            f"use d{a.verify}k1v{a.verify}"
        )
    return None


def _require(available: Collection[str] | None, field: str, what: str) -> None:
    if available is not None and field not in available:
        raise UnsupportedSetting(f"{what} needs vLLM's {field!r}, which the installed vLLM does not have")


def speculative_config(
    arm: Arm | str,
    *,
    drafter: str | Path | None = None,
    temperature: float,
    available: Collection[str] | None = None,
) -> SpecTranslation | None:
    """vLLM's `speculative_config` for `arm` (None for `plain`). `drafter`: the exported EAGLE directory
    (`drafter/export.py`), required by drafter arms. `temperature`: the rollout's, which picks the draft
    sampling. `available`: `SpeculativeConfig`'s field names in the installed vLLM (None: assume 0.33's)."""
    a = as_arm(arm)
    if a.kind == "plain":
        return None
    if (reason := expressible(a)) is not None:
        raise UnsupportedSetting(reason)
    notes: list[str] = []
    if a.kind == "group":  # this project's group/history drafts as vLLM's custom proposer (`group.py`)
        _require(available, "method", "group drafts (a custom_class proposer)")
        config = {"method": "custom_class", "model": GROUP_PROPOSER, "num_speculative_tokens": a.depth}
        return SpecTranslation(config, tuple(notes))
    if a.kind == "ngram":
        low, high = NGRAM_LOOKUP
        config: dict[str, Any] = {
            "method": "ngram",
            "num_speculative_tokens": a.depth,
            "prompt_lookup_min": low,
            "prompt_lookup_max": high,
        }
        notes.append("vLLM's n-gram lookup continues the earliest match of the longest suffix, ours the latest")
        return SpecTranslation(config, tuple(notes))
    if drafter is None:
        raise UnsupportedSetting(f"arm {a.label} drafts with the EAGLE drafter: give its exported directory")
    config = {"method": "eagle", "model": str(drafter), "num_speculative_tokens": a.depth}
    if available is None or "draft_sample_method" in available:
        config["draft_sample_method"] = "probabilistic" if temperature > 0 else "greedy"
    elif temperature > 0:
        notes.append("this vLLM drafts greedily at every temperature (lossless; acceptance differs from ours)")
    return SpecTranslation(config, tuple(notes))


def _ranges(edges: tuple[int, ...], max_num_seqs: int) -> list[tuple[int, int, int]]:
    """(bucket, first batch, last batch) for every bucket that holds batches in 1..max_num_seqs."""
    out, low = [], 1
    for bucket, high in enumerate((*edges, max_num_seqs)):
        high = min(high, max_num_seqs)
        if low <= high:
            out.append((bucket, low, high))
        low = max(low, high + 1)
    return out


def dynamic_schedule(
    table: Mapping[int, Arm | str],
    *,
    max_num_seqs: int,
    edges: Iterable[int] = DEFAULT_EDGES,
    switch_threshold: int | None = None,
) -> tuple[str, int, list[tuple[int, int, int]]]:
    """An adaptive-SD decision table as vLLM's `num_speculative_tokens_per_batch_size`.

    `table`: bucket index (`tuner.bucket_of`) -> arm, e.g. a published `sd_config`'s best arms; buckets
    without an entry get K = 0 (plain). `switch_threshold`: an `SdSwitch` threshold; batches above it get
    K = 0 (the switch's band resolved to off: vLLM's schedule has no hysteresis). Returns `(method,
    num_speculative_tokens, schedule)`: the one method every speculative arm uses, the largest K (vLLM caps
    the schedule at it) and contiguous inclusive ranges covering 1..max_num_seqs, equal neighbours merged.
    Refuses tree arms, a table mixing EAGLE and n-gram arms, and a table with no speculative arm."""
    if max_num_seqs < 1:
        raise UnsupportedSetting(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    edges = tuple(edges)
    arms = {bucket: as_arm(arm) for bucket, arm in table.items()}
    kinds = {a.kind for a in arms.values() if a.kind != "plain"}
    for a in arms.values():
        if (reason := expressible(a)) is not None:
            raise UnsupportedSetting(reason)
    if len(kinds) > 1:
        raise UnsupportedSetting("a vLLM engine runs one speculative method: the table mixes EAGLE and n-gram arms")
    if not kinds:
        raise UnsupportedSetting("the table has no speculative arm: run without a speculative_config")
    if kinds == {"group"}:
        raise UnsupportedSetting(
            "vLLM's custom proposers are not told the step's chain length: group drafts run at one depth "
            "at every batch size (a fixed arm)"
        )
    method = "eagle" if kinds == {"drafter"} else "ngram"
    entries: list[tuple[int, int, int]] = []
    for bucket, low, high in _ranges(edges, max_num_seqs):
        depth = arms[bucket].depth if bucket in arms else 0
        pieces = [(low, high, depth)]
        if switch_threshold is not None:
            on_high = min(high, switch_threshold)
            pieces = [(low, on_high, depth), (max(low, on_high + 1), high, 0)]
        entries += [(a, b, k) for a, b, k in pieces if a <= b]
    merged: list[tuple[int, int, int]] = []
    for low, high, k in entries:
        if merged and merged[-1][2] == k and merged[-1][1] + 1 == low:
            merged[-1] = (merged[-1][0], high, k)
        else:
            merged.append((low, high, k))
    top = max(k for _, _, k in merged)
    if top == 0:
        raise UnsupportedSetting("the schedule never drafts (every batch size is off): run without SD")
    return method, top, merged


def sampling_params(
    *,
    max_tokens: int,
    temperature: float,
    seed: int | None,
    eos_ids: Iterable[int],
    stop_strings: Sequence[str] = (),
    top_p: float = 1.0,
) -> dict[str, Any]:
    """Keyword arguments of `vllm.SamplingParams` for one request of this project's rollouts."""
    if max_tokens < 1:
        raise UnsupportedSetting(f"max_tokens must be >= 1, got {max_tokens}")
    if not math.isfinite(temperature) or temperature < 0:
        raise UnsupportedSetting(f"temperature must be finite and >= 0, got {temperature}")
    if 0 < temperature < GREEDY_EPS:
        raise UnsupportedSetting(f"vLLM samples greedily below temperature {GREEDY_EPS}; use 0 or >= {GREEDY_EPS}")
    if top_p != 1.0:
        raise UnsupportedSetting(
            "top_p < 1 is refused: the learner's log-probs are over the full vocabulary (rl/learner.py), so a "
            "truncated behaviour distribution would bias the importance ratio"
        )
    return {
        "n": 1,
        "temperature": float(temperature),
        "top_p": 1.0,
        "seed": seed,
        "max_tokens": int(max_tokens),
        "ignore_eos": True,
        "stop_token_ids": sorted({int(t) for t in eos_ids}),
        "logprobs": 0,
        # Stop strings need the text; the stop token stays in the output, as our engine keeps it.
        "detokenize": bool(stop_strings),
        **({"stop": list(stop_strings), "include_stop_str_in_output": True} if stop_strings else {}),
    }


def llm_kwargs(
    policy: str | Path,
    *,
    max_batch: int,
    max_len: int,
    dtype: str = "auto",
    seed: int = 0,
    gpu_memory_utilization: float = 0.85,
    kv_cache_bytes: int | None = None,
    enforce_eager: bool = False,
    inline: bool = False,
    speculative: SpecTranslation | None = None,
    schedule: list[tuple[int, int, int]] | None = None,
    worker_extension: str | None = None,
    scheduler: str | None = None,
    schedule_file: str | None = None,
    available: Collection[str] | None = None,
    spec_available: Collection[str] | None = None,
) -> dict[str, Any]:
    """Keyword arguments of `vllm.LLM` for a rollout engine on `policy` (a Hugging Face directory).

    `worker_extension`: import path of a class vLLM mixes into its workers (the backend's in-place weight
    updates). `kv_cache_bytes`: the KV cache's size (else vLLM sizes it by `gpu_memory_utilization`).
    `scheduler`: import path of the scheduler class (with speculation only: `scheduling.py`), and
    `schedule_file` the file it reads new schedules from (`additional_config`, where the installed vLLM has it).
    `inline`: vLLM's worker in the engine core's process (the `uni` executor). Chunked prefill is off: a
    request's prompt is prefilled in one step, so vLLM never rewinds a seeded request's random generator
    after a partial prefill, which its CPU generators cannot do ("CPU Generator does not use offset").
    `available` / `spec_available`: `EngineArgs` / `SpeculativeConfig` field names of the installed vLLM
    (None: assume 0.33's). The policy's tokenizer is never loaded by vLLM (token ids in and
    out)."""
    if max_batch < 1 or max_len < 2:
        raise UnsupportedSetting(f"need max_batch >= 1 and max_len >= 2, got {max_batch}, {max_len}")
    _require(available, "logprobs_mode", "behaviour log-probs after temperature")
    if worker_extension is not None:
        _require(available, "worker_extension_cls", "in-place policy and drafter updates")
    kwargs: dict[str, Any] = {
        "model": str(policy),
        "skip_tokenizer_init": True,
        "max_num_seqs": max_batch,
        "max_model_len": max_len,
        "dtype": dtype,
        "seed": seed,
        "logprobs_mode": "processed_logprobs",
        "enable_prefix_caching": True,
        "gpu_memory_utilization": gpu_memory_utilization,
        "enforce_eager": enforce_eager,
        "enable_chunked_prefill": False,
        "max_num_batched_tokens": max(max_len, 2048),
    }
    if kv_cache_bytes is not None:
        _require(available, "kv_cache_memory_bytes", "a KV cache of a given size")
        kwargs["kv_cache_memory_bytes"] = int(kv_cache_bytes)
    if inline:
        kwargs["distributed_executor_backend"] = "uni"
    if worker_extension is not None:
        kwargs["worker_extension_cls"] = worker_extension
    if scheduler is not None and speculative is not None:  # a scheduler that takes new schedules in place
        _require(available, "scheduler_cls", "a new sd_config without a new engine")
        kwargs["scheduler_cls"] = scheduler
        if schedule_file is not None and (available is None or "additional_config" in available):
            kwargs["additional_config"] = {"tlt_schedule_file": schedule_file}
    if speculative is not None:
        spec = dict(speculative.config)
        if schedule is not None:
            _require(spec_available, "num_speculative_tokens_per_batch_size", "SD switched by batch size")
            spec["num_speculative_tokens_per_batch_size"] = [list(entry) for entry in schedule]
            spec["num_speculative_tokens"] = max(k for _, _, k in schedule)
        kwargs["speculative_config"] = spec
        if available is None or "per_request_spec_decode_metrics" in available:
            kwargs["per_request_spec_decode_metrics"] = "detailed"  # per-round accept lengths per request
    elif schedule is not None:
        raise UnsupportedSetting("a batch-size schedule needs a speculative arm")
    return kwargs
