"""The target's cached forward at static shapes, captured once per shape and replayed.

At small batches a decode step or a verify round is launch-bound on a GPU: a few hundred kernels of
microseconds each, launched one by one from Python. A CUDA graph records them once per shape and replays
them with one launch. What a graph needs is a forward with no host reads and no data-dependent shapes:

- attention reads a fixed number S of cache entries, the active rows' longest length plus the new tokens
  rounded up to `len_step`, and masks the rest on the device (`attention_context(static_len=S)`); the eager
  forward reads exactly max(length) + T entries, which it learns by a host read;
- the batch is padded up to a capture size (`batch_sizes`). Padded rows run in the idle slots after the
  active ones (the scheduler keeps active rows in slots 0..B-1): they write only in those slots'
  uncommitted region (clamped to the cache), which no forward reads before writing it, and their outputs
  are dropped;
- inputs are copied into buffers the graph owns, and the output is the graph's own buffer, valid until the
  next call (callers index or copy what they keep, as the engine does).

Weights are swapped in place (`GenerationEngine.load_policy` copies into the same tensors), so graphs stay
valid across policy versions.

Two replay backends with one contract:
- "cuda": `torch.cuda.CUDAGraph`, one memory pool shared by every shape;
- "trace": the aten ops of one run, recorded by a dispatch mode and replayed on the same tensors. Python
  control flow, shapes and scalars are frozen at capture exactly as in a CUDA graph, and host reads during
  capture are refused as CUDA refuses them, so the CPU tests hold the captured forward (not only the static
  one) to the eager forward. It also skips the modules' Python on a CPU.
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from tlt_stream.model.cache import KVCache
from tlt_stream.model.transformer import Transformer

log = logging.getLogger(__name__)

__all__ = ["BATCH_SIZES", "ForwardGraphs", "GraphBackend", "GraphCaptureError", "record", "resolve_backend"]

GraphBackend = Literal["cuda", "trace"]

BATCH_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)
"""Batch sizes captured (a batch runs at the smallest that holds it); vLLM's default capture list is similar."""


def attention_span(needed: int, len_step: int, max_len: int) -> int:
    """Cache entries a captured forward reads when it needs `needed`: whole `len_step`s up to 4 of them,
    then the next power of two of them, capped at the cache; so a context of n tokens runs in at most
    4 + log2(n / (4 len_step)) shapes, and reads under twice what it needs."""
    steps = math.ceil(needed / len_step)
    if steps > 4:
        steps = 1 << (steps - 1).bit_length()
    return min(max_len, steps * len_step)


def _aten(*names: str) -> frozenset[Any]:
    """aten overloads by name ("op" for its default overload, "op.overload")."""
    found = []
    for name in names:
        packet, _, overload = name.partition(".")
        found.append(getattr(getattr(torch.ops.aten, packet), overload or "default"))
    return frozenset(found)


_HOST_READS = _aten(
    "item",
    "_local_scalar_dense",
    "is_nonzero",
    "equal",
    "nonzero",
    "masked_select",
    "_unique2",
    "unique_dim",
    "unique_consecutive",
    "repeat_interleave.Tensor",
)
"""Ops whose result the host must wait for, or whose output shape depends on data: refused during a capture.
`tolist`, `numpy` and `.cpu()` read a CPU tensor without an op, so a CPU test cannot see them; any other op
whose output shape changes between capture and replay is refused at the replay (`Trace.replay`), and what a
frozen host value changes shows as a replay that differs from the eager forward, which the tests check with
inputs that change between calls. So the stand-in is close to, not the same as, a CUDA capture."""


class GraphCaptureError(RuntimeError):
    """The function read the device from the host (or made a shape from data) while being captured."""


def resolve_backend(setting: str, device: torch.device) -> GraphBackend | None:
    """The backend for a `rollout.graphs` setting: "off" none, "auto" CUDA graphs on a CUDA device (none
    elsewhere), "cuda" or "trace" as named (cuda needs a CUDA device)."""
    if setting == "off":
        return None
    if setting == "auto":
        return "cuda" if device.type == "cuda" else None
    if setting == "cuda" and device.type != "cuda":
        raise ValueError(f"rollout.graphs=cuda needs a CUDA device, the model is on {device}")
    if setting not in ("cuda", "trace"):
        raise ValueError(f"rollout.graphs must be off, auto, cuda or trace, got {setting!r}")
    return setting  # type: ignore[return-value]


def _locate(value: Any, slots: dict[int, int], path: tuple) -> list[tuple[tuple, int]]:
    """(path, value slot) of every tensor in `value` (an op's argument: a tensor, or a list or tuple of
    them) that an earlier op of the trace produced."""
    if isinstance(value, torch.Tensor):
        return [(path, slots[id(value)])] if id(value) in slots else []
    if isinstance(value, list | tuple):
        return [found for j, item in enumerate(value) for found in _locate(item, slots, (*path, j))]
    return []


