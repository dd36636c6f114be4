"""What the vLLM backend refuses in one line before vLLM starts: inputs vLLM would start on and then die with at
its first step, or run wrongly (`check_*`, which `VllmEngine` runs before it builds `vllm.LLM`; one that asks
vLLM imports it inside and says nothing when the installed vLLM is laid out otherwise, for vLLM then says so
itself), and the one line of vLLM's own multi-line validation errors (`first_error`)."""

from __future__ import annotations

import importlib
import inspect
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tlt_stream.basics.errors import CheckpointError
from tlt_stream.drafter.model import check_drafter_fits as drafter_fits
from tlt_stream.rollout.vllm.config import UnsupportedSetting
from tlt_stream.rollout.vllm.settings import VllmSettings

__all__ = ["check_cpu_attention", "check_drafter_fits", "check_head_dim", "check_recompute", "first_error"]


def _config(directory: Path) -> dict[str, Any]:
    return json.loads((directory / "config.json").read_text())


def _head_dim(config: Mapping[str, Any]) -> int:
    return int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])


def check_cpu_attention(policy: Path) -> None:
    """Refuse, before vLLM starts, a policy whose head size vLLM's CPU attention has no kernel for: the CPU
    build starts such an engine and its core dies at the first step ("Unsupported CPU attention
    configuration: head_dim=16")."""
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        sizes = list(CPUAttentionBackend.get_supported_head_sizes())
    except (ImportError, AttributeError):  # another layout of vLLM: it says so itself at the first step
        return
    try:
        head_dim = _head_dim(_config(policy))
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return  # vLLM reads it its own way (a nested text_config...)
    if sizes and head_dim not in sizes:
        raise UnsupportedSetting(
            f"{policy}: head size {head_dim}, which vLLM's CPU attention cannot run (it runs "
            f"{', '.join(map(str, sizes))}); use the torch backend (rollout.backend=torch)"
        )


_HEADS_FROM_HIDDEN = {"Qwen2ForCausalLM": ("vllm.model_executor.models.qwen2", "Qwen2Attention")}
"""Architectures whose attention in vLLM may take no `head_dim` (it sizes each head hidden_size /
num_attention_heads): the module and class whose constructor says whether it does."""


def check_head_dim(policy: Path) -> None:
    """Refuse, before vLLM starts, a policy whose config.json sets a `head_dim` other than hidden_size /
    num_attention_heads for an architecture whose vLLM attention ignores it: vLLM builds the heads from
    hidden / heads and loads the weights into that shape (a smaller head_dim kills the engine as it loads
    them, a larger one runs with its weights cut to the wrong shape)."""
    try:
        config = _config(policy)
        head_dim, hidden, heads = config.get("head_dim"), config["hidden_size"], config["num_attention_heads"]
        derived = hidden // heads
    except (OSError, KeyError, TypeError, ValueError, ZeroDivisionError):
        return  # vLLM reads it its own way (a nested text_config...)
    arch = next((a for a in config.get("architectures") or () if a in _HEADS_FROM_HIDDEN), None)
    if arch is None or head_dim is None or head_dim == derived:
        return
    module, name = _HEADS_FROM_HIDDEN[arch]
    try:
        takes = "head_dim" in inspect.signature(getattr(importlib.import_module(module), name)).parameters
    except (ImportError, AttributeError, TypeError, ValueError):  # another layout of vLLM: it says so itself
        return
    if not takes:
        raise UnsupportedSetting(
            f"{policy}: config.json sets head_dim {head_dim}, but vLLM's {arch} sizes each head as hidden_size / "
            f"num_attention_heads ({hidden} / {heads} = {derived}) and would load the weights in that shape; use "
            "the torch backend (rollout.backend=torch)"
        )


def check_drafter_fits(export: Path, policy: Path, source: str | Path | None) -> dict[str, tuple[int, ...]]:
    """Refuse, before vLLM starts, an EAGLE export whose tensors are not exactly those its own config.json
    implies, or whose config is not a Llama EAGLE draft's (`drafter.export.check_eagle_export`: a hand-made or
    third-party export, or one whose config was edited; vLLM's EAGLE loader skips an unexpected tensor and leaves
    a missing one as initialised, drafting with wrong weights without a word; a drafter swapped in later is held
    to this one's layout), and an EAGLE drafter made for a policy of another hidden size or vocabulary: vLLM
    loads it and its core dies at the first drafting step (a shape mismatch in the draft's fc). Returns the
    export's layout (name -> shape), so the engine holds later swaps to it without reading the files again."""
    from tlt_stream.drafter.export import check_eagle_export, read_eagle_config

    draft = read_eagle_config(export)
    try:
        target = _config(policy)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{policy}: unreadable policy config ({exc})") from None
    layout = check_eagle_export(export, config=draft)
    drafter_fits(
        (draft.get("hidden_size"), draft.get("vocab_size")),
        (target.get("hidden_size"), target.get("vocab_size")),
        named=f"drafter {source or export}",
        fits=str(policy),
    )
    return layout


def check_recompute(policy: Path, settings: VllmSettings) -> None:
    """Refuse, before vLLM starts, a policy this project's runtime cannot load when the engine keeps a copy of
    it (hidden states, partial rollouts): else vLLM would start and the copy fail afterwards."""
    from tlt_stream.model.loader import load_spec

    try:
        load_spec(policy)
    except CheckpointError as exc:
        needs = "partial rollouts" if settings.partial_rollouts else "hidden='recompute'"
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise CheckpointError(
            f"{first} (the vLLM backend keeps this project's copy of the policy for {needs}; without "
            "them use VllmSettings(hidden='none'))"
        ) from None


def first_error(exc: BaseException) -> str:
    """The reason in one of vLLM's (pydantic) validation errors, without the long lists some carry."""
    errors = getattr(exc, "errors", None)
    message = ""
    if callable(errors):
        try:
            message = str(errors()[0].get("msg", ""))
        except Exception:  # any failure: fall back to the text
            message = ""
    if not message:
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        message = lines[1] if len(lines) > 1 and "validation error" in lines[0] else (lines[0] if lines else "")
    message = message.removeprefix("Value error, ").removeprefix("Assertion failed, ")
    for cut in (" Supported architectures:", " To allow overriding"):
        message = message.split(cut)[0]
    return " ".join(message.split())
