"""The sharded learner's optimizer pieces written in the background (issue 25 point 3), on 2 gloo ranks.

Each rank is its own process (`test_sharded_learner.py`'s `rank_main`); a rank's background write can be
held at its start until the test releases it (`hold_writes`: a slow disk, made deterministic), so what is
asserted is structure, never timing: the save returned and its step is committed while its pieces are not
on disk, the next update ran meanwhile, the pieces that land are the state at the save, a set missing a
rank's piece (or holding another save's) is no state and a resume falls back past it, and pruning spares
the step a rank is still writing into and the newest complete state. Real files throughout.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.unit.test_sharded_learner import (
    SETTINGS,
    Ranks,
    assert_close,
    drive,
    finish_ranks,
    optimizer,
    release_and_kill,
    run_ranks,
    start_ranks,
    tiny_policy,
    wait_for,
    weights,
)
from tlt_stream.rl.checkpoint import (
    checkpoint_at,
    complete_checkpoints,
    has_optimizer_state,
    latest_checkpoint,
    optimizer_source,
)
from tlt_stream.rl.sharded import Trainer
from tlt_stream.store.tensors import optimizer_tensors

# The same xdist worker as the other 2-rank tests: two of them at once would oversubscribe CI's two cores.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("test_sharded_learner")]

PIECES = ["index.json", "rank-00000.safetensors", "rank-00001.safetensors"]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The initial policy, and one process's 3 updates from it, checkpointed (the reference)."""
    tmp = tmp_path_factory.mktemp("background")
    init = tiny_policy(tmp / "init")
    torch.set_num_threads(1)
    drive(Trainer(SETTINGS, "cpu"), tmp / "single", init, resume=None, updates=range(1, 4), metrics=tmp / "single.json")
    return {"init": init, "single": tmp / "single"}


@contextlib.contextmanager
def held(gate: Path, **spec: object) -> Iterator[Ranks]:
    """2 ranks whose writes `spec["hold"]` says are held until `gate/release`; released and, if the test
    failed before it finished them, killed on the way out."""
    gate.mkdir()
    ranks = start_ranks(2, **spec)
    try:
        yield ranks
    finally:
        release_and_kill(gate, ranks)


def pieces(step_dir: Path) -> list[str]:
    optimizer_dir = step_dir / "optimizer"
    return sorted(p.name for p in optimizer_dir.iterdir()) if optimizer_dir.is_dir() else []


def test_the_save_commits_before_its_optimizer_pieces_land_and_they_are_the_state_at_the_save(
    world: dict[str, Path], tmp_path: Path
) -> None:
    root, gate, out = tmp_path / "two", tmp_path / "gate", tmp_path / "two.json"
    spec = {"init": str(world["init"]), "root": str(root), "out": str(out), "resume": None, "updates": [1, 3]}
    spec.update(save_last=False, hold={"step": 1, "ranks": [0, 1], "dir": str(gate)})
    with held(gate, **spec) as ranks:
        wait_for(out, ranks)  # rank 0 saved step 1, then ran update 2; its stop() now waits for its write
        step_1 = root / "step-00000001"
        assert (root / "LATEST").read_text().strip() == step_1.name
        assert latest_checkpoint(root) == checkpoint_at(root, 1), "committed"
        assert (gate / "started-0").exists() and (gate / "started-1").exists(), "both writes are under way"
        assert not [name for name in pieces(step_1) if not name.startswith(".tmp-")], "and neither has landed"
        assert not has_optimizer_state(step_1) and optimizer_source(checkpoint_at(root, 1)).step == 0
        assert len(json.loads(out.read_text())) == 2, "update 2 ran while step 1's pieces were held"
        (gate / "release").touch()
        finish_ranks(ranks)
    assert pieces(step_1) == PIECES and has_optimizer_state(step_1)
    # The snapshot at step 1's save, not the moments update 2 made before the pieces were written.
    single_1, single_2 = optimizer(world["single"], 1), optimizer(world["single"], 2)
    assert any(not torch.allclose(single_1[k], single_2[k], atol=1e-4) for k in single_1), "update 2 moved them"
    assert_close(optimizer(world["single"], 1), optimizer(root, 1), "the optimizer state of step 1")

    # A resume from step 1 loads those pieces, on 2 ranks and on one process, and redoes update 2 exactly.
    one = tmp_path / "one"
    shutil.copytree(root, one)
    unheld = {k: v for k, v in spec.items() if k not in ("hold", "save_last")}
    run_ranks(2, **{**unheld, "out": str(tmp_path / "resumed.json"), "resume": 1, "updates": [2, 3]})
    drive(Trainer(SETTINGS, "cpu"), one, world["init"], resume=1, updates=range(2, 3), metrics=tmp_path / "one.json")
    for name, resumed in (("resumed", root), ("one", one)):
        assert json.loads((tmp_path / f"{name}.resume.json").read_text()) == {"optimizer_step": 1}, name
        assert_close(weights(world["single"], 2), weights(resumed, 2), f"{name}: weights of step 2")
        assert_close(optimizer(world["single"], 2), optimizer(resumed, 2), f"{name}: optimizer of step 2")


