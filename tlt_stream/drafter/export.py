"""Export a drafter for serving: the layout vLLM's EAGLE (EAGLE-1) loader reads.

`tlt-stream export-drafter CKPT --format eagle --out DIR` writes `DIR/config.json` (a one-layer Llama
config) and `DIR/model.safetensors` so that `speculative_config={"method": "eagle", "model": DIR, ...}` loads
it as vLLM's `EagleLlamaForCausalLM` (`vllm/model_executor/models/llama_eagle.py`). What follows was read in
vLLM 0.33.0 (wheel `vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl`, `__commit_id__ = "g4ba787ec9"`) and
checked against the 0.10-era `llama_eagle.py` (vllm-project/vllm at 00da92319af4b2ad2cde8525b7b609c779bdc52f).

**What vLLM computes.** `LlamaModel.forward(input_ids, positions, hidden_states)` in `llama_eagle.py`:
`h = fc(cat(embed_tokens(input_ids), hidden_states))` (`fc`: 2H -> H, no bias; the token embedding FIRST),
then its decoder layers, layer 0 built with `input_layernorm = nn.Identity()`, and `h + residual` returned
with no final norm; `compute_logits` applies the LM head. The features are the target's final-norm hidden
states (`gpu_model_runner` hands the target model's output, `LlamaModel` after `self.norm`, to the
proposer); while drafting ahead, the draft's own output is fed back. That is this project's `Drafter`
exactly: `fc([embed(x_{t+1}); f_t])`, one decoder layer without its input norm, no final norm, the target's
frozen embedding and LM head. The one difference is the position: vLLM pairs (x_{t+1}, f_t) at position t
(`set_inputs_first_pass` "rotates the input ids and leaves the positions unchanged"), this project at t + 1.
Both feed every token of a sequence the same shift, and the only use of positions is RoPE, whose attention
scores depend on position differences only, so the outputs agree up to floating-point rounding (the unit
test checks logits and greedy drafts against a re-implementation of vLLM's forward).

**Names.** `EagleLlamaForCausalLM.load_weights` prefixes every name without `lm_head` with `model.`; the
model's `hf_to_vllm_mapper` stacks `.q_proj/.k_proj/.v_proj` into `.qkv_proj` and `.gate_proj/.up_proj` into
`.gate_up_proj`. So the file holds Hugging Face (unfused) names:

| this project (`Drafter.state_dict()`)       | exported tensor (vLLM checkpoint name)                   |
| ------------------------------------------- | -------------------------------------------------------- |
| `fc.weight` [H, 2H], input `[embed; feat]`  | `fc.weight`, same column order (vLLM: `(embeds, hidden)`) |
| `layer.self_attn.qkv_proj.weight` `[q;k;v]` | `layers.0.self_attn.{q,k,v}_proj.weight` (row split)      |
| `layer.self_attn.qkv_proj.bias` (qkv_bias)  | `layers.0.self_attn.{q,k,v}_proj.bias`                    |
| `layer.self_attn.o_proj.weight` / `.bias`   | `layers.0.self_attn.o_proj.weight` / `.bias`              |
| `layer.post_attention_layernorm.weight`     | `layers.0.post_attention_layernorm.weight`                |
| `layer.mlp.gate_up_proj.weight` `[gate;up]` | `layers.0.mlp.gate_proj.weight`, `layers.0.mlp.up_proj.weight` |
| `layer.mlp.gate_up_proj.bias`, `down_proj.*` | `layers.0.mlp.{gate,up}_proj.bias`, `layers.0.mlp.down_proj.*` |
| no input norm (`nn.Identity`)               | nothing (vLLM's layer 0 has no `input_layernorm` parameter) |
| borrowed embedding                          | `embed_tokens.weight` only with `--policy` (see below)    |
| borrowed LM head                            | never written                                             |

**Embedding and LM head.** `EagleLlamaForCausalLM` has no `lm_head` module: a `lm_head.weight` in the file
would make `AutoWeightsLoader` raise ("There is no module or parameter named 'lm_head'"), and without one
`SpecDecodeBaseProposer._maybe_share_lm_head` (`vllm/v1/spec_decode/llm_base_proposer.py`) shares the
target's head. Without `embed_tokens.weight` (`has_own_embed_tokens` stays False), `_maybe_share_embeddings`
shares the target's embedding module when pipeline parallelism is 1. Sharing the live target's modules is
what this project's `bind` does, and it survives in-place policy reloads, so by default neither is written.
With pipeline parallelism > 1 vLLM loads the draft's embedding from the file instead; `--policy DIR`
writes that policy's `embed_tokens.weight` for that case (the export then belongs to that policy version;
with PP = 1 vLLM shares the target's embedding when the two are equal and keeps a separate copy otherwise).

**Config.** vLLM reads the draft `config.json` with transformers (`model_type: llama`, `architectures:
["LlamaForCausalLM"]`, renamed to `EagleLlamaForCausalLM` by `EAGLEConfig`), and `LlamaDecoderLayer` reads
`hidden_size`, `num_attention_heads`, `num_key_value_heads`, `head_dim`, `intermediate_size`, `hidden_act`,
`rms_norm_eps`, `rope_parameters` (`rope_theta` and `rope_scaling` under transformers 4: the export writes both),
`max_position_embeddings`, `attention_bias` (q/k/v *and* o bias), `qkv_bias` (overrides the q/k/v part: Qwen2's
bias layout), `mlp_bias`; `num_hidden_layers` sizes the draft;
`vocab_size` sizes the (shared) embedding and the logits processor. Bias flags must match the tensors:
`AutoWeightsLoader` silently ignores an unexpected `.bias`, and a missing tensor is not an error for EAGLE
drafts (`EagleLlamaForCausalLM.load_weights` returns no loaded-name set, so the loader's strict check is
skipped), so a mismatch would run wrong weights without complaint. The export writes exactly the tensors
its config implies, and `check_eagle_export` refuses, before vLLM starts on it, an export whose tensors are
not the ones its own `config.json` implies (`eagle_layout`: vLLM's reading of the config above, layers after the
first keeping their `input_layernorm`, `embed_tokens.weight` optional): a hand-made or third-party export, or
one whose config was edited.

Tree drafting (top-k > 1) is a runtime setting, not part of the export; see `rollout/vllm/config.py`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file
from torch import nn

from tlt_stream.basics.errors import CheckpointError
from tlt_stream.drafter.model import CONFIG, WEIGHTS, Drafter, layout_mismatch, read_drafter, tensor_shapes
from tlt_stream.model.families import hf_rope_parameters
from tlt_stream.model.loader import layer_tensor_names
from tlt_stream.model.spec import ModelSpec
from tlt_stream.store.weights import transformers4_keys

__all__ = [
    "EAGLE_ARCHITECTURE",
    "EAGLE_CONFIG_ARCHITECTURES",
    "EXPORT_RECORD",
    "FORMATS",
    "ExportError",
    "ExportResult",
    "check_eagle_export",
    "eagle_config",
    "eagle_config_spec",
    "eagle_layout",
    "eagle_tensor_names",
    "eagle_tensors",
    "export_drafter",
    "file_in_the_way",
    "read_eagle_config",
    "resolve_drafter_dir",
]

FORMATS = ("eagle",)
EAGLE_ARCHITECTURE = "LlamaForCausalLM"
"""What the draft config names; vLLM's `EAGLEConfig` turns it into `EagleLlamaForCausalLM`."""
EAGLE_CONFIG_ARCHITECTURES = (EAGLE_ARCHITECTURE, f"Eagle{EAGLE_ARCHITECTURE}")
"""The `architectures` of a draft config vLLM runs as `EagleLlamaForCausalLM` (`EAGLEConfig` keeps an `Eagle`
prefix that is already there)."""
EXPORT_RECORD = "tlt_export.json"
"""Provenance written next to the export (vLLM ignores it)."""
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ExportError(CheckpointError):
    """The drafter cannot be exported in the requested format (the message says why, in one line)."""


