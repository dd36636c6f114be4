"""From a finished generation to what goes on the streams: the scored `Sample` and its `HiddenWindow`.

One place builds both, so the rollout worker and the benchmarks stream exactly the same thing.

The hidden-state window of a sample covers the prompt and the response but the last token: row i is the
policy's final-norm state at position i, whose logits predicted token i + 1 (`GenerationResult.hidden` and
`prompt_hidden` together). The last response token has no state (nothing was computed after it), so the
window's tokens stop one short; the first `len(prompt_ids)` rows are prompt context, not trained on.
"""

from __future__ import annotations

from typing import Any

import torch

from tlt_stream.basics.messages import HiddenWindow, PromptGroup, Sample, Tensor

__all__ = ["hidden_window", "make_sample"]


def make_sample(
    result: Any,
    group: PromptGroup,
    index: int,
    *,
    reward: float,
    policy_version: int,
    drafter_version: int,
    worker_id: str,
    gen_seconds: float,
) -> Sample:
    """The `Sample` for response `index` of `group`, from a `GenerationResult`."""
    accepts = result.accept_lengths
    # Tokens per target forward over every token the request emitted, also those a re-verification under a
    # newer policy discarded afterwards (partial rollouts): `accepts` keeps the SD rounds that emitted them,
    # so counting only the tokens kept could give fewer tokens than its rounds emitted (a negative count of
    # forwards, a sample the learner could not decode). SD rounds emit `accepts[i]` each; every other token
    # took one forward (a plain step, the prefill's first token, a re-verification's resampled token).
    emitted = len(result.token_ids) + result.tokens_discarded
    forwards = len(accepts) + max(0, emitted - sum(accepts))
    return Sample(
        sample_id=f"{group.task_id}/{index}",
        task_id=group.task_id,
        prompt_id=group.prompt_id,
        index=index,
        group_size=group.group_size,
        prompt_ids=list(group.prompt_ids),
        token_ids=Tensor.from_values(result.token_ids, "int32"),
        logprobs=Tensor.from_values(result.logprobs, "float32"),
        policy_version=policy_version,
        drafter_version=drafter_version,
        reward=float(reward),
        finish_reason=result.finish_reason,
        worker_id=worker_id,
        step=group.step,
        gen_seconds=gen_seconds,
        accept_length=emitted / forwards if forwards else 1.0,
    )


def hidden_window(result: Any, sample_id: str, policy_version: int, *, dtype: str = "bfloat16") -> HiddenWindow:
    """The drafter-training window of one finished generation (requested with `return_hidden=True`).

    `dtype` is the wire format of the states (bfloat16 halves the stream's bytes; the drafter trains in
    float32 either way).
    """
    if result.hidden is None or result.prompt_hidden is None:
        raise ValueError("the generation was not run with return_hidden=True")
    prompt, response = list(result.prompt_ids), list(result.token_ids)
    states = torch.cat([result.prompt_hidden, result.hidden[: len(response)]])  # [P - 1 + n, H]
    tokens = (prompt + response)[: states.shape[0]]
    return HiddenWindow(
        sample_id=sample_id,
        policy_version=policy_version,
        token_ids=tokens,
        hidden=Tensor.from_torch(states.to(getattr(torch, dtype)).contiguous()),
        start=0,
        prompt_len=len(prompt),
    )
