"""Which policy a rollout worker generates with: the newest announced version, verified, loaded between steps.

The worker loads the announced `PolicyVersion` once the requests in flight have finished (with partial
rollouts, at once: the rows in flight are re-verified under it), so every sample comes from one policy
version, the one it reports. Its bytes are checked against the announced sha256 as they are read; a
mismatch, a location outside the store or a config this worker cannot serve is refused for good, logged
and shown in the worker's state reason, and the old weights stay in use. A version whose directory is not
there (pruned by the learner for a newer one, or its storage away for a while) is tried again after a
backoff unless a newer one is announced first (`rollout/versions.py` keeps that state). The engine is
built at the first load and every later version is loaded into it in place.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from tlt_stream.basics.aio import wait_until
from tlt_stream.basics.config import Config
from tlt_stream.basics.messages import PolicyVersion, WorkerStatus
from tlt_stream.bus.control import ControlPlane
from tlt_stream.bus.registry import WorkerRegistry
from tlt_stream.model.loader import CheckpointError, stop_token_ids
from tlt_stream.model.sizing import context_len
from tlt_stream.model.threads import in_own_thread
from tlt_stream.rl.validate import location_problem
from tlt_stream.rollout.build import build_engine
from tlt_stream.rollout.stops import StopStrings
from tlt_stream.rollout.versions import PolicyVersions
from tlt_stream.store.digest import ChecksumMismatch, verify_directory
from tlt_stream.store.locations import local_location, unresolvable

if TYPE_CHECKING:
    from tlt_stream.rollout.adaptive import AdaptiveSd
    from tlt_stream.rollout.protocol import RolloutEngine
    from tlt_stream.store.weights import PolicyWeights

__all__ = ["PolicyLoader"]

log = logging.getLogger("tlt_stream.roles.rollout_worker")


class PolicyLoader:
    """The worker's policy and the engine it runs in: the version loaded, the announced one, and what it takes
    to go from one to the other."""

    def __init__(
        self, config: Config, control: ControlPlane, registry: WorkerRegistry, *, device: str, hidden: bool
    ) -> None:
        self.config = config
        self.control = control
        self.registry = registry
        self.device = device
        self.hidden = hidden
        """Whether the engine keeps hidden states (streamed, or trained on by this worker's idle trainer)."""
        self.policy: PolicyVersion | None = None
        self.versions = PolicyVersions()
        """Refused policy versions, and one that was not there when we tried to load it (tried again after
        a backoff unless a newer one comes first)."""
        self.engine: RolloutEngine | None = None
        """Built at the first load, then kept for the worker's life."""
        self.built = asyncio.Event()
        """Set once the engine exists."""
        self.adaptive: AdaptiveSd | None = None
        self.tokenizer: Any = None
        self.stop_ids: list[int] = []
        """Every EOS id of the loaded policy (`model.stop_token_ids`)."""
        self.stop_rule: StopStrings | None = None
        """The stop strings, on the policy's tokenizer (None without any)."""
        self.vocab_size: int | None = None
        """The loaded policy's vocabulary (from its config.json): prompts outside it are dead-lettered."""
        self.max_len: int | None = None
        """Prompt + response tokens per row: `rollout.max_len`, else the loaded policy's context."""

    @property
    def version(self) -> int:
        return self.policy.version if self.policy is not None else -1

    async def load(self, announced: PolicyVersion, drafter: str | None, drafter_version: int) -> float | None:
        """Load `announced` (from `loadable`; with nothing in flight unless partial rollouts re-verify it), the
        engine built around `drafter` at the first load. Returns the seconds from its announcement to loaded,
        or None when it was refused or could not be read now (said in the log and the worker's state)."""
        await self.registry.set_state(WorkerStatus.LOADING, f"policy version {announced.version}")
        store_root = self.config.bus.store_root
        if problem := unresolvable(announced.location, store_root) or location_problem(announced.location, store_root):
            self._refuse(announced, problem)
            return None
        try:
            await in_own_thread(self._load, announced, drafter, drafter_version)
        except (ChecksumMismatch, CheckpointError, OSError) as exc:
            if not isinstance(exc, ChecksumMismatch) and not await asyncio.to_thread(Path(announced.location).is_dir):
                # Not there now: pruned by the learner for a newer version (which is announced next), or its
                # storage away for a while. Refusing it for good would stall an on-policy run whose tasks
                # need exactly this version, so try it again after a backoff unless a newer one comes first.
                delay = self.versions.unreadable(announced.version, time.monotonic())
                log.warning("policy version %d unreadable (%s); trying again in %.1f s", announced.version, exc, delay)
                self.registry.update_info(unreadable_policy=f"{announced.version}: {exc}")
                if self.policy is not None:
                    await self.registry.set_state(
                        WorkerStatus.IDLE, f"policy version {announced.version} unreadable, kept {self.version}: {exc}"
                    )
                return None
            self._refuse(announced, exc)  # corrupt (its bytes do not match the announced sha256) or unusable
            if self.policy is not None:  # keep generating with the version we have, and say why
                await self.registry.set_state(
                    WorkerStatus.IDLE, f"refused policy version {announced.version}, kept {self.version}: {exc}"
                )
            return None
        self.versions.loaded(announced.version)
        self.built.set()
        self.registry.update_info(policy_version=announced.version)
        log.info("loaded policy version %d", announced.version)
        if announced.published_at <= 0:
            return 0.0
        latency = max(0.0, time.time() - announced.published_at)  # two wall clocks: skew shifts it, never below 0
        self.registry.update_info(load_latency_s=f"{latency:.3f}")
        return latency

    def _refuse(self, announced: PolicyVersion, why: object) -> None:
        self.versions.refuse(announced.version)
        log.error("refused policy version %d: %s", announced.version, why)
        self.registry.update_info(refused_policy=f"{announced.version}: {why}")

    def _load(self, announced: PolicyVersion, drafter: str | None, drafter_version: int) -> None:
        """Verify and load `announced`. On torch each file is read once: hashed, and its tensors parsed from
        those same bytes (`store/weights.py`), so nothing reaches the engine before the whole directory
        matched; vLLM's processes read the checkpoint themselves, so it is verified first (a second read)."""
        from tlt_stream.model import load_tokenizer
        from tlt_stream.store.weights import read_weights

        own = self.config.rollout
        weights = None
        if own.backend == "torch":
            weights = read_weights(announced.location, announced.sha256, scheme=announced.digest)
        else:
            verify_directory(announced.location, announced.sha256, scheme=announced.digest)
        self.vocab_size, positions = _policy_limits(announced.location)
        self.max_len = context_len(own.max_len, positions, announced.location)  # longer: every sample poison
        if self.tokenizer is None:
            if not Path(announced.location).is_dir():  # pruned since verified: say so, not "bad repo id"
                raise CheckpointError(f"{announced.location}: vanished while loading (pruned by the learner?)")
            self.tokenizer = load_tokenizer(announced.location)  # the learner publishes data.tokenizer with it
        self.stop_ids = stop_token_ids(announced.location, self.tokenizer)
        if own.stop and self.stop_rule is None:
            self.stop_rule = StopStrings(self.tokenizer, own.stop)
        if self.engine is not None and self.config.policy.partial_rollouts and self.engine.has_unfinished:
            self.engine.load_policy(announced.location, reverify=True, weights=weights)  # rows in flight, losslessly
        elif self.engine is not None:  # one engine for the worker's life: each version is loaded into it in place
            self.engine.load_policy(announced.location, weights=weights)
        else:
            self._build(announced, drafter, drafter_version, weights)
        self.policy = announced

    def _build(
        self, announced: PolicyVersion, drafter: str | None, drafter_version: int, weights: PolicyWeights | None
    ) -> None:
        config = self.config
        if config.rollout.max_len != self.max_len:  # the checkpoint's context
            config = msgspec.structs.replace(
                config, rollout=msgspec.structs.replace(config.rollout, max_len=self.max_len)
            )
        self.engine, self.adaptive = build_engine(
            announced.location,
            config,
            device=self.device,
            drafter=drafter,
            hidden=self.hidden,
            drafter_version=drafter_version,
            weights=weights,
        )
        rollout, cache = config.rollout, getattr(self.engine, "cache", None)
        rows = f"{rollout.max_batch} rows"
        if cache is not None:  # torch: the rows that fit the budget
            per_row = self.engine.row_bytes  # type: ignore[attr-defined]
            rows = f"KV cache and row buffers {per_row / 2**20:.1f} MiB a row, {cache.max_batch} rows"
        print(
            f"{self.registry.worker_id}: rows of {rollout.max_len} tokens (prompt + response; responses up to "
            f"{min(rollout.max_response_len or rollout.max_len, rollout.max_len)}), {rows}",
            file=sys.stderr,
        )

    def announced(self) -> PolicyVersion | None:
        """The announced policy version, its location as a path on this node (`store/locations.py`)."""
        announced = self.control.current.get("policy")
        if not isinstance(announced, PolicyVersion):
            return None
        local = local_location(announced.location, self.config.bus.store_root)
        return announced if local == announced.location else msgspec.structs.replace(announced, location=local)

    def loadable(self) -> PolicyVersion | None:
        """The announced policy version when it is newer than ours, not refused and past its backoff."""
        announced = self.announced()
        number = announced.version if announced is not None else None
        return announced if self.versions.loadable(number, self.version, time.monotonic()) else None

    def awaiting_retry(self) -> bool:
        """Whether the newest announced policy is one we could not read and will try again."""
        announced = self.announced()
        return self.versions.awaiting_retry(announced.version if announced is not None else None, self.version)

    async def wait_to_retry(self, stop: asyncio.Event) -> None:
        """Until the unreadable version's next try, a newer announcement, or `stop`."""
        if self.versions.unavailable is not None:
            remaining = max(0.0, self.versions.retry_at - time.monotonic())
            await self.wait_for_newer(self.versions.unavailable, stop, timeout=remaining)

    async def wait_for_newer(self, version: int, stop: asyncio.Event, timeout: float | None = None) -> None:
        """Until a policy version newer than `version` is announced, `stop` is set, or `timeout` passes."""
        await wait_until(self.control.wait_for("policy", version + 1), stop, timeout)


def _policy_limits(location: str) -> tuple[int | None, int | None]:
    """(`vocab_size`, `max_position_embeddings`) from a Hugging Face checkpoint's config.json (None for what
    it does not say)."""
    try:
        config = json.loads((Path(location) / "config.json").read_text())
    except (OSError, ValueError):
        return None, None

    def positive(name: str) -> int | None:
        value = config.get(name) if isinstance(config, dict) else None
        return int(value) if isinstance(value, int) and value > 0 else None

    return positive("vocab_size"), positive("max_position_embeddings")
