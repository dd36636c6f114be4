"""The GPU rollout backend on vLLM (optional extra `vllm`; imported only when selected).

UNVERIFIED: written against vLLM 0.33.0's public API (read from its wheel, `__commit_id__` g4ba787ec9) and
not yet run on a GPU; `bench/gpu_check.sh` is the check. Importing this module never imports vllm:
`VllmEngine` does, and without vLLM it fails in one line naming `pip install 'tlt-stream[vllm]'`.

`VllmEngine` offers what the rollout worker uses of `GenerationEngine` (engine.py): `add_request`, `step`
(finished requests as `GenerationResult`s), `generate`, `has_unfinished`, `tokens_generated`, plus the
version changes the worker makes:

- **Generation.** One `vllm.LLM` in token-id mode (`skip_tokenizer_init`), continuously batched by vLLM;
  `add_request`/`step` drive `LLM.llm_engine` (`LLMEngine.add_request`, `.step`). Requests stop exactly at
  the given EOS ids, and each sampled token comes back with its behaviour log-prob, log softmax(logits / T)
  (raw log-softmax at T = 0), the convention of `rollout/sampling.py` (`vllm/config.py`, `sampling_params`). vLLM
  seeds each request's sampler with the request's seed, but its random streams are not this project's, so
  sampled outputs differ from the torch engine's for the same seed (distributions are the same).
- **Policy versions in place** (`load_policy`): `LLM.collective_rpc("tlt_reload_policy", ...)` reaches
  `TltWorkerExtension` (mixed into vLLM's workers with `worker_extension_cls`) in every vLLM worker, which
  calls the worker's `reload_weights(weights_path=...)` (vLLM's in-place reload,
  `vllm/model_executor/model_loader/reload/inplace.py`) or, on a vLLM without it, `model.load_weights` over
  the checkpoint's safetensors (what TRL and OpenRLHF do). No engine restart. The prefix cache is reset
  (its KV was computed by the old weights). Like the torch worker, only between requests.
- **No partial rollouts** (`load_policy(..., reverify=True)`, `add_request(..., ahead_limit=...)`): they
  raise `UnsupportedSetting`. The torch engine's lossless re-verification (`rollout/reverify.py`) would
  need from vLLM: (1) holding a request after N tokens without returning it (a per-request token budget
  that parks instead of finishing, ends included); (2) scoring prompt + partial response under the new
  weights with each token's logprob at the request's temperature (prompt-logprob scoring,
  `SamplingParams(prompt_logprobs=...)`, rescaled by T) plus the full distribution of the old weights at a
  rejection (a second model, or the old weights kept); (3) resuming the request from the
  kept prefix with its sampler's random stream continued, not re-seeded (a per-request generator state,
  which vLLM does not expose). Until then, vLLM runs partial rollouts only as the off-policy fallback
  the pipeline already has.
- **Drafter versions in place** (`load_drafter`): the drafter is exported (`drafter/export.py`) and
  `tlt_swap_drafter` loads the export's layer and fc tensors into the draft model with its own
  `load_weights` (the embedding and LM head stay shared with the target, so they follow policy reloads).
  Allowed with requests in flight: SD stays lossless whatever the drafter proposes.
- **Speculative decoding**: EAGLE chains only, fixed when the engine is built: a static arm, or the adaptive
  switch and per-bucket chain lengths as vLLM's batch-size schedule (`vllm/config.py`, `dynamic_schedule`). Trees,
  per-step epsilon-greedy exploration and hysteresis have no vLLM equivalent; a new `sd_config` table takes
  a new engine (`close()` this one first). See docs/vllm.md.
- **Hidden states** for drafter training: vLLM returns no final-norm hidden states with EAGLE on (its
  `extract_hidden_states` is a speculative method of its own, intermediate layers only). With
  `hidden="recompute"` the backend keeps this project's `Transformer` on the same policy weights and runs one
  prefill over prompt + response per finished request (`recompute_hidden`), which is what the torch engine
  streams: the policy's final-norm states at every position but the last. It costs one more copy of the
  policy's weights on the device and a prefill per sample; the alternative is the learner's forward over
  the same samples (the same states, if its forward returned them), which the learner service would then
  have to publish.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import json
import logging
import tempfile
from collections.abc import Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

import torch

from tlt_stream.basics.config import DEFAULTS
from tlt_stream.basics.errors import CheckpointError
from tlt_stream.model.transformer import Transformer
from tlt_stream.rollout.arms import Arm
from tlt_stream.rollout.engine import GenerationResult, generate_all
from tlt_stream.rollout.scheduler import FinishReason, StopRule
from tlt_stream.rollout.stops import StopStrings
from tlt_stream.rollout.switch import DEFAULT_EDGES
from tlt_stream.rollout.vllm.config import (
    UnsupportedSetting,
    as_arm,
    dynamic_schedule,
    llm_kwargs,
    sampling_params,
    speculative_config,
)

__all__ = [
    "INSTALL_HINT",
    "WORKER_EXTENSION",
    "BackendUnavailable",
    "DraftHolder",
    "TltWorkerExtension",
    "VllmEngine",
    "VllmSettings",
    "accept_lengths",
    "drafter_swap_tensors",
    "field_names",
    "recompute_hidden",
    "require_vllm",
    "sampled_logprobs",
    "to_generation_result",
]

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'tlt-stream[vllm]'"
_SHAPE_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "attention_bias",
    "qkv_bias",
    "mlp_bias",
)
"""Draft config keys that fix the draft model's parameter shapes (an in-place swap must keep them)."""
FINISH_REASONS: dict[str, FinishReason] = {"stop": "eos", "length": "length"}
"""vLLM `CompletionOutput.finish_reason` -> ours ("abort", "error", "repetition" produce no sample); a "stop"
whose `stop_reason` is a string is our "stop" (a stop string), one with an int or None our "eos"."""


