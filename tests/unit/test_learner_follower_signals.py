"""A sharded learner's follower ranks and the signals torchrun forwards to every rank.

Rank 0's service stops on SIGTERM/SIGINT after the update in hand and its STOP ends the other ranks once
their background optimizer writes have landed. A follower that died on the signal itself could cut its
piece of the newest checkpoint's optimizer state short, so it ignores both (`follow_rank_0`) and leaves
when told, or, with rank 0 gone, once its write in flight has landed.

In-process: the entry ignores both signals while it follows, puts the handlers back after, and waits for
the write when following fails. On 2 gloo ranks (`test_sharded_learner.py`'s policy and groups): rank 1's
write of step 1 is held by a file gate (`hold_writes`, a slow disk made deterministic) while it is sent
SIGTERM, and its piece still lands, whether rank 0 then stops it or is killed. No timing is asserted.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.ports import free_port
from tests.unit.test_sharded_learner import (
    ROOT,
    SETTINGS,
    Ranks,
    groups_of,
    hold_writes,
    release_and_kill,
    save,
    tiny_policy,
    wait_for,
)
from tlt_stream.rl.checkpoint import has_optimizer_state
from tlt_stream.rl.ranks import RankLink
from tlt_stream.rl.sharded import Trainer
from tlt_stream.roles import learner as learner_role
from tlt_stream.roles.learner import follow_rank_0

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class FakeTrainer:
    link = RankLink(rank=1, world=2, device=torch.device("cpu"))

    def __init__(self) -> None:
        self.waits = 0

    def wait_for_writes(self) -> float:
        self.waits += 1
        return 0.0


def test_a_follower_ignores_stop_signals_while_it_follows(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    seen: list[object] = []

    def follow(trainer: FakeTrainer, *, root: Path, init_policy: Path) -> None:
        seen.extend(signal.getsignal(sig) for sig in STOP_SIGNALS)

    before = [signal.getsignal(sig) for sig in STOP_SIGNALS]
    monkeypatch.setattr(learner_role, "follow", follow)
    trainer = FakeTrainer()
    follow_rank_0(trainer, root=tmp_path, init_policy=tmp_path)  # type: ignore[arg-type]
    assert seen == [signal.SIG_IGN, signal.SIG_IGN]
    assert [signal.getsignal(sig) for sig in STOP_SIGNALS] == before, "the handlers are put back"


def test_a_follower_whose_link_breaks_waits_for_its_write_before_leaving(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    trainer = FakeTrainer()

    def follow(trainer: FakeTrainer, *, root: Path, init_policy: Path) -> None:
        raise RuntimeError("Connection closed by peer")  # what gloo raises when rank 0 is gone

    before = [signal.getsignal(sig) for sig in STOP_SIGNALS]
    monkeypatch.setattr(learner_role, "follow", follow)
    with pytest.raises(RuntimeError, match="closed by peer"):
        follow_rank_0(trainer, root=tmp_path, init_policy=tmp_path)  # type: ignore[arg-type]
    assert trainer.waits == 1
    assert [signal.getsignal(sig) for sig in STOP_SIGNALS] == before


def rank_main(spec: str) -> None:
    """One rank's process (`python -c`, torchrun's environment set by the caller). Rank 0 saves steps 0 and
    1 (rank 1's write of step 1 is held), waits for its own writes, says so (`saved`), and stops the ranks
    when the test creates `stop`; rank 1 follows through `follow_rank_0`, as `serve_learner` runs it."""
    from tlt_stream.rl.ranks import join_ranks, leave_ranks

    args = json.loads(spec)
    torch.set_num_threads(1)
    link = join_ranks("cpu", timeout_s=120)
    assert link is not None
    gate, root, init = Path(args["hold"]["dir"]), Path(args["root"]), Path(args["init"])
    hold_writes(args["hold"], link.rank)
    trainer = Trainer(SETTINGS, "cpu", link)
    if not link.leader:
        follow_rank_0(trainer, root=root, init_policy=init)
        leave_ranks(link)
        return
    trainer.build(init)
    save(trainer, root, 0)
    assert trainer.core is not None
    trainer.core.step(groups_of(1))
    save(trainer, root, 1)
    trainer.wait_for_writes()  # rank 0's piece and the index of step 1 are on disk
    (gate / "saved").touch()
    while not (gate / "stop").exists():
        time.sleep(0.02)
    trainer.stop()
    leave_ranks(link)


@contextlib.contextmanager
def two_ranks(tmp_path: Path, init: Path) -> Iterator[tuple[Ranks, Path, Path]]:
    """Rank 0 and rank 1 of `rank_main`, rank 1's write of step 1 held until `gate/release`; (ranks, gate,
    checkpoint root). On the way out the gate is released and a rank still running is killed."""
    gate, root = tmp_path / "gate", tmp_path / "checkpoints"
    gate.mkdir()
    spec = {"init": str(init), "root": str(root), "hold": {"step": 1, "ranks": [1], "dir": str(gate)}}
    code = f"from tests.unit.test_learner_follower_signals import rank_main; rank_main({json.dumps(json.dumps(spec))})"
    port = free_port()  # rank 0's rendezvous store binds it
    ranks: Ranks = []
    try:
        for rank in range(2):
            env = {**os.environ, "WORLD_SIZE": "2", "RANK": str(rank), "LOCAL_RANK": str(rank)}
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
            err = tempfile.TemporaryFile()  # noqa: SIM115 (closed below)
            ranks.append((subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, stderr=err), err))
        yield ranks, gate, root
    finally:
        release_and_kill(gate, ranks)


def stderr_of(rank: tuple[subprocess.Popen, object]) -> str:
    err = rank[1]
    err.seek(0)  # type: ignore[attr-defined]
    return err.read().decode()[-3000:]  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def init(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_policy(tmp_path_factory.mktemp("follower") / "init")


# The same xdist worker as the other 2-rank tests: two of them at once would oversubscribe CI's two cores.
@pytest.mark.slow
@pytest.mark.xdist_group("test_sharded_learner")
@pytest.mark.parametrize("rank_0", ["stops", "is killed"])
def test_sigterm_during_a_followers_held_write_still_lets_its_piece_land(
    init: Path, tmp_path: Path, rank_0: str
) -> None:
    with two_ranks(tmp_path, init) as (ranks, gate, root):
        wait_for(gate / "saved", ranks)
        wait_for(gate / "started-1", ranks)  # rank 1's piece of step 1 is being written, held
        leader, follower = ranks
        follower[0].send_signal(signal.SIGTERM)  # torchrun forwards it to every rank
        if rank_0 == "stops":
            (gate / "stop").touch()  # rank 0's service stopped after its update: its STOP ends rank 1
        else:
            leader[0].kill()  # rank 0 gone: rank 1's link breaks
            leader[0].wait()
        (gate / "release").touch()
        code = follower[0].wait(timeout=240)
        if rank_0 == "stops":
            assert leader[0].wait(timeout=240) == 0, stderr_of(leader)
        assert code != -signal.SIGTERM, "the follower died on SIGTERM"
        step_1 = root / "step-00000001"
        assert (step_1 / "optimizer" / "rank-00001.safetensors").exists(), stderr_of(follower)
        assert has_optimizer_state(step_1), "step 1's optimizer state is complete"
        if rank_0 == "stops":
            assert code == 0, stderr_of(follower)
        else:
            assert code != 0 and "stops following rank 0" in stderr_of(follower)
