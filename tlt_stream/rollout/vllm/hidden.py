"""Hidden states for drafter training from samples vLLM generated, recomputed by one prefill.

vLLM returns no final-norm hidden states while EAGLE runs (its `extract_hidden_states` is a speculative method
of its own and hands intermediate layers to a KV connector), so the backend keeps this project's
`Transformer` on the same policy weights and runs one padded prefill over prompt + response of each finished
request that asked for them: the policy's final-norm states at every position but the last, what the torch
engine streams. It costs a second copy of the policy's weights and a prefill per sample.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tlt_stream.model.transformer import Transformer

__all__ = ["recompute_hidden"]


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