class BackendUnavailable(RuntimeError):
    """The vLLM backend was selected but cannot run here (vLLM missing); the message is one line."""


def require_vllm() -> ModuleType:
    """`import vllm`, or `BackendUnavailable` saying how to install it."""
    try:
        import vllm
    except ImportError as exc:
        raise BackendUnavailable(
            f"the vllm rollout backend needs vLLM, which is not installed ({exc}): {INSTALL_HINT}"
        ) from None
    return vllm


def field_names(cls: Any) -> frozenset[str]:
    """Constructor field names of a vLLM config class: dataclass (EngineArgs, SpeculativeConfig, a pydantic
    dataclass) or msgspec Struct (SamplingParams)."""
    if hasattr(cls, "__struct_fields__"):
        return frozenset(cls.__struct_fields__)
    if dataclasses.is_dataclass(cls):
        return frozenset(f.name for f in dataclasses.fields(cls))
    if hasattr(cls, "model_fields"):
        return frozenset(cls.model_fields)
    raise TypeError(f"cannot list the fields of {cls!r}")


# ------------------------------------------------------------------------------------ outputs -> ours (pure)


def _get(obj: Any, name: str, default: Any = None) -> Any:
    return obj.get(name, default) if isinstance(obj, Mapping) else getattr(obj, name, default)


def sampled_logprobs(token_ids: Sequence[int], logprobs: Sequence[Any] | None) -> list[float]:
    """The log-prob of each sampled token from vLLM's per-position logprobs (`list[dict[int, Logprob]]` or
    `FlatLogprobs`, which indexes the same way), requested with `SamplingParams(logprobs=0)`."""
    if logprobs is None:
        raise ValueError("vLLM returned no logprobs: the request must set SamplingParams(logprobs=0)")
    if len(logprobs) != len(token_ids):
        raise ValueError(f"vLLM returned logprobs for {len(logprobs)} positions, {len(token_ids)} tokens")
    out = []
    for i, token in enumerate(token_ids):
        position = logprobs[i]
        entry = position.get(token) if position else None
        if entry is None:
            raise ValueError(f"vLLM returned no logprob for the sampled token {token} at position {i}")
        out.append(float(entry if isinstance(entry, (int, float)) else entry.logprob))
    return out


