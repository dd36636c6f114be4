"""What a generation engine hands back: one finished request's tokens, behaviour logprobs and states, and
`generate_all`, the batch driver every backend shares (the torch engine and the vLLM one)."""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field
from typing import Any

import torch

from tlt_stream.rollout.scheduler import FinishReason, StopRule

__all__ = ["GenerationResult", "generate_all"]


@dataclass(slots=True)
class GenerationResult:
    """One finished request."""

    request_id: Hashable
    prompt_ids: list[int]
    token_ids: list[int]
    """Generated tokens, including the EOS token when `finish_reason == "eos"`."""
    logprobs: list[float]
    """Behaviour log-probability of each generated token (see `sampling` for temperature 0)."""
    finish_reason: FinishReason
    hidden: torch.Tensor | None = None
    """`[n, H]` final-norm hidden states when requested: `hidden[i]` is the state whose logits produced
    `token_ids[i]`, i.e. the state at input position `len(prompt_ids) - 1 + i` (input token
    `prompt_ids[-1]` for i = 0, else `token_ids[i - 1]`)."""
    accept_lengths: list[int] = field(default_factory=list)
    """Tokens emitted by each speculative round of this request (empty when SD never ran for it), also the
    rounds whose tokens a re-verification then discarded."""
    prompt_hidden: torch.Tensor | None = None
    """`[len(prompt_ids) - 1, H]` when hidden states were requested: the states at the prompt positions
    before the last one (whose state is `hidden[0]`), so `cat(prompt_hidden, hidden)` covers every input
    position `0 .. len(prompt_ids) + len(token_ids) - 2`."""
    reverifications: int = 0
    """Times a newly loaded policy re-verified this request's tokens (`GenerationEngine.load_policy`)."""
    tokens_kept: int = 0
    """Tokens those re-verifications kept, summed over them (a token kept twice counts twice)."""
    tokens_discarded: int = 0
    """Tokens they discarded (the first rejected one and all after it), summed over them."""


def generate_all(
    engine: Any,
    prompts: SequenceOf[SequenceOf[int]],
    max_new_tokens: int,
    temperature: float = 0.0,
    seed: int | None = None,
    eos_ids: Iterable[int] = (),
    *,
    stop: StopRule | None = None,
    return_hidden: bool = False,
) -> list[GenerationResult]:
    """`generate` for any engine with `add_request`/`step`/`has_unfinished` (this one, the vLLM backend): every
    prompt queued (prompt i seeded with `seed + i`), stepped to the end, results in input order."""
    if engine.has_unfinished:
        raise RuntimeError("generate() needs an idle engine; drive add_request/step instead")
    eos = frozenset(eos_ids)
    ids = [
        engine.add_request(
            p,
            max_new_tokens,
            temperature,
            None if seed is None else seed + i,
            eos,
            stop=stop,
            return_hidden=return_hidden,
        )
        for i, p in enumerate(prompts)
    ]
    done: dict[Hashable, GenerationResult] = {}
    while engine.has_unfinished:
        for result in engine.step():
            done[result.request_id] = result
    return [done[i] for i in ids]
