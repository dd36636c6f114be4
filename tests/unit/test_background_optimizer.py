"""The optimizer state written in the background (issue 25 point 3): the next update does not wait for it,
what it writes is the state at the save, a resume takes the newest complete state and says so, and pruning
keeps what a resume needs."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.unit.test_weight_sync import one_group, save, trainer_on
from tlt_stream.rl import checkpoint as checkpoint_module
from tlt_stream.rl.checkpoint import (
    OPTIMIZER,
    complete_checkpoints,
    has_optimizer_state,
    latest_checkpoint,
    restore_checkpoint,
)
from tlt_stream.rl.sharded import Trainer
from tlt_stream.store.shards import read_shards


class Gate:
    """Holds background optimizer writes at their start until released (a slow disk, deterministically)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *, end: str | None = None) -> None:
        self.started = threading.Event()
        self.release = threading.Event()
        self.written: list[Path] = []
        real = checkpoint_module._write_optimizer_state

        def gated(state: object, tmp: Path) -> None:
            self.started.set()
            assert self.release.wait(timeout=60), "the test never released the write"
            if end is not None:
                (tmp / "rank-00000.safetensors").write_bytes(b"half a file")
                if end == "killed":  # the thread stops where it is, as in a SIGKILLed process: nothing cleans up
                    raise SystemExit
                raise OSError("disk gone")
            real(state, tmp)
            self.written.append(tmp)

        monkeypatch.setattr(checkpoint_module, "_write_optimizer_state", gated)


def update(trainer: Trainer, task: str) -> None:
    assert trainer.core is not None
    trainer.core.step(one_group(task, trainer.core.model.get_input_embeddings().weight.shape[0]))


def moments(trainer: Trainer) -> dict[str, torch.Tensor]:
    assert trainer.core is not None
    state = trainer.core.optimizer.state_dict()["state"]
    return {f"state.{i}.{slot}": v.clone() for i, slots in state.items() for slot, v in slots.items()}