def accept_lengths(metrics: Any, num_tokens: int) -> list[int]:
    """Tokens emitted per speculative round from vLLM's per-request SD metrics (`RequestSpecDecodeMetrics`
    or its `to_dict()`; engine option `per_request_spec_decode_metrics`): `detailed` gives the rounds in
    order (`per_step_accepted`), `summary` only a histogram of accepted drafts (rounds then come grouped by
    length: counts and sums, which is all `rl/samples.py` uses, are exact). Each round emits its accepted
    drafts plus one token; rounds cut short by EOS or the length limit are trimmed so the total never
    exceeds `num_tokens`. None or absent metrics (SD off): no rounds."""
    if metrics is None:
        return []
    steps = _get(metrics, "per_step_accepted") or []
    if not steps:
        histogram = _get(metrics, "histogram") or _get(metrics, "acceptance_histogram") or []
        steps = [j for j, count in enumerate(histogram) for _ in range(int(count))]
    lengths, left = [], num_tokens
    for accepted in steps:
        if left <= 0:
            break
        emitted = min(int(accepted) + 1, left)
        lengths.append(emitted)
        left -= emitted
    return lengths


def to_generation_result(
    output: Any,
    *,
    request_id: Hashable,
    prompt_ids: Sequence[int],
    eos_ids: Iterable[int],
    stop: StopStrings | None = None,
    hidden: torch.Tensor | None = None,
    prompt_hidden: torch.Tensor | None = None,
) -> GenerationResult:
    """A finished vLLM `RequestOutput` (one completion) as this project's `GenerationResult`. A response that
    vLLM stopped at a stop string is cut where `stop` applied token by token stops it, as our engine does."""
    if not _get(output, "finished", False):
        raise ValueError(f"request {request_id!r}: vLLM output is not finished")
    completions = list(_get(output, "outputs") or [])
    if len(completions) != 1:
        raise ValueError(f"request {request_id!r}: expected one completion (n=1), got {len(completions)}")
    completion = completions[0]
    sent = [int(t) for t in prompt_ids]
    echoed = _get(output, "prompt_token_ids")
    if echoed is not None and list(echoed) != sent:
        raise ValueError(f"request {request_id!r}: vLLM echoed a different prompt than was sent")
    token_ids = [int(t) for t in _get(completion, "token_ids")]
    reason = _get(completion, "finish_reason")
    finish = FINISH_REASONS.get(str(reason))
    if finish is None:
        raise ValueError(f"request {request_id!r}: vLLM finished it with {reason!r}, which yields no sample")
    positions = _get(completion, "logprobs")
    if finish == "eos" and isinstance(_get(completion, "stop_reason"), str):
        if stop is None:
            raise ValueError(f"request {request_id!r}: vLLM stopped at a stop string none was asked for")
        keep = stop.first_stop(token_ids)
        finish = "stop"
        if keep is not None:
            token_ids, positions = token_ids[:keep], None if positions is None else list(positions)[:keep]
    eos = {int(t) for t in eos_ids}
    if finish == "eos" and (not token_ids or token_ids[-1] not in eos):
        raise ValueError(
            f"request {request_id!r}: vLLM stopped at {_get(completion, 'stop_reason')!r}, "
            f"not at an EOS id {sorted(eos)}"
        )
    if hidden is not None and hidden.shape[0] != len(token_ids):
        raise ValueError(f"request {request_id!r}: {hidden.shape[0]} hidden states for {len(token_ids)} tokens")
    return GenerationResult(
        request_id=request_id,
        prompt_ids=sent,
        token_ids=token_ids,
        logprobs=sampled_logprobs(token_ids, positions),
        finish_reason=finish,
        hidden=hidden,
        accept_lengths=accept_lengths(_get(completion, "spec_decode_metrics"), len(token_ids)),
        prompt_hidden=prompt_hidden,
    )


# ------------------------------------------------------------------------------- hidden states (pure torch)


