"""Learner checkpoints: exact round trips, policy hashing, crash safety at the rename and the pointer, pruning."""

from __future__ import annotations

import copy
import os
import random
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from tlt_stream.model import load_model
from tlt_stream.rl.checkpoint import latest_checkpoint, restore_checkpoint, save_checkpoint
from tlt_stream.store.digest import ChecksumMismatch, directory_sha256, verify_directory
from tlt_stream.tasks.tokenizer import build_tokenizer

VOCAB = 32


class SimulatedCrash(BaseException):
    """Stands for SIGKILL: not an Exception, so no cleanup handler runs."""


def make_model(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
        initializer_range=0.5,
    )
    return LlamaForCausalLM(config)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    ids = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(seed))  # [B, T]
    optimizer.zero_grad()
    model(ids, labels=ids).loss.backward()
    optimizer.step()


def trained(seed: int = 0) -> tuple[LlamaForCausalLM, torch.optim.Optimizer]:
    model = make_model(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_step(model, optimizer, seed=100)
    return model, optimizer


def save(root: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, **kwargs):
    return save_checkpoint(root, step=step, model=model, optimizer=optimizer, ledger=[f"s{step}"], **kwargs)


def test_round_trip_restores_weights_optimizer_rng_ledger_and_loads_everywhere(tmp_path: Path) -> None:
    model, optimizer = trained()
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    opt_state = copy.deepcopy(optimizer.state_dict())
    torch.manual_seed(7)
    random.seed(7)
    extra = {"policy_version": 3, "lr": 0.01}
    info = save_checkpoint(
        tmp_path,
        step=1,
        model=model,
        optimizer=optimizer,
        ledger=["b", "a", "a"],
        extra=extra,
        tokenizer=build_tokenizer(),
    )
    next_torch, next_python = torch.rand(4), random.random()
    train_step(model, optimizer, seed=101)
    after_step = {k: v.detach().clone() for k, v in model.state_dict().items()}
    torch.rand(3), random.random()

    fresh = make_model(seed=5)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    assert latest_checkpoint(tmp_path) == info
    ledger, meta = restore_checkpoint(info, model=fresh, optimizer=fresh_opt)
    assert ledger == {"a", "b"} and meta["extra"] == extra and meta["step"] == 1
    assert (info.path / "ledger.json").read_text() == '["a", "b"]'
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in weights.items())
    assert fresh.lm_head.weight is fresh.model.embed_tokens.weight
    restored = fresh_opt.state_dict()
    assert restored["param_groups"] == opt_state["param_groups"]
    for idx, state in opt_state["state"].items():
        assert all(torch.equal(restored["state"][idx][name], t) for name, t in state.items())
    assert torch.equal(torch.rand(4), next_torch) and random.random() == next_python

    assert (info.policy_dir / "tokenizer.json").is_file()
    ids = torch.tensor([[1, 5, 9, 30, 2]])  # [1, T]
    hf = AutoModelForCausalLM.from_pretrained(info.policy_dir).eval()
    runtime = load_model(info.policy_dir)
    with torch.no_grad():
        expected = fresh(ids).logits[0]  # [T, V]
        hidden = runtime(ids, torch.arange(ids.shape[1]).unsqueeze(0), runtime.new_cache(1, 8))  # [1, T, H]
        torch.testing.assert_close(hf(ids).logits[0], expected, atol=1e-5, rtol=0)
        torch.testing.assert_close(runtime.logits(hidden)[0], expected, atol=1e-5, rtol=0)

    train_step(fresh, fresh_opt, seed=101)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in after_step.items())


