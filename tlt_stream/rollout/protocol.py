"""The one engine surface every rollout backend offers: what the rollout worker, the drafter trainer and
`tlt-stream generate` call, whichever backend (`engine.GenerationEngine` on torch, `vllm.backend.VllmEngine`
on vLLM) was built. `tests/unit/test_engine_protocol.py` checks that both classes have every member with the
same parameters, so a change to one backend's surface that the other lacks fails a test, not a GPU run."""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from tlt_stream.rollout.engine import GenerationResult
    from tlt_stream.rollout.scheduler import StopRule
    from tlt_stream.store.weights import PolicyWeights

__all__ = ["RolloutEngine"]


class RolloutEngine(Protocol):
    tokens_generated: int
    """Tokens emitted since the engine was built (SD's bonus and accepted tokens included)."""
    rounds: int
    """Speculative rounds run (one target forward each)."""
    plain_steps: int
    """Plain decode steps run (one target forward each)."""
    arm: object
    """The SD arm the next steps use; None for plain decoding (torch: an `Arm`; vLLM: its label)."""

    @property
    def has_unfinished(self) -> bool:
        """Whether any request is queued or running."""
        ...

    @property
    def has_work(self) -> bool:
        """Whether `step` would do anything: unfinished requests other than parked drafts."""
        ...

    @property
    def num_running(self) -> int:
        """Requests being decoded now."""
        ...

    @property
    def num_parked(self) -> int:
        """Drafts (`ahead_limit`) waiting for `load_policy(..., reverify=True)`; `step` does nothing for them."""
        ...

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
        """Queue a request; its id (a fresh one when `request_id` is None). With `ahead_limit` it is a draft
        for the next policy version: it parks after that many tokens (or when it ends) until re-verified."""
        ...

    def step(self) -> list[GenerationResult]:
        """Advance every running request; the requests that finished."""
        ...

    def load_policy(self, path: str | Path, *, reverify: bool = False, weights: PolicyWeights | None = None) -> None:
        """Another version of the policy, in place: only with nothing in flight, or with `reverify`, which
        re-verifies every request holding tokens under it, losslessly (`rollout/reverify.py`). `weights`:
        `path`'s contents already read and verified by the caller (torch only: vLLM's own processes read
        `path`)."""
        ...

    def load_drafter(self, path: str | Path) -> object:
        """Another drafter, in place (rows in flight go on: SD is lossless whatever it proposes)."""
        ...