@torch.inference_mode()
def recompute_hidden(
    model: Transformer, sequences: Sequence[tuple[Sequence[int], Sequence[int]]], *, max_tokens: int = 16_384
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """For each (prompt ids, generated ids), the final-norm hidden states a `GenerationEngine` run with
    `return_hidden=True` reports: `(prompt_hidden [P - 1, H], hidden [n, H])`, `hidden[i]` the state whose
    logits produced token i. One padded prefill over prompt + response minus its last token per batch of at
    most `max_tokens` (padded) tokens; results on the model's device."""
    out: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(sequences)
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i][0]) + len(sequences[i][1]))
    device = model.device
    start = 0
    while start < len(order):
        end = start + 1
        while end < len(order):  # longest last: the batch's padded width is its last sequence's
            width = len(sequences[order[end]][0]) + len(sequences[order[end]][1]) - 1
            if (end - start + 1) * width > max_tokens:
                break
            end += 1
        batch = order[start:end]
        rows = [[int(t) for t in (*sequences[i][0], *sequences[i][1])][:-1] for i in batch]
        if any(len(sequences[i][0]) < 1 or len(sequences[i][1]) < 1 for i in batch):
            raise ValueError("every sequence needs a prompt and at least one generated token")
        lens = [len(r) for r in rows]
        t = max(lens)
        ids = torch.zeros(len(rows), t, dtype=torch.long)
        for b, row in enumerate(rows):
            ids[b, : lens[b]] = torch.tensor(row)
        cache = model.new_cache(len(rows), t)
        num_new = torch.tensor(lens, device=device)
        positions = torch.arange(t, device=device).expand(len(rows), t)
        states = model(ids.to(device), positions, cache, num_new=None if min(lens) == t else num_new)
        for b, i in enumerate(batch):
            p = len(sequences[i][0])
            out[i] = (states[b, : p - 1].clone(), states[b, p - 1 : lens[b]].clone())
        start = end
    return [pair for pair in out if pair is not None]


# ------------------------------------------------------------------ run inside vLLM's worker processes


def _safetensors_items(directory: Path, *, skip: tuple[str, ...] = ()) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{directory}: no safetensors weights")
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open handles have keys(), not __iter__)
                if not name.startswith(skip):
                    yield name, f.get_tensor(name)


def drafter_swap_tensors(export: str | Path) -> list[tuple[str, torch.Tensor]]:
    """The tensors of an EAGLE export that an in-place drafter swap loads: the draft's own (fc and its layer),
    never `embed_tokens`/`lm_head`. The draft shares those modules with the target, so loading an export's
    embedding (written with `--policy`) would overwrite the live policy's."""
    return list(_safetensors_items(Path(export), skip=("embed_tokens.", "lm_head.")))


def _runner_model(runner: Any) -> Any:
    get = getattr(runner, "get_model", None)
    return get() if callable(get) else runner.model


def _reload_policy_on_worker(worker: Any, path: str) -> None:
    """Reload the target model's weights in place from checkpoint `path` (in a vLLM worker)."""
    runner = worker.model_runner
    reload = getattr(runner, "reload_weights", None)
    if reload is not None and "weights_path" in inspect.signature(reload).parameters:
        worker.reload_weights(weights_path=path, is_checkpoint_format=True)
        return
    with torch.no_grad():
        _runner_model(runner).load_weights(_safetensors_items(Path(path)))


def _swap_drafter_on_worker(worker: Any, path: str) -> int:
    """Load an EAGLE export's own tensors into the draft model in place (in a vLLM worker); the embedding
    and LM head stay the target's shared modules (loading them would overwrite the target's)."""
    runner = worker.model_runner
    get = getattr(runner, "get_draft_model", None)
    draft = get() if callable(get) else getattr(getattr(runner, "drafter", None), "model", None)
    if draft is None:
        raise RuntimeError("this vLLM engine has no draft model (it was built without speculative decoding)")
    weights = drafter_swap_tensors(path)
    try:
        from vllm.config import set_current_vllm_config

        context: Any = set_current_vllm_config(worker.vllm_config)
    except (ImportError, AttributeError):
        import contextlib

        context = contextlib.nullcontext()
    with context, torch.no_grad():
        draft.load_weights(iter(weights))
    return len(weights)