def test_pruning_spares_a_step_a_rank_still_writes_and_a_set_missing_a_piece_is_no_state(
    world: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root, gate, out = tmp_path / "two", tmp_path / "gate", tmp_path / "two.json"
    spec = {"init": str(world["init"]), "root": str(root), "out": str(out), "resume": None, "updates": [1, 3]}
    spec.update(keep=1, hold={"step": 1, "ranks": [1], "dir": str(gate)})
    with held(gate, **spec) as ranks:
        wait_for(out, ranks)  # rank 0 saved steps 1 and 2 (keep 1) while rank 1 still holds step 1's piece
        step_1, step_2 = root / "step-00000001", root / "step-00000002"
        # keep=1, yet step 1 stays (rank 1 writes into it) and step 0 too (the newest complete state).
        assert [c.step for c in complete_checkpoints(root)] == [0, 1, 2]
        assert (gate / "started-1").exists() and "rank-00001.safetensors" not in pieces(step_1)
        assert "rank-00000.safetensors" in pieces(step_1), "rank 0's piece of step 1 landed on its own"
        assert optimizer_source(checkpoint_at(root, 2)).step == 0
        (gate / "release").touch()
        finish_ranks(ranks)
    assert pieces(step_1) == PIECES == pieces(step_2)
    assert all(has_optimizer_state(c.path) for c in complete_checkpoints(root))

    # Step 2's set mixed with another save's piece, then missing one (rank 1 killed before its piece
    # landed): no state either way, and a resume from step 2 takes step 1's moments.
    mine = step_2 / "optimizer" / "rank-00001.safetensors"
    shutil.copy(step_1 / "optimizer" / "rank-00001.safetensors", mine)
    assert not has_optimizer_state(step_2) and optimizer_source(checkpoint_at(root, 2)).step == 1
    mine.unlink()
    (step_2 / "optimizer" / ".tmp-rank-00001.safetensors-0123456789ab").write_bytes(b"half a piece")
    assert not has_optimizer_state(step_2) and optimizer_source(checkpoint_at(root, 2)).step == 1
    assert latest_checkpoint(root, clean=True) == checkpoint_at(root, 2)
    assert pieces(step_2) == ["index.json", "rank-00000.safetensors"], "the killed write's leftover is cleaned"
    info = checkpoint_at(root, 2)
    resumed = Trainer(SETTINGS, "cpu")
    resumed.build(info.master_dir, step=2)
    with caplog.at_level(logging.WARNING, logger="tlt_stream.rl.checkpoint"):
        _, meta = resumed.restore(info)
    assert meta["optimizer_step"] == 1 and "optimizer moments of step 1" in caplog.text
    loaded, _ = optimizer_tensors(resumed.core.optimizer.state_dict())
    assert_close(optimizer(root, 1), loaded, "the moments resumed", atol=0)

    # 2 ranks and one process resume from step 2 the same way and make the same update 3.
    one = tmp_path / "one"
    shutil.copytree(root, one)
    unheld = {k: v for k, v in spec.items() if k != "hold"}
    run_ranks(2, **{**unheld, "out": str(tmp_path / "two-3.json"), "resume": 2, "updates": [3, 4]})
    drive(Trainer(SETTINGS, "cpu"), one, world["init"], resume=2, updates=range(3, 4), metrics=tmp_path / "one.json")
    assert json.loads((tmp_path / "two-3.resume.json").read_text()) == {"optimizer_step": 1}
    assert_close(weights(one, 3), weights(root, 3), "weights of step 3")
    assert_close(optimizer(one, 3), optimizer(root, 3), "optimizer of step 3")