@dataclass(frozen=True)
class ExportResult:
    path: Path
    config: dict[str, Any]
    tensors: tuple[str, ...]
    with_embedding: bool


def resolve_drafter_dir(path: str | Path) -> Path:
    """A drafter checkpoint directory as given, or the `drafter/` inside an online-training state directory
    (`drafter/online.py` writes states as `fence-F-step-S/{drafter/, trainer.json, ...}`)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such drafter checkpoint directory")
    if not (path / CONFIG).is_file() and (path / "drafter" / CONFIG).is_file():
        return path / "drafter"
    return path


def eagle_config(spec: ModelSpec, *, dtype: str) -> dict[str, Any]:
    """The draft `config.json` vLLM's EAGLE-1 Llama model reads for a drafter of shape `spec`: RoPE and dtype
    as transformers 5 writes them and as transformers 4 reads them (`transformers4_keys`), so a vLLM on either
    runs the target's RoPE."""
    config = {
        "architectures": [EAGLE_ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_parameters": hf_rope_parameters(spec),
        "max_position_embeddings": spec.max_position_embeddings,
        "vocab_size": spec.vocab_size,
        "attention_bias": spec.o_bias,
        "qkv_bias": spec.qkv_bias,
        "mlp_bias": spec.mlp_bias,
        "tie_word_embeddings": False,
        "dtype": dtype,
    }
    return {**config, **transformers4_keys(config)}


def eagle_tensor_names(spec: ModelSpec, *, with_embedding: bool = False) -> list[str]:
    """Exactly the tensor names the export of a drafter of shape `spec` holds (the config implies them)."""
    names = ["fc.weight", *layer_tensor_names("layers.0.", spec, input_layernorm=False)]
    if with_embedding:
        names.append("embed_tokens.weight")
    return sorted(names)


def _check_architecture(drafter: Drafter) -> None:
    """Refuse a drafter whose computation differs from vLLM's EAGLE-1 Llama forward in a way a renaming of
    its tensors cannot express (the checks pin the invariants the mapping above relies on)."""
    spec = drafter.spec
    if spec.architecture not in ("llama", "qwen2"):
        raise ExportError(f"drafter architecture {spec.architecture!r} has no vLLM EAGLE equivalent")
    if drafter.fc.bias is not None:
        raise ExportError("the drafter's fc has a bias; vLLM's EAGLE fc is bias-free (no faithful export)")
    if not isinstance(drafter.layer.input_layernorm, nn.Identity):
        raise ExportError(
            "the drafter's layer normalises its input; vLLM's EAGLE layer 0 has no input norm (no faithful export)"
        )
    if spec.num_layers != 1:
        raise ExportError(f"the drafter has {spec.num_layers} layers; the export supports one")


def eagle_tensors(drafter: Drafter, *, embedding: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The drafter's own weights under vLLM's checkpoint names (see the module docstring's table)."""
    return {name: t.to("cpu").contiguous() for name, t in _eagle_named(drafter, embedding).items()}


def _eagle_named(drafter: Drafter, embedding: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """`eagle_tensors` where the drafter's tensors are (a drafter on the meta device gives the layout alone)."""
    _check_architecture(drafter)
    spec = drafter.spec
    own = {name: t.detach() for name, t in drafter.state_dict().items()}
    q, kv, inter = spec.q_size, spec.kv_size, spec.intermediate_size
    p = "layers.0."
    out: dict[str, torch.Tensor] = {
        "fc.weight": own.pop("fc.weight"),
        f"{p}post_attention_layernorm.weight": own.pop("layer.post_attention_layernorm.weight"),
        f"{p}self_attn.o_proj.weight": own.pop("layer.self_attn.o_proj.weight"),
        f"{p}mlp.down_proj.weight": own.pop("layer.mlp.down_proj.weight"),
    }
    for suffix in ("weight", "bias") if spec.qkv_bias else ("weight",):
        fused = own.pop(f"layer.self_attn.qkv_proj.{suffix}")
        for x, part in zip("qkv", fused.split([q, kv, kv]), strict=True):
            out[f"{p}self_attn.{x}_proj.{suffix}"] = part
    for suffix in ("weight", "bias") if spec.mlp_bias else ("weight",):
        fused = own.pop(f"layer.mlp.gate_up_proj.{suffix}")
        for x, part in zip(("gate", "up"), fused.split([inter, inter]), strict=True):
            out[f"{p}mlp.{x}_proj.{suffix}"] = part
    if spec.o_bias:
        out[f"{p}self_attn.o_proj.bias"] = own.pop("layer.self_attn.o_proj.bias")
    if spec.mlp_bias:
        out[f"{p}mlp.down_proj.bias"] = own.pop("layer.mlp.down_proj.bias")
    if own:  # a tensor the mapping does not know: exporting without it would run a different model
        raise ExportError(f"drafter tensors {sorted(own)} have no place in vLLM's EAGLE layout")
    if embedding is not None:
        if tuple(embedding.shape) != (spec.vocab_size, spec.hidden_size):
            raise ExportError(
                f"policy embedding has shape {tuple(embedding.shape)}, the drafter needs "
                f"{(spec.vocab_size, spec.hidden_size)}"
            )
        out["embed_tokens.weight"] = embedding.detach()
    expected = eagle_tensor_names(spec, with_embedding=embedding is not None)
    assert sorted(out) == expected, (sorted(out), expected)
    return out


_EAGLE_SIZES = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
"""The draft config keys that size vLLM's EAGLE Llama model and have no default this check would trust."""


def _eagle_config_refusal(where: str | Path, why: str) -> CheckpointError:
    return CheckpointError(
        f"{where}: config.json is not an EAGLE-1 Llama draft config ({why}); vLLM's EAGLE drafts read "
        f"architectures {[EAGLE_ARCHITECTURE]} with model_type 'llama' (what `tlt-stream export-drafter` writes)"
    )


def eagle_config_spec(config: object, *, where: str | Path = "<config>") -> ModelSpec:
    """The shape of the draft model vLLM builds from the EAGLE-1 draft `config` (a parsed `config.json`), read
    as vLLM's `LlamaDecoderLayer` reads it: `num_key_value_heads` defaults to the heads, `head_dim` to hidden
    size / heads; q/k/v bias from `qkv_bias` when the key is there, else `attention_bias or bias`; o bias from
    `attention_bias or bias`; `mlp_bias` on gate, up and down. Refuses with `CheckpointError`, in one line naming
    `where`, a config that is not a Llama EAGLE draft's or whose sizes are missing or invalid."""
    if not isinstance(config, dict):
        raise _eagle_config_refusal(where, f"not a JSON object: {type(config).__name__}")
    archs = config.get("architectures")
    if not isinstance(archs, list) or len(archs) != 1 or archs[0] not in EAGLE_CONFIG_ARCHITECTURES:
        raise _eagle_config_refusal(where, f"architectures {archs!r}")
    if config.get("model_type") != "llama":
        raise _eagle_config_refusal(where, f"model_type {config.get('model_type')!r}")
    sizes: dict[str, int] = {}
    for key in (*_EAGLE_SIZES, "num_key_value_heads", "head_dim"):
        value = config.get(key)
        if value is None and key not in _EAGLE_SIZES:
            continue  # vLLM's default: as many KV heads as heads, heads of hidden_size / num_attention_heads
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            why = "missing" if key not in config else f"{value!r} is not a positive integer"
            raise _eagle_config_refusal(where, f"{key} {why}")
        sizes[key] = value
    flags: dict[str, bool] = {}
    for key in ("attention_bias", "bias", "qkv_bias", "mlp_bias"):
        value = config.get(key)
        if value is not None and not isinstance(value, bool):
            raise _eagle_config_refusal(where, f"{key} {value!r} is not true or false")
        flags[key] = bool(value)
    attention_bias = flags["attention_bias"] or flags["bias"]
    heads = sizes["num_attention_heads"]
    try:
        return ModelSpec(
            architecture="llama",
            vocab_size=sizes["vocab_size"],
            hidden_size=sizes["hidden_size"],
            intermediate_size=sizes["intermediate_size"],
            num_layers=sizes["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=sizes.get("num_key_value_heads", heads),
            head_dim=sizes.get("head_dim", sizes["hidden_size"] // heads),
            qkv_bias=flags["qkv_bias"] if "qkv_bias" in config else attention_bias,
            o_bias=attention_bias,
            mlp_bias=flags["mlp_bias"],
        )
    except ValueError as exc:  # GQA heads that do not divide, an odd or zero head size...
        raise _eagle_config_refusal(where, str(exc)) from None


def eagle_layout(
    config: object, *, with_embedding: bool = False, where: str | Path = "<config>"
) -> dict[str, tuple[int, ...]]:
    """The tensors (name -> shape) an EAGLE-1 export with draft config `config` must hold: exactly what vLLM's
    `EagleLlamaForCausalLM` loads for it, under the names `eagle_tensors` writes; `embed_tokens.weight` with
    `with_embedding`. Layer 0 is this project's drafter layer (no input norm); the layers after it, where the
    config has several, are the same plus their `input_layernorm` (vLLM drops the norm of layer 0 only). No
    weight is allocated (the drafter is built on the meta device). Refuses a config `eagle_config_spec` refuses."""
    spec = eagle_config_spec(config, where=where)
    with torch.device("meta"):
        drafter = Drafter(spec)
    first = {name: tuple(t.shape) for name, t in _eagle_named(drafter, None).items()}
    layout = dict(first)
    for i in range(1, spec.num_layers):
        layout.update(
            {f"layers.{i}." + n.removeprefix("layers.0."): s for n, s in first.items() if n.startswith("layers.0.")}
        )
        layout[f"layers.{i}.input_layernorm.weight"] = (spec.hidden_size,)
    if with_embedding:
        layout["embed_tokens.weight"] = (spec.vocab_size, spec.hidden_size)
    return layout


def read_eagle_config(export: str | Path) -> Any:
    """The parsed `config.json` of the EAGLE export directory `export`, as `check_eagle_export` reads it (a
    caller that needs the config too reads it here and hands it over, so the file is read once). Refuses, with
    `CheckpointError` in one line naming `export`, a file that is missing, unreadable or not JSON."""
    export = Path(export)
    try:
        return json.loads((export / CONFIG).read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"{export}: unreadable drafter config ({exc})") from None


def check_eagle_export(export: str | Path, *, config: object | None = None) -> dict[str, tuple[int, ...]]:
    """Refuse, with `CheckpointError` in one line naming `export` and the first difference, an EAGLE export
    directory whose safetensors (every `*.safetensors` in it, as vLLM loads them; headers only) do not hold
    exactly the tensors its own `config.json` implies (`eagle_layout`; `embed_tokens.weight` may be there or
    not): vLLM ignores an unexpected tensor and leaves a missing one as initialised, and drafts with wrong weights
    without a word. `config`: that `config.json` as `read_eagle_config` parsed it (None: read here). Returns the
    layout found (every tensor, the embedding included)."""
    export = Path(export)
    if config is None:
        config = read_eagle_config(export)
    files = sorted(export.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{export}: no safetensors weights")
    found = tensor_shapes(files)
    expected = eagle_layout(config, with_embedding="embed_tokens.weight" in found, where=export)
    if (why := layout_mismatch(found, expected)) is not None:
        raise CheckpointError(
            f"{export}: the EAGLE export does not hold the tensors its config.json implies: {why} (vLLM would "
            "skip or leave unset what differs and draft with wrong weights); re-export it with "
            "`tlt-stream export-drafter`"
        )
    return found


def _policy_embedding(policy: Path, spec: ModelSpec) -> torch.Tensor:
    """The embedding of the Hugging Face policy checkpoint at `policy`, checked against the drafter."""
    from tlt_stream.model.loader import embedding_tensor, load_spec

    target = load_spec(policy)
    if (target.hidden_size, target.vocab_size) != (spec.hidden_size, spec.vocab_size):
        raise ExportError(
            f"{policy}: policy (hidden {target.hidden_size}, vocab {target.vocab_size}) does not fit the drafter "
            f"(hidden {spec.hidden_size}, vocab {spec.vocab_size})"
        )
    try:
        return embedding_tensor(policy, target)
    except (SafetensorError, OSError) as exc:  # a truncated, foreign or unreadable weights file
        raise ExportError(f"--policy {policy}: unreadable safetensors ({exc})") from None


def file_in_the_way(path: str | Path) -> Path | None:
    """The nearest existing ancestor of `path` when it is not a directory (a file where a folder must be made
    for `path`), else None."""
    for parent in Path(path).absolute().parents:
        if parent.exists():
            return None if parent.is_dir() else parent
    return None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def export_drafter(
    checkpoint: str | Path,
    out: str | Path,
    *,
    format: str = "eagle",
    policy: str | Path | None = None,
    dtype: str = "float32",
    overwrite: bool = False,
) -> ExportResult:
    """Write the drafter at `checkpoint` (a drafter directory or an online-training state) to `out` in
    `format`. `policy`: also write that policy's embedding (needed by vLLM only with pipeline parallelism).
    `dtype`: of the written weights (float32, bfloat16, float16; vLLM casts to the target's dtype). Refuses, with
    `CheckpointError`/`ExportError`, a bad checkpoint, an unknown format or an existing non-empty `out`
    (unless `overwrite`)."""
    if format not in FORMATS:
        raise ExportError(f"unknown export format {format!r}; supported: {', '.join(FORMATS)}")
    if dtype not in DTYPES:
        raise ExportError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    source = resolve_drafter_dir(checkpoint)
    drafter = read_drafter(source)
    embedding = _policy_embedding(Path(policy), drafter.spec) if policy is not None else None
    tensors = eagle_tensors(drafter, embedding=embedding)
    tensors = {name: t.to(DTYPES[dtype]) for name, t in tensors.items()}
    config = eagle_config(drafter.spec, dtype=dtype)

    try:  # standard JSON only: a non-finite value would be written as `NaN`/`Infinity`, which strict readers refuse
        config_text = json.dumps(config, indent=2, sort_keys=True, allow_nan=False) + "\n"
    except ValueError:
        raise ExportError(f"{source}: the drafter's config holds a non-finite number; remake the drafter") from None

    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out}: exists and is not a directory; name a directory")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise ExportError(f"{out}: directory is not empty (pass --force to replace its export)")
        foreign = sorted(p.name for p in out.iterdir() if p.name not in (CONFIG, WEIGHTS, EXPORT_RECORD))
        if foreign:  # vLLM loads every *.safetensors of the directory: never leave strangers next to ours
            raise ExportError(f"{out}: holds more than an export ({', '.join(foreign[:3])}); choose another --out")
    if (blocker := file_in_the_way(out)) is not None:
        raise ExportError(f"--out {out}: {blocker} is a file, not a folder; choose another --out")
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    except OSError as exc:
        raise ExportError(f"--out {out}: cannot create it ({exc.strerror or exc}); choose another --out") from None
    try:  # the whole export is written next to `out` first: a failure leaves an earlier export as it was
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
        (tmp / CONFIG).write_text(config_text)
        record = {
            "format": format,
            "source": str(source.resolve()),
            "source_sha256": _sha256(source / WEIGHTS),
            "policy": str(Path(policy).resolve()) if policy is not None else None,
            "vllm": {"method": "eagle", "architecture": "EagleLlamaForCausalLM"},
        }
        (tmp / EXPORT_RECORD).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
        out.mkdir(parents=True, exist_ok=True)
        for name in (WEIGHTS, CONFIG, EXPORT_RECORD):  # the weights first: a config never names missing ones
            os.replace(tmp / name, out / name)
    except OSError as exc:
        raise ExportError(f"--out {out}: cannot write the export ({exc.strerror or exc})") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return ExportResult(out, config, tuple(sorted(tensors)), embedding is not None)
