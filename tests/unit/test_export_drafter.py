"""`export-drafter --format eagle`: the exported files, read the way vLLM reads them and run through a
re-implementation of vLLM's EAGLE-1 forward, give this project's drafter's logits and greedy drafts.

The reference below is written from vLLM 0.33.0 (wheel vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl,
`vllm/_version.py` commit id g4ba787ec9; the 0.10-era llama_eagle.py at vllm-project/vllm
00da92319af4b2ad2cde8525b7b609c779bdc52f computes the same), not copied from it:
- loading: vllm/model_executor/models/llama_eagle.py `EagleLlamaForCausalLM.load_weights` (prefix `model.`
  unless `lm_head`), `LlamaModel.hf_to_vllm_mapper` (q/k/v -> qkv_proj, gate/up -> gate_up_proj),
  vllm/model_executor/models/utils.py `AutoWeightsLoader` (an unknown name raises, an unexpected `.bias` is
  silently skipped); embedding and LM head shared from the target (vllm/v1/spec_decode/llm_base_proposer.py
  `_maybe_share_embeddings`, `_maybe_share_lm_head`);
- forward: llama_eagle.py `LlamaModel.forward` (fc over `cat(input_embeds, hidden_states)`, layer 0 without
  input norm, `hidden_states + residual`, no final norm); vllm/model_executor/models/llama.py
  `LlamaDecoderLayer`/`LlamaAttention`/`LlamaMLP` (bias flags from `attention_bias`, `qkv_bias`,
  `mlp_bias`); vllm/ir/ops/layernorm.py `fused_add_rms_norm`; rotary_embedding/base.py + common.py (neox);
- positions: llm_base_proposer.py `set_inputs_first_pass` (input ids shifted left by one, positions kept:
  the pair (x_{t+1}, f_t) at position t) and `propose` (the draft's own output fed back, position + 1).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from tests.families import tiny_spec
from tlt_stream.commands.cli import main
from tlt_stream.drafter.export import (
    ExportError,
    eagle_tensor_names,
    eagle_tensors,
    export_drafter,
)
from tlt_stream.drafter.model import Drafter, save_drafter
from tlt_stream.model import load_model
from tlt_stream.model.layers import RMSNorm
from tlt_stream.model.spec import ModelSpec
from tlt_stream.model.transformer import Transformer
from tlt_stream.rollout.arms import Arm
from tlt_stream.rollout.proposers import EagleProposer

torch.set_default_dtype(torch.float32)

BASE = tiny_spec(num_layers=2, rms_norm_eps=1e-5, rope_theta=500.0)
"""A two-layer target (its drafter has one); head_dim 12 != hidden / heads: the config must carry head_dim."""
SPECS = {
    "llama": BASE,
    "qwen2-qkv-bias": dataclasses.replace(BASE, architecture="qwen2", qkv_bias=True),
    "llama-all-biases": dataclasses.replace(BASE, qkv_bias=True, o_bias=True, mlp_bias=True),
}


# ------------------------------------------------------------------------------ vLLM's EAGLE, re-implemented


def vllm_load(export: Path, target: Transformer) -> tuple[dict, dict[str, torch.Tensor]]:
    """The draft parameters as vLLM's loader would fill them from `export` (config + safetensors)."""
    config = json.loads((export / "config.json").read_text())
    h, q, kv = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    d, inter = config.get("head_dim") or h // q, config["intermediate_size"]
    attention_bias = config.get("attention_bias", False) or config.get("bias", False)
    qkv_bias = config.get("qkv_bias", attention_bias)  # llama.py LlamaDecoderLayer: qkv_bias overrides
    shapes = {  # EagleLlamaForCausalLM's parameters (the model holds no lm_head of its own)
        "model.embed_tokens.weight": (config["vocab_size"], h),
        "model.fc.weight": (h, 2 * h),
        "model.layers.0.self_attn.qkv_proj.weight": ((q + 2 * kv) * d, h),
        "model.layers.0.self_attn.o_proj.weight": (h, q * d),
        "model.layers.0.post_attention_layernorm.weight": (h,),
        "model.layers.0.mlp.gate_up_proj.weight": (2 * inter, h),
        "model.layers.0.mlp.down_proj.weight": (h, inter),
    }
    if qkv_bias:
        shapes["model.layers.0.self_attn.qkv_proj.bias"] = ((q + 2 * kv) * d,)
    if attention_bias:
        shapes["model.layers.0.self_attn.o_proj.bias"] = (h,)
    if config.get("mlp_bias", False):
        shapes["model.layers.0.mlp.gate_up_proj.bias"] = (2 * inter,)
        shapes["model.layers.0.mlp.down_proj.bias"] = (h,)
    shards = {  # hf_to_vllm_mapper: (fused name, row offset, rows)
        ".q_proj": (".qkv_proj", 0, q * d),
        ".k_proj": (".qkv_proj", q * d, kv * d),
        ".v_proj": (".qkv_proj", (q + kv) * d, kv * d),
        ".gate_proj": (".gate_up_proj", 0, inter),
        ".up_proj": (".gate_up_proj", inter, inter),
    }
    params = {name: torch.full(shape, float("nan")) for name, shape in shapes.items()}
    loaded: set[str] = set()
    for name, tensor in load_file(str(export / "model.safetensors")).items():
        if "lm_head" in name:
            raise ValueError(f"There is no module or parameter named {name!r}")  # no lm_head module
        name = "model." + name
        for part, (fused, offset, rows) in shards.items():
            if part in name:
                name = name.replace(part, fused)
                if name not in params:
                    raise ValueError(f"no parameter {name}")
                params[name][offset : offset + rows] = tensor.float()
                loaded.add(f"{name}[{offset}]")
                break
        else:
            if name not in params:
                if name.endswith(".bias"):
                    continue  # AutoWeightsLoader ignores unexpected biases
                raise ValueError(f"There is no module or parameter named {name!r}")
            assert params[name].shape == tensor.shape, name
            params[name] = tensor.float()
            loaded.add(name)
    if "model.embed_tokens.weight" not in loaded:  # pipeline parallel 1: the target's embedding is shared
        params["model.embed_tokens.weight"] = target.embed_tokens.weight.detach()
    params["lm_head.weight"] = target.lm_head_weight.detach()  # shared target head
    unset = sorted(n for n, t in params.items() if torch.isnan(t).any())
    assert not unset, f"parameters the export left uninitialised: {unset}"
    return config, params


