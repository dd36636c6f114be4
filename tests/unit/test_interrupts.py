"""A Ctrl-C that torch swallows is still an interruption. torch builds a tensor from a Python sequence by calling
its `__getitem__`, and turns whatever that raises, a KeyboardInterrupt included, into `ValueError("could not
determine the shape of object type ...")`: a SIGINT landing there reached `tlt-stream run` as "evaluation
before training failed: could not determine the shape of object type 'torch.storage.UntypedStorage'" (exit 1)
and `tlt-stream eval` as a one-line error (exit 2). Here the signal is sent to this process from inside such
a `__getitem__`, so torch itself does the swallowing; the commands must say they were interrupted (exit 130)."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tlt_stream.commands.cli import main


class Landing:
    """A one-element sequence whose element, when torch reads it, is where a SIGINT to this process lands."""

    def __len__(self) -> int:
        return 1

    def __getitem__(self, index: int) -> float:
        os.kill(os.getpid(), signal.SIGINT)
        return 0.0


def interrupted_inside_torch(*args: Any, **kwargs: Any) -> Any:
    """A stand-in for an evaluation that is Ctrl-C'd while torch builds a tensor."""
    torch.tensor(Landing())
    raise AssertionError("torch let the KeyboardInterrupt through: the swallowing this file is about is gone")


@pytest.fixture(autouse=True)
def python_sigint() -> Iterator[None]:
    """Python's own SIGINT handler, as a command run from a shell has it (a test runner's worker may not)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_torch_turns_a_keyboard_interrupt_into_a_value_error() -> None:
    """The premise, from torch itself: without a note of the signal, the caller sees only a ValueError."""
    with pytest.raises(ValueError, match="could not determine the shape of object type 'Landing'"):
        torch.tensor(Landing())


def rows(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i)}) + "\n" for i in range(n)))
    return path


def test_run_says_it_was_interrupted_when_torch_swallows_a_ctrl_c_of_the_evaluation_before_training(
    tmp_path: Path, init_policy: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import tlt_stream.commands.run.launch as launch

    monkeypatch.setattr(launch, "evaluate_version", interrupted_inside_torch)
    started: list[Any] = []
    monkeypatch.setattr(launch, "run_plan", lambda *a, **k: started.append(a))
    train, test = rows(tmp_path / "train.jsonl", 4), rows(tmp_path / "test.jsonl", 2)
    out = tmp_path / "run"
    code = main(["run", "--policy", str(init_policy), "--dataset", str(train), "--eval-dataset", str(test),
                 "--reward", "exact", "--eval", "2", "--steps", "1", "--max-len", "48", "--out", str(out)])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 130, err
    assert err.rstrip().endswith("tlt-stream: interrupted"), err
    assert "failed" not in err and "could not determine" not in err, err
    assert not started and not (out / "checkpoints").exists(), "no service was started"


def test_run_says_it_was_interrupted_when_torch_swallows_a_ctrl_c_of_the_evaluation_after_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import tlt_stream.commands.run.launch as launch
    import tlt_stream.rl.checkpoint as checkpoint
    from tlt_stream.basics.config import load_config
    from tlt_stream.basics.interrupts import noting_sigint
    from tlt_stream.commands.run.setup import finish

    monkeypatch.setattr(launch, "evaluate_version", interrupted_inside_torch)
    last = SimpleNamespace(step=3, policy_dir=tmp_path / "checkpoints" / "step-00000003" / "policy")
    monkeypatch.setattr(checkpoint, "latest_checkpoint", lambda *a, **k: last)
    plan = SimpleNamespace(run_dir=tmp_path, cores=1)
    with pytest.raises(KeyboardInterrupt), noting_sigint():  # as `tlt-stream run` calls it
        finish(plan, load_config(), 0, 2, 12.0)  # type: ignore[arg-type]
    err = capsys.readouterr().err
    assert "failed" not in err and "finished" not in err, err


def test_eval_of_ones_own_dataset_says_it_was_interrupted_when_torch_swallows_a_ctrl_c(
    tmp_path: Path, init_policy: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import tlt_stream.rl.evaluate as evaluate

    monkeypatch.setattr(evaluate, "evaluate_dataset", interrupted_inside_torch)
    test = rows(tmp_path / "test.jsonl", 2)
    code = main(["eval", "--model", str(init_policy), "--dataset", str(test), "--reward", "exact"])
    err = capsys.readouterr().err
    assert code == 130, err
    assert err.rstrip().endswith("tlt-stream: interrupted") and "could not determine" not in err, err


def test_the_note_leaves_a_handler_of_someone_elses_alone_and_puts_python_s_back() -> None:
    from tlt_stream.basics.interrupts import noting_sigint, sigint_received

    with noting_sigint():
        assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
        assert sigint_received()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler

    def mine(signum: int, frame: Any) -> None:
        pass

    signal.signal(signal.SIGINT, mine)
    with noting_sigint():
        assert signal.getsignal(signal.SIGINT) is mine
    assert signal.getsignal(signal.SIGINT) is mine and not sigint_received()
