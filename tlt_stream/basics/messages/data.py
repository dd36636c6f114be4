"""The data plane's entries: prompt groups (`prompts`), finished samples (`samples`), hidden-state windows for
the drafter (`hidden`) and dead letters (`dead`)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Annotated, Any, Literal

import numpy as np
from msgspec import Meta

if TYPE_CHECKING:
    pass

from tlt_stream.basics.messages.wire import Entry, NonNegInt, Tensor, Version

__all__ = [
    "MAX_GROUP_SIZE",
    "DeadEntry",
    "DeadLetter",
    "HiddenEntry",
    "HiddenWindow",
    "PromptGroup",
    "PromptsEntry",
    "Sample",
    "SamplesEntry",
]


MAX_GROUP_SIZE = 4096
"""The most responses one prompt's group may have."""

# ---------------------------------------------------------------------------------------------------- prompts


class PromptGroup(Entry, tag="prompt_group"):
    """One prompt to be answered G times by one rollout worker (the unit of the `prompts` stream)."""

    task_id: str
    prompt_id: str
    prompt_ids: list[NonNegInt]
    answer: str
    group_size: Annotated[int, Meta(ge=1, le=MAX_GROUP_SIZE)]
    min_policy_version: NonNegInt = 0
    step: NonNegInt = 0
    prompt_text: str = ""
    fields: dict[str, Any] = {}
    """The dataset row's other fields (JSON values), for a reward that asks for them by name."""
    draft_version: NonNegInt | None = None
    """Partial rollouts: a worker may start the group under this (older) policy version as a draft; its rows
    are re-verified under `min_policy_version` before any sample is sent. None: not a draft."""

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("prompt_ids is empty")
        if self.draft_version is not None and self.draft_version >= self.min_policy_version:
            raise ValueError(
                f"draft_version {self.draft_version} must be older than min_policy_version {self.min_policy_version}"
            )

    @property
    def startable_version(self) -> int:
        """The oldest policy version a worker may start this group under (as a draft when it is older than
        `min_policy_version`)."""
        return self.min_policy_version if self.draft_version is None else self.draft_version


PromptsEntry = PromptGroup


# ---------------------------------------------------------------------------------------------------- samples


class Sample(Entry, tag="sample"):
    """One finished response with everything the learner needs (the unit of the `samples` stream).

    `sample_id` is deterministic (`{task_id}/{index}`), so a sample regenerated after a worker died is
    recognised as the same sample and applied at most once.
    """

    sample_id: str
    task_id: str
    prompt_id: str
    index: NonNegInt
    group_size: Annotated[int, Meta(ge=1, le=MAX_GROUP_SIZE)]
    prompt_ids: list[NonNegInt]
    token_ids: Tensor
    """int32 [n]: the response."""
    logprobs: Tensor
    """float32 [n]: behaviour log-probabilities of `token_ids` under the policy that generated them."""
    policy_version: NonNegInt
    drafter_version: Version
    reward: float
    finish_reason: Literal["eos", "stop", "length"]
    """eos: ended at an EOS id; stop: at a stop string; length: cut at the token limit (truncated)."""
    worker_id: str
    step: NonNegInt = 0
    gen_seconds: Annotated[float, Meta(ge=0)] = 0.0
    accept_length: Annotated[float, Meta(ge=0)] = 0.0
    """Mean tokens emitted per target forward while generating this sample (1.0 without SD)."""

    def __post_init__(self) -> None:
        if self.token_ids.dtype != "int32" or len(self.token_ids.shape) != 1:
            raise ValueError(f"token_ids must be int32 [n], got {self.token_ids.dtype}{self.token_ids.shape}")
        if self.logprobs.dtype != "float32" or self.logprobs.shape != self.token_ids.shape:
            raise ValueError(
                f"logprobs must be float32 {self.token_ids.shape}, got {self.logprobs.dtype}{self.logprobs.shape}"
            )
        if self.index >= self.group_size:
            raise ValueError(f"index {self.index} is outside a group of {self.group_size}")
        if self.token_ids.shape[0]:
            # One reduction each: min < 0 catches negative ids; a NaN or infinite logprob makes the sum
            # non-finite, and a positive one shows in the max.
            if self.token_ids.to_numpy().min() < 0:
                raise ValueError("token_ids must be non-negative")
            lp = self.logprobs.to_numpy()
            if not (math.isfinite(float(lp.sum(dtype=np.float64))) and lp.max() <= 0.0):
                raise ValueError("logprobs must be finite values <= 0")

    @property
    def response_len(self) -> int:
        return self.token_ids.shape[0]


SamplesEntry = Sample


# ---------------------------------------------------------------------------------------------------- hidden


class HiddenWindow(Entry, tag="hidden"):
    """A window of target hidden states with the tokens they were computed at (drafter training data).

    Row i of `hidden` is the target's final-layer hidden state at the position of `token_ids[i]`, i.e. the
    state whose logits predicted `token_ids[i + 1]`. The first `prompt_len` rows are prompt positions
    (context, not trained on).
    """

    sample_id: str
    policy_version: NonNegInt
    token_ids: list[NonNegInt]
    hidden: Tensor
    start: NonNegInt = 0
    prompt_len: NonNegInt = 0

    def __post_init__(self) -> None:
        if len(self.hidden.shape) != 2 or self.hidden.shape[0] != len(self.token_ids):
            raise ValueError(
                f"hidden must be [len(token_ids), H] = [{len(self.token_ids)}, H], got {self.hidden.shape}"
            )
        if self.prompt_len > len(self.token_ids):
            raise ValueError("prompt_len exceeds the window")


HiddenEntry = HiddenWindow


# ---------------------------------------------------------------------------------------------------- dead


class DeadLetter(Entry, tag="dead"):
    """An entry that failed to decode, validate or be handled, with why and where it came from."""

    stream: str
    entry_id: str
    reason: str
    origin: str
    deliveries: NonNegInt = 0
    payload: bytes = b""
    """The raw entry, truncated to `payload_limit` bytes."""
    payload_size: NonNegInt = 0


DeadEntry = DeadLetter
