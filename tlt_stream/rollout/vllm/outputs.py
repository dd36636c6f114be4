"""vLLM's finished request outputs as this project's `GenerationResult`s (pure: no vllm import).

vLLM returns each request once, finished (`RequestOutputKind.FINAL_ONLY`): its token ids, the sampled
tokens' log-probs (`SamplingParams(logprobs=0)` with the engine's `processed_logprobs`), why it finished and,
with speculative decoding, its per-request metrics (`per_request_spec_decode_metrics`). Finish reasons map
as `FINISH_REASONS` says; a response that vLLM stopped at a stop string is cut where this project's
`StopStrings`, applied token by token, stops it, so both engines return the same sample.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any

import torch

from tlt_stream.rollout.engine import GenerationResult
from tlt_stream.rollout.scheduler import FinishReason
from tlt_stream.rollout.stops import StopStrings

__all__ = ["FINISH_REASONS", "accept_lengths", "sampled_logprobs", "to_generation_result"]

FINISH_REASONS: dict[str, FinishReason] = {"stop": "eos", "length": "length"}
"""vLLM `CompletionOutput.finish_reason` -> ours ("abort", "error", "repetition" produce no sample); a "stop"
whose `stop_reason` is a string is our "stop" (a stop string), one with an int or None our "eos"."""

FINISH_REASONS: dict[str, FinishReason] = {"stop": "eos", "length": "length"}


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
