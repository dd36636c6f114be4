"""Load a Hugging Face Llama/Qwen/Mistral checkpoint directory into the runtime, or refuse it in one clear line.

A checkpoint this runtime would silently mis-run (`families.py` says which run) is rejected at load time
with `CheckpointError`, never half-supported. Weights come only from safetensors
(single file or sharded with an index), or from tensors a caller already read and verified
(`store/weights.py`, what a rollout worker loads), and q/k/v and gate/up are fused here, once.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open

from tlt_stream.basics.errors import CheckpointError
from tlt_stream.model.families import spec_from_hf_config
from tlt_stream.model.layers import rope_inv_freq
from tlt_stream.model.spec import ModelSpec
from tlt_stream.model.transformer import Transformer

if TYPE_CHECKING:
    from tlt_stream.store.weights import PolicyWeights


def layer_tensor_names(p: str, spec: ModelSpec, *, input_layernorm: bool = True) -> list[str]:
    """The Hugging Face names of one decoder layer's tensors under prefix `p` (unfused q/k/v, gate/up; the
    biases the spec declares). EAGLE drafts have no `input_layernorm`."""
    names = [f"{p}input_layernorm.weight"] if input_layernorm else []
    names.append(f"{p}post_attention_layernorm.weight")
    names += [f"{p}self_attn.{x}_proj.weight" for x in "qkvo"]
    names += [f"{p}mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
    if spec.qkv_bias:
        names += [f"{p}self_attn.{x}_proj.bias" for x in "qkv"]
    if spec.o_bias:
        names.append(f"{p}self_attn.o_proj.bias")
    if spec.mlp_bias:
        names += [f"{p}mlp.{x}_proj.bias" for x in ("gate", "up", "down")]
    if spec.qk_norm:
        names += [f"{p}self_attn.{x}_norm.weight" for x in "qk"]
    return names


def load_spec(path: Path | str) -> ModelSpec:
    """Read and validate `path/config.json`."""
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{path}: no config.json (not a Hugging Face checkpoint directory)")
    try:
        cfg = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{config_file}: unreadable config ({e})") from e
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{config_file}: expected a JSON object")
    return spec_from_hf_config(cfg, path)


def _weight_files(path: Path) -> dict[str, Path]:
    """Map each tensor name to the safetensors file that holds it: `model.safetensors` where there is one, else
    the shards of `model.safetensors.index.json`, transformers' order (a checkpoint saved whole over a sharded
    one keeps the old index, whose shards `save_pretrained` removed)."""
    single = path / "model.safetensors"
    if single.is_file():
        with safe_open(single, framework="pt") as f:
            return dict.fromkeys(f.keys(), single)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: malformed shard index ({e})") from e
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index}: malformed shard index (weight_map must map tensor names to files)")
        files = {name: path / shard for name, shard in weight_map.items()}
        for shard in set(files.values()):
            if not shard.is_file():
                raise CheckpointError(f"{path}: shard {shard.name} listed in the index is missing")
        return files
    pickled = [name for name in ("pytorch_model.bin", "pytorch_model.bin.index.json") if (path / name).is_file()]
    also = (
        f" ({pickled[0]} is not read: pickled weights are never unpickled; save it as safetensors)" if pickled else ""
    )
    raise CheckpointError(f"{path}: no model.safetensors or model.safetensors.index.json{also}")


def _missing(have: Mapping[str, Any], names: list[str], path: Path) -> None:
    missing = [n for n in names if n not in have]
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise CheckpointError(f"{path}: missing tensors {shown}")


def _read_tensors(files: dict[str, Path], names: list[str], path: Path) -> dict[str, torch.Tensor]:
    _missing(files, names, path)
    by_file: dict[Path, list[str]] = {}
    for n in names:
        by_file.setdefault(files[n], []).append(n)
    out: dict[str, torch.Tensor] = {}
    for file, file_names in by_file.items():
        with safe_open(file, framework="pt") as f:
            for n in file_names:
                out[n] = f.get_tensor(n)
    return out


def _embedding_name(spec: ModelSpec, have: Collection[str]) -> str:
    """The checkpoint's name of the token embedding: its own, or with tied embeddings saved under the head's
    name alone (`lm_head.weight`, as some exports write them; transformers loads those too), that one."""
    own = "model.embed_tokens.weight"
    if spec.tie_word_embeddings and own not in have and "lm_head.weight" in have:
        return "lm_head.weight"
    return own


def _hf_names(spec: ModelSpec, have: Collection[str]) -> list[str]:
    """The Hugging Face tensors this runtime reads of a checkpoint holding `have`."""
    names = [_embedding_name(spec, have), "model.norm.weight"]
    if not spec.tie_word_embeddings:
        names.append("lm_head.weight")
    for i in range(spec.num_layers):
        names += layer_tensor_names(f"model.layers.{i}.", spec)
    return names


def _fused_state_dict(
    spec: ModelSpec, have: Collection[str], read: Callable[[list[str]], dict[str, torch.Tensor]]
) -> dict[str, torch.Tensor]:
    """Hugging Face names -> this runtime's names, with q/k/v and gate/up concatenated; `read(names)` gives
    the Hugging Face tensors, of the names in `have`."""
    prefix = "model."
    hf = read(_hf_names(spec, have))
    sd = {
        "embed_tokens.weight": hf[_embedding_name(spec, have)],
        "norm.weight": hf[f"{prefix}norm.weight"],
    }
    if not spec.tie_word_embeddings:
        sd["lm_head.weight"] = hf["lm_head.weight"]
    for i in range(spec.num_layers):
        p, q = f"{prefix}layers.{i}.", f"layers.{i}."
        sd[f"{q}input_layernorm.weight"] = hf[f"{p}input_layernorm.weight"]
        sd[f"{q}post_attention_layernorm.weight"] = hf[f"{p}post_attention_layernorm.weight"]
        sd[f"{q}self_attn.qkv_proj.weight"] = torch.cat([hf[f"{p}self_attn.{x}_proj.weight"] for x in "qkv"])
        sd[f"{q}self_attn.o_proj.weight"] = hf[f"{p}self_attn.o_proj.weight"]
        sd[f"{q}mlp.gate_up_proj.weight"] = torch.cat([hf[f"{p}mlp.{x}_proj.weight"] for x in ("gate", "up")])
        sd[f"{q}mlp.down_proj.weight"] = hf[f"{p}mlp.down_proj.weight"]
        if spec.qkv_bias:
            sd[f"{q}self_attn.qkv_proj.bias"] = torch.cat([hf[f"{p}self_attn.{x}_proj.bias"] for x in "qkv"])
        if spec.o_bias:
            sd[f"{q}self_attn.o_proj.bias"] = hf[f"{p}self_attn.o_proj.bias"]
        if spec.qk_norm:
            for x in "qk":
                sd[f"{q}self_attn.{x}_norm.weight"] = hf[f"{p}self_attn.{x}_norm.weight"]
        if spec.mlp_bias:
            sd[f"{q}mlp.gate_up_proj.bias"] = torch.cat([hf[f"{p}mlp.{x}_proj.bias"] for x in ("gate", "up")])
            sd[f"{q}mlp.down_proj.bias"] = hf[f"{p}mlp.down_proj.bias"]
    return sd


def resolve_device(spec: str) -> torch.device:
    """A `--device` value as a torch device: "auto" is the first CUDA device when torch sees one, else the
    CPU; "cpu", "cuda" and "cuda:N" are taken as given once checked. Raises ValueError with the reason."""
    spec = spec.strip().lower()
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(spec)
    except RuntimeError as exc:
        raise ValueError(f"--device {spec!r}: not a device (use auto, cpu, cuda or cuda:N)") from exc
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ValueError(f"--device {spec!r}: only auto, cpu, cuda and cuda:N are supported")
    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        raise ValueError(f"--device {spec}: torch {torch.__version__} ({build}) sees no CUDA device")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"--device {spec}: only {torch.cuda.device_count()} CUDA device(s) visible")
    return device


def resolve_dtype(name: str, device: torch.device | str) -> torch.dtype:
    """A dtype setting (`auto`, `float32`, `bfloat16`) on `device`: auto is bfloat16 on CUDA, else float32."""
    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if name not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be auto, float32 or bfloat16, got {name!r}")
    return getattr(torch, name)


def load_model(
    path: Path | str,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    weights: PolicyWeights | None = None,
) -> Transformer:
    """Load `path` (config.json + safetensors) as an eval-mode `Transformer` with `dtype` weights on `device`;
    with `weights`, from those (the directory's contents already read and verified) without reading `path`."""
    path = Path(path)
    if weights is not None:
        spec = spec_from_hf_config(weights.config, path)
        tensors = have = weights.tensors

        def read(names: list[str]) -> dict[str, torch.Tensor]:
            _missing(tensors, names, path)
            return {n: tensors[n] for n in names}
    else:
        if not path.is_dir():
            raise CheckpointError(f"{path}: checkpoint directory does not exist")
        spec = load_spec(path)
        files = have = _weight_files(path)

        def read(names: list[str]) -> dict[str, torch.Tensor]:
            return _read_tensors(files, names, path)

    sd = _fused_state_dict(spec, have, read)
    with torch.device("meta"):
        model = Transformer(spec)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    for name, tensor in sd.items():
        if tensor.shape != expected[name]:
            raise CheckpointError(
                f"{path}: tensor {name} has shape {tuple(tensor.shape)}, config implies {tuple(expected[name])}"
            )
    model.load_state_dict({k: v.to(device=device, dtype=dtype) for k, v in sd.items()}, assign=True)
    model.inv_freq = rope_inv_freq(spec).to(device)
    return model.eval().requires_grad_(False)


def embedding_tensor(path: Path, spec: ModelSpec) -> torch.Tensor:
    """The token embedding of the checkpoint at `path` (whose spec is `spec`), read alone."""
    files = _weight_files(path)
    name = _embedding_name(spec, files)
    return _read_tensors(files, [name], path)[name]


def check_checkpoint(path: Path | str) -> ModelSpec:
    """What loading `path` into the torch runtime would refuse, found without reading a tensor: no directory,
    its config (an architecture or a feature the runtime does not run), its safetensors files and every tensor
    the runtime reads; `CheckpointError` in one line. The attention window is `ModelSpec.check_window`'s."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: checkpoint directory does not exist")
    spec = load_spec(path)
    files = _weight_files(path)
    _missing(files, _hf_names(spec, files), path)
    return spec


def _config_dict(model_dir: str | Path) -> dict[str, Any]:
    """`model_dir/config.json` as a dict ({} when unreadable or not an object)."""
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return cfg if isinstance(cfg, dict) else {}


def _positive_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def checkpoint_positions(model_dir: str | Path) -> int | None:
    """The `max_position_embeddings` of `model_dir/config.json`, or where it leaves the key out, its family's
    default as transformers reads it (Llama's 2048); None when unreadable, or absent from a family this runtime
    does not know."""
    cfg = _config_dict(model_dir)
    if "max_position_embeddings" in cfg:
        return _positive_int(cfg["max_position_embeddings"])
    try:
        return spec_from_hf_config(cfg, model_dir).max_position_embeddings
    except CheckpointError:
        return None


def checkpoint_vocab(model_dir: str | Path) -> int | None:
    """The `vocab_size` of `model_dir/config.json` (None when unreadable or absent): the token ids the policy
    embeds, whatever its tokenizer holds."""
    return _positive_int(_config_dict(model_dir).get("vocab_size"))


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tiktoken.model", "vocab.json", "vocab.txt", "spiece.model")
"""Files one of which a directory must hold for its tokenizer to load (a fast tokenizer's, SentencePiece's or
tiktoken's model, a BPE's or WordPiece's vocabulary)."""


def load_tokenizer(directory: str | Path) -> Any:
    """The tokenizer saved in `directory` (a checkpoint's, or `data.tokenizer`), from local files only, or
    `CheckpointError` in one line. transformers builds an empty tokenizer for a directory without tokenizer
    files rather than raising: every prompt and response would then be empty text, scored and trained on."""
    path = Path(directory)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such tokenizer directory")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise CheckpointError(
            f"{path}: no tokenizer files (one of {', '.join(TOKENIZER_FILES)}); set data.tokenizer "
            "(--set data.tokenizer=DIR) to a directory that has them"
        )
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, TypeError, ImportError) as exc:  # ImportError: sentencepiece or protobuf missing
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"{path}: the tokenizer does not load ({reason})") from exc
    if len(tokenizer) < 2:
        raise CheckpointError(f"{path}: the tokenizer has {len(tokenizer)} token(s): not a usable vocabulary")
    return tokenizer


