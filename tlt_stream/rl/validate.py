"""What decoding cannot check: a message that is well-formed but poison for the service that handles it.

`basics/messages/` refuses what is malformed on its own terms (negative token ids, non-finite logprobs, an index
outside its group). What only a handler knows is checked here, as pure functions that return the reason a
message must not be used (None when it may): the policy's vocabulary and context length, the newest
published version, the rollout limit. A service dead-letters what fails, with that reason, and goes on:
the same entry would fail the same way on every redelivery and every restart, so raising would crash-loop
the service (compose gives up after three restarts) and stall the run.
"""

from __future__ import annotations

import math

from tlt_stream.basics.messages import PromptGroup, Sample

__all__ = ["location_problem", "prompt_problem", "sample_problem"]


def _ids_problem(name: str, ids: list[int], vocab_size: int) -> str | None:
    if ids and max(ids) >= vocab_size:
        return f"{name} holds token id {max(ids)}, outside the policy's vocabulary of {vocab_size}"
    return None


def sample_problem(sample: Sample, *, vocab_size: int, max_positions: int | None, newest_version: int) -> str | None:
    """Why the learner must not train on `sample`, or None.

    `newest_version` is the newest policy version published (the learner's own): a sample cannot come from
    a later one. `max_positions` is the policy's context length (None: unbounded)."""
    expected_id = f"{sample.task_id}/{sample.index}"
    if sample.sample_id != expected_id:
        return f"sample id {sample.sample_id!r} is not {expected_id!r} (ids must be deterministic for exactly-once)"
    if not math.isfinite(sample.reward):
        return f"reward {sample.reward} is not finite"
    if not sample.prompt_ids:
        return "the sample has no prompt token (the first response token needs a context)"
    if problem := _ids_problem("prompt_ids", sample.prompt_ids, vocab_size):
        return problem
    if sample.response_len and int(sample.token_ids.to_numpy().max()) >= vocab_size:
        top = int(sample.token_ids.to_numpy().max())
        return f"token_ids holds token id {top}, outside the policy's vocabulary of {vocab_size}"
    length = len(sample.prompt_ids) + sample.response_len
    if max_positions is not None and length > max_positions:
        return f"prompt + response is {length} tokens, longer than the policy's {max_positions} positions"
    if sample.policy_version > newest_version:
        return f"policy version {sample.policy_version} is newer than the newest published ({newest_version})"
    return None


def prompt_problem(task: PromptGroup, *, vocab_size: int, max_len: int, newest_version: int) -> str | None:
    """Why a rollout worker must not generate for `task`, or None.

    `max_len` is the worker's prompt + response limit: a prompt must leave room for at least one response
    token. `newest_version` is the newest policy version published: a task that waits for a later one would
    wait forever (and hold its worker's reads up while it does)."""
    if len(task.prompt_ids) >= max_len:
        return f"prompt of {len(task.prompt_ids)} tokens leaves no room for a response within max_len={max_len}"
    if problem := _ids_problem("prompt_ids", task.prompt_ids, vocab_size):
        return problem
    if task.startable_version > newest_version:
        return (
            f"min_policy_version {task.min_policy_version} is newer than the newest published policy ({newest_version})"
            if task.draft_version is None
            else f"draft_version {task.draft_version} is newer than the newest published policy ({newest_version})"
        )
    if task.min_policy_version > newest_version + 1:  # a draft runs at most one version ahead
        return f"min_policy_version {task.min_policy_version} is more than one version ahead of {newest_version}"
    return None


def location_problem(location: str, store_root: str | None) -> str | None:
    """Why a checkpoint location announced on the control plane must not be read, or None: with a store
    root configured, the location must resolve (symlinks and `..` followed) inside it."""
    if store_root is None:
        return None
    from pathlib import Path

    root = Path(store_root).resolve()
    target = Path(location).resolve()
    if not target.is_relative_to(root):
        return f"checkpoint location {location} is outside the checkpoint store {root}"
    return None
