"""Reading back what TensorBoard and W&B wrote, with their own file formats: the evidence that a tracker
logged what it was given comes from the files, not from the tracker."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any


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


def wandb_records(run_file: Path) -> list[Any]:
    """The protobuf records of a `run-*.wandb` file: a LevelDB-style log (":W&B" header of 7 bytes, then
    32 KiB blocks of records, each crc32 + length + type, split FIRST/MIDDLE/LAST across blocks)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = run_file.read_bytes()
    assert data[:4] == b":W&B", "not a W&B run file"
    block, pos, pending, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pos += 7
        if length == 0 and kind == 0:
            break
        pending += data[pos : pos + length]
        pos += length
        if kind in (1, 4):  # FULL or LAST
            record = pb.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def wandb_history(run_dir: Path) -> dict[int, dict[str, Any]]:
    """step -> {key: value} of every offline W&B run file under `run_dir`."""
    out: dict[int, dict[str, Any]] = {}
    for run_file in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        for record in wandb_records(run_file):
            if record.WhichOneof("record_type") != "history":
                continue
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            out.setdefault(int(row["_step"]), {}).update(row)
    return out


def wandb_config(run_dir: Path) -> dict[str, Any]:
    """The configuration recorded with the offline W&B run(s) under `run_dir`."""
    out: dict[str, Any] = {}
    for run_file in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        for record in wandb_records(run_file):
            if record.WhichOneof("record_type") == "run":
                out.update({item.key: json.loads(item.value_json) for item in record.run.config.update})
    return out
