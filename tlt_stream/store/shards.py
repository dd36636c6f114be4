"""Training state sharded over ranks: each rank writes its own pieces once, any number of ranks reads them.

A sharded learner (FSDP2) holds every parameter, and so its Adam moments, as dim-0 pieces cut the way
`torch.chunk` cuts (rank r holds chunk r, or nothing when there are fewer chunks than ranks). Each rank
writes `rank-XXXXX.safetensors` with its pieces; rank 0 also writes `index.json`: the number of ranks,
which tensors are pieces (the rest, a step count say, is the same on every rank) and the JSON part of the
state. A run with as many ranks reads only its own file; any other number (one process included) reads
every file, joins the pieces into whole tensors and cuts its own (`piece`). Safetensors + JSON only: no
pickle, no torch.distributed.checkpoint metadata file (which is one).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save

from tlt_stream.store.durable import write_json

__all__ = ["INDEX", "piece", "read_shards", "write_shard"]

INDEX = "index.json"
FORMAT = "dim0-chunks-v1"


def _rank_file(directory: Path, rank: int) -> Path:
    return directory / f"rank-{rank:05d}.safetensors"


def write_shard(
    directory: Path, *, rank: int, world: int, tensors: dict[str, torch.Tensor], pieces: set[str], meta: dict[str, Any]
) -> None:
    """Write this rank's `tensors` (those named in `pieces` are its dim-0 pieces) into `directory`, fsynced;
    rank 0 also writes the index with `meta` (the state's JSON part, the same on every rank)."""
    if not pieces <= set(tensors):
        raise ValueError(f"pieces names tensors not given: {sorted(pieces - set(tensors))[:3]}")
    directory.mkdir(exist_ok=True)
    data = save({k: t.detach().cpu().contiguous() for k, t in tensors.items()})
    with open(_rank_file(directory, rank), "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    if rank == 0:
        write_json(directory / INDEX, {"format": FORMAT, "world": world, "pieces": sorted(pieces), "meta": meta})


def read_shards(directory: Path, *, rank: int | None, world: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The state in `directory` for rank `rank` of `world`: its own pieces when the state was written by as
    many ranks, else whole tensors for the reader to cut (`piece`); `rank=None` asks for whole tensors. Returns
    (tensors, the state's JSON part). ValueError for anything unreadable or incomplete."""
    try:
        index = json.loads((directory / INDEX).read_text(encoding="utf-8"))
        if index.get("format") != FORMAT:
            raise ValueError(f"format {index.get('format')!r}, expected {FORMAT!r}")
        written = int(index["world"])
        if rank is not None and written == world:
            return load_file(_rank_file(directory, rank)), index["meta"]
        files = [load_file(_rank_file(directory, r)) for r in range(written)]
    except (OSError, ValueError, KeyError, SafetensorError) as exc:
        raise ValueError(f"{directory}: unreadable sharded state ({exc})") from exc
    pieces = set(index["pieces"])
    whole = {key: torch.cat([f[key] for f in files]) if key in pieces else tensor for key, tensor in files[0].items()}
    return whole, index["meta"]


def piece(whole: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank `rank`'s dim-0 piece of `whole` among `world` ranks, as FSDP2 cuts it (`torch.chunk`; empty for
    a rank past the last chunk)."""
    chunks = torch.chunk(whole, world, dim=0)
    return chunks[rank] if rank < len(chunks) else whole[:0]
