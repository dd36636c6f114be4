"""Reading back what TensorBoard and W&B wrote, with their own file formats: the evidence that a tracker
logged what it was given comes from the files, not from the tracker."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tlt_stream.rl.tracking import wandb_records


def tensorboard_scalars(logdir: Path) -> dict[str, dict[int, float]]:
    """tag -> {step: value} from the event files under `logdir`."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def tensorboard_texts(logdir: Path) -> dict[int, str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    out = {}
    for tag in acc.Tags()["tensors"]:
        for event in acc.Tensors(tag):
            out[event.step] = event.tensor_proto.string_val[0].decode()
    return out


def wandb_run_records(run_dir: Path) -> list[Any]:
    """The records of every offline W&B run file under `run_dir`, each file whole: holding its exit record,
    which `WandbTracker.close` waits for (wandb's own `run.finish()` can return before the file is written)."""
    out = []
    for run_file in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        records = wandb_records(run_file)
        kinds = {record.WhichOneof("record_type") for record in records}
        assert "exit" in kinds, f"{run_file} has no exit record ({len(records)} records): not all written yet"
        out += records
    return out


def wandb_history(run_dir: Path) -> dict[int, dict[str, Any]]:
    """step -> {key: value} of every offline W&B run file under `run_dir`."""
    out: dict[int, dict[str, Any]] = {}
    for record in wandb_run_records(run_dir):
        if record.WhichOneof("record_type") != "history":
            continue
        row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
        out.setdefault(int(row["_step"]), {}).update(row)
    return out


def wandb_config(run_dir: Path) -> dict[str, Any]:
    """The configuration recorded with the offline W&B run(s) under `run_dir`."""
    out: dict[str, Any] = {}
    for record in wandb_run_records(run_dir):
        if record.WhichOneof("record_type") == "run":
            out.update({item.key: json.loads(item.value_json) for item in record.run.config.update})
    return out
