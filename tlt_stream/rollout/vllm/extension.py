"""What runs inside vLLM's worker processes: in-place policy reloads and drafter swaps.

`TltWorkerExtension` is mixed into vLLM's worker class by `worker_extension_cls` (named by import path:
`WORKER_EXTENSION`), so `LLM.collective_rpc("tlt_...", args=(path,))` reaches its methods by name in every
worker. A callable would have to be pickled across vLLM's process boundary, which vLLM allows only with
VLLM_ALLOW_INSECURE_SERIALIZATION=1; a name and a path string need nothing of the kind.

- `tlt_prepare()`: the CPU build's broken rejection-sampler kernel replaced (`kernels.py`);
- `tlt_reload_policy(dir)`: the worker's `reload_weights(weights_path=dir)` (vLLM's in-place reload,
  `model_loader/reload/inplace.py`), or `model.load_weights` over the checkpoint's safetensors on a vLLM
  without it (what TRL and OpenRLHF do); then a tied LM head's weight is processed again (the CPU build's
  packed GEMM would keep the old embedding: `_reprocess_tied_heads`).
- `tlt_swap_drafter(export)`: the export's fc and layer tensors into the draft model through vLLM's in-place
  reload (`reload_weights` with the draft as the model: weights a platform repacked after loading, as the
  CPU build does, are loaded in checkpoint format and processed again; a plain `load_weights` fails on
  them), or the draft's own `load_weights` on a vLLM without it; never `embed_tokens`/`lm_head`, which the
  draft shares with the target (loading an export's embedding would overwrite the live policy's).
- `tlt_measure()` / `tlt_drain_steps()`: each decode step's rows, chain length, tokens and seconds
  (`measure.StepMeter` around the model runner), what the per-bucket tuner learns from (`tuning.py`).
- `tlt_draft_tensor(name)`: a parameter of the draft model as vLLM holds it (what a swap loaded).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from tlt_stream.basics.errors import CheckpointError

__all__ = [
    "DRAFT_SHAPE_KEYS",
    "WORKER_EXTENSION",
    "TltWorkerExtension",
    "drafter_swap_layout",
    "drafter_swap_shapes",
    "drafter_swap_tensors",
]

DRAFT_SHAPE_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "attention_bias",
    "qkv_bias",
    "mlp_bias",
)
"""Draft config keys that fix the draft model's parameter shapes (an in-place swap must keep them)."""


SHARED_WITH_TARGET = ("embed_tokens.", "lm_head.")
"""Draft tensors a swap never loads: the draft shares these modules with the target."""


def _weight_files(directory: Path) -> list[Path]:
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{directory}: no safetensors weights")
    return files


def _safetensors_items(directory: Path, *, skip: tuple[str, ...] = ()) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for file in _weight_files(directory):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open handles have keys(), not __iter__)
                if not name.startswith(skip):
                    yield name, f.get_tensor(name)


def drafter_swap_tensors(export: str | Path) -> list[tuple[str, torch.Tensor]]:
    """The tensors of an EAGLE export that an in-place drafter swap loads: the draft's own (fc and its layer),
    never `embed_tokens`/`lm_head`. The draft shares those modules with the target, so loading an export's
    embedding (written with `--policy`) would overwrite the live policy's."""
    return list(_safetensors_items(Path(export), skip=SHARED_WITH_TARGET))


def drafter_swap_shapes(export: str | Path) -> dict[str, tuple[int, ...]]:
    """The layout of what `drafter_swap_tensors` would load (name -> shape), from the files' headers alone: an
    export whose layout is not the engine's drafter's is refused before vLLM loads any of it (vLLM fails
    half-way through an in-place reload, and its draft model is broken after that)."""
    from tlt_stream.drafter.model import tensor_shapes

    return drafter_swap_layout(tensor_shapes(_weight_files(Path(export))))