class _Op:
    """One recorded op, ready to run again: its arguments as recorded, with the places where a value the
    trace produced goes (a top-level argument, or an item of a list argument such as `index_put_`'s)."""

    __slots__ = ("args", "call", "func", "inner", "kwargs", "nested", "out_slots", "shape", "single")

    def __init__(self, func: Any, args: Sequence[Any], kwargs: dict[str, Any], slots: dict[int, int]) -> None:
        self.func = func
        self.call = getattr(func, "_op", func)  # the C++ entry point: skips OpOverload's Python __call__
        self.args, self.kwargs = list(args), dict(kwargs)
        found = [f for i, a in enumerate(args) for f in _locate(a, slots, (i,))]
        found += [f for name, a in kwargs.items() for f in _locate(a, slots, (name,))]
        self.inner = [(path[0], slot) for path, slot in found if len(path) == 1]
        self.nested = [(path, slot) for path, slot in found if len(path) > 1]
        if any(len(path) > 2 for path, _ in self.nested):
            raise GraphCaptureError(f"{func} takes a traced tensor nested deeper than a list: not replayable")
        # Drop the recording's own intermediates (a replay puts its values there): a trace holds no memory
        # but its inputs' and the tensors made outside it.
        for at, _ in self.inner:
            if isinstance(at, int):
                self.args[at] = None
            else:
                self.kwargs[at] = None
        for path, _ in self.nested:
            holder = self.args if isinstance(path[0], int) else self.kwargs
            items = list(holder[path[0]])  # type: ignore[index]
            items[path[1]] = None
            holder[path[0]] = items  # type: ignore[index]
        self.out_slots: list[tuple[int, int]] = []
        self.single = True
        self.shape: torch.Size | None = None
        """The output's shape when recorded (one-tensor outputs): a replay must give the same."""

    def run(self, values: list[Any]) -> Any:
        args, kwargs = self.args, self.kwargs
        if self.inner or self.nested:
            args, kwargs = list(args), dict(kwargs)
            for at, slot in self.inner:
                if isinstance(at, int):
                    args[at] = values[slot]
                else:
                    kwargs[at] = values[slot]
            for path, slot in self.nested:
                holder = args if isinstance(path[0], int) else kwargs
                items = list(holder[path[0]])  # type: ignore[index]
                items[path[1]] = values[slot]
                holder[path[0]] = items  # type: ignore[index]
        return self.call(*args, **kwargs)


class _Recorder(TorchDispatchMode):
    """Runs every aten op as usual and records it, with which earlier op made each of its tensor arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[_Op] = []
        self.slots: dict[int, int] = {}
        """id(tensor) -> value slot, for the tensors the trace produced."""
        self.keep: list[Any] = []
        """Every recorded output, held so that no id is reused while recording."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _HOST_READS:
            raise GraphCaptureError(f"{func} reads the device from the host while a graph is being captured")
        op = _Op(func, args, kwargs, self.slots)
        out = func(*args, **kwargs)
        op.single = isinstance(out, torch.Tensor)
        op.shape = out.shape if op.single else None
        for i, x in enumerate([out] if op.single else tree_flatten(out)[0]):
            if isinstance(x, torch.Tensor):
                op.out_slots.append((i, self.slots.setdefault(id(x), len(self.slots))))
        self.keep.append(out)
        self.ops.append(op)
        return out


@dataclass
class Trace:
    """A recorded function: `replay()` runs its ops again on the tensors they read then (inputs, weights,
    the cache) and returns what the function returned."""

    ops: list[_Op]
    slots: int
    output_slot: int | None
    output: torch.Tensor

    def replay(self) -> torch.Tensor:
        values: list[Any] = [None] * self.slots
        for op in self.ops:
            out = op.run(values)
            if op.single:
                if out.shape != op.shape:  # a shape made from data: a CUDA graph would replay the old one
                    raise GraphCaptureError(
                        f"{op.func} returned {tuple(out.shape)} on replay, {tuple(op.shape)} when recorded"
                    )
                for _, slot in op.out_slots:
                    values[slot] = out
            elif op.out_slots:
                leaves = tree_flatten(out)[0]
                for i, slot in op.out_slots:
                    values[slot] = leaves[i]
        return self.output if self.output_slot is None else values[self.output_slot]


def record(fn: Callable[[], torch.Tensor]) -> Trace:
    """Run `fn` once, recording its aten ops (`Trace`); raises `GraphCaptureError` on a host read."""
    recorder = _Recorder()
    with recorder:
        output = fn()
    return Trace(recorder.ops, len(recorder.slots), recorder.slots.get(id(output)), output)


