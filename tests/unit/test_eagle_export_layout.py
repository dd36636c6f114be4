"""The EAGLE export a vLLM engine starts with is checked against its own config.json before vLLM starts
(`drafter.export.check_eagle_export`, run by `rollout.vllm.prestart.check_drafter_fits`): vLLM's EAGLE loader
skips an unexpected tensor and leaves a missing one as initialised, so an export whose tensors are not the ones
its config implies would draft with wrong weights without a word. Our own exports pass, with and without the
policy embedding; a stray bias, fused q/k/v names, a missing tensor, a wrong shape, an edited config and a config
that is no Llama EAGLE draft's are refused in one line naming the export. The checks read each file of the export
once, and what they read gives the layout the engine holds drafter swaps to."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.families import tiny_spec
from tlt_stream.basics.errors import CheckpointError
from tlt_stream.drafter import model as drafter_model
from tlt_stream.drafter.export import check_eagle_export, eagle_config_spec, eagle_layout, export_drafter
from tlt_stream.drafter.model import Drafter, save_drafter, tensor_shapes
from tlt_stream.model.spec import ModelSpec
from tlt_stream.rollout.vllm.extension import drafter_swap_layout, drafter_swap_shapes
from tlt_stream.rollout.vllm.prestart import check_drafter_fits

BASE = tiny_spec()  # head_dim 12 != hidden / heads: the config must carry it
SPECS = {
    "gqa-explicit-head-dim": BASE,
    "mha-derived-head-dim": dataclasses.replace(BASE, num_kv_heads=4, head_dim=8),
    "attention-bias": dataclasses.replace(BASE, qkv_bias=True, o_bias=True),
    "qkv-bias-only": dataclasses.replace(BASE, architecture="qwen2", qkv_bias=True),
    "o-bias-only": dataclasses.replace(BASE, o_bias=True),
    "mlp-bias": dataclasses.replace(BASE, mlp_bias=True),
    "all-biases": dataclasses.replace(BASE, qkv_bias=True, o_bias=True, mlp_bias=True),
}


@pytest.fixture(scope="module")
def policy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Hugging Face Llama policy of the drafters' hidden size and vocabulary (its embedding is what
    `export_drafter(policy=...)` writes)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("policy")
    config = LlamaConfig(
        vocab_size=BASE.vocab_size,
        hidden_size=BASE.hidden_size,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    LlamaForCausalLM(config).save_pretrained(out)
    return out


def export(tmp_path: Path, spec: ModelSpec = BASE, *, policy: Path | None = None, name: str = "eagle") -> Path:
    torch.manual_seed(0)
    save_drafter(Drafter(spec), tmp_path / f"{name}-drafter")
    return export_drafter(tmp_path / f"{name}-drafter", tmp_path / name, policy=policy).path


def rewrite(directory: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> None:
    """Change the export's tensors in place (a hand-made export)."""
    tensors = load_file(str(directory / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})


