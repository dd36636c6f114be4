"""Training state as safetensors + JSON, never a pickle: optimizer moments, RNG streams, any tensor dict.

Loading a checkpoint can therefore never run code; a `.pt` where safetensors belong is refused, not
unpickled. Used by the learner's checkpoints and the drafter's online-training state alike."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save

from tlt_stream.store.durable import write_json

__all__ = [
    "load_tensors",
    "optimizer_state",
    "optimizer_tensors",
    "refuse_pickle",
    "rng_tensors",
    "save_tensors",
    "set_rng_state",
]


def save_tensors(tensors: dict[str, torch.Tensor], meta: dict[str, Any], stem: Path) -> None:
    """`stem.safetensors` + `stem.json`, each fsynced: no pickle anywhere in a checkpoint."""
    data = save(tensors)
    with open(stem.with_suffix(".safetensors"), "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    write_json(stem.with_suffix(".json"), meta)


def refuse_pickle(stem: Path) -> None:
    """ValueError when a pickle (`stem.pt`) stands where `stem.safetensors` belongs: never unpickled, and
    never taken for a missing part either."""
    pickled = stem.with_suffix(".pt")
    if pickled.exists() and not stem.with_suffix(".safetensors").exists():
        raise ValueError(f"{pickled}: a pickle; tlt-stream loads only safetensors + JSON (it never unpickles)")


def load_tensors(stem: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    refuse_pickle(stem)
    try:
        tensors = load_file(stem.with_suffix(".safetensors"))
        meta = json.loads(stem.with_suffix(".json").read_text(encoding="utf-8"))
    except (OSError, ValueError, SafetensorError) as exc:
        raise ValueError(f"{stem}: unreadable checkpoint part ({exc})") from exc
    return tensors, meta


def optimizer_tensors(state: dict[str, Any], *, copy: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """An optimizer `state_dict` as safetensors tensors (`state.{param}.{slot}`) and JSON for the rest. With
    `copy`, every tensor is a CPU copy (a snapshot the next optimizer step cannot change; without, a CPU
    tensor is the optimizer's own)."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for index, slots in state["state"].items():
        for slot, value in slots.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state.{index}.{slot}"] = value.detach().to("cpu", copy=copy).contiguous()
            else:
                scalars.setdefault(str(index), {})[slot] = value
    groups = [{k: list(v) if isinstance(v, tuple) else v for k, v in group.items()} for group in state["param_groups"]]
    return tensors, {"scalars": scalars, "param_groups": groups}


def optimizer_state(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict[str, Any]:
    """The inverse of `optimizer_tensors`: a `state_dict` an optimizer loads."""
    state: dict[int, dict[str, Any]] = {}
    for key, tensor in tensors.items():
        _, index, slot = key.split(".", 2)
        state.setdefault(int(index), {})[slot] = tensor
    for index, slots in meta["scalars"].items():
        state.setdefault(int(index), {}).update(slots)
    groups = [{k: tuple(v) if k == "betas" else v for k, v in group.items()} for group in meta["param_groups"]]
    return {"state": state, "param_groups": groups}


def rng_tensors() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The RNG streams as tensors (torch, each CUDA device) and JSON (Python's `random`)."""
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors.update({f"cuda.{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    version, internal, gauss = random.getstate()
    return tensors, {"python": [version, list(internal), gauss]}


def set_rng_state(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    torch.set_rng_state(tensors["torch"])
    version, internal, gauss = meta["python"]
    random.setstate((version, tuple(internal), gauss))
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            if f"cuda.{i}" in tensors:
                torch.cuda.set_rng_state(tensors[f"cuda.{i}"], i)