def rms_norm_fused_add(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    x = x.float() + residual.float()
    residual = x
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return x * weight, residual


def neox_rope(x: torch.Tensor, positions: torch.Tensor, theta: float, d: int) -> torch.Tensor:
    """x [T, heads, d]: the cos/sin cache of base.py and common.py's neox rotation."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float) / d))
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, d/2]
    cos, sin = freqs.cos()[:, None, :], freqs.sin()[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def vllm_eagle_forward(
    config: dict,
    params: dict[str, torch.Tensor],
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    hidden_states: torch.Tensor,
    *,
    hidden_first: bool = False,
    input_norm: bool = False,
) -> torch.Tensor:
    """One causal pass of the draft over a single sequence of T tokens -> `[T, H]` (before the LM head).

    `hidden_first` and `input_norm` are deliberate departures (the fc input order reversed, an input norm
    added) that the sensitivity test uses to show the comparison would catch such a mapping error."""
    p = "model.layers.0."
    h, q, kv = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    d = config.get("head_dim") or h // q
    eps, theta = config["rms_norm_eps"], config["rope_parameters"]["rope_theta"]
    embeds = F.embedding(input_ids, params["model.embed_tokens.weight"])
    pair = (hidden_states, embeds) if hidden_first else (embeds, hidden_states)
    x = F.linear(torch.cat(pair, dim=-1), params["model.fc.weight"])
    residual = x  # layer 0: residual is None, input_layernorm is nn.Identity
    if input_norm:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    qkv = F.linear(x, params[f"{p}self_attn.qkv_proj.weight"], params.get(f"{p}self_attn.qkv_proj.bias"))
    qs, ks, vs = qkv.split([q * d, kv * d, kv * d], dim=-1)
    t = input_ids.shape[0]
    qs = neox_rope(qs.view(t, q, d), positions, theta, d)
    ks = neox_rope(ks.view(t, kv, d), positions, theta, d)
    vs = vs.view(t, kv, d)
    ks, vs = ks.repeat_interleave(q // kv, dim=1), vs.repeat_interleave(q // kv, dim=1)
    scores = torch.einsum("thd,shd->hts", qs, ks) * d**-0.5
    scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    attn = torch.einsum("hts,shd->thd", scores.softmax(-1), vs).reshape(t, q * d)
    attn = F.linear(attn, params[f"{p}self_attn.o_proj.weight"], params.get(f"{p}self_attn.o_proj.bias"))
    x, residual = rms_norm_fused_add(attn, residual, params[f"{p}post_attention_layernorm.weight"], eps)
    gate_up = F.linear(x, params[f"{p}mlp.gate_up_proj.weight"], params.get(f"{p}mlp.gate_up_proj.bias"))
    gate, up = gate_up.chunk(2, dim=-1)
    x = F.linear(F.silu(gate) * up, params[f"{p}mlp.down_proj.weight"], params.get(f"{p}mlp.down_proj.bias"))
    return x + residual


def vllm_logits(params: dict[str, torch.Tensor], hidden: torch.Tensor) -> torch.Tensor:
    return F.linear(hidden, params["lm_head.weight"])


# ------------------------------------------------------------------------------------------------- fixtures


def random_drafter(spec: ModelSpec, seed: int) -> tuple[Transformer, Drafter]:
    """A random target (the embedding and head the drafter borrows) and a drafter with every parameter
    random, norm weights and biases included, so a misplaced tensor changes the output."""
    torch.manual_seed(seed)
    target = Transformer(spec).eval()
    drafter = Drafter(spec)
    with torch.no_grad():
        for name, param in drafter.named_parameters():
            if name.endswith("layernorm.weight"):
                param.copy_(1 + 0.3 * torch.randn_like(param))
            else:
                param.copy_(0.25 * torch.randn_like(param))
    return target, drafter.bind(target).eval()


def exported(tmp_path: Path, spec: ModelSpec, seed: int = 0) -> tuple[Transformer, Drafter, Path]:
    target, drafter = random_drafter(spec, seed)
    save_drafter(drafter, tmp_path / "drafter")
    export_drafter(tmp_path / "drafter", tmp_path / "eagle", format="eagle")
    return target, drafter, tmp_path / "eagle"


def sequence(spec: ModelSpec, t: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens x_0..x_t and target features f_0..f_{t-1} (final-norm-like: unit RMS)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, spec.vocab_size, (t + 1,), generator=g)
    features = torch.randn(t, spec.hidden_size, generator=g)
    return tokens, features


# ---------------------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("variant", sorted(SPECS))
def test_exported_weights_give_our_draft_logits_through_vllms_eagle_forward(tmp_path: Path, variant: str) -> None:
    spec = SPECS[variant]
    target, drafter, export = exported(tmp_path, spec)
    config, params = vllm_load(export, target)
    t = 11
    tokens, features = sequence(spec, t, seed=3)
    with torch.no_grad():
        # ours: the pair (x_{i+1}, f_i) at position i + 1 (EagleProposer._catch_up), causal
        mask = torch.ones(t, t, dtype=torch.bool).tril()[None, None]
        ours = drafter.dense(tokens[None, 1:], features[None], torch.arange(1, t + 1)[None], mask)[0]
        ours_logits = drafter.logits(ours)
        # vLLM: input ids shifted left by one, positions unchanged (pair (x_{i+1}, f_i) at position i)
        ref = vllm_eagle_forward(config, params, tokens[1:], torch.arange(t), features)
        ref_logits = vllm_logits(params, ref)
    assert ours_logits.abs().max() > 1.0  # a live comparison, not two near-zero tensors
    torch.testing.assert_close(ref, ours, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(ref_logits, ours_logits, atol=5e-5, rtol=5e-5)
    assert torch.equal(ref_logits.argmax(-1), ours_logits.argmax(-1))


def test_the_comparison_catches_a_reversed_fc_input_or_an_input_norm(tmp_path: Path) -> None:
    """Were the export (or vLLM) to order the fc input [hidden; embed], or normalise the layer input, the
    logits would differ far beyond the tolerance above: the equality test can fail."""
    spec = SPECS["llama"]
    target, drafter, export = exported(tmp_path, spec)
    config, params = vllm_load(export, target)
    t = 11
    tokens, features = sequence(spec, t, seed=3)
    with torch.no_grad():
        mask = torch.ones(t, t, dtype=torch.bool).tril()[None, None]
        ours = drafter.logits(drafter.dense(tokens[None, 1:], features[None], torch.arange(1, t + 1)[None], mask)[0])
        for wrong in ({"hidden_first": True}, {"input_norm": True}):
            ref = vllm_logits(
                params, vllm_eagle_forward(config, params, tokens[1:], torch.arange(t), features, **wrong)
            )
            assert (ref - ours).abs().max() > 1e-2, wrong


def test_greedy_drafts_of_our_proposer_match_vllms_drafting_loop(tmp_path: Path) -> None:
    """Catch-up over the committed pairs, then four levels drafted by feeding the draft's own output back:
    our EagleProposer (KV cache, spec_offset, positions t + 1) and vLLM's propose loop (positions t) draft
    the same tokens."""
    spec = SPECS["qwen2-qkv-bias"]
    target, drafter, export = exported(tmp_path, spec, seed=5)
    config, params = vllm_load(export, target)
    depth, t = 4, 9
    for seed in range(4):
        tokens, features = sequence(spec, t, seed=10 + seed)
        proposer = EagleProposer(drafter)
        proposer.allocate(1, 64)
        proposer.reset_slot(0)
        proposer.observe(0, tokens[1:].tolist(), features)
        proposal = proposer.propose(1, Arm.drafter(depth, 1, depth), torch.zeros(1), [None])
        ours = proposal.tree.tokens[0].tolist()

        ids, positions, feats = tokens[1:].clone(), torch.arange(t), features.clone()
        drafted: list[int] = []
        with torch.no_grad():
            for _ in range(depth):
                out = vllm_eagle_forward(config, params, ids, positions, feats)
                token = int(vllm_logits(params, out[-1]).argmax())
                drafted.append(token)
                ids = torch.cat([ids, torch.tensor([token])])
                positions = torch.cat([positions, positions[-1:] + 1])
                feats = torch.cat([feats, out[-1:]])  # the draft's own output is the next feature
        assert ours == drafted, (seed, ours, drafted)


@pytest.mark.parametrize("variant", sorted(SPECS))
def test_config_has_what_vllm_reads_and_transformers_parses_it(tmp_path: Path, variant: str) -> None:
    from transformers import AutoConfig

    spec = SPECS[variant]
    _, _, export = exported(tmp_path, spec)
    config = json.loads((export / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]  # EAGLEConfig renames it EagleLlamaForCausalLM
    assert config["model_type"] == "llama"
    expected = {
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": spec.rms_norm_eps,
        "max_position_embeddings": spec.max_position_embeddings,
        "vocab_size": spec.vocab_size,
        "attention_bias": spec.o_bias,
        "qkv_bias": spec.qkv_bias,
        "mlp_bias": spec.mlp_bias,
    }
    assert {k: config[k] for k in expected} == expected
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": spec.rope_theta}
    parsed = AutoConfig.from_pretrained(export)  # vLLM reads the draft config with transformers
    assert type(parsed).__name__ == "LlamaConfig"
    for key, value in expected.items():
        assert getattr(parsed, key) == value, key
    assert parsed.rope_parameters["rope_theta"] == spec.rope_theta
    names = set(load_file(str(export / "model.safetensors")))
    assert names == set(eagle_tensor_names(spec))
    assert not any("lm_head" in n or "embed_tokens" in n or "input_layernorm" in n for n in names)


def test_the_policy_embedding_is_written_when_asked(tmp_path: Path, init_policy: Path) -> None:
    policy = load_model(init_policy)
    torch.manual_seed(4)
    save_drafter(Drafter(policy.spec), tmp_path / "drafter")
    result = export_drafter(tmp_path / "drafter", tmp_path / "with", policy=init_policy, dtype="bfloat16")
    assert result.with_embedding
    weights = load_file(str(tmp_path / "with" / "model.safetensors"))
    assert weights["embed_tokens.weight"].dtype == torch.bfloat16
    assert torch.equal(weights["embed_tokens.weight"], policy.embed_tokens.weight.to(torch.bfloat16))
    assert json.loads((tmp_path / "with" / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_a_drafter_vllm_cannot_run_is_refused() -> None:
    _, drafter = random_drafter(SPECS["llama"], 0)
    drafter.layer.input_layernorm = RMSNorm(drafter.spec.hidden_size, drafter.spec.rms_norm_eps)
    with pytest.raises(ExportError, match="no input norm"):
        eagle_tensors(drafter)


# ------------------------------------------------------------------------------------------------------ CLI


@pytest.fixture
def drafter_dir(tmp_path: Path, init_policy: Path) -> Path:
    torch.manual_seed(1)
    return save_drafter(Drafter(load_model(init_policy).spec), tmp_path / "drafter")


def test_cli_exports_a_drafter_and_an_online_training_state(
    tmp_path: Path, drafter_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "eagle"
    assert main(["export-drafter", str(drafter_dir), "--format", "eagle", "--out", str(out)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["architecture"] == "EagleLlamaForCausalLM" and report["with_embedding"] is False
    assert sorted(load_file(str(out / "model.safetensors"))) == report["tensors"]
    record = json.loads((out / "tlt_export.json").read_text())
    assert record["source"] == str(drafter_dir.resolve()) and len(record["source_sha256"]) == 64

    state = tmp_path / "fence-3-step-40"  # drafter/online.py's state layout: the drafter in drafter/
    (state / "drafter").mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        (state / "drafter" / name).write_bytes((drafter_dir / name).read_bytes())
    (state / "trainer.json").write_text("{}")
    assert main(["export-drafter", str(state), "--out", str(tmp_path / "from-state")]) == 0
    assert json.loads(capsys.readouterr().out)["tensors"] == report["tensors"]
    for name, tensor in load_file(str(tmp_path / "from-state" / "model.safetensors")).items():
        assert torch.equal(tensor, load_file(str(out / "model.safetensors"))[name])


def test_cli_refuses_bad_input_in_one_line(
    tmp_path: Path, drafter_dir: Path, init_policy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def refused(*argv: str) -> str:
        assert main(["export-drafter", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("tlt-stream export-drafter: ") and "\n" not in err and "Traceback" not in err
        return err

    out = str(tmp_path / "out")
    assert "no such drafter checkpoint" in refused(str(tmp_path / "missing"), "--out", out)
    assert "is not ['TltEagleDrafter']" in refused(str(init_policy), "--out", out)  # a policy, not a drafter
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((drafter_dir / "config.json").read_text())
    (broken / "model.safetensors").write_bytes(b"\x00" * 40)
    assert "unreadable safetensors" in refused(str(broken), "--out", out)
    save_file({"fc.weight": torch.zeros(3, 3)}, str(broken / "model.safetensors"))
    assert "do not match" in refused(str(broken), "--out", out)

    foreign = tmp_path / "foreign-policy"  # a policy whose vocabulary does not fit the drafter
    foreign.mkdir()
    cfg = json.loads((init_policy / "config.json").read_text())
    (foreign / "config.json").write_text(json.dumps({**cfg, "vocab_size": cfg["vocab_size"] + 1}))
    assert "does not fit the drafter" in refused(str(drafter_dir), "--out", out, "--policy", str(foreign))

    assert main(["export-drafter", str(drafter_dir), "--out", out]) == 0
    capsys.readouterr()
    assert "not empty" in refused(str(drafter_dir), "--out", out)
    assert main(["export-drafter", str(drafter_dir), "--out", out, "--force"]) == 0
    capsys.readouterr()
    (Path(out) / "extra.safetensors").write_bytes(b"")  # vLLM would load it too
    assert "holds more than an export (extra.safetensors)" in refused(str(drafter_dir), "--out", out, "--force")
    with pytest.raises(SystemExit) as exc:  # argparse: an unknown format is a usage error
        main(["export-drafter", str(drafter_dir), "--format", "medusa", "--out", out])
    assert exc.value.code == 2
