"""A policy's weights as Hugging Face safetensors, written and read with the digest in the same pass.

The learner writes a version's weights once: each shard is serialised in memory, hashed and written
(`HashingWriter`), so the directory's sha256 costs no read. A worker reads each file once (`read_verified`),
hashes it and parses the tensors from those same bytes, so what it loads is exactly what it verified, and a
directory that does not match is refused before any tensor of it reaches a model.

The layout is what `save_pretrained` writes: `model.safetensors`, or `model-0000i-of-0000n.safetensors`
shards with `model.safetensors.index.json` when the weights exceed one shard; `{"format": "pt"}` metadata;
a tensor shared under several names (a tied LM head) is written once, under its first name. `config.json`
carries RoPE and dtype under transformers 5's keys and transformers 4's (`transformers4_keys`), so a consumer
pinned to either reads the same model.
"""

from __future__ import annotations

import itertools
import json
import math
import struct
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load, save

from tlt_stream.store.digest import DigestScheme, HashingWriter, read_verified

if TYPE_CHECKING:
    from transformers import PreTrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "INDEX",
    "SHARD_BYTES",
    "PolicyWeights",
    "read_weights",
    "save_policy",
    "transformers4_keys",
    "unique_tensors",
    "write_weights",
]

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
"""safetensors dtype names this reader maps without a copy (others go through safetensors' own parser)."""

SHARD_BYTES = 2 << 30
"""Largest shard: the writer holds one serialised shard in memory, a reader one file's bytes."""
INDEX = "model.safetensors.index.json"
_METADATA = {"format": "pt"}


@dataclass
class PolicyWeights:
    """A policy directory's verified contents: what a loader needs, parsed from the bytes that were hashed."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    """Every tensor of every safetensors file, by its Hugging Face name."""
    config: dict[str, Any] = field(default_factory=dict)
    """`config.json`."""


def unique_tensors(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` with each storage once, under its first name (a tied LM head is the embedding's tensor)."""
    seen: set[tuple[int, tuple[int, ...]]] = set()
    out = {}
    for name, tensor in state.items():
        key = (tensor.data_ptr(), tuple(tensor.shape))
        if tensor.numel() == 0 or key not in seen:
            seen.add(key)
            out[name] = tensor
    return out