def test_policy_sha256_is_stable_and_catches_one_flipped_byte(tmp_path: Path) -> None:
    model, optimizer = trained()
    a = save(tmp_path / "a", 1, model, optimizer)
    b = save(tmp_path / "b", 5, model, optimizer)
    assert a.digest == "v2" and a.policy_sha256 == b.policy_sha256 == directory_sha256(b.policy_dir, scheme="v2")
    verify_directory(a.policy_dir, a.policy_sha256.upper(), scheme="v2")

    weights = b.policy_dir / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01
    weights.write_bytes(bytes(data))
    assert directory_sha256(b.policy_dir, scheme="v2") != b.policy_sha256
    with pytest.raises(ChecksumMismatch, match=str(b.policy_dir)) as err:
        verify_directory(b.policy_dir, b.policy_sha256, scheme="v2")
    assert "\n" not in str(err.value) and b.policy_sha256[:12] in str(err.value)
    with pytest.raises(ChecksumMismatch):
        restore_checkpoint(b, model=make_model(seed=1))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        verify_directory(tmp_path / "nowhere", a.policy_sha256)


def test_policy_sha256_ignores_mtime_and_location_but_not_name_content_boundaries(tmp_path: Path) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    (one / "sub").mkdir(parents=True)
    (one / "a").write_bytes(b"bc")
    (one / "sub" / "x").write_bytes(b"")
    digest = directory_sha256(one)
    os.utime(one / "a", (0, 0))
    assert directory_sha256(shutil.move(one, tmp_path / "elsewhere")) == digest
    (two / "sub").mkdir(parents=True)
    (two / "ab").write_bytes(b"c")
    (two / "sub" / "x").write_bytes(b"")
    assert directory_sha256(two) != digest