def edit_config(directory: Path, **changes: object) -> None:
    config = json.loads((directory / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (directory / "config.json").write_text(json.dumps(config))


def refusal(directory: Path, policy: Path) -> str:
    """The one-line refusal of the pre-start checks for the export at `directory`."""
    with pytest.raises(CheckpointError) as exc:
        check_drafter_fits(directory, policy, None)
    message = str(exc.value)
    assert "\n" not in message and str(directory) in message, message
    return message


# ------------------------------------------------------------------------------------------- our exports pass


@pytest.mark.parametrize("variant", sorted(SPECS))
@pytest.mark.parametrize("with_embedding", [False, True], ids=["no-embedding", "policy-embedding"])
def test_our_exports_hold_exactly_what_their_config_implies(
    tmp_path: Path, policy: Path, variant: str, with_embedding: bool
) -> None:
    spec = SPECS[variant]
    out = export(tmp_path, spec, policy=policy if with_embedding else None)
    config = json.loads((out / "config.json").read_text())
    found = tensor_shapes([out / "model.safetensors"])
    assert eagle_layout(config, with_embedding=with_embedding) == found
    assert ("embed_tokens.weight" in found) == with_embedding
    assert check_eagle_export(out) == found
    check_drafter_fits(out, policy, None)  # what VllmEngine runs before vLLM starts
    read = eagle_config_spec(config)
    assert (read.qkv_bias, read.o_bias, read.mlp_bias) == (spec.qkv_bias, spec.o_bias, spec.mlp_bias)
    assert (read.num_kv_heads, read.head_dim) == (spec.num_kv_heads, spec.head_dim)


def test_the_layout_is_vllms_reading_of_the_config() -> None:
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 1,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
    }
    layout = eagle_layout(config)  # a Llama-3-8B drafter's sizes: nothing is allocated
    assert layout["fc.weight"] == (4096, 8192)
    assert layout["layers.0.self_attn.k_proj.weight"] == (8 * 128, 4096)  # head_dim: hidden / heads
    assert layout["layers.0.mlp.gate_proj.weight"] == (14336, 4096)
    assert not any(name.endswith(".bias") or "input_layernorm" in name for name in layout)
    mha = eagle_layout({**config, "num_key_value_heads": None})  # absent or null: as many KV heads as heads
    assert mha["layers.0.self_attn.v_proj.weight"] == (4096, 4096)
    assert eagle_layout(config, with_embedding=True)["embed_tokens.weight"] == (128256, 4096)

    def biases(**flags: object) -> set[str]:
        return {n.removeprefix("layers.0.") for n in eagle_layout({**config, **flags}) if n.endswith(".bias")}

    qkv = {"self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"}
    assert biases(attention_bias=True) == {*qkv, "self_attn.o_proj.bias"}
    assert biases(bias=True) == {*qkv, "self_attn.o_proj.bias"}  # InternLM's key, read by vLLM's Llama too
    assert biases(attention_bias=True, qkv_bias=False) == {"self_attn.o_proj.bias"}  # qkv_bias overrides q/k/v
    assert biases(qkv_bias=True) == qkv
    assert biases(mlp_bias=True) == {"mlp.gate_proj.bias", "mlp.up_proj.bias", "mlp.down_proj.bias"}
    two = eagle_layout({**config, "num_hidden_layers": 2, "architectures": ["EagleLlamaForCausalLM"]})
    assert "layers.0.input_layernorm.weight" not in two  # vLLM drops the input norm of layer 0 only
    assert two["layers.1.input_layernorm.weight"] == (4096,)
    assert two["layers.1.self_attn.o_proj.weight"] == layout["layers.0.self_attn.o_proj.weight"]


def test_a_two_layer_export_passes_and_a_config_saying_two_over_one_layer_is_refused(
    tmp_path: Path, policy: Path
) -> None:
    out = export(tmp_path)

    def second_layer(tensors: dict[str, torch.Tensor]) -> None:
        for name in [n for n in tensors if n.startswith("layers.0.")]:
            tensors[name.replace("layers.0.", "layers.1.")] = tensors[name].clone()
        tensors["layers.1.input_layernorm.weight"] = torch.ones(BASE.hidden_size)

    edit_config(out, num_hidden_layers=2)
    assert "missing ['layers.1." in refusal(out, policy)  # vLLM would build a second, uninitialised layer
    rewrite(out, second_layer)
    check_drafter_fits(out, policy, None)


def test_the_start_checks_read_each_file_of_the_export_once(
    tmp_path: Path, policy: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What `VllmEngine` runs on its export before vLLM starts: `check_drafter_fits`, then the swap layout from
    the layout it returns. Every open of a file (`Path.open`, under `read_text`/`read_bytes`) and of a safetensors
    header (`safe_open`, under `tensor_shapes`) is counted."""
    out = export(tmp_path, policy=policy)
    opened: Counter[str] = Counter()
    open_path, open_header = Path.open, drafter_model.safe_open

    def counted_path(self: Path, *args: object, **kwargs: object):
        opened[str(self)] += 1
        return open_path(self, *args, **kwargs)

    def counted_header(file: str, *args: object, **kwargs: object):
        opened[str(file)] += 1
        return open_header(file, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(Path, "open", counted_path)
        patch.setattr(drafter_model, "safe_open", counted_header)
        swap = drafter_swap_layout(check_drafter_fits(out, policy, None))
    assert opened[str(out / "config.json")] == 1
    assert opened[str(out / "model.safetensors")] == 1
    assert opened[str(policy / "config.json")] == 1
    assert swap == drafter_swap_shapes(out)  # what a swap is checked against, read from the files themselves
    assert "embed_tokens.weight" not in swap and "fc.weight" in swap


# ------------------------------------------------------------------------------------------------ refusals


def test_an_unexpected_bias_is_refused(tmp_path: Path, policy: Path) -> None:
    out = export(tmp_path)  # no biases in its config
    rewrite(out, lambda t: t.__setitem__("layers.0.self_attn.o_proj.bias", torch.zeros(BASE.hidden_size)))
    message = refusal(out, policy)
    assert "unexpected ['layers.0.self_attn.o_proj.bias']" in message and "missing []" in message


def test_fused_qkv_names_are_refused(tmp_path: Path, policy: Path) -> None:
    out = export(tmp_path)

    def fuse(tensors: dict[str, torch.Tensor]) -> None:
        parts = [tensors.pop(f"layers.0.self_attn.{x}_proj.weight") for x in "qkv"]
        tensors["layers.0.self_attn.qkv_proj.weight"] = torch.cat(parts)

    rewrite(out, fuse)
    message = refusal(out, policy)
    assert "unexpected ['layers.0.self_attn.qkv_proj.weight']" in message
    assert "'layers.0.self_attn.q_proj.weight'" in message


def test_a_missing_o_proj_is_refused(tmp_path: Path, policy: Path) -> None:
    out = export(tmp_path)
    rewrite(out, lambda t: t.pop("layers.0.self_attn.o_proj.weight"))
    assert "missing ['layers.0.self_attn.o_proj.weight'], unexpected []" in refusal(out, policy)


def test_a_tensor_of_the_wrong_shape_is_refused(tmp_path: Path, policy: Path) -> None:
    out = export(tmp_path)
    wrong = "layers.0.self_attn.k_proj.weight"
    rewrite(out, lambda t: t.__setitem__(wrong, torch.zeros(BASE.num_heads * BASE.head_dim, BASE.hidden_size)))
    message = refusal(out, policy)
    assert f"{wrong} has shape (48, 32), expected (24, 32)" in message


def test_an_embedding_of_another_vocabulary_is_refused(tmp_path: Path, policy: Path) -> None:
    out = export(tmp_path, policy=policy)
    rewrite(out, lambda t: t.__setitem__("embed_tokens.weight", torch.zeros(BASE.vocab_size + 1, BASE.hidden_size)))
    assert "embed_tokens.weight has shape (51, 32), expected (50, 32)" in refusal(out, policy)


def test_a_config_edited_to_another_intermediate_size_is_refused(tmp_path: Path, policy: Path) -> None:
    out = export(tmp_path)
    edit_config(out, intermediate_size=64)
    message = refusal(out, policy)
    assert "mlp." in message and "expected (" in message and "64" in message


@pytest.mark.parametrize(
    ("changes", "why"),
    [
        ({"architectures": ["Eagle3LlamaForCausalLM"]}, "architectures ['Eagle3LlamaForCausalLM']"),
        ({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}, "architectures ['Qwen2ForCausalLM']"),
        ({"architectures": None}, "architectures None"),
        ({"model_type": "eagle"}, "model_type 'eagle'"),
        ({"hidden_size": None}, "hidden_size missing"),
        ({"num_hidden_layers": 1.5}, "num_hidden_layers 1.5 is not a positive integer"),
        ({"intermediate_size": True}, "intermediate_size True is not a positive integer"),
        ({"num_key_value_heads": 3}, "multiple of num_kv_heads"),
        ({"head_dim": 0}, "head_dim 0 is not a positive integer"),
        ({"mlp_bias": "yes"}, "mlp_bias 'yes' is not true or false"),
    ],
)
def test_a_config_that_is_no_llama_eagle_drafts_is_refused_in_one_line(
    tmp_path: Path, policy: Path, changes: dict, why: str
) -> None:
    out = export(tmp_path)
    edit_config(out, **changes)
    message = refusal(out, policy)
    assert "is not an EAGLE-1 Llama draft config" in message and why in message


@pytest.mark.parametrize("text", ["[1, 2]", "{not json", ""])
def test_an_unreadable_or_foreign_config_json_is_refused_in_one_line(tmp_path: Path, text: str) -> None:
    out = export(tmp_path)
    (out / "config.json").write_text(text)
    with pytest.raises(CheckpointError) as exc:
        check_eagle_export(out)
    assert "\n" not in str(exc.value) and str(out) in str(exc.value)


def test_an_unreadable_policy_config_is_refused_naming_the_policy(tmp_path: Path, policy: Path) -> None:
    out = export(tmp_path)
    broken = tmp_path / "policy"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError) as exc:
        check_drafter_fits(out, broken, None)
    message = str(exc.value)
    assert "\n" not in message and message.startswith(f"{broken}: unreadable policy config"), message


def test_a_config_without_head_dim_or_kv_heads_reads_vllms_defaults(tmp_path: Path, policy: Path) -> None:
    out = export(tmp_path, SPECS["mha-derived-head-dim"])  # 4 heads of 32 / 4 = 8, no GQA
    edit_config(out, head_dim=None, num_key_value_heads=None)
    check_drafter_fits(out, policy, None)
    out = export(tmp_path, BASE, name="gqa")  # heads of 12 and 2 KV heads: not what the defaults give
    edit_config(out, head_dim=None)
    assert "layers.0.self_attn." in refusal(out, policy)
