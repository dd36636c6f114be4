"""Sizes that come from the checkpoint, not from a preset: the context a row holds, the prompt share of it,
the KV bytes one row costs and the rows that fit a memory budget.

A row of the KV cache holds `max_len` entries for every layer, so a long context costs rows, not length:
the worker runs as many rows as its budget holds (`rollout.kv_cache_gib`) and says so at start. Every
function is plain arithmetic on settings and a `ModelSpec`; a setting that cannot work is a `ConfigError`
naming its key, with the numbers. Torch is imported only by the functions that need it (the prompt limit
is read by the dataset loader, which does not).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from tlt_stream.basics.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from tlt_stream.model.spec import ModelSpec

__all__ = [
    "PROMPT_LEN",
    "context_len",
    "engine_bytes_per_row",
    "fitting_rows",
    "free_memory",
    "kv_bytes_per_row",
    "prompt_limit",
]

PROMPT_LEN = 1024
"""Prompt tokens kept by default (`data.max_prompt_len` None): about what a reasoning prompt needs, and never
more than half the context."""


def context_len(max_len: int | None, positions: int | None, where: str = "the policy") -> int:
    """`rollout.max_len` against a checkpoint of `positions` positions (None: it does not say): the setting
    when it fits, the checkpoint's context when unset; a `ConfigError` naming the key otherwise."""
    if max_len is None:
        if positions is None:
            raise ConfigError(f"rollout.max_len: {where} does not say its context (max_position_embeddings); set it")
        return positions
    if positions is not None and max_len > positions:
        raise ConfigError(
            f"rollout.max_len: {max_len} is longer than the {positions} positions of {where} "
            f"(max_position_embeddings): set {positions} or less, or leave it unset to use the checkpoint's context"
        )
    return max_len


def prompt_limit(max_prompt_len: int | None, max_len: int | None) -> int:
    """Prompt tokens kept: `data.max_prompt_len`, else `PROMPT_LEN` capped at half of the context `max_len`."""
    if max_prompt_len is not None:
        return max_prompt_len
    return PROMPT_LEN if max_len is None else min(PROMPT_LEN, max_len // 2)


def kv_bytes_per_row(spec: ModelSpec, max_len: int, dtype: torch.dtype) -> int:
    """Bytes of K and V one row of `max_len` entries takes: 2 * layers * kv_heads * head_dim * max_len * size."""
    import torch

    size = torch.empty((), dtype=dtype).element_size()
    return 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * max_len * size


def engine_bytes_per_row(
    spec: ModelSpec,
    max_len: int,
    dtype: torch.dtype,
    *,
    headroom: int = 0,
    drafter: ModelSpec | None = None,
    hidden: bool = False,
    graph_tokens: int = 0,
) -> int:
    """Bytes the torch engine (`rollout.engine.GenerationEngine`) holds for one row of `max_len` tokens,
    between steps, whatever the row generates: what a budget is divided by and what the worker prints.

    - the target's K and V over `max_len + headroom` entries (`headroom`: the uncommitted draft nodes);
    - with an EAGLE `drafter` (its layer spec): its K and V over as many entries, and the target's states it
      has not consumed yet (`max_len` states of the target's width: it consumes them at each SD round, and
      while SD is off they wait for the next one);
    - with `hidden` (states kept for the drafter's training): the engine's per-slot buffer of `max_len`
      states, the prompt's and the generated tokens';
    - with captured forwards of up to `graph_tokens` tokens: their output buffer (`graph_tokens` states)
      and input buffers (ids and positions of 8 bytes, a `graph_tokens`-square tree mask of 1 byte);
    - one 8-byte length per cache, and the engine's 8-byte row counter.

    Not counted: a forward's own workspace while it runs (activations, attention scores; with CUDA graphs,
    the pool that holds one graph's intermediates), and the model's weights."""
    import torch

    size = torch.empty((), dtype=dtype).element_size()
    state = spec.hidden_size * size
    total = kv_bytes_per_row(spec, max_len + headroom, dtype) + 8 + 8
    if drafter is not None:
        total += kv_bytes_per_row(drafter, max_len + headroom, dtype)
        total += max_len * state + 8
    if hidden:
        total += max_len * state
    if graph_tokens:
        total += graph_tokens * (state + 2 * 8 + graph_tokens)
    return total


def free_memory(device: Any) -> int:
    """Bytes free on `device` now: the CUDA allocator's view, else the host's available memory."""
    import torch

    if torch.device(device).type == "cuda":
        return torch.cuda.mem_get_info(torch.device(device))[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def fitting_rows(per_row: int, max_batch: int, budget: int, max_len: int) -> int:
    """Rows of `per_row` bytes (`engine_bytes_per_row`) that fit `budget`, at most `max_batch`; a `ConfigError`
    with the numbers when not even one does."""
    rows = min(max_batch, budget // per_row)
    if rows < 1:
        raise ConfigError(
            f"rollout.kv_cache_gib: one row of {max_len} tokens needs {per_row / 2**30:.2f} GiB of KV cache and "
            f"row buffers and the budget is {budget / 2**30:.2f} GiB: set a shorter rollout.max_len or a larger "
            "budget"
        )
    return rows
