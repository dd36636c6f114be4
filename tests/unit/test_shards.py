"""`store/shards.py`: pieces written by ranks at their own pace count only as a complete set of one save.

Real files throughout: what a rank killed mid-write, a piece of another save or a set from before pieces
recorded their save leaves on disk, and what `incomplete`, `read_shards` and the checkpoint readers make
of it."""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest
import torch

from tlt_stream.store.shards import INDEX, incomplete, piece, rank_file, read_shards, write_shard

WHOLE = torch.arange(10.0).reshape(5, 2)
META = {"scalars": {"0": {"step": 3}}, "param_groups": []}


def write_rank(directory: Path, rank: int, *, world: int = 2, save_id: str = "a1") -> None:
    tensors = {"state.0.exp_avg": piece(WHOLE, rank, world), "state.0.step": torch.tensor(3.0)}
    write_shard(
        directory, rank=rank, world=world, tensors=tensors, pieces={"state.0.exp_avg"}, meta=META, save_id=save_id
    )


def test_a_complete_set_of_one_save_reads_whole_and_per_rank(tmp_path: Path) -> None:
    directory = tmp_path / "optimizer"
    write_rank(directory, 1)  # ranks land in any order, each making the directory if it is first
    assert incomplete(directory) == "no index"
    write_rank(directory, 0)
    assert incomplete(directory) is None
    assert sorted(p.name for p in directory.iterdir()) == [INDEX, "rank-00000.safetensors", "rank-00001.safetensors"]
    whole, meta = read_shards(directory, rank=None, world=1)
    assert torch.equal(whole["state.0.exp_avg"], WHOLE) and meta == META
    mine, _ = read_shards(directory, rank=1, world=2)
    assert torch.equal(mine["state.0.exp_avg"], piece(WHOLE, 1, 2))
    cut, _ = read_shards(directory, rank=2, world=3)  # another world: whole tensors, for the reader to cut
    assert torch.equal(cut["state.0.exp_avg"], WHOLE)


@pytest.mark.parametrize("damage", ["missing piece", "piece of another save", "piece of another world", "no index"])
def test_an_incomplete_or_mixed_set_is_no_state(tmp_path: Path, damage: str) -> None:
    directory = tmp_path / "optimizer"
    write_rank(directory, 0)
    write_rank(directory, 1)
    other = tmp_path / "other"
    match damage:
        case "missing piece":  # rank 1 killed before its piece landed
            rank_file(directory, 1).unlink()
        case "piece of another save":
            write_rank(other, 1, save_id="b2")
            shutil.copy(rank_file(other, 1), rank_file(directory, 1))
        case "piece of another world":
            write_rank(other, 1, world=3)
            shutil.copy(rank_file(other, 1), rank_file(directory, 1))
        case "no index":
            (directory / INDEX).unlink()
    assert incomplete(directory) is not None
    with pytest.raises(ValueError, match="incomplete"):
        read_shards(directory, rank=0, world=2)  # even the reader of its own (present) piece


def test_a_set_from_before_pieces_recorded_their_save_is_complete_when_every_file_is_there(tmp_path: Path) -> None:
    """Sharded checkpoints written inline (whole with their directory) have no save id anywhere."""
    from safetensors.torch import save_file

    directory = tmp_path / "optimizer"
    directory.mkdir()
    for rank in range(2):
        save_file({"state.0.exp_avg": piece(WHOLE, rank, 2)}, str(rank_file(directory, rank)))
    index = {"format": "dim0-chunks-v1", "world": 2, "pieces": ["state.0.exp_avg"], "meta": META}
    (directory / INDEX).write_text(json.dumps(index))
    assert incomplete(directory) is None
    assert torch.equal(read_shards(directory, rank=None, world=1)[0]["state.0.exp_avg"], WHOLE)
    rank_file(directory, 1).unlink()
    assert incomplete(directory) == "no piece of rank 1 of 2"


def test_a_piece_lands_whole_or_not_at_all(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A write that fails mid-file leaves the piece absent (its `.tmp-` sibling removed), never a torn one."""
    directory = tmp_path / "optimizer"
    real_fsync = os.fsync

    def failing_fsync(fd: int) -> None:  # the piece's bytes are written; making them durable fails
        if stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError("disk gone")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(OSError, match="disk gone"):
        write_rank(directory, 1)
    assert list(directory.iterdir()) == []
    with pytest.raises(FileNotFoundError):  # its checkpoint pruned under it: nothing is made
        write_rank(tmp_path / "gone" / "optimizer", 1)
    assert not (tmp_path / "gone").exists()


def test_a_rank_whose_checkpoint_was_pruned_under_its_write_logs_and_counts_a_failure(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from tlt_stream.store.background import BackgroundWriter

    writes = BackgroundWriter("test")
    step = tmp_path / "step-00000001"
    target = rank_file(step / "optimizer", 1)
    with caplog.at_level("ERROR"):
        writes.submit(target, lambda t: write_rank(t.parent, 1), directory=False)  # the step is already gone
        writes.wait()
    assert writes.failures == 1 and "FileNotFoundError" in (writes.last.error or "") and str(target) in caplog.text
    step.mkdir()
    writes.submit(target, lambda t: write_rank(t.parent, 1), directory=False)
    writes.wait()
    assert writes.failures == 1 and writes.last.error is None and target.is_file()
