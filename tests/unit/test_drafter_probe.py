"""The drafter with the model families users train: a bf16 policy's drafter keeps learning online, bad
weights or windows never reach drafting or training, and speculative decoding with a drafter made, trained
online and exported for a Qwen3, Llama 3, Qwen2 or Mistral policy stays lossless against transformers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import msgspec
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.families import EOS, build_family
from tlt_stream.basics.config import DEFAULTS, DrafterConfig
from tlt_stream.commands.cli import main
from tlt_stream.drafter.buffer import WindowBuffer
from tlt_stream.drafter.export import export_drafter
from tlt_stream.drafter.model import Drafter, load_drafter, read_drafter, save_drafter
from tlt_stream.drafter.online import OnlineDrafterTrainer
from tlt_stream.drafter.train import Window
from tlt_stream.model import load_model
from tlt_stream.model.loader import CheckpointError
from tlt_stream.model.transformer import Transformer
from tlt_stream.rollout.arms import Arm
from tlt_stream.rollout.engine import GenerationEngine
from tlt_stream.rollout.proposers import EagleProposer


def _config(**changes: object) -> DrafterConfig:
    """The drafter section with small batches and no warm-up (the learning rate is the default's)."""
    return msgspec.structs.replace(DEFAULTS.drafter, lr_warmup_steps=0, row_tokens=32, batch_pairs=64, **changes)


def _windows(model: Transformer, n: int, length: int, seed: int) -> list[Window]:
    """The policy's greedy continuations of random prompts with its final-norm states in bf16, as the hidden
    stream carries them (greedy: a learnable signal)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, model.spec.vocab_size, (3,), generator=g).tolist() for _ in range(n)]
    out = []
    with torch.inference_mode():
        for r in GenerationEngine(model, n, length + 4).generate(prompts, length - 3):
            tokens = r.prompt_ids + r.token_ids
            hidden = model(torch.tensor([tokens]), torch.arange(len(tokens))[None], model.new_cache(1, len(tokens)))[0]
            out.append(Window(torch.tensor(tokens), hidden.to(torch.bfloat16).clone(), len(r.prompt_ids)))
    return out


def _buffer(windows: list[Window]) -> WindowBuffer:
    buffer = WindowBuffer(recent_tokens=256, reservoir_tokens=256, max_window_tokens=16, seed=0)
    for window in windows:
        buffer.add(window, 0)
    return buffer


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("qwen2")
    build_family("qwen2", path, vocab=57, seed=1)  # a vocabulary past the tests' 41 token ids
    return path


# ------------------------------------------------------------------------------------- a bf16 policy


def test_a_bf16_policys_drafter_trains_in_float32_and_publishes_in_bf16(qwen2_dir: Path, tmp_path: Path) -> None:
    """At the default learning rate an AdamW step is below bf16's resolution for most weights: a drafter
    trained in its policy's bf16 would barely change. The trainer keeps float32 weights, publishes the
    drafter in the policy's dtype, and resumes from the float32 ones."""
    torch.set_num_threads(1)
    target = load_model(qwen2_dir, dtype=torch.bfloat16)
    torch.manual_seed(0)
    save_drafter(Drafter(target.spec), tmp_path / "start")
    windows = _windows(target, 8, 20, seed=1)
    trainer = OnlineDrafterTrainer(load_drafter(tmp_path / "start", target), _buffer(windows), _config())
    before = {k: v.float().clone() for k, v in trainer.drafter.state_dict().items()}
    losses = [trainer.train_step()["loss"] for _ in range(8)]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    moved = {k: float((v.float() != before[k]).float().mean()) for k, v in trainer.drafter.state_dict().items()}
    assert all(share > 0.9 for share in moved.values()), moved  # in bf16: a quarter of the weights, no norm gain

    state = trainer.save_state(tmp_path / "state")
    published = load_file(str(state / "drafter" / "model.safetensors"))
    assert {t.dtype for t in published.values()} == {torch.bfloat16}, "what the engine holds, for read-back"
    resumed = OnlineDrafterTrainer(load_drafter(tmp_path / "start", target), _buffer(windows), _config())
    resumed.load_state(state)
    for name, value in trainer.drafter.state_dict().items():
        assert torch.equal(resumed.drafter.state_dict()[name], value), name
    assert trainer.train_step()["loss"] == resumed.train_step()["loss"]

    # The float32 drafter drafts for the bf16 policy (mixed dtypes), and the published one too: lossless.
    prompts = [w.tokens[:4].tolist() for w in _windows(target, 3, 8, seed=5)]
    plain = [r.token_ids for r in GenerationEngine(target, 3, 40).generate(prompts, 12, eos_ids=[EOS])]
    for drafter in (trainer.drafter.eval(), load_drafter(state / "drafter", target)):
        engine = GenerationEngine(target, 3, 40, proposer=EagleProposer(drafter), arm=Arm.drafter(3, 2, 6))
        assert [r.token_ids for r in engine.generate(prompts, 12, eos_ids=[EOS])] == plain
    assert export_drafter(state, tmp_path / "export").tensors


# ------------------------------------------------------------------------------------- bad weights and windows


def test_a_drafter_with_nan_or_infinite_weights_is_refused_in_one_line(
    qwen2_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    torch.manual_seed(0)
    good = save_drafter(Drafter(load_model(qwen2_dir).spec), tmp_path / "good")
    for bad_value in (float("nan"), float("inf")):
        bad = tmp_path / f"bad-{bad_value}"
        bad.mkdir()
        (bad / "config.json").write_text((good / "config.json").read_text())
        tensors = load_file(str(good / "model.safetensors"))
        tensors["layer.mlp.down_proj.weight"][3, 1] = bad_value
        save_file(tensors, str(bad / "model.safetensors"))
        with pytest.raises(CheckpointError, match=r"down_proj\.weight holds NaN or infinite values"):
            read_drafter(bad)
        with pytest.raises(CheckpointError, match="holds NaN or infinite values"):
            load_drafter(bad, load_model(qwen2_dir))
        assert main(["export-drafter", str(bad), "--out", str(tmp_path / f"out-{bad_value}")]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("tlt-stream export-drafter: ") and "NaN or infinite" in err and "\n" not in err
        assert not (tmp_path / f"out-{bad_value}").exists()
    read_drafter(good)


def _tiny_target() -> Transformer:
    from tlt_stream.model.spec import ModelSpec

    torch.manual_seed(0)
    model = Transformer(ModelSpec("qwen2", 37, 24, 48, 1, 3, 1, 8))
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return model.eval().requires_grad_(False)


def test_a_window_with_non_finite_states_is_left_out_of_the_buffer() -> None:
    target = _tiny_target()
    tokens = torch.arange(1, 11)
    with torch.inference_mode():
        hidden = target(tokens[None], torch.arange(10)[None], target.new_cache(1, 10))[0].clone()
    buffer = WindowBuffer(recent_tokens=64, reservoir_tokens=64, max_window_tokens=16)
    for bad in (float("nan"), float("inf")):
        poisoned = hidden.clone()
        poisoned[4, 2] = bad
        buffer.add(Window(tokens, poisoned.to(torch.bfloat16)), 0)
    assert len(buffer) == 0
    buffer.add(Window(tokens, hidden.to(torch.bfloat16)), 0)
    assert len(buffer) == 1


def test_a_step_with_a_non_finite_loss_is_skipped_and_the_drafter_stays_finite() -> None:
    target = _tiny_target()
    tokens = torch.arange(1, 11)
    huge = torch.full((10, 24), 3.0e38)  # finite, but every sum over it overflows
    buffer = WindowBuffer(recent_tokens=64, reservoir_tokens=64, max_window_tokens=16)
    buffer.add(Window(tokens, huge), 0)
    torch.manual_seed(0)
    trainer = OnlineDrafterTrainer(Drafter(target.spec).bind(target), buffer, _config())
    before = {k: v.clone() for k, v in trainer.drafter.state_dict().items()}
    stats = trainer.train_step()
    assert stats is not None and stats["skipped"] == 1.0 and not math.isfinite(stats["grad_norm"] * stats["loss"])
    assert trainer.step_count == 0 and not trainer.optimizer.state
    assert all(torch.equal(v, before[k]) for k, v in trainer.drafter.state_dict().items())
    result = trainer.train_slice(max_steps=2)
    assert result.steps == 2 and result.loss is None


# ------------------------------------------------------------------------------------- families, end to end


def _hf_greedy(hf: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, eos_token_id=EOS, pad_token_id=EOS
    )[0, len(prompt) :].tolist()
    return out[: out.index(EOS) + 1] if EOS in out else out


def _from_eagle(export: Path, drafter: Drafter) -> dict[str, torch.Tensor]:
    """The exported vLLM names back into the drafter's own (the inverse of the export's table)."""
    t = load_file(str(export / "model.safetensors"))
    p = "layers.0."
    state = {
        "fc.weight": t["fc.weight"],
        "layer.post_attention_layernorm.weight": t[p + "post_attention_layernorm.weight"],
        "layer.self_attn.o_proj.weight": t[p + "self_attn.o_proj.weight"],
        "layer.mlp.down_proj.weight": t[p + "mlp.down_proj.weight"],
        "layer.self_attn.qkv_proj.weight": torch.cat([t[p + f"self_attn.{x}_proj.weight"] for x in "qkv"]),
        "layer.mlp.gate_up_proj.weight": torch.cat([t[p + "mlp.gate_proj.weight"], t[p + "mlp.up_proj.weight"]]),
    }
    if drafter.spec.qkv_bias:
        state["layer.self_attn.qkv_proj.bias"] = torch.cat([t[p + f"self_attn.{x}_proj.bias"] for x in "qkv"])
    assert set(state) == set(drafter.state_dict())
    return state


@pytest.mark.parametrize("family", ["qwen3", "llama3", "qwen2", "mistral"])
def test_greedy_decoding_stays_transformers_own_through_training_and_export(family: str, tmp_path: Path) -> None:
    torch.set_num_threads(1)
    hf = build_family(family, tmp_path / "policy", vocab=57, seed=2)
    target = load_model(tmp_path / "policy")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 41, (n,), generator=g).tolist() for n in (5, 1, 8)]
    reference = [_hf_greedy(hf, p, 16) for p in prompts]

    torch.manual_seed(0)
    save_drafter(Drafter(target.spec), tmp_path / "start")
    drafter = load_drafter(tmp_path / "start", target)
    trainer = OnlineDrafterTrainer(drafter, _buffer(_windows(target, 6, 16, seed=4)), _config())
    trainer.train_slice(max_steps=3)
    state = trainer.save_state(tmp_path / "state")
    export = export_drafter(state, tmp_path / "export").path
    config = json.loads((export / "config.json").read_text())
    assert (config["hidden_size"], config["vocab_size"], config["head_dim"]) == (64, 57, target.spec.head_dim)
    assert config["rope_parameters"]["rope_type"] == target.spec.rope_type

    back = Drafter(drafter.spec)
    back.load_state_dict(_from_eagle(export, back))
    engine = GenerationEngine(target, 3, 40, proposer=EagleProposer(load_drafter(state / "drafter", target)))
    for arm, proposer in ((Arm.drafter(4, 1, 4), None), (Arm.drafter(3, 3, 9), EagleProposer(back.bind(target)))):
        if proposer is not None:
            engine = GenerationEngine(target, 3, 40, proposer=proposer)
        engine.arm = arm
        assert [r.token_ids for r in engine.generate(prompts, 16, eos_ids=[EOS])] == reference


def test_a_drafter_of_another_layout_is_refused_at_the_swap_and_the_current_one_keeps_drafting(
    qwen2_dir: Path, tmp_path: Path
) -> None:
    """A drafter for the same policy (hidden size and vocabulary) but of another width raised torch's
    multi-line size-mismatch RuntimeError from the engine's swap, which the worker's swap does not catch."""
    import dataclasses

    torch.set_num_threads(1)
    target = load_model(qwen2_dir)
    torch.manual_seed(0)
    save_drafter(Drafter(target.spec), tmp_path / "current")
    wider = dataclasses.replace(target.spec, intermediate_size=target.spec.intermediate_size * 2)
    save_drafter(Drafter(wider), tmp_path / "wider")
    engine = GenerationEngine(target, 2, 40, proposer=EagleProposer(load_drafter(tmp_path / "current", target)))
    before = {k: v.clone() for k, v in engine.proposer.drafter.state_dict().items()}  # type: ignore[union-attr]

    with pytest.raises(CheckpointError) as refused:
        engine.load_drafter(tmp_path / "wider")
    assert "\n" not in str(refused.value) and "layout" in str(refused.value)
    after = engine.proposer.drafter.state_dict()  # type: ignore[union-attr]
    assert all(torch.equal(before[k], after[k]) for k in before)
    engine.load_drafter(tmp_path / "current")  # a drafter of its own layout still swaps in