def test_the_next_update_runs_while_the_optimizer_state_is_written_and_that_state_is_the_saves(
    tmp_path: Path, init_policy: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trainer = trainer_on(init_policy)
    root = tmp_path / "checkpoints"
    update(trainer, "a")
    gate = Gate(monkeypatch)
    at_save = moments(trainer)
    info = save(trainer, root, 1, wait=False)
    assert gate.started.wait(timeout=30)
    # The save returned with its write held: the version is committed without it.
    assert latest_checkpoint(root) == info and not has_optimizer_state(info.path)
    assert trainer.optimizer_writes.busy == info.path / OPTIMIZER
    update(trainer, "b")  # the next update, with the write still held: the loop does not wait on it
    assert not gate.release.is_set() and trainer.optimizer_writes.busy is not None
    after = moments(trainer)
    assert any(not torch.equal(after[k], v) for k, v in at_save.items()), "the update changed the moments"

    gate.release.set()
    trainer.wait_for_writes()
    assert has_optimizer_state(info.path) and trainer.optimizer_writes.last.error is None
    written, _ = read_shards(info.path / OPTIMIZER, rank=None, world=1)
    assert written.keys() == at_save.keys()
    assert all(torch.equal(written[k], v) for k, v in at_save.items()), "the snapshot at the save, not after"


def test_at_most_one_write_in_flight_and_pruning_keeps_the_fallback_and_the_one_being_written(
    tmp_path: Path, init_policy: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trainer = trainer_on(init_policy)
    root = tmp_path / "checkpoints"
    trainer.save(root, step=0, ledger=set(), extra={}, tokenizer=None, keep=1, publish_dtype=torch.float32)
    trainer.wait_for_writes()
    gate = Gate(monkeypatch)
    update(trainer, "a")
    trainer.save(root, step=1, ledger={"a/0"}, extra={}, tokenizer=None, keep=1, publish_dtype=torch.float32)
    assert gate.started.wait(timeout=30)
    # keep=1, and step 1's state is being written: step 0, the newest complete state, stays.
    assert [c.step for c in complete_checkpoints(root)] == [0, 1]

    update(trainer, "b")
    saving = threading.Thread(
        target=lambda: trainer.save(
            root, step=2, ledger={"a/0", "b/0"}, extra={}, tokenizer=None, keep=1, publish_dtype=torch.float32
        )
    )
    gate.started.clear()
    saving.start()
    committed = root / "step-00000002" / "meta.json"
    deadline = time.monotonic() + 120
    while not committed.exists():  # step 2 itself is committed before its optimizer write is submitted
        assert saving.is_alive(), "step 2's save ended without committing"
        assert time.monotonic() < deadline, "step 2 was never committed"
        time.sleep(0.01)
    # Submitted now or in a moment: a second write in flight would start (gate.started) and let the save
    # return; it can only stay blocked while it waits for step 1's write, which the gate holds.
    saving.join(timeout=5)
    assert saving.is_alive() and not gate.started.is_set(), "step 2's write waits for step 1's: one in flight"
    gate.release.set()
    saving.join(timeout=60)
    trainer.wait_for_writes()
    # Pruned at step 2's save, while its own state was in flight: step 1 is what a resume would need then.
    assert [c.step for c in complete_checkpoints(root)] == [1, 2]
    trainer.save(root, step=3, ledger={"a/0", "b/0"}, extra={}, tokenizer=None, keep=1, publish_dtype=torch.float32)
    trainer.stop()  # waits for the write
    assert [c.step for c in complete_checkpoints(root)] == [2, 3] and has_optimizer_state(root / "step-00000003")


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the "killed" writer
@pytest.mark.parametrize("end", ["killed", "failed"])
def test_a_resume_past_an_unfinished_write_takes_the_newest_complete_state_and_says_so(
    tmp_path: Path, init_policy: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, end: str
) -> None:
    trainer = trainer_on(init_policy)
    root = tmp_path / "checkpoints"
    common = {"extra": {}, "tokenizer": None, "keep": 3, "publish_dtype": torch.float32}
    update(trainer, "a")
    trainer.save(root, step=1, ledger={"a/0", "a/1"}, **common)
    trainer.wait_for_writes()
    step_1 = moments(trainer)
    update(trainer, "b")
    gate = Gate(monkeypatch, end=end)
    info = trainer.save(root, step=2, ledger={"a/0", "a/1", "b/0", "b/1"}, **common)
    gate.release.set()
    trainer.wait_for_writes()
    assert trainer.optimizer_writes.failures == (end == "failed") and not has_optimizer_state(info.path)
    leftover = any(p.name.startswith(".tmp-") for p in info.path.iterdir())
    assert leftover == (end == "killed"), "a failed write cleans up after itself; a killed one cannot"

    assert latest_checkpoint(root, clean=True) == info
    assert not any(p.name.startswith(".tmp-") for p in info.path.iterdir()), "cleaned on resume"
    fresh = trainer_on(info.master_dir)
    with caplog.at_level(logging.WARNING, logger="tlt_stream.rl.checkpoint"):
        ledger, meta = fresh.restore(info)
    # Update 2 counts once: its samples are in the ledger (redelivered copies are duplicates, never retrained)
    # and its weights are the ones resumed; only its optimizer moments are step 1's, and that is said.
    assert ledger == {"a/0", "a/1", "b/0", "b/1"} and meta["step"] == 2
    assert meta["optimizer_step"] == 1 and "optimizer moments of step 1" in caplog.text
    assert all(torch.equal(moments(fresh)[k], v) for k, v in step_1.items())
    assert all(torch.equal(a, b) for a, b in zip(fresh.core.model.state_dict().values(),
                                                 trainer.core.model.state_dict().values(), strict=True))  # fmt: skip
    update(fresh, "c")  # it trains on from there

    # With no complete state anywhere: fresh moments, said too.
    for older in complete_checkpoints(root)[:-1]:
        checkpoint_module.remove_dir(older.path)
    _, meta = restore_checkpoint(info, optimizer=trainer_on(info.master_dir).core.optimizer, restore_rng=False)
    assert meta["optimizer_step"] == -1
