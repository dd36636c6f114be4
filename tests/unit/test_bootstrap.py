"""`bootstrap` builds a loadable, deterministic tiny world, skips work it already did, and finishes a build
that was interrupted; `tlt-stream run` builds whatever its world is missing."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from tlt_stream.basics.config import Config  # launch.sd defaults to eagle: the world needs a drafter
from tlt_stream.commands.cli import main
from tlt_stream.commands.run.launch import RunPlan
from tlt_stream.drafter.model import load_drafter
from tlt_stream.model import load_model
from tlt_stream.tasks import bootstrap as bootstrap_module
from tlt_stream.tasks.bootstrap import MARKER, STAGING, bootstrap, unfinished
from tlt_stream.tasks.evaluate import evaluate

# One xdist worker runs this module, so its module-scoped fixtures are built once.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("test_bootstrap")]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("world")
    bootstrap(out, seed=3, size="small")
    return out


def test_policy_loads_in_transformers_and_the_runtime_with_matching_logits(world: Path) -> None:
    hf = AutoModelForCausalLM.from_pretrained(world / "policy").eval()
    ours = load_model(world / "policy")
    tokenizer = AutoTokenizer.from_pretrained(world / "policy")
    text = "Q: Start at 17 and add 8, 4 times.\nA: Step 1/4: 17+8"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    with torch.inference_mode():
        expected = hf(torch.tensor([ids])).logits[0]
        hidden = ours(torch.tensor([ids]), torch.arange(len(ids))[None], ours.new_cache(1, len(ids)))
        got = ours.logits(hidden)[0]
    assert torch.allclose(got, expected, atol=1e-4)
    drafter = load_drafter(world / "drafter", ours)
    assert drafter.bound


def test_bootstrap_is_deterministic_and_skips_finished_work(tiny: str, tmp_path: Path) -> None:
    world = tmp_path / "world"
    first = bootstrap(world, seed=3, size=tiny)
    marker = world / "bootstrap.json"
    before = marker.stat().st_mtime_ns
    record = bootstrap(world, seed=3, size=tiny)
    assert marker.stat().st_mtime_ns == before and record == first == json.loads(marker.read_text())
    again = tmp_path / "again"
    bootstrap(again, seed=3, size=tiny)
    for part in ("policy", "drafter"):
        a, b = load_file(world / part / "model.safetensors"), load_file(again / part / "model.safetensors")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), f"{part} differs for one seed"


def test_a_change_in_the_drafter_settings_alone_retrains_only_the_drafter(
    tiny: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def tensors(path: Path) -> dict[str, torch.Tensor]:
        return load_file(path / "model.safetensors")

    old = tmp_path / "old"
    bootstrap(old, seed=3, size=tiny)
    first_policy, first_drafter = tensors(old / "policy"), tensors(old / "drafter")
    policy_files = {f: f.stat().st_mtime_ns for f in (old / "policy").iterdir()}
    settings = bootstrap_module.SIZES[tiny]
    monkeypatch.setitem(
        bootstrap_module.SIZES, tiny, dataclasses.replace(settings, drafter_steps=settings.drafter_steps + 5)
    )
    record = bootstrap(old, seed=3, size=tiny)
    assert record["policy_kept"] and record["settings"]["drafter_steps"] == settings.drafter_steps + 5
    assert {f: f.stat().st_mtime_ns for f in (old / "policy").iterdir()} == policy_files  # not rewritten
    assert json.loads((old / "bootstrap.json").read_text()) == record
    fresh = tmp_path / "fresh"
    bootstrap(fresh, seed=3, size=tiny)  # the same settings from nothing: the same drafter
    a, b = tensors(old / "drafter"), tensors(fresh / "drafter")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], v) for k, v in first_drafter.items())

    monkeypatch.setitem(bootstrap_module.SIZES, tiny, dataclasses.replace(settings, sft_steps=settings.sft_steps + 1))
    record = bootstrap(old, seed=3, size=tiny)  # a policy setting changed: everything is rebuilt
    assert "policy_kept" not in record
    assert any(not torch.equal(tensors(old / "policy")[k], v) for k, v in first_policy.items())


def test_eval_reports_accuracy_lengths_and_acceptance(world: Path) -> None:
    report = evaluate(world / "policy", drafter=str(world / "drafter"), n=8, temperature=1.0, batch_size=8)
    assert 0.0 <= report["accuracy"] <= 1.0 and report["prompts"] == 8
    assert report["length"]["max"] >= report["length"]["p50"] > 0
    assert report["mean_accept_length"] >= 1.0


# ------------------------------------------------------------------------------ interrupted builds

TINY = "tiny"


@pytest.fixture
def tiny(monkeypatch: pytest.MonkeyPatch) -> str:
    """A size whose whole bootstrap (the real phases, barely trained) takes a few seconds."""
    small = bootstrap_module.SIZES["small"]
    settings = dataclasses.replace(small, hidden_size=32, layers=1, intermediate_size=64, sft_steps=4)
    settings = dataclasses.replace(settings, sft_batch_tokens=1024, drafter_samples=4, drafter_steps=3)
    monkeypatch.setitem(bootstrap_module.SIZES, TINY, settings)
    return TINY


@pytest.fixture
def policy_seeds(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The seed of every policy `bootstrap` trains from here on."""
    seeds: list[int] = []
    train = bootstrap_module.train_policy

    def counted(settings, seed, out, progress):  # type: ignore[no-untyped-def]
        seeds.append(seed)
        return train(settings, seed, out, progress)

    monkeypatch.setattr(bootstrap_module, "train_policy", counted)
    return seeds