class TltWorkerExtension:
    """Methods vLLM mixes into its worker class (`worker_extension_cls`, named by import path), so that
    `LLM.collective_rpc("tlt_...", args=(path,))` reaches them by name: a callable would have to be pickled
    across vLLM's process boundary, which vLLM allows only with VLLM_ALLOW_INSECURE_SERIALIZATION=1. No
    `__init__` and only `tlt_`-prefixed names (vLLM refuses an extension that shadows a worker attribute)."""

    def tlt_reload_policy(self, path: str) -> None:
        _reload_policy_on_worker(self, path)

    def tlt_swap_drafter(self, path: str) -> int:
        return _swap_drafter_on_worker(self, path)


WORKER_EXTENSION = f"{TltWorkerExtension.__module__}.{TltWorkerExtension.__qualname__}"


# ------------------------------------------------------------------------------------------------- engine


@dataclass(frozen=True)
class VllmSettings:
    """How to build the vLLM engine (see `vllm_config` for the translation of each)."""

    max_batch: int = DEFAULTS.rollout.max_batch
    """vLLM's `max_num_seqs`."""
    max_len: int = DEFAULTS.rollout.max_len
    """vLLM's `max_model_len`: prompt + response tokens per request."""
    temperature: float = DEFAULTS.rollout.temperature
    """The rollout temperature (picks greedy or probabilistic drafting); requests may still differ."""
    arm: str | None = None
    """A chain arm label (`d4k1v4`) or `ngram-dN`: speculative decoding at every batch size; None: off."""
    switch_threshold: int | None = None
    """With `arm`: SD only at running batch <= this (an `SdSwitch` threshold, without its band)."""
    table: Mapping[int, str] | None = None
    """Instead of `arm`: bucket -> arm label (a published `sd_config`), as vLLM's batch-size schedule."""
    edges: tuple[int, ...] = DEFAULT_EDGES
    dtype: str = DEFAULTS.rollout.dtype
    """vLLM's dtype: auto, float32 or bfloat16. vLLM's auto is the checkpoint's dtype except for a float32
    checkpoint, which it runs in the platform's half type (bfloat16 on CUDA; vLLM 0.33.0, checked on the CPU by
    bench/vllm_cpu_check.sh): the same as this project's `rollout.dtype = "auto"` on CUDA."""
    gpu_memory_utilization: float = 0.80
    enforce_eager: bool = False
    seed: int = DEFAULTS.sd.seed
    hidden: Literal["recompute", "none"] = "recompute"
    """Where `return_hidden` states come from (module docstring)."""
    hidden_batch_tokens: int = 16_384
    work_dir: str | None = None
    """Where drafter exports go (default: a temporary directory owned by the engine)."""


@dataclass
class DraftHolder:
    """Where `GenerationEngine` has its proposer: the drafter the engine drafts with, as a torch module
    bound to the recompute model (vLLM holds its own copy of the same weights)."""

    drafter: Any


@dataclass
class _Pending:
    request_id: Hashable
    prompt_ids: list[int]
    eos_ids: frozenset[int]
    return_hidden: bool
    stop: StopStrings | None = None


_NO_PARTIAL_ROLLOUTS = (
    "the vllm backend has no partial rollouts (load_policy(reverify=True), ahead_limit): it cannot park a "
    "request, score its tokens under new weights at its temperature, or resume it with its random stream; "
    "use the torch engine"
)