class _Inputs:
    """The input buffers every captured shape reads, allocated once for the largest shape: a shape's inputs
    are contiguous views of their first elements, so the memory they take does not grow with the shapes."""

    def __init__(self, max_batch: int, max_tokens: int, device: torch.device) -> None:
        self.ids = torch.zeros(max_batch * max_tokens, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_batch * max_tokens, dtype=torch.long, device=device)
        self.tree_mask = torch.zeros(max_batch * max_tokens * max_tokens, dtype=torch.bool, device=device)


class _Graph:
    """One captured shape: its input views and how to replay it."""

    def __init__(self, batch: int, tokens: int, tree: bool, inputs: _Inputs) -> None:
        n = batch * tokens
        self.ids = inputs.ids[:n].view(batch, tokens)
        self.positions = inputs.positions[:n].view(batch, tokens)
        self.tree_mask = inputs.tree_mask[: n * tokens].view(batch, tokens, tokens) if tree else None
        self.replay: Callable[[], torch.Tensor] = lambda: torch.empty(0)


class ForwardGraphs:
    """`Transformer.forward` over `cache` slots 0..B-1 (decode steps, verify rounds), captured per
    (padded batch, tokens, attention length, tree or causal) and replayed. `__call__` has the eager
    forward's semantics for `first_slot=0, spec_offset=0` and no `num_new`.

    Batches larger than the largest capture size (or the cache), and calls of more than `max_tokens`
    tokens, run eagerly. At most `max_graphs` shapes are kept (least recently used dropped). The span
    grows in `len_step`s up to 4 of them, then doubles, so a long context adds few shapes (attention reads
    at most twice the entries it needs).

    A shape whose capture fails, or (with `check`, on by default for CUDA) whose first replay disagrees
    with one eager forward over the same inputs, is logged and runs eagerly from then on: the forward is
    idempotent (it writes the same K/V again), so the check costs one forward per shape. Every graph
    writes its output into one buffer `[max_batch, max_tokens, H]` allocated outside the graphs' shared
    memory pool and reads its inputs from views of one set of input buffers, so the device memory they hold
    is one graph's intermediates plus those buffers, whatever the number of shapes (a graph's own output,
    kept alive for its replays, would hold a buffer per shape); `model.sizing.engine_bytes_per_row` counts
    the buffers."""

    def __init__(
        self,
        model: Transformer,
        cache: KVCache,
        backend: GraphBackend,
        *,
        batch_sizes: Sequence[int] = BATCH_SIZES,
        len_step: int = 128,
        max_graphs: int = 256,
        max_tokens: int = 65,
        check: bool | None = None,
    ) -> None:
        if backend == "cuda" and model.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the model is on {model.device}")
        if min(len_step, max_graphs, max_tokens) <= 0:
            raise ValueError(
                f"len_step, max_graphs and max_tokens must be positive: {len_step}, {max_graphs}, {max_tokens}"
            )
        self.model, self.cache, self.backend = model, cache, backend
        sizes = {s for s in batch_sizes if 0 < s < cache.max_batch}
        if cache.max_batch <= max(batch_sizes):  # the cache's own batch, so no batch it holds runs eagerly
            sizes.add(cache.max_batch)
        self.batch_sizes = sorted(sizes)
        self.len_step, self.max_graphs, self.max_tokens = len_step, max_graphs, max_tokens
        self._out = torch.empty(
            (cache.max_batch, max_tokens, model.spec.hidden_size), dtype=model.dtype, device=model.device
        )
        """The output buffer every graph writes."""
        self._inputs = _Inputs(cache.max_batch, max_tokens, model.device)
        """The input buffers every graph reads (views of them)."""
        self._graphs: OrderedDict[tuple[int, int, int, bool], _Graph] = OrderedDict()
        self._pool: Any = torch.cuda.graph_pool_handle() if backend == "cuda" else None
        self.check = backend == "cuda" if check is None else check
        self._refused: set[tuple[int, int, int, bool]] = set()
        """Shapes that run eagerly: their capture failed or their first replay disagreed."""
        self.captures = 0
        """Shapes captured so far (a dropped shape captured again counts again)."""
        self.dropped = 0
        """Shapes dropped to keep `max_graphs`."""
        self.failed = 0
        """Shapes whose capture failed or whose first replay disagreed with the eager forward."""
        self.replays = 0
        self.eager = 0
        """Calls that ran eagerly (batch above every capture size, too many tokens, a refused shape)."""
        self.capture_seconds = 0.0
        """Wall seconds spent capturing (warm-up runs included; the device synchronised around each)."""

    def __call__(
        self, ids: torch.Tensor, positions: torch.Tensor, tree_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`ids`, `positions [B, T]`, `tree_mask [B, T, T]` bool or None (causal) -> hidden `[B, T, H]`."""
        b, t = ids.shape
        padded = next((s for s in self.batch_sizes if s >= b), None)
        if padded is None or t > self.max_tokens:
            return self._eager(ids, positions, tree_mask)
        hi = int(self.cache.lengths[:b].max())  # the one host read, outside the graph
        if hi + t > self.cache.max_len:
            raise ValueError(f"{t} new tokens after {hi} cached ones exceed the cache ({self.cache.max_len} entries)")
        span = attention_span(hi + t, self.len_step, self.cache.max_len)
        key = (padded, t, span, tree_mask is not None)
        if key in self._refused:
            return self._eager(ids, positions, tree_mask)
        graph = self._graphs.get(key)
        fresh = graph is None
        if graph is None:
            graph = _Graph(padded, t, tree_mask is not None, self._inputs)
        graph.ids[:b].copy_(ids)
        graph.positions[:b].copy_(positions)
        if b < padded:
            graph.ids[b:].zero_()
            graph.positions[b:].zero_()
        if graph.tree_mask is not None:
            assert tree_mask is not None
            graph.tree_mask[:b].copy_(tree_mask)
            if b < padded:  # padded rows: each node sees itself only
                graph.tree_mask[b:].zero_()
                graph.tree_mask[b:].diagonal(dim1=-2, dim2=-1).fill_(True)
        if fresh:
            started = self._clock()
            try:
                out = self._capture(graph, span)
                problem = self._disagreement(graph, out, b) if self.check else None
            except Exception as err:  # a backend's capture error: logged, and the shape runs eagerly
                problem = f"capture failed: {type(err).__name__}: {err}"
            self.capture_seconds += self._clock() - started
            if problem is not None:
                self.failed += 1
                self._refused.add(key)
                log.warning("forward graph for batch %d, %d tokens, span %d runs eagerly: %s", padded, t, span, problem)
                return self._eager(ids, positions, tree_mask)
            if self.check:  # the check's eager forward wrote its own K/V: the graph writes them again
                out = graph.replay()
            self._graphs[key] = graph
            while len(self._graphs) > self.max_graphs:
                self._graphs.popitem(last=False)
                self.dropped += 1
            self.captures += 1
        else:
            self._graphs.move_to_end(key)
            out = graph.replay()
            self.replays += 1
        return out[:b]

    def _eager(self, ids: torch.Tensor, positions: torch.Tensor, tree_mask: torch.Tensor | None) -> torch.Tensor:
        self.eager += 1
        return self.model(ids, positions, self.cache, tree_mask=tree_mask)

    def _disagreement(self, graph: _Graph, out: torch.Tensor, b: int) -> str | None:
        """Why the first replay's rows 0..b-1 are not the eager forward's over the same inputs, or None."""
        mask = graph.tree_mask[:b] if graph.tree_mask is not None else None
        eager = self.model(graph.ids[:b], graph.positions[:b], self.cache, tree_mask=mask)
        got = out[:b].float()
        want = eager.float()
        scale = float(want.abs().max()) if want.numel() else 0.0
        error = float((got - want).abs().max()) if want.numel() else 0.0
        tolerance = (1e-3 if self.model.dtype == torch.float32 else 5e-2) * max(1.0, scale)
        if not math.isfinite(error) or error > tolerance:
            return f"its first replay differs from the eager forward by {error:.3g} (tolerance {tolerance:.3g})"
        return None

    def _clock(self) -> float:
        if self.backend == "cuda":
            torch.cuda.synchronize(self.model.device)
        return time.perf_counter()

    def _run(self, graph: _Graph, span: int) -> torch.Tensor:
        hidden = self.model(graph.ids, graph.positions, self.cache, tree_mask=graph.tree_mask, static_len=span)
        b, t = graph.ids.shape
        return self._out[:b, :t].copy_(hidden)

    def _capture(self, graph: _Graph, span: int) -> torch.Tensor:
        """Capture `graph`'s shape; returns the output of the run that captured it (for the current inputs)."""
        if self.backend == "trace":
            trace = record(lambda: self._run(graph, span))
            graph.replay = trace.replay
            return trace.output
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up runs (allocator, kernels' lazy set-up) outside the capture
            for _ in range(2):
                self._run(graph, span)
        torch.cuda.current_stream().wait_stream(side)
        cuda_graph = torch.cuda.CUDAGraph()
        # thread_local: another thread of the worker may use the device meanwhile (the idle drafter trainer)
        with torch.cuda.graph(cuda_graph, pool=self._pool, capture_error_mode="thread_local"):
            out = self._run(graph, span)

        def replay() -> torch.Tensor:
            cuda_graph.replay()
            return out

        graph.replay = replay
        return replay()