@contextlib.contextmanager
def ctrl_c_in_the_drafter_phase(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The block's bootstrap is stopped by Ctrl-C once its policy is saved, its drafter file half-written."""

    def interrupted(policy_dir, windows, settings, seed, out, progress):  # type: ignore[no-untyped-def]
        out.mkdir(parents=True)
        (out / "model.safetensors").write_bytes(b"half a drafter")
        raise KeyboardInterrupt

    train = bootstrap_module.train_drafter
    monkeypatch.setattr(bootstrap_module, "train_drafter", interrupted)
    try:
        with pytest.raises(KeyboardInterrupt):
            yield
    finally:
        monkeypatch.setattr(bootstrap_module, "train_drafter", train)


def mtimes(directory: Path) -> dict[str, int]:
    return {f.name: f.stat().st_mtime_ns for f in directory.iterdir()}


def same_tensors(a: Path, b: Path) -> bool:
    x, y = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def assert_complete(world: Path, record: dict) -> None:
    assert json.loads((world / MARKER).read_text()) == record and {"policy", "drafter"} <= record.keys()
    assert not (world / STAGING).exists() and unfinished(world) is None
    load_drafter(world / "drafter", load_model(world / "policy"))
    RunPlan(world=world, run_dir=world.parent / "run", config=Config())  # what refused with "no drafter for --sd eagle"


def test_an_interrupted_first_build_is_no_world_and_the_next_call_finishes_it(
    tmp_path: Path, tiny: str, policy_seeds: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    world = tmp_path / "world"
    with ctrl_c_in_the_drafter_phase(monkeypatch):
        bootstrap(world, seed=1, size=tiny)
    assert [p.name for p in world.iterdir()] == [STAGING]  # no marker, no policy, no drafter in place
    pending = unfinished(world)
    assert pending is not None and (pending["seed"], pending["size"]) == (1, tiny) and "drafter" not in pending
    with pytest.raises(FileNotFoundError, match="no policy"):
        RunPlan(world=world, run_dir=tmp_path / "run", config=Config())
    staged = mtimes(world / STAGING / "policy")

    record = bootstrap(world, seed=1, size=tiny)
    assert_complete(world, record)
    assert policy_seeds == [1] and mtimes(world / "policy") == staged  # the saved policy was kept, not retrained
    fresh = tmp_path / "fresh"
    assert bootstrap(fresh, seed=1, size=tiny)["settings"] == record["settings"]
    for part in ("policy", "drafter"):  # resumed, the world is the one an uninterrupted build makes
        assert same_tensors(world / part, fresh / part), part


def test_a_leftover_of_a_killed_build_does_not_break_the_next(tmp_path: Path, tiny: str) -> None:
    world = tmp_path / "world"
    killed = world / STAGING / "policy"  # killed while saving its policy: files, and no record of them
    killed.mkdir(parents=True)
    (killed / "config.json").write_text("{")
    (killed / "model.safetensors").write_bytes(b"")
    assert unfinished(world) == {}
    assert_complete(world, bootstrap(world, seed=1, size=tiny))


def test_an_interrupted_rebuild_leaves_the_old_world_whole_and_is_not_resumed_for_other_settings(
    tmp_path: Path, tiny: str, policy_seeds: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    world = tmp_path / "world"
    first = bootstrap(world, seed=1, size=tiny)
    marker = (world / MARKER).read_bytes()
    with ctrl_c_in_the_drafter_phase(monkeypatch):
        bootstrap(world, seed=2, size=tiny)
    assert (world / MARKER).read_bytes() == marker and (world / STAGING / MARKER).is_file()
    assert unfinished(world) is None  # the seed-1 world is still whole and still serves a run
    RunPlan(world=world, run_dir=tmp_path / "run", config=Config())

    assert bootstrap(world, seed=1, size=tiny) == first and not (world / STAGING).exists()  # the leftover goes
    with ctrl_c_in_the_drafter_phase(monkeypatch):
        bootstrap(world, seed=2, size=tiny)
    record = bootstrap(world, seed=3, size=tiny)
    assert policy_seeds == [1, 2, 2, 3] and record["seed"] == 3  # seed 2's staged policy is not taken for seed 3
    assert_complete(world, record)


def test_a_drafter_only_rebuild_stopped_while_installing_is_finished_next_time(
    tmp_path: Path, tiny: str, policy_seeds: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    world = tmp_path / "world"
    bootstrap(world, seed=1, size=tiny)
    policy = mtimes(world / "policy")
    settings = bootstrap_module.SIZES[tiny]
    monkeypatch.setitem(bootstrap_module.SIZES, tiny, dataclasses.replace(settings, drafter_steps=5))
    install = bootstrap_module._install

    def stopped(stage: Path, out: Path, part: str) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(bootstrap_module, "_install", stopped)
    with pytest.raises(KeyboardInterrupt):
        bootstrap(world, seed=1, size=tiny)
    assert (world / "drafter").is_dir()  # the old drafter is still in place, but the world is marked unfinished
    assert "drafter" not in json.loads((world / MARKER).read_text())
    pending = unfinished(world)
    assert pending is not None and pending["settings"]["drafter_steps"] == 5

    monkeypatch.setattr(bootstrap_module, "_install", install)
    record = bootstrap(world, seed=1, size=tiny)
    assert record["policy_kept"] and record["settings"]["drafter_steps"] == 5
    assert policy_seeds == [1] and mtimes(world / "policy") == policy
    assert_complete(world, record)


# ------------------------------------------------------------------------------ `tlt-stream run`'s world


@pytest.fixture
def run_here(tmp_path: Path, tiny: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A directory to run `tlt-stream run` in, whose default world (`artifacts/world`) is built tiny."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(bootstrap_module.SIZES, "default", bootstrap_module.SIZES[tiny])
    for name in ("TLT_RUN", "TLT_REDIS_URL", "TLT_MQTT_URL"):
        monkeypatch.delenv(name, raising=False)
    threads = torch.get_num_threads()
    yield tmp_path / "artifacts" / "world"
    torch.set_num_threads(threads)


def run_cli(capsys: pytest.CaptureFixture[str], *args: str, device: str = "cuda:99") -> tuple[int, str]:
    """`tlt-stream run` up to its services: a device this machine lacks (a well-formed one: a malformed one
    is refused before anything, by the configuration) stops it right after its world is ready, a world it
    cannot use stops it at the same place; no server or process is started either way."""
    code = main(["run", "--device", device, "--eval", "0", "--out", "runs/r", *args])
    return code, capsys.readouterr().err


def refused_device(err: str) -> bool:
    return "--device cuda:99: " in err and ("sees no CUDA device" in err or "CUDA device(s) visible" in err)


def test_run_builds_what_an_old_layout_world_is_missing(
    run_here: Path, policy_seeds: list[int], capsys: pytest.CaptureFixture[str]
) -> None:
    world = run_here
    bootstrap(world)
    shutil.rmtree(world / "drafter")  # the old layout of a first run stopped after its policy: no drafter,
    (world / MARKER).unlink()  # and no marker (it was written last)
    code, err = run_cli(capsys)
    assert code == 2 and "no drafter in artifacts/world; bootstrapping" in err and refused_device(err), err
    record = json.loads((world / MARKER).read_text())
    assert policy_seeds == [0, 0] and "policy_kept" not in record  # a policy nothing records is not trusted
    assert_complete(world, record)

    policy = mtimes(world / "policy")
    shutil.rmtree(world / "drafter")  # a marker naming a drafter that is not there
    code, err = run_cli(capsys)
    assert code == 2 and "holds an unfinished bootstrap" in err, err
    record = json.loads((world / MARKER).read_text())
    assert record["policy_kept"] and policy_seeds == [0, 0] and mtimes(world / "policy") == policy
    assert_complete(world, record)

    code, err = run_cli(capsys)
    assert code == 2 and "bootstrapping" not in err and refused_device(err), err  # a whole world is used as is


def test_run_finishes_a_build_interrupted_in_its_world_but_leaves_a_world_of_ones_own_alone(
    run_here: Path, tiny: str, policy_seeds: list[int], capsys: pytest.CaptureFixture[str], monkeypatch
) -> None:
    interrupted = run_here.parent / "interrupted"
    with ctrl_c_in_the_drafter_phase(monkeypatch):
        bootstrap(interrupted, seed=4, size=tiny)
    code, err = run_cli(capsys, "--world", str(interrupted))
    assert code == 2 and "holds an unfinished bootstrap" in err, err
    record = json.loads((interrupted / MARKER).read_text())
    assert (record["seed"], record["size"]) == (4, tiny) and policy_seeds == [4]  # resumed with its own settings
    assert_complete(interrupted, record)

    own = run_here.parent / "own"  # a policy of one's own, no drafter, no marker: refused, never replaced
    shutil.copytree(interrupted / "policy", own / "policy")
    code, err = run_cli(capsys, "--world", str(own), device="cpu")
    assert code == 2 and "no drafter for --sd eagle" in err and "bootstrapping" not in err, err
    assert sorted(p.name for p in own.iterdir()) == ["policy"] and policy_seeds == [4]