def _shards(tensors: dict[str, torch.Tensor], shard_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Consecutive groups of tensors of at most `shard_bytes` (a larger tensor gets a shard of its own)."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    return shards


def write_weights(writer: HashingWriter, state: Mapping[str, torch.Tensor], *, shard_bytes: int | None = None) -> None:
    """Write `state` (tied tensors once) as safetensors into `writer`'s directory, each file hashed as written;
    shards of at most `shard_bytes` (default `SHARD_BYTES`)."""
    tensors = {k: t.detach().to("cpu").contiguous() for k, t in unique_tensors(state).items()}
    shards = _shards(tensors, shard_bytes or SHARD_BYTES)
    if len(shards) == 1:
        writer.write("model.safetensors", save(shards[0], metadata=_METADATA))
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        writer.write(name, save(shard, metadata=_METADATA))
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    writer.write(INDEX, json.dumps(index, indent=2, sort_keys=True).encode())


def read_weights(directory: Path | str, expected_sha256: str, *, scheme: DigestScheme = "v1") -> PolicyWeights:
    """Every tensor and the config of policy `directory`, each file read once and verified against
    `expected_sha256` (`ChecksumMismatch` otherwise, and nothing is returned). ValueError for a weights file
    or config that does not parse."""
    out = PolicyWeights()

    def parse(name: str, data: bytearray) -> None:
        if name.endswith(".safetensors") and "/" not in name:
            try:
                tensors = tensors_in(data)
            except (SafetensorError, ValueError) as exc:
                raise ValueError(f"{directory}/{name}: unreadable safetensors ({exc})") from exc
            clash = out.tensors.keys() & tensors.keys()
            if clash:
                raise ValueError(f"{directory}: tensor {sorted(clash)[0]} is in more than one file")
            out.tensors.update(tensors)
        elif name == "config.json":
            out.config = json.loads(data)

    read_verified(directory, expected_sha256, parse, scheme=scheme)
    return out


def tensors_in(data: bytearray) -> dict[str, torch.Tensor]:
    """The tensors of one safetensors file's bytes, as views of `data` (no copy: a loader copies them into
    its model once). The format: an 8-byte little-endian header length, a JSON header of
    {name: {dtype, shape, data_offsets}} (plus `__metadata__`), then the data. ValueError for a header that
    does not describe the bytes (truncated, overlapping or out-of-range offsets, a size that is not the
    shape's); a dtype this reader does not map, or a big-endian host, goes through safetensors' parser."""
    if len(data) < 8:
        raise ValueError("shorter than a safetensors header")
    (n,) = struct.unpack_from("<Q", data, 0)
    if n > len(data) - 8:
        raise ValueError(f"header length {n} past the end of the file ({len(data)} bytes)")
    try:
        header = json.loads(bytes(data[8 : 8 + n]))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    header.pop("__metadata__", None)
    if sys.byteorder != "little" or any(
        not isinstance(v, dict) or v.get("dtype") not in _DTYPES for v in header.values()
    ):
        return load(bytes(data))
    start, size = 8 + n, len(data) - 8 - n
    out, spans = {}, []
    for name, info in header.items():
        dtype, shape, (begin, end) = _DTYPES[info["dtype"]], info["shape"], info["data_offsets"]
        numel = math.prod(shape)
        if not 0 <= begin <= end <= size:
            raise ValueError(f"tensor {name}: offsets {begin}..{end} out of range of the data ({size} bytes)")
        if end - begin != numel * dtype.itemsize:
            raise ValueError(f"tensor {name}: offsets {begin}..{end} do not hold {info['dtype']}{shape}")
        spans.append((begin, end, name))
        flat = (
            torch.frombuffer(data, dtype=dtype, count=numel, offset=start + begin)
            if numel
            else torch.empty(0, dtype=dtype)
        )
        out[name] = flat.view(shape)
    spans.sort()
    for (_, end, a), (begin, _, b) in itertools.pairwise(spans):
        if begin < end:
            raise ValueError(f"tensors {a} and {b} overlap")
    return out


TRANSFORMERS4_TOP_LEVEL = ("rope_theta", "partial_rotary_factor")
"""RoPE parameters transformers 4 kept at the top level of a config, beside `rope_scaling` rather than in it."""


def transformers4_keys(config: dict[str, Any]) -> dict[str, Any]:
    """The keys a transformers 4 reader takes RoPE and dtype from, carrying the values of `config`'s
    transformers 5 `rope_parameters` and `dtype`, to add to a config this project writes: `rope_theta` at the
    top level, `rope_scaling` (the other parameters, `rope_type` with them) unless the RoPE is default, and
    `torch_dtype`.

    Why: transformers 4, and the engines pinned to it, never read `rope_parameters` or `dtype`; from a config
    without these keys they run default RoPE (wrong logits at every position of a scaled model) in no stated
    dtype. Transformers 5 and the runtime's `spec_from_hf_config` read `rope_scaling` first, so it holds
    exactly the same parameters and both generations load the same RoPE. Per-layer RoPE has no transformers 4
    spelling and is left alone."""
    out: dict[str, Any] = {}
    if config.get("dtype") is not None:
        out["torch_dtype"] = config["dtype"]
    params = dict(config.get("rope_parameters") or {})
    if not params or any(isinstance(v, dict) for v in params.values()):
        return out
    out.update({key: params.pop(key) for key in TRANSFORMERS4_TOP_LEVEL if key in params})
    if params.get("rope_type", "default") != "default":
        out["rope_scaling"] = params
    return out


def _config_json(config: PreTrainedConfig) -> bytes:
    """`config.json` for `config` as `save_pretrained` writes it (validated, its diff from the defaults, sorted
    keys, two-space indent), plus the keys transformers 4 reads RoPE and dtype from (`transformers4_keys`): a
    consumer pinned to transformers 4 would otherwise run a scaled policy with default RoPE. Built in memory so
    the file is written, and hashed, once rather than written by transformers and rewritten here."""
    if hasattr(config, "validate"):  # save_pretrained's check: not every config class is strict
        config.validate()
    data = json.loads(config.to_json_string(use_diff=True))
    data.pop("transformers_weights", None)  # names the source's weights file; save_pretrained drops it too
    data.update(transformers4_keys(data))
    return (json.dumps(data, indent=2, sort_keys=True) + "\n").encode()


def save_policy(
    model: PreTrainedModel,
    out: Path,
    tokenizer: PreTrainedTokenizerBase | None,
    weights: dict[str, torch.Tensor] | None,
    *,
    dtype: torch.dtype | None = None,
) -> str:
    """`model` (or its gathered `weights`) as a Hugging Face directory in `out`, as `save_pretrained` writes
    it for the Llama/Qwen2 models the runtime loads (config with `architectures` and `dtype`, and the same RoPE
    and dtype under transformers 4's keys; generation config, safetensors, tied tensors once), its
    floating-point weights cast to `dtype` when given; returns its v2 sha256, hashed from the bytes as they
    were written (the generation config and tokenizer files, small, are hashed from disk)."""
    state = dict(model.state_dict() if weights is None else weights)
    for ignored in getattr(model, "_keys_to_ignore_on_save", None) or ():
        state.pop(ignored, None)
    if dtype is not None:
        cast: dict[tuple[int, tuple[int, ...]], torch.Tensor] = {}
        state = {
            name: cast.setdefault((t.data_ptr(), tuple(t.shape)), t.detach().to(dtype)) if t.is_floating_point() else t
            for name, t in state.items()
        }
    out.mkdir()
    writer = HashingWriter(out)
    config = model.config
    saved = config.dtype, config.architectures
    config.dtype = str(dtype or model.dtype).removeprefix("torch.")  # config.json says what the files hold
    config.architectures = [type(model).__name__.removeprefix("FSDP")]  # FSDP2 renames the sharded class
    try:
        writer.write("config.json", _config_json(config))
    finally:
        config.dtype, config.architectures = saved
    if getattr(model, "generation_config", None) is not None and model.can_generate():
        model.generation_config.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    write_weights(writer, state)
    return writer.sha256()
