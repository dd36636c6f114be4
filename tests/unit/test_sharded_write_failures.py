"""A follower rank's failed background optimizer write reaches rank 0, on 2 gloo ranks.

Each rank is its own process (`test_sharded_learner.py`'s `rank_main`). Rank 1's writes of steps 1 and 3
fail for real (`fail_writes`: a directory stands where its piece lands, so the write's own rename raises);
rank 0 hears of the first at save 3's agreement (rank 1 had to end that write before it could start step
2's, which it does before save 3), of the second after STOP (every rank's write has ended), and says both
where it says its own: the update's figures (`write_figures`, what the service puts in the metrics the
monitor reads) and one log line each. Neither step counts as complete, and a resume from step 3 takes step
2's moments. No timing is asserted; the order comes from the collectives.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.unit.test_sharded_learner import SETTINGS, finish_ranks, release_and_kill, start_ranks, tiny_policy
from tlt_stream.rl.checkpoint import checkpoint_at, has_optimizer_state, latest_checkpoint
from tlt_stream.rl.ranks import RankLink, WriteFailures
from tlt_stream.rl.sharded import Trainer
from tlt_stream.store.shards import incomplete


@pytest.mark.slow
@pytest.mark.xdist_group("test_sharded_learner")  # two 2-rank tests at once would oversubscribe CI's cores
def test_a_followers_failed_writes_reach_rank_0_and_their_steps_stay_incomplete(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    init = tiny_policy(tmp_path / "init")
    root, out, gate = tmp_path / "two", tmp_path / "two.json", tmp_path / "gate"
    spec = {"init": str(init), "root": str(root), "out": str(out), "resume": None, "updates": [1, 4]}
    ranks = start_ranks(2, **spec, fail={"steps": [1, 3], "ranks": [1]})
    try:
        leader_log, follower_log = finish_ranks(ranks)
    finally:
        gate.mkdir()
        release_and_kill(gate, ranks)

    rows = json.loads(out.read_text())
    assert rows[0]["optimizer_write_failures"] == 0 and "optimizer_write_failed_rank" not in rows[0]
    assert rows[1]["optimizer_write_failures"] in (0, 1), "heard at save 2 if rank 1's write had ended by then"
    assert rows[2]["optimizer_write_failures"] == 1, "rank 1's failed write of step 1, heard at save 3"
    assert (rows[2]["optimizer_write_failed_rank"], rows[2]["optimizer_write_failed_step"]) == (1, 1)
    stopped = json.loads(out.with_suffix(".stopped.json").read_text())
    assert stopped["optimizer_write_failures"] == 2, "step 3's, heard after STOP; step 1's not counted twice"
    assert (stopped["optimizer_write_failed_rank"], stopped["optimizer_write_failed_step"]) == (1, 3)

    for step in (1, 3):
        said = f"rank 1: its background optimizer write of step {step} failed (IsADirectoryError: [Errno 21]"
        assert leader_log.count(said) == 1, leader_log[-3000:]
        assert f"step-{step:08d}/optimizer/rank-00001.safetensors" in follower_log, "rank 1 logs its own"
    assert "Traceback" not in leader_log

    # On disk: steps 1 and 3 lack rank 1's piece, so they hold no optimizer state; 0 and 2 are complete.
    assert [has_optimizer_state(root / f"step-{s:08d}") for s in range(4)] == [True, False, True, False]
    assert incomplete(root / "step-00000003" / "optimizer") == "no piece of rank 1 of 2"
    info = latest_checkpoint(root, clean=True)
    assert info == checkpoint_at(root, 3)
    resumed = Trainer(SETTINGS, "cpu")
    resumed.build(info.master_dir, step=3)
    with caplog.at_level(logging.WARNING):
        _, meta = resumed.restore(info)
    assert meta["optimizer_step"] == 2 and "optimizer moments of step 2" in caplog.text


def test_a_write_report_crosses_the_link_whole_or_cut_at_a_character(tmp_path: Path) -> None:
    """One rank's gloo group, in this process: the report rides the agreement, its message cut to the wire's
    bytes without splitting a character."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        link = RankLink(rank=0, world=1, device=torch.device("cpu"))
        said = WriteFailures(count=3, step=7, error="OSError: [Errno 28] No space left on device")
        assert link.agree_reporting(True, said) == (True, [said])
        assert link.agree_reporting(False, WriteFailures()) == (False, [WriteFailures()])
        ok, [long] = link.agree_reporting(True, WriteFailures(1, 2, "é" * 200))
        assert ok and long.error == "é" * 120 and (long.count, long.step) == (1, 2)
    finally:
        dist.destroy_process_group()