class VllmEngine:
    """`GenerationEngine`'s surface on vLLM (module docstring); `policy` is a Hugging Face checkpoint
    directory, `drafter` a drafter checkpoint (or an EAGLE export) for EAGLE arms."""

    def __init__(
        self, policy: str | Path, *, settings: VllmSettings = VllmSettings(), drafter: str | Path | None = None
    ) -> None:
        vllm = require_vllm()
        from vllm.config import SpeculativeConfig
        from vllm.engine.arg_utils import EngineArgs

        from tlt_stream.model.loader import load_spec

        self.settings = settings
        self.policy = Path(policy)
        self.vocab_size = load_spec(self.policy).vocab_size
        self._tmp = None if settings.work_dir else tempfile.TemporaryDirectory(prefix="tlt-vllm-")
        self.work_dir = Path(settings.work_dir or self._tmp.name)  # type: ignore[union-attr]
        self._exports = itertools.count()
        self._drafter_export: Path | None = None
        spec_fields = field_names(SpeculativeConfig)
        speculative, schedule, self.arm = self._speculation(drafter, spec_fields)
        kwargs = llm_kwargs(
            self.policy,
            max_batch=settings.max_batch,
            max_len=settings.max_len,
            dtype=settings.dtype,
            seed=settings.seed,
            gpu_memory_utilization=settings.gpu_memory_utilization,
            enforce_eager=settings.enforce_eager,
            speculative=speculative,
            schedule=schedule,
            worker_extension=WORKER_EXTENSION,
            available=field_names(EngineArgs),
            spec_available=spec_fields,
        )
        for note in speculative.notes if speculative is not None else ():
            log.warning("vllm backend: %s", note)
        log.info("vllm backend: LLM(%s)", json.dumps(kwargs, default=str))
        wanted = sampling_params(max_tokens=1, temperature=0.0, seed=None, eos_ids=())
        missing = sorted(set(wanted) - field_names(vllm.SamplingParams))
        if missing:
            raise UnsupportedSetting(f"the installed vLLM's SamplingParams has no {missing}")
        self._vllm = vllm
        self.llm = vllm.LLM(**kwargs)
        self._engine = self.llm.llm_engine
        self._pending: dict[str, _Pending] = {}
        self._ids = itertools.count()
        self._keys = itertools.count()
        self.tokens_generated = 0
        self.rounds = 0
        self.plain_steps = 0
        """Engine steps without speculation: with `rounds` (steps with it), the batched target forwards, as
        `GenerationEngine` counts them."""
        self._recompute: Transformer | None = None
        self._drafter_source = None if drafter is None else Path(drafter)
        self.proposer: DraftHolder | None = None
        if settings.hidden == "recompute":
            self._recompute = self._load_recompute_model(self.policy)
            self._bind_drafter()

    # -- construction helpers

    def _speculation(self, drafter: str | Path | None, spec_fields: frozenset[str]) -> tuple[Any, Any, Arm | None]:
        s = self.settings
        if s.arm is not None and s.table is not None:
            raise UnsupportedSetting("give either a fixed arm or an sd_config table, not both")
        if s.table is not None:
            method, top, schedule = dynamic_schedule(
                s.table, max_num_seqs=s.max_batch, edges=s.edges, switch_threshold=s.switch_threshold
            )
            arm = Arm.drafter(top, 1, top) if method == "eagle" else Arm.ngram(top)
        elif s.arm is not None:
            arm = as_arm(s.arm)
            schedule = None
            if s.switch_threshold is not None and arm.kind != "plain":
                key = 0  # one bucket covering every batch size, cut by the switch
                _, _, schedule = dynamic_schedule(
                    {key: arm}, max_num_seqs=s.max_batch, edges=(), switch_threshold=s.switch_threshold
                )
        else:
            return None, None, None
        if arm.kind == "plain":
            return None, None, None
        export = None
        if arm.kind == "drafter":
            if drafter is None:
                raise UnsupportedSetting(f"arm {arm.label} needs a drafter (a checkpoint or an EAGLE export)")
            export = self._drafter_export = self._export(drafter)
        translation = speculative_config(arm, drafter=export, temperature=s.temperature, available=spec_fields)
        return translation, schedule, arm

    def _export(self, drafter: str | Path) -> Path:
        """An EAGLE export of `drafter` (used as is when it already is one)."""
        from tlt_stream.drafter.export import EXPORT_RECORD, export_drafter

        path = Path(drafter)
        if (path / EXPORT_RECORD).is_file():
            return path
        out = self.work_dir / f"drafter-{next(self._exports)}"
        return export_drafter(path, out, format="eagle").path

    def _load_recompute_model(self, policy: Path) -> Transformer:
        from tlt_stream.model import load_model

        dtype = {"float32": torch.float32, "float16": torch.float16}.get(self.settings.dtype, torch.bfloat16)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        return load_model(policy, dtype=dtype, device=device)

    def _bind_drafter(self) -> None:
        """The current drafter, bound to the recompute model (what online drafter training measures against)."""
        from tlt_stream.drafter.export import EXPORT_RECORD
        from tlt_stream.drafter.model import load_drafter

        source = self._drafter_source
        unbindable = source is None or (source / EXPORT_RECORD).is_file()  # an export is no project checkpoint
        if self._recompute is None or self._drafter_export is None or unbindable:
            self.proposer = None
        else:
            self.proposer = DraftHolder(load_drafter(source, self._recompute))

    @property
    def model(self) -> Transformer:
        """This project's `Transformer` on the engine's current policy weights (the hidden-state recompute
        model): what a drafter binds its embedding and LM head to, e.g. for online drafter training."""
        if self._recompute is None:
            raise RuntimeError("the vLLM engine keeps no torch copy of the policy without hidden='recompute'")
        return self._recompute

    # -- GenerationEngine's surface

    @property
    def has_unfinished(self) -> bool:
        return bool(self._pending) or self._engine.has_unfinished_requests()

    @property
    def has_work(self) -> bool:
        return self.has_unfinished  # nothing parks on vLLM

    @property
    def num_running(self) -> int:
        """Requests added and not yet returned (vLLM's running + waiting)."""
        return len(self._pending)

    @property
    def num_parked(self) -> int:
        """Always 0: no drafts on vLLM (module docstring, partial rollouts)."""
        return 0

    def add_request(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        temperature: float = 0.0,
        seed: int | None = None,
        eos_ids: Iterable[int] = (),
        request_id: Hashable | None = None,
        *,
        stop: StopRule | None = None,
        return_hidden: bool = False,
        ahead_limit: int | None = None,
    ) -> Hashable:
        """Queue a request (`GenerationEngine.add_request`'s contract) and return its id. vLLM checks stop
        rules itself, so `stop` must be a `StopStrings` (its strings go to vLLM). No drafts: `ahead_limit`
        must be None (module docstring, partial rollouts)."""
        if ahead_limit is not None:
            raise UnsupportedSetting(_NO_PARTIAL_ROLLOUTS)
        from vllm.sampling_params import RequestOutputKind

        prompt = [int(t) for t in prompt_ids]
        eos = frozenset(int(t) for t in eos_ids)
        rid = next(self._ids) if request_id is None else request_id
        if return_hidden and self._recompute is None:
            raise ValueError("return_hidden needs VllmSettings(hidden='recompute')")
        if stop is not None and not isinstance(stop, StopStrings):
            raise UnsupportedSetting(f"the vllm backend stops on stop strings only, not on {stop!r}")
        if not prompt:
            raise ValueError(f"request {rid!r}: empty prompt")
        if any(not 0 <= t < self.vocab_size for t in prompt):
            raise ValueError(f"request {rid!r}: prompt token ids must lie in [0, {self.vocab_size})")
        if len(prompt) + max_new_tokens > self.settings.max_len:
            raise ValueError(
                f"request {rid!r}: prompt ({len(prompt)}) + max_new_tokens ({max_new_tokens}) exceeds "
                f"max_len ({self.settings.max_len})"
            )
        params = sampling_params(
            max_tokens=max_new_tokens,
            temperature=temperature,
            seed=seed,
            eos_ids=eos,
            stop_strings=stop.strings if stop is not None else (),
        )
        key = f"tlt-{next(self._keys)}"  # vLLM wants unique str ids; ours may be any hashable
        self._engine.add_request(
            key,
            {"prompt_token_ids": prompt},
            self._vllm.SamplingParams(**params, output_kind=RequestOutputKind.FINAL_ONLY),
        )
        self._pending[key] = _Pending(rid, prompt, eos, return_hidden, stop)
        return rid

    def step(self) -> list[GenerationResult]:
        """One vLLM engine step; the requests that finished in it, as `GenerationResult`s."""
        results, wanted = [], []
        if self._pending:  # one batched target forward (a verify round with SD on; vLLM's schedule may set K=0)
            if self.arm is not None:
                self.rounds += 1
            else:
                self.plain_steps += 1
        for out in self._engine.step():
            pending = self._pending.pop(out.request_id, None) if getattr(out, "finished", False) else None
            if pending is None:
                continue
            result = to_generation_result(
                out,
                request_id=pending.request_id,
                prompt_ids=pending.prompt_ids,
                eos_ids=pending.eos_ids,
                stop=pending.stop,
            )
            self.tokens_generated += len(result.token_ids)
            results.append(result)
            if pending.return_hidden:
                wanted.append(result)
        if wanted:
            assert self._recompute is not None
            states = recompute_hidden(
                self._recompute,
                [(r.prompt_ids, r.token_ids) for r in wanted],
                max_tokens=self.settings.hidden_batch_tokens,
            )
            for result, (prompt_hidden, hidden) in zip(wanted, states, strict=True):
                result.prompt_hidden, result.hidden = prompt_hidden, hidden
        return results

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        temperature: float = 0.0,
        seed: int | None = None,
        eos_ids: Iterable[int] = (),
        *,
        stop: StopRule | None = None,
        return_hidden: bool = False,
    ) -> list[GenerationResult]:
        """Generate for every prompt (prompt i seeded with `seed + i`); results in input order."""
        return generate_all(
            self, prompts, max_new_tokens, temperature, seed, eos_ids, stop=stop, return_hidden=return_hidden
        )

    # -- versions

    def load_policy(self, path: str | Path, *, reverify: bool = False, weights: Any = None) -> None:
        """Reload the policy's weights in place (every vLLM worker) from Hugging Face checkpoint `path`.
        Only with nothing in flight: every sample must come from one policy version. `reverify` (lossless
        re-verification of requests in flight) is not available on vLLM (module docstring), nor `weights`:
        vLLM's workers read `path` in their own processes, so a caller verifies it before (a second read)."""
        if weights is not None:
            raise ValueError("vLLM's workers read the checkpoint themselves: pass its path, not its tensors")
        if reverify:
            raise UnsupportedSetting(_NO_PARTIAL_ROLLOUTS)
        if self.has_unfinished:
            raise RuntimeError("load_policy() with requests in flight; let them finish first")
        from tlt_stream.model.loader import load_spec

        path = Path(path)
        old, new = load_spec(self.policy), load_spec(path)
        if dataclasses.replace(new, max_position_embeddings=old.max_position_embeddings) != old:
            raise CheckpointError(f"{path}: a different architecture than the engine's policy; build a new engine")
        self.llm.collective_rpc("tlt_reload_policy", args=(str(path),))
        self.llm.reset_prefix_cache()
        if self._recompute is not None:
            self._recompute = self._load_recompute_model(path)
        self.policy = path
        self._bind_drafter()

    def load_drafter(self, path: str | Path) -> int:
        """Swap the drafter in place (a drafter checkpoint, exported here, or an EAGLE export); requests in
        flight continue. Returns the number of tensors loaded per worker."""
        if self._drafter_export is None:
            raise RuntimeError("this engine drafts without an EAGLE drafter; there is nothing to swap")
        export = self._export(path)
        current = json.loads((self._drafter_export / "config.json").read_text())
        fresh = json.loads((export / "config.json").read_text())
        if any(current.get(k) != fresh.get(k) for k in _SHAPE_KEYS):
            raise CheckpointError(f"{path}: the drafter's shape differs from the engine's; build a new engine")
        counts = self.llm.collective_rpc("tlt_swap_drafter", args=(str(export),))
        self._drafter_export = export
        self._drafter_source = Path(path)
        self._bind_drafter()
        self.llm.reset_prefix_cache()  # cached prefixes carry the old drafter's KV (only acceptance suffers)
        return int(counts[0]) if counts else 0

    def close(self) -> None:
        """Shut the engine down (its worker processes and GPU memory) and remove its exports."""
        core = getattr(self._engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        if self._tmp is not None:
            self._tmp.cleanup()