def prompt_encoder(tokenizer: Any) -> Callable[[str], list[int]]:
    """A text's token ids as the model sees a prompt: special tokens written in the text are their own ids (a
    chat template writes the BOS itself), and where the tokenizer begins every sequence with special tokens of
    its own (Llama's and Mistral's BOS, whether or not `bos_token` names it; Qwen's adds none) and the text does
    not start with them, they are added, as `tokenizer(text)` and transformers' `generate` on it do. What the
    tokenizer adds is asked of it once, here; what it appends after a text (an EOS) is not added to a prompt."""
    prefix = _special_prefix(tokenizer)

    def encode(text: str) -> list[int]:
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        if prefix and ids[: len(prefix)] != prefix:
            ids[:0] = prefix
        return ids

    return encode


PROBES = ("a", "1", "Hello", " ")
"""Texts a tokenizer is asked to encode to see what it adds around a text (the first that encodes to a token)."""


def _special_prefix(tokenizer: Any) -> list[int]:
    """The ids `tokenizer` puts before a text when asked for its special tokens (`[bos]`, or nothing)."""
    for probe in PROBES:
        plain = list(tokenizer(probe, add_special_tokens=False)["input_ids"])
        if not plain:
            continue
        with_special = list(tokenizer(probe)["input_ids"])
        for start in range(len(with_special) - len(plain) + 1):
            if with_special[start : start + len(plain)] == plain:
                return with_special[:start]
        bos = getattr(tokenizer, "bos_token_id", None)  # the text's own tokens changed beside it: its BOS alone
        return [bos] if len(with_special) > len(plain) and with_special[0] == bos else []
    return []


def stop_token_ids(model_dir: str | Path, tokenizer: Any = None) -> list[int]:
    """Every id a response of this checkpoint stops at: the `eos_token_id` of `generation_config.json` and
    of `config.json` (an int or a list: Qwen's chat models stop on `<|im_end|>` and `<|endoftext|>`) and the
    tokenizer's own `eos_token_id`, sorted; a malformed file counts for nothing."""
    found: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        try:
            value = json.loads((Path(model_dir) / name).read_text()).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            continue
        values = value if isinstance(value, list) else [value]
        found.update(v for v in values if isinstance(v, int) and not isinstance(v, bool) and v >= 0)
    own = getattr(tokenizer, "eos_token_id", None)
    if isinstance(own, int) and own >= 0:
        found.add(own)
    return sorted(found)
