"""The tiny world shipped with the package is the one the bootstrap recipe builds on its defaults, matches its
manifest byte for byte, loads, and is what a default bootstrap installs (without training); a damaged copy is
refused and `--rebuild` trains."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tlt_stream.drafter.model import load_drafter
from tlt_stream.model import load_model
from tlt_stream.tasks import bootstrap as bootstrap_module
from tlt_stream.tasks import shipped
from tlt_stream.tasks.bootstrap import bootstrap, request, ships

ROOT = Path(__file__).resolve().parents[2]


class Trained(Exception):
    """Raised by a stand-in for the policy's training: the bootstrap took the training path."""


@pytest.fixture
def no_training(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise Trained

    monkeypatch.setattr(bootstrap_module, "train_policy", refuse)
    monkeypatch.setattr(bootstrap_module, "drafter_windows", refuse)


def test_the_shipped_world_is_the_default_recipes_and_matches_its_manifest() -> None:
    record = json.loads((shipped.SHIPPED / "bootstrap.json").read_text())
    assert {k: record[k] for k in ("version", "seed", "size", "settings")} == request(0, "default")
    assert ships(0, "default") and not ships(1, "default") and not ships(0, "small")
    manifest = json.loads((shipped.SHIPPED / shipped.MANIFEST).read_text())["files"]
    assert {"policy/config.json", "drafter/config.json"} <= manifest.keys()
    assert all(len(entry["sha256"]) == 64 for entry in manifest.values())
    assert shipped.check() == []


def test_the_shipped_policy_and_drafter_load_in_transformers_and_the_runtime_alike() -> None:
    hf = AutoModelForCausalLM.from_pretrained(shipped.SHIPPED / "policy").eval()
    ours = load_model(shipped.SHIPPED / "policy")
    ids = list(range(3, 40))
    with torch.inference_mode():
        expected = hf(torch.tensor([ids])).logits[0]
        got = ours.logits(ours(torch.tensor([ids]), torch.arange(len(ids))[None], ours.new_cache(1, len(ids))))[0]
    assert torch.allclose(got, expected, atol=1e-4)
    assert load_drafter(shipped.SHIPPED / "drafter", ours).bound


def test_a_default_bootstrap_installs_the_shipped_world_without_training(tmp_path: Path, no_training: None) -> None:
    world = tmp_path / "world"
    record = bootstrap(world, seed=0, size="default")
    assert record["shipped"] is True and json.loads((world / "bootstrap.json").read_text()) == record
    assert shipped.digests(world) == shipped.digests(shipped.SHIPPED)
    assert not (world / bootstrap_module.STAGING).exists()
    assert bootstrap(world, seed=0, size="default") == record  # found, as a trained world is


def test_rebuild_and_other_seeds_train(tmp_path: Path, no_training: None) -> None:
    with pytest.raises(Trained):
        bootstrap(tmp_path / "a", seed=0, size="default", rebuild=True)
    bootstrap(tmp_path / "copied", seed=0, size="default")
    with pytest.raises(Trained):  # a world that is a copy of the shipped one is trained anew, not found
        bootstrap(tmp_path / "copied", seed=0, size="default", rebuild=True)
    with pytest.raises(Trained):
        bootstrap(tmp_path / "b", seed=5, size="default")


@pytest.mark.parametrize("damage", ["changed", "missing", "extra"])
def test_a_damaged_shipped_world_is_found_and_refused(tmp_path: Path, damage: str) -> None:
    copy = tmp_path / "shipped"
    shutil.copytree(shipped.SHIPPED, copy)
    weights = next((copy / "policy").glob("*.safetensors"))
    if damage == "changed":
        data = bytearray(weights.read_bytes())
        data[-1] ^= 1
        weights.write_bytes(bytes(data))
    elif damage == "missing":
        weights.unlink()
    else:
        (copy / "drafter" / "notes.txt").write_text("x")
    problems = shipped.check(copy)
    expected = {"changed": "changed", "missing": "missing", "extra": "not in the manifest"}[damage]
    assert len(problems) == 1 and problems[0].endswith(expected), problems
    with pytest.raises(ValueError, match="damaged"):
        shipped.copy_into(tmp_path / "stage", copy)


@pytest.mark.slow
def test_the_wheel_carries_the_shipped_world(tmp_path: Path) -> None:
    wheel = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path)]
    subprocess.run([*wheel, str(ROOT)], check=True, capture_output=True)
    (wheel,) = tmp_path.glob("tlt_stream-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    manifest = json.loads((shipped.SHIPPED / shipped.MANIFEST).read_text())["files"]
    wanted = {f"tlt_stream/tasks/world/{name}" for name in manifest} | {
        "tlt_stream/tasks/world/bootstrap.json",
        "tlt_stream/tasks/world/shipped.json",
    }
    assert wanted <= names, sorted(wanted - names)