def drafter_swap_layout(layout: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The part of an export's whole `layout` (name -> shape, its headers as read) that a swap loads: what
    `drafter_swap_shapes` gives for the same files, for a caller that has read the headers already."""
    return {name: shape for name, shape in layout.items() if not name.startswith(SHARED_WITH_TARGET)}


def _runner_model(runner: Any) -> Any:
    get = getattr(runner, "get_model", None)
    return get() if callable(get) else runner.model


def _tied_heads(model: Any) -> list[Any]:
    """The unquantized LM heads (`ParallelLMHead`s) of `model` whose weight is another module's (tied
    embeddings: Qwen3-0.6B's kind), the target's and the draft's alike."""
    owners: dict[int, list[Any]] = {}
    for module in model.modules():
        weight = module._parameters.get("weight") if hasattr(module, "_parameters") else None
        if weight is not None:
            owners.setdefault(id(weight), []).append(module)
    heads = []
    for modules in owners.values():
        if len(modules) < 2:
            continue
        for module in modules:
            method = getattr(module, "quant_method", None)
            if type(module).__name__ == "ParallelLMHead" and type(method).__name__ == "UnquantizedEmbeddingMethod":
                heads.append(module)
    return heads


def _reprocess_tied_heads(model: Any) -> int:
    """After an in-place reload: process each tied LM head's weight again (the number processed).

    A tied head loads nothing from the checkpoint (its weight is the embedding's), so vLLM's layerwise reload
    puts its old tensors back without running `process_weights_after_loading` on it. The embedding's new
    values do reach the shared parameter, but the CPU build computes the logits with a GEMM it packed from
    the head's weight at load time (`dispatch_cpu_unquantized_gemm`), which then still holds the old
    policy's embedding: logits of new hidden states against old output embeddings."""
    heads = _tied_heads(model)
    for head in heads:
        head.quant_method.process_weights_after_loading(head)
    return len(heads)


def _reload_policy_on_worker(worker: Any, path: str) -> None:
    """Reload the target model's weights in place from checkpoint `path` (in a vLLM worker)."""
    runner = worker.model_runner
    reload = getattr(runner, "reload_weights", None)
    if reload is not None and "weights_path" in inspect.signature(reload).parameters:
        worker.reload_weights(weights_path=path, is_checkpoint_format=True)
    else:
        with torch.no_grad():
            _runner_model(runner).load_weights(_safetensors_items(Path(path)))
    with torch.no_grad():
        _reprocess_tied_heads(_runner_model(runner))


def _swap_drafter_on_worker(worker: Any, path: str) -> int:
    """Load an EAGLE export's own tensors into the draft model in place (in a vLLM worker); the embedding
    and LM head stay the target's shared modules (loading them would overwrite the target's)."""
    runner = worker.model_runner
    get = getattr(runner, "get_draft_model", None)
    draft = get() if callable(get) else getattr(getattr(runner, "drafter", None), "model", None)
    if draft is None:
        raise RuntimeError("this vLLM engine has no draft model (it was built without speculative decoding)")
    weights = drafter_swap_tensors(path)
    try:  # vLLM's in-place reload: weights a platform repacked after loading (the CPU build's) are re-processed
        from vllm.model_executor.model_loader.reload.inplace import reload_weights
    except ImportError:
        reload_weights = None
    try:
        from vllm.config import set_current_vllm_config

        context: Any = set_current_vllm_config(worker.vllm_config)
    except (ImportError, AttributeError):
        context = contextlib.nullcontext()
    with context, torch.no_grad():
        if reload_weights is None:
            draft.load_weights(iter(weights))
        else:  # the shared embedding and LM head load nothing: their own tensors are put back
            reload_weights(worker.vllm_config, draft, iter(weights), None, is_checkpoint_format=True)
    return len(weights)


class TltWorkerExtension:
    """Methods vLLM mixes into its worker class (`worker_extension_cls`, named by import path), so that
    `LLM.collective_rpc("tlt_...", args=(path,))` reaches them by name: a callable would have to be pickled
    across vLLM's process boundary, which vLLM allows only with VLLM_ALLOW_INSECURE_SERIALIZATION=1. No
    `__init__` and only `tlt_`-prefixed names (vLLM refuses an extension that shadows a worker attribute)."""

    def tlt_prepare(self) -> list[str]:
        """Once, after the engine started: replace the kernels of vLLM's CPU build that sample wrongly
        (`kernels.py`); the names replaced."""
        from tlt_stream.rollout.vllm.kernels import fix_cpu_kernels

        return fix_cpu_kernels()

    def tlt_reload_policy(self, path: str) -> None:
        _reload_policy_on_worker(self, path)

    def tlt_swap_drafter(self, path: str) -> int:
        return _swap_drafter_on_worker(self, path)

    def tlt_measure(self) -> bool:
        """Start recording each decode step (`measure.StepMeter` around the model runner; once)."""
        from tlt_stream.rollout.vllm.measure import StepMeter

        if getattr(self, "_tlt_meter", None) is None:
            meter = StepMeter()
            meter.install(self.model_runner)  # type: ignore[attr-defined]
            self._tlt_meter = meter
        return True

    def tlt_drain_steps(self) -> list[tuple[int, int, int, float, int]]:
        """The decode steps recorded since the last call: (rows, K, tokens, seconds, drafted)."""
        meter = getattr(self, "_tlt_meter", None)
        return meter.drain() if meter is not None else []

    def tlt_draft_tensor(self, name: str) -> list[float]:
        """The draft model's parameter `name` (vLLM's name, e.g. `model.layers.0.post_attention_layernorm.weight`),
        flattened: the weights a drafter swap put there, read back from the engine."""
        runner = self.model_runner  # type: ignore[attr-defined]
        get = getattr(runner, "get_draft_model", None)
        draft = get() if callable(get) else getattr(getattr(runner, "drafter", None), "model", None)
        if draft is None:
            raise RuntimeError("this vLLM engine has no draft model")
        return dict(draft.named_parameters())[name].detach().float().flatten().tolist()

    def tlt_bind_group(self) -> bool:
        """Hand the group proposer (`group.GroupDrafts`, vLLM's custom proposer) the model runner whose
        input batch names its rows; False when this engine drafts with something else."""
        from tlt_stream.rollout.vllm.group import GroupDrafts

        runner = self.model_runner  # type: ignore[attr-defined]
        drafter = getattr(runner, "drafter", None)
        if not isinstance(drafter, GroupDrafts):
            return False
        drafter.bind(runner)
        return True

    def tlt_group_remember(self, prompt: list[int], response: list[int]) -> bool:
        """Index a finished response produced elsewhere as history for `prompt` (False without a group
        proposer)."""
        from tlt_stream.rollout.vllm.group import GroupDrafts

        drafter = getattr(self.model_runner, "drafter", None)  # type: ignore[attr-defined]
        if not isinstance(drafter, GroupDrafts):
            return False
        drafter.remember(prompt, response)
        return True

    def tlt_group_drafted(self) -> int:
        """Rows the group proposer gave a non-empty chain so far (0 without one)."""
        return int(getattr(getattr(self.model_runner, "drafter", None), "drafted", 0))  # type: ignore[attr-defined]


WORKER_EXTENSION = f"{TltWorkerExtension.__module__}.{TltWorkerExtension.__qualname__}"
