"""Training state sharded over ranks: each rank writes its own pieces once, any number of ranks reads them.

A sharded learner (FSDP2) holds every parameter, and so its Adam moments, as dim-0 pieces cut the way
`torch.chunk` cuts (rank r holds chunk r, or nothing when there are fewer chunks than ranks). Each rank
writes `rank-XXXXX.safetensors` with its pieces; rank 0 also writes `index.json`: the number of ranks,
which tensors are pieces (the rest, a step count say, is the same on every rank) and the JSON part of the
state. A run with as many ranks reads only its own file; any other number (one process included) reads
every file, joins the pieces into whole tensors and cuts its own (`piece`). Safetensors + JSON only: no
pickle, no torch.distributed.checkpoint metadata file (which is one).

The ranks write at their own pace (each on its own thread, after the checkpoint is committed:
`rl/sharded.py`) and any of them may die meanwhile, so each file lands whole or not at all (a `.tmp-` name,
fsynced, renamed) and the set counts only when it is complete (`incomplete`): the index and every one of
its `world` pieces, each piece recording (safetensors metadata) its rank, the world and the save it belongs
to, the same save as the index's. Anything less is no state at all: `read_shards` refuses it, and a resume
takes an older complete one. Sets written before pieces recorded their save (no `save` in the index) were
made whole with their checkpoint directory; all their files present is all they need.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save

from tlt_stream.store.durable import atomic_file, fsync_dir

__all__ = ["INDEX", "incomplete", "piece", "rank_file", "read_shards", "write_shard"]

INDEX = "index.json"
FORMAT = "dim0-chunks-v1"


def rank_file(directory: Path, rank: int) -> Path:
    """Where rank `rank`'s piece of the state in `directory` lands."""
    return directory / f"rank-{rank:05d}.safetensors"


def write_shard(
    directory: Path,
    *,
    rank: int,
    world: int,
    tensors: dict[str, torch.Tensor],
    pieces: set[str],
    meta: dict[str, Any],
    save_id: str,
) -> None:
    """Land this rank's `tensors` (those named in `pieces` are its dim-0 pieces) in `directory`, made if need
    be, as one atomic, fsynced file; rank 0 then lands the index with `meta` (the state's JSON part, the same
    on every rank). `save_id` is the same on every rank of one save and differs between saves."""
    if not pieces <= set(tensors):
        raise ValueError(f"pieces names tensors not given: {sorted(pieces - set(tensors))[:3]}")
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} of {world}")
    directory.mkdir(exist_ok=True)  # FileNotFoundError when the checkpoint around it is gone (pruned)
    fsync_dir(directory.parent)
    stamp = {"rank": str(rank), "world": str(world), "save": save_id}
    data = save({k: t.detach().cpu().contiguous() for k, t in tensors.items()}, metadata=stamp)
    atomic_file(rank_file(directory, rank), data)
    if rank == 0:
        index = {"format": FORMAT, "world": world, "save": save_id, "pieces": sorted(pieces), "meta": meta}
        atomic_file(directory / INDEX, json.dumps(index).encode())


def incomplete(directory: Path) -> str | None:
    """Why the state in `directory` is not a complete set (None: it is): the index missing or unreadable, a
    rank's piece missing, or a piece of another save, rank or world than the index says."""
    try:
        index = json.loads((directory / INDEX).read_text(encoding="utf-8"))
        if not isinstance(index, dict) or index.get("format") != FORMAT:
            return f"an index of format {index.get('format') if isinstance(index, dict) else None!r}"
        world, save_id = index["world"], index.get("save")
        if isinstance(world, bool) or not isinstance(world, int) or world < 1:
            return f"an index saying world {world!r}"
        for rank in range(world):
            file = rank_file(directory, rank)
            if not file.is_file():
                return f"no piece of rank {rank} of {world}"
            if save_id is None:  # written whole with its checkpoint directory, before pieces said their save
                continue
            with safe_open(file, framework="pt") as f:
                stamp = f.metadata() or {}
            if stamp != {"rank": str(rank), "world": str(world), "save": str(save_id)}:
                return f"{file.name} says {stamp}, the index rank {rank} of {world}, save {save_id}"
    except FileNotFoundError:
        return "no index"
    except (OSError, ValueError, KeyError, SafetensorError) as exc:
        return f"unreadable ({exc})"
    return None


def read_shards(directory: Path, *, rank: int | None, world: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The state in `directory` for rank `rank` of `world`: its own pieces when the state was written by as
    many ranks, else whole tensors for the reader to cut (`piece`); `rank=None` asks for whole tensors. Returns
    (tensors, the state's JSON part). ValueError for anything unreadable or incomplete."""
    why = incomplete(directory)
    if why is not None:
        raise ValueError(f"{directory}: incomplete sharded state ({why})")
    try:
        index = json.loads((directory / INDEX).read_text(encoding="utf-8"))
        written = int(index["world"])
        if rank is not None and written == world:
            return load_file(rank_file(directory, rank)), index["meta"]
        files = [load_file(rank_file(directory, r)) for r in range(written)]
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
