"""`bootstrap` builds a loadable, deterministic tiny world and skips work it already did."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from tlt_stream.drafter.model import load_drafter
from tlt_stream.model import load_model
from tlt_stream.tasks import bootstrap as bootstrap_module
from tlt_stream.tasks.bootstrap import bootstrap
from tlt_stream.tasks.evaluate import evaluate

pytestmark = pytest.mark.slow


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


def test_bootstrap_is_deterministic_and_skips_finished_work(world: Path, tmp_path: Path) -> None:
    marker = world / "bootstrap.json"
    before = marker.stat().st_mtime_ns
    record = bootstrap(world, seed=3, size="small")
    assert marker.stat().st_mtime_ns == before and record == json.loads(marker.read_text())
    again = tmp_path / "again"
    bootstrap(again, seed=3, size="small")
    for part in ("policy", "drafter"):
        a, b = load_file(world / part / "model.safetensors"), load_file(again / part / "model.safetensors")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), f"{part} differs for one seed"


def test_a_change_in_the_drafter_settings_alone_retrains_only_the_drafter(
    world: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def tensors(path: Path) -> dict[str, torch.Tensor]:
        return load_file(path / "model.safetensors")

    old = tmp_path / "old"
    shutil.copytree(world, old)
    policy_files = {f: f.stat().st_mtime_ns for f in (old / "policy").iterdir()}
    small = bootstrap_module.SIZES["small"]
    monkeypatch.setitem(
        bootstrap_module.SIZES, "small", dataclasses.replace(small, drafter_steps=small.drafter_steps + 5)
    )
    record = bootstrap(old, seed=3, size="small")
    assert record["policy_kept"] and record["settings"]["drafter_steps"] == small.drafter_steps + 5
    assert {f: f.stat().st_mtime_ns for f in (old / "policy").iterdir()} == policy_files  # not rewritten
    assert json.loads((old / "bootstrap.json").read_text()) == record
    fresh = tmp_path / "fresh"
    bootstrap(fresh, seed=3, size="small")  # the same settings from nothing: the same drafter
    a, b = tensors(old / "drafter"), tensors(fresh / "drafter")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], v) for k, v in tensors(world / "drafter").items())

    monkeypatch.setitem(bootstrap_module.SIZES, "small", dataclasses.replace(small, sft_steps=small.sft_steps + 1))
    record = bootstrap(old, seed=3, size="small")  # a policy setting changed: everything is rebuilt
    assert "policy_kept" not in record
    assert any(not torch.equal(tensors(old / "policy")[k], v) for k, v in tensors(world / "policy").items())


def test_eval_reports_accuracy_lengths_and_acceptance(world: Path) -> None:
    report = evaluate(world / "policy", drafter=str(world / "drafter"), n=8, temperature=1.0, batch_size=8)
    assert 0.0 <= report["accuracy"] <= 1.0 and report["prompts"] == 8
    assert report["length"]["max"] >= report["length"]["p50"] > 0
    assert report["mean_accept_length"] >= 1.0
