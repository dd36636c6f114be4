"""The KL term (`learner.kl_coef` > 0) on two gloo ranks (FSDP2) against one process.

With a KL term each rank also holds the frozen reference, the initial policy, sharded like the policy
(`Trainer._reference`), and every micro-batch (an idle round's too) runs its forward, whose all-gathers every
rank must make in step. The ranks are processes under torchrun's environment
(`test_sharded_learner.start_ranks`), driven as the learner service drives them; the reference is the same
updates on one process. Update 1 starts at the reference (the KL and its gradient are zero there), so the
term acts from update 2 on: the figures and the saved weights must follow the single process, and differ
from the same updates without the term. Resumed from a sharded checkpoint, every rank loads the reference from
`learner.reference` (the initial policy, not the checkpoint) and the run goes on as if never stopped.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.unit.test_sharded_learner import SETTINGS, assert_close, drive, run_ranks, tiny_policy, weights
from tlt_stream.rl.learner import LearnerSettings
from tlt_stream.rl.sharded import Trainer

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("test_sharded_learner")]

KL = {"kl_coef": 0.5}
"""Large enough that the term moves the weights visibly against the policy-gradient part."""
UPDATES = range(1, 4)


def single_process(tmp: Path, init: Path, name: str, **settings: object) -> list[dict[str, float]]:
    trainer = Trainer(LearnerSettings(**{**SETTINGS.__dict__, **settings}), "cpu")
    drive(trainer, tmp / name, init, resume=None, updates=UPDATES, metrics=tmp / f"{name}.json")
    return json.loads((tmp / f"{name}.json").read_text())


def test_two_ranks_with_a_kl_term_make_the_single_process_updates(tmp_path: Path) -> None:
    init = tiny_policy(tmp_path / "init")
    torch.set_num_threads(1)
    one = single_process(tmp_path, init, "one", **KL)
    plain = single_process(tmp_path, init, "plain")
    spec = {"init": str(init), "updates": [UPDATES.start, UPDATES.stop], "resume": None, "settings": KL}
    run_ranks(2, root=str(tmp_path / "two"), out=str(tmp_path / "two.json"), **spec)
    two = json.loads((tmp_path / "two.json").read_text())

    assert one[0]["kl_ref"] == pytest.approx(0.0, abs=1e-9), "update 1 starts at the reference"
    assert all(row["kl_ref"] > 1e-4 for row in one[1:]), "the policy has moved away from the reference"
    for update, (a, b) in enumerate(zip(one, two, strict=True), start=1):
        for key in ("loss", "grad_norm", "kl_ref", "approx_kl_old", "clip_fraction"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), f"update {update}: {key}"
    for step in UPDATES:
        assert_close(weights(tmp_path / "one", step), weights(tmp_path / "two", step), f"weights of step {step}")

    assert [row["loss"] for row in two[1:]] != pytest.approx([row["loss"] for row in plain[1:]], rel=1e-4)
    last = UPDATES[-1]
    with_kl, without = weights(tmp_path / "two", last), weights(tmp_path / "plain", last)
    moved = max(float((with_kl[k] - without[k]).abs().max()) for k in with_kl)
    assert moved > 1e-4, "the KL term changed the update"

    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "two", resumed, ignore=shutil.ignore_patterns(f"step-{last:08d}"))
    (resumed / "LATEST").write_text(f"step-{last - 1:08d}\n")
    again = {**spec, "updates": [last, last + 1], "resume": last - 1, "settings": {**KL, "reference": str(init)}}
    run_ranks(2, root=str(resumed), out=str(tmp_path / "resumed.json"), **again)
    redo = json.loads((tmp_path / "resumed.json").read_text())[0]
    assert redo["kl_ref"] == pytest.approx(two[-1]["kl_ref"], rel=1e-6), "the reference is the initial policy"
    assert redo["loss"] == pytest.approx(two[-1]["loss"], rel=1e-6)
    assert_close(weights(resumed, last), weights(tmp_path / "two", last), "weights of the resumed update")
