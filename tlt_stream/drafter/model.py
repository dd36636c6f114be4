"""The EAGLE-style drafter: one decoder layer that predicts the target's next hidden state.

Input at position t+1 is `fc([embed(x_{t+1}); f_t])` (2H -> H, no bias), where f_t is the target's final-norm
hidden state at position t (the state whose logits predicted x_{t+1}) during catch-up, or the drafter's
own prediction while drafting ahead. One decoder layer with the first input norm dropped turns it into
f^_{t+1}; the target's frozen LM head turns that into q(x_{t+2}). The embedding and LM head are borrowed
from the bound target and never saved with the drafter, so a drafter checkpoint is small and always
pairs with the current policy's head.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from tlt_stream.model.cache import KVCache
from tlt_stream.model.layers import DecoderLayer, attention_context, rope_inv_freq, rope_tables
from tlt_stream.model.loader import CheckpointError
from tlt_stream.model.spec import POSITIVE_SIZES, ModelSpec
from tlt_stream.model.transformer import Transformer

__all__ = [
    "DRAFTER_ARCHITECTURE",
    "Drafter",
    "check_drafter_fits",
    "drafter_layer_spec",
    "layout_mismatch",
    "load_drafter",
    "read_drafter",
    "read_drafter_spec",
    "save_drafter",
    "tensor_shapes",
]

DRAFTER_ARCHITECTURE = "TltEagleDrafter"
WEIGHTS = "model.safetensors"
CONFIG = "config.json"


def drafter_layer_spec(spec: ModelSpec) -> ModelSpec:
    """The drafter's one layer for a target of shape `spec`: the target's sizes, biases and RoPE (positions
    as long as the target's), in the Llama layout vLLM's EAGLE loader reads (Qwen2 keeps its q/k/v bias;
    no q/k norm, no attention window: the drafter's own choices, which bind to no target weight)."""
    arch = "qwen2" if spec.architecture == "qwen2" else "llama"
    return dataclasses.replace(spec, architecture=arch, num_layers=1, qk_norm=False, sliding_window=None)


class Drafter(nn.Module):
    """fc + one decoder layer; `bind(target)` lends it the target's embedding and LM head (frozen)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        layer_spec = drafter_layer_spec(spec)
        self.spec = layer_spec
        h = spec.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layer = DecoderLayer(layer_spec)
        self.layer.input_layernorm = nn.Identity()  # EAGLE drops the first layer's input norm
        self.register_buffer("inv_freq", rope_inv_freq(layer_spec), persistent=False)
        self._embed: torch.Tensor | None = None
        self._lm_head: torch.Tensor | None = None

    def bind(self, target: Transformer) -> Drafter:
        """Borrow `target`'s embedding and LM head (frozen; shared memory, not copied)."""
        if target.spec.hidden_size != self.spec.hidden_size or target.spec.vocab_size != self.spec.vocab_size:
            raise CheckpointError(
                f"drafter (hidden {self.spec.hidden_size}, vocab {self.spec.vocab_size}) does not fit the "
                f"target (hidden {target.spec.hidden_size}, vocab {target.spec.vocab_size})"
            )
        self._embed = target.embed_tokens.weight.detach()
        self._lm_head = target.lm_head_weight.detach()
        return self

    @property
    def bound(self) -> bool:
        return self._embed is not None

    @property
    def policy_dtype(self) -> torch.dtype:
        """The dtype of the bound target's weights (what `load_drafter` casts a drafter to for drafting)."""
        embed, _ = self._require_bound()
        return embed.dtype

    def _require_bound(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._embed is None or self._lm_head is None:
            raise RuntimeError("drafter is not bound to a target; call drafter.bind(target) first")
        return self._embed, self._lm_head

    def new_cache(self, max_batch: int, max_len: int) -> KVCache:
        w = self.fc.weight
        return KVCache.for_model(self.spec, max_batch, max_len, dtype=w.dtype, device=w.device)

    def forward(
        self,
        tokens: torch.Tensor,
        features: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        *,
        num_new: torch.Tensor | None = None,
        tree_mask: torch.Tensor | None = None,
        first_slot: int = 0,
        spec_offset: int = 0,
    ) -> torch.Tensor:
        """Predict next hidden states for `tokens [B, T]` paired with `features [B, T, H]` at `positions`.

        Cache semantics are the target's (`Transformer.forward`), including `spec_offset` for drafting
        several levels ahead without committing. Returns `[B, T, H]`.
        """
        x = self.fc(self._inputs(tokens, features))  # [B, T, H]
        ctx = attention_context(
            positions,
            cache,
            self.inv_freq,
            x.dtype,
            num_new=num_new,
            tree_mask=tree_mask,
            first_slot=first_slot,
            spec_offset=spec_offset,
            rope_scale=self.spec.rope_attention_factor,
        )
        return self.layer(x, cache.k[0], cache.v[0], ctx)

    def dense(
        self, tokens: torch.Tensor, features: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """Cache-free forward for training: `tokens [B, T]`, `features [B, T, H]`, `positions [B, T]`,
        `mask [B, 1, T, T]` bool (block-diagonal causal for packed windows). Returns `[B, T, H]`."""
        x = self.fc(self._inputs(tokens, features))
        cos, sin = rope_tables(positions, self.inv_freq, x.dtype, self.spec.rope_attention_factor)
        return self.layer.dense(x, cos, sin, mask)

    def _inputs(self, tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """`[embed(tokens); features]` in the drafter's own dtype, which may be wider than the borrowed
        embedding's (the online trainer keeps float32 weights for a bf16 policy)."""
        embed, _ = self._require_bound()
        dtype = self.fc.weight.dtype
        return torch.cat([F.embedding(tokens, embed).to(dtype), features.to(dtype)], dim=-1)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The borrowed LM head over `hidden`, computed in the head's dtype."""
        _, head = self._require_bound()
        return F.linear(hidden.to(head.dtype), head)


def save_drafter(
    drafter: Drafter,
    path: str | Path,
    *,
    metadata: dict[str, object] | None = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write the drafter's own weights (not the borrowed embedding/head) and config to directory `path`;
    with `dtype`, its floating-point weights cast to that dtype."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {
        k: (v.detach().to(dtype) if dtype is not None and v.is_floating_point() else v.detach()).contiguous()
        for k, v in drafter.state_dict().items()
    }
    save_file(tensors, str(path / WEIGHTS))
    config = {"architectures": [DRAFTER_ARCHITECTURE], "spec": dataclasses.asdict(drafter.spec), **(metadata or {})}
    (path / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True))
    return path


_POSITIVE_INTS = frozenset({*POSITIVE_SIZES, "max_position_embeddings", "sliding_window"})
"""Integer fields of a spec that must be at least 1 (`rope_original_max_positions` may be 0)."""


def _spec_field(name: str, kind: str, value: object) -> str | None:
    """Why `value` is not a valid `ModelSpec.name` of annotated type `kind` (None when it is): a finite
    positive number of the right type, a bool, a string (a JSON config can hold NaN, Infinity, 1.5 or
    "128" where an integer belongs, which `ModelSpec` itself does not refuse)."""
    if value is None:
        return None if "None" in kind else "must not be null"
    if kind.startswith("int"):
        if not isinstance(value, int) or isinstance(value, bool):
            return f"must be an integer, got {value!r}"
        floor = 1 if name in _POSITIVE_INTS else 0
        return None if value >= floor else f"must be >= {floor}, got {value}"
    if kind == "float":
        if not isinstance(value, int | float) or isinstance(value, bool):
            return f"must be a number, got {value!r}"
        return None if math.isfinite(value) and value > 0 else f"must be a finite positive number, got {value}"
    if kind == "bool":
        return None if isinstance(value, bool) else f"must be true or false, got {value!r}"
    return None if isinstance(value, str) else f"must be a string, got {value!r}"


def read_drafter_spec(path: str | Path) -> ModelSpec:
    """The validated spec of the drafter checkpoint at directory `path`, from its config alone (the weights
    are not read): raises `CheckpointError`, in one line, unless both files are there and the config is one
    `save_drafter` could have written: every field of the right type and finite, and the shape of a drafter
    (one layer, no q/k norm, no attention window; the tensors hold exactly that)."""
    path = Path(path)
    config_file, weights_file = path / CONFIG, path / WEIGHTS
    for needed in (config_file, weights_file):
        if not needed.is_file():
            raise CheckpointError(f"{path}: not a drafter checkpoint ({needed.name} is missing)")
    try:
        config = json.loads(config_file.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{config_file}: not UTF-8 text ({exc.reason})") from None
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{config_file}: invalid JSON ({exc})") from None
    except OSError as exc:
        raise CheckpointError(f"{config_file}: cannot read ({exc.strerror or exc})") from None
    if not isinstance(config, dict) or config.get("architectures") != [DRAFTER_ARCHITECTURE]:
        found = config.get("architectures") if isinstance(config, dict) else config
        raise CheckpointError(f"{path}: architectures {found} is not [{DRAFTER_ARCHITECTURE!r}]")
    raw = config.get("spec")
    if not isinstance(raw, dict):
        raise CheckpointError(f"{config_file}: invalid drafter spec ('spec' must be an object)")
    kinds = {f.name: str(f.type) for f in dataclasses.fields(ModelSpec)}
    for name, value in raw.items():
        why = _spec_field(name, kinds[name], value) if name in kinds else "is not a drafter spec field"
        if why is not None:
            raise CheckpointError(f"{config_file}: invalid drafter spec (spec.{name} {why})")
    try:
        spec = ModelSpec(**raw)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{config_file}: invalid drafter spec ({exc})") from None
    shaped = drafter_layer_spec(spec)
    if shaped != spec:
        wrong = [
            f"{f.name} {getattr(spec, f.name)!r} where a drafter has {getattr(shaped, f.name)!r}"
            for f in dataclasses.fields(ModelSpec)
            if getattr(spec, f.name) != getattr(shaped, f.name)
        ]
        raise CheckpointError(
            f"{config_file}: the spec says {', '.join(wrong)} (its tensors hold one plain decoder layer); "
            "remake the drafter with `tlt-stream drafter init`"
        )
    return spec


def check_drafter_fits(drafter: tuple[object, object], policy: tuple[object, object], *, named: str, fits: str) -> None:
    """Refuse, in one line, a drafter of (hidden size, vocabulary) `drafter` for a policy of `policy`: it reads
    the policy's hidden states and borrows its embedding and LM head, so both must be equal. `named` says
    which drafter (a path, a flag), `fits` which policy."""
    if drafter != policy:
        raise CheckpointError(
            f"{named}: made for a policy of hidden size {drafter[0]} and vocabulary {drafter[1]}, not {fits} "
            f"({policy[0]}, {policy[1]}); make one for it with `tlt-stream drafter init`"
        )


Shapes = Mapping[str, tuple[int, ...]]
"""A drafter's layout: tensor name -> shape."""


def tensor_shapes(files: Iterable[Path]) -> dict[str, tuple[int, ...]]:
    """The layout of the tensors in safetensors `files`, from their headers alone (no tensor is read): what a
    drafter's weights can be checked against before they are loaded anywhere. A file that is not whole
    safetensors is refused with `CheckpointError`, in one line."""
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open handles have keys(), not __iter__)
                    shapes[name] = tuple(f.get_slice(name).get_shape())
        except (SafetensorError, OSError) as exc:  # truncated, foreign or unreadable file
            raise CheckpointError(f"{file}: unreadable safetensors ({exc})") from None
    return shapes


def layout_mismatch(found: Shapes, expected: Shapes) -> str | None:
    """Why drafter weights of layout `found` do not fit a drafter of layout `expected`, in words for one line
    (None when they fit): names missing or unexpected, else the first tensor of another shape."""
    if set(found) != set(expected):
        missing, extra = sorted(set(expected) - set(found)), sorted(set(found) - set(expected))
        return f"drafter weights do not match (missing {missing}, unexpected {extra})"
    for name, shape in found.items():
        if tuple(shape) != tuple(expected[name]):
            return f"{name} has shape {tuple(shape)}, expected {tuple(expected[name])}"
    return None


def read_drafter(path: str | Path) -> Drafter:
    """Read a drafter saved by `save_drafter` without binding it: float32 on the CPU, its own weights only
    (what an export needs; `load_drafter` binds it to a target for drafting). Weights of another layout than
    the spec's (checked from the file's header before any tensor is read) or not all finite are refused, in
    one line."""
    path = Path(path)
    weights_file = path / WEIGHTS
    spec = read_drafter_spec(path)
    drafter = Drafter(spec)
    expected = {name: tuple(t.shape) for name, t in drafter.state_dict().items()}
    if (why := layout_mismatch(tensor_shapes([weights_file]), expected)) is not None:
        raise CheckpointError(f"{path}: {why}")
    try:
        state = load_file(str(weights_file))
    except (SafetensorError, OSError) as exc:  # changed or unreadable since its header was read
        raise CheckpointError(f"{weights_file}: unreadable safetensors ({exc})") from None
    for name in sorted(state):  # a diverged drafter drafts nothing and would be exported as it is
        if state[name].is_floating_point() and not bool(torch.isfinite(state[name]).all()):
            raise CheckpointError(
                f"{weights_file}: {name} holds NaN or infinite values; "
                "remake the drafter with `tlt-stream drafter init`"
            )
    drafter.load_state_dict(state)
    return drafter


def load_drafter(path: str | Path, target: Transformer) -> Drafter:
    """Load a drafter saved by `save_drafter` and bind it to `target` (dtype and device follow the target)."""
    drafter = read_drafter(path)
    drafter.to(device=target.device, dtype=target.dtype)
    return drafter.bind(target).eval()
