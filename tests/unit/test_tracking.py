"""Experiment tracking: TensorBoard and offline W&B get the figures and samples, read back from their files."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

from tests.tracking_files import tensorboard_scalars, tensorboard_texts, wandb_config, wandb_history
from tlt_stream.rl.tracking import MissingTracker, open_trackers, require_trackers, scalars

ROWS = [
    {"sample_id": "t/0", "prompt": "1+1=", "response": "2 | done", "reward": 1.0, "finish_reason": "eos"},
    {"sample_id": "t/1", "prompt": "1+1=", "response": "3", "reward": 0.0, "finish_reason": "stop"},
]


def test_only_finite_numbers_are_figures() -> None:
    line = {"version": 3, "time": 1.0, "reward_mean": 0.5, "samples": 8, "nan": float("nan"), "updated": True,
            "response_lens": [1, 2], "recovered": "no"}  # fmt: skip
    assert scalars(line) == {"reward_mean": 0.5, "samples": 8.0}
    assert scalars({"accuracy": 1}, "eval/") == {"eval/accuracy": 1.0}


def test_both_trackers_get_each_steps_figures_and_samples(tmp_path: Path) -> None:
    config = {"learner": {"lr": 1e-6}}
    trackers = open_trackers(["tensorboard", "wandb", "tensorboard"], tmp_path, run="r1", config=config)
    assert len(trackers) == 2, "each tracker once"
    for version in (1, 2):
        for tracker in trackers:
            tracker.log(version, {"reward_mean": version / 4, "loss": -version})
            tracker.log_samples(version, ROWS)
    for tracker in trackers:
        tracker.close()

    board = tensorboard_scalars(tmp_path / "tensorboard" / "learner")
    assert board["reward_mean"] == {1: 0.25, 2: 0.5} and board["loss"] == {1: -1.0, 2: -2.0}
    texts = tensorboard_texts(tmp_path / "tensorboard" / "learner")
    assert set(texts) == {1, 2} and "2 \\| done" in texts[2] and "stop" in texts[2]

    history = wandb_history(tmp_path)
    assert {s: (h["reward_mean"], h["loss"]) for s, h in history.items()} == {1: (0.25, -1), 2: (0.5, -2)}
    assert history[2]["samples/_type"] == "table-file" and history[2]["samples/nrows"] == 2
    runs = list(tmp_path.glob("wandb/offline-run-*"))
    assert len(runs) == 1 and runs[0].name.endswith("r1-learner"), "the run's id is the run's name: resumable"


def test_a_missing_package_or_an_unknown_name_is_one_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(MissingTracker, match=r"wandb, which is not installed .*pip install 'tlt-stream\[tracking\]'"):
        require_trackers(["wandb"])
    with pytest.raises(MissingTracker, match="wandb"):
        open_trackers(["tensorboard", "wandb"], tmp_path, run="r", config={})
    with pytest.raises(ValueError, match="unknown tracker"):
        open_trackers(["mlflow"], tmp_path, run="r", config={})


def test_the_learner_gives_wandb_its_configuration_without_secrets(tmp_path: Path) -> None:
    from tlt_stream.basics.config import DEFAULTS, override
    from tlt_stream.rl.tracking import trackers_for

    config = override(
        DEFAULTS,
        {"bus.redis_url": "redis://:hunter2@127.0.0.1:6379/0", "learner.log_to": ("wandb",), "learner.lr": 3e-6},
    )
    trackers = trackers_for(config, tmp_path)  # what the learner (and the run's evaluations) open
    for tracker in trackers:
        tracker.close()
    (run_file,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    recorded = wandb_config(tmp_path)
    assert recorded["learner"]["lr"] == 3e-6, "the configuration is recorded with the run"
    assert recorded["bus"]["redis_url"] == "redis://:***@127.0.0.1:6379/0"
    assert b"hunter2" not in run_file.read_bytes(), "the password is not, anywhere"


def test_closing_a_wandb_run_waits_until_its_file_holds_everything(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`run.finish()` returns once W&B's service has answered the exit record, then tells it, unanswered, to
    close the run's stream; the file's last block reaches the disk only then. Under load the service got to
    that after the tests had read the file (missing steps, a missing configuration)."""
    from wandb.sdk.lib.service.service_connection import ServiceConnection

    inform_finish = ServiceConnection.inform_finish

    def starved(self: ServiceConnection, run_id: str) -> None:  # the service gets to it a second later
        threading.Timer(1.0, inform_finish, (self, run_id)).start()

    monkeypatch.setattr(ServiceConnection, "inform_finish", starved)
    (tracker,) = open_trackers(["wandb"], tmp_path, run="late", config={"learner": {"lr": 1e-6}})
    tracker.log(1, {"loss": -1.0})
    tracker.close()
    assert {s: h["loss"] for s, h in wandb_history(tmp_path).items()} == {1: -1.0}
    assert wandb_config(tmp_path)["learner"] == {"lr": 1e-6}


def test_a_wandb_file_that_never_gets_its_exit_record_is_a_clear_error(tmp_path: Path) -> None:
    from tlt_stream.rl.tracking import _wait_for_exit_record, wandb_records

    (tracker,) = open_trackers(["wandb"], tmp_path, run="whole", config={})
    tracker.log(1, {"loss": -1.0})
    tracker.close()
    (run_file,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    torn = tmp_path / "torn.wandb"
    torn.write_bytes(run_file.read_bytes()[:-3])  # the exit record's last bytes not written (yet)
    assert wandb_records(torn) == wandb_records(run_file)[:-1], "a torn record is not read"
    with pytest.raises(TimeoutError, match=r"torn\.wandb within 0\.2s .*no exit record"):
        _wait_for_exit_record(torn, 0.2)