def test_crash_before_rename_keeps_previous_and_clean_removes_leftover(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, optimizer = trained()
    first = save(tmp_path, 1, model, optimizer)

    def crash(*args: object) -> None:
        raise SimulatedCrash

    monkeypatch.setattr(os, "rename", crash)
    with pytest.raises(SimulatedCrash):
        save(tmp_path, 2, model, optimizer)
    monkeypatch.undo()
    leftovers = list(tmp_path.glob(".tmp-*"))
    assert len(leftovers) == 1 and (leftovers[0] / "meta.json").is_file()
    assert (tmp_path / "LATEST").read_text().strip() == "step-00000001"
    assert latest_checkpoint(tmp_path) == first
    assert latest_checkpoint(tmp_path, clean=True) == first
    assert not list(tmp_path.glob(".tmp-*"))
    assert save(tmp_path, 2, model, optimizer).step == 2


def test_crash_between_rename_and_pointer_keeps_previous_then_resaves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, optimizer = trained()
    first = save(tmp_path, 1, model, optimizer)

    def crash(*args: object) -> None:
        raise SimulatedCrash

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(SimulatedCrash):
        save(tmp_path, 2, model, optimizer)
    monkeypatch.undo()
    assert (tmp_path / "step-00000002" / "meta.json").is_file()
    assert latest_checkpoint(tmp_path, clean=True) == first
    assert not list(tmp_path.glob(".tmp-*"))
    second = save(tmp_path, 2, model, optimizer)
    assert latest_checkpoint(tmp_path) == second


def test_fallback_when_pointer_is_broken_and_incomplete_dirs_are_ignored(tmp_path: Path) -> None:
    model, optimizer = trained()
    first = save(tmp_path, 1, model, optimizer)
    second = save(tmp_path, 2, model, optimizer)
    shutil.rmtree(second.path)
    assert latest_checkpoint(tmp_path) == first
    incomplete = tmp_path / "step-00000009"
    shutil.copytree(first.path, incomplete)
    (incomplete / "meta.json").unlink()
    (tmp_path / "LATEST").write_text("step-00000009\n")
    assert latest_checkpoint(tmp_path) == first
    (tmp_path / "LATEST").write_text("../../etc\n")
    assert latest_checkpoint(tmp_path) == first
    (tmp_path / "LATEST").unlink()
    assert latest_checkpoint(tmp_path) == first


def test_pruning_and_refusals(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path) is None
    assert latest_checkpoint(tmp_path / "missing") is None
    model, optimizer = trained()
    for step in (1, 2, 3, 5):
        info = save(tmp_path, step, model, optimizer, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["LATEST", "step-00000003", "step-00000005"]
    assert latest_checkpoint(tmp_path) == info
    with pytest.raises(ValueError, match="already exists"):
        save(tmp_path, 5, model, optimizer)
    with pytest.raises(ValueError, match="lower than"):
        save(tmp_path, 4, model, optimizer)
    with pytest.raises(ValueError, match="keep"):
        save(tmp_path, 6, model, optimizer, keep=0)
    with pytest.raises(ValueError, match="JSON"):
        save(tmp_path, 6, model, optimizer, extra={"bad": object()})
    assert not list(tmp_path.glob(".tmp-*"))


def test_restore_refuses_weights_that_do_not_fit_the_model(tmp_path: Path) -> None:
    model, optimizer = trained()
    info = save(tmp_path, 1, model, optimizer)
    untied = make_model(seed=1)
    untied.config.tie_word_embeddings = False
    untied.lm_head.weight = torch.nn.Parameter(untied.lm_head.weight.detach().clone())
    with pytest.raises(ValueError, match=r"missing \['lm_head.weight'\]"):
        restore_checkpoint(info, model=untied, restore_rng=False)


def test_restore_refuses_optimizer_state_from_different_parameter_groups(tmp_path: Path) -> None:
    from tlt_stream.basics.errors import CheckpointError
    from tlt_stream.rl.learner import LearnerCore, LearnerSettings

    model, optimizer = trained()
    info = save(tmp_path, 1, model, optimizer)  # one parameter group
    core = LearnerCore(make_model(seed=0), LearnerSettings(final_norm_lr_scale=10.0))  # two
    with pytest.raises(CheckpointError, match=r"does not fit this learner.*final_norm_lr_scale"):
        restore_checkpoint(info, optimizer=core.optimizer, restore_rng=False)


def test_a_policy_directory_that_vanishes_while_hashed_is_missing_not_mismatched(tmp_path) -> None:
    """A worker hashing a directory the learner prunes at that moment read it as empty and refused the version
    for good as a checksum mismatch; missing is retried."""
    from unittest import mock

    import pytest

    from tlt_stream.store.digest import directory_sha256

    policy = tmp_path / "policy"
    policy.mkdir()
    (policy / "model.safetensors").write_bytes(b"x")
    real_walk = os.walk

    def walk_after_prune(root, **kwargs):  # the directory goes between is_dir() and the walk
        os.rename(policy, tmp_path / "pruned")
        return real_walk(root, **kwargs)

    with mock.patch("tlt_stream.rl.checkpoint.os.walk", walk_after_prune), pytest.raises(FileNotFoundError):
        directory_sha256(policy)


def test_a_policy_published_in_bf16_keeps_fp32_masters_beside_it_that_training_resumes_from(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    model, optimizer = trained()
    info = save(tmp_path, 1, model, optimizer, tokenizer=build_tokenizer(), publish_dtype=torch.bfloat16)
    published = load_file(info.policy_dir / "model.safetensors")
    assert {t.dtype for t in published.values()} == {torch.bfloat16}, "workers load the rollout's dtype"
    assert "lm_head.weight" not in published, "tied weights stay tied: written once"
    own = model.state_dict()
    for name, tensor in published.items():
        assert torch.equal(tensor, own[name].to(torch.bfloat16))
    assert info.master_sha256 is not None and latest_checkpoint(tmp_path) == info
    load_model(info.policy_dir)  # the rollout engine reads it (cast to its own dtype)

    fresh, fresh_opt = make_model(seed=9), None
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    restore_checkpoint(info, model=fresh, optimizer=fresh_opt)
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert a.dtype == b.dtype == torch.float32 and torch.equal(a, b), f"{name}: exact fp32 masters, not bf16"

    (info.master_dir / "model.safetensors").write_bytes(b"x" * 64)
    with pytest.raises(ChecksumMismatch):
        restore_checkpoint(info, model=fresh)


def test_a_policy_in_its_own_dtype_has_no_master_copy(tmp_path: Path) -> None:
    model, optimizer = trained()
    info = save(tmp_path, 1, model, optimizer, publish_dtype=torch.float32)
    assert info.master_sha256 is None and info.master_dir == info.policy_dir
    assert not (info.path / "master").exists()
