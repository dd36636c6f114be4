"""Building a rollout engine from what a worker asks for: the backend, the batch shape, the draft source and
how the SD arm is chosen. Plain code, no bus: the rollout worker calls it on its first policy version (later
versions are loaded into the same engine in place), tests call it directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from tlt_stream.basics.config import DEFAULTS
from tlt_stream.rollout.adaptive import AdaptiveSd, AdaptiveSettings
from tlt_stream.rollout.arms import Arm

__all__ = ["EngineSpec", "build_engine", "vllm_settings"]

PLAIN_NODES = 64
"""Draft-tree nodes the torch engine's buffers hold at least (room for any arm a table may name)."""


@dataclass(frozen=True)
class EngineSpec:
    max_batch: int
    max_len: int
    temperature: float
    device: str
    """A resolved device: cpu, cuda or cuda:N."""
    dtype: str = DEFAULTS.rollout.dtype
    """Weights and KV cache: auto (bfloat16 on CUDA, float32 on the CPU), float32 or bfloat16."""
    graphs: str = DEFAULTS.rollout.graphs
    """Captured forwards (`model.graphs.resolve_backend`): off, auto, cuda or trace; torch backend only."""
    drafter: str | None = None
    """The draft source: an EAGLE drafter directory, "ngram" (prompt lookup), or None (no speculation)."""
    group: bool = DEFAULTS.sd.group
    """Draft also from the prompt's own responses (`GroupProposer`; with "ngram" it replaces prompt lookup)."""
    group_strong_match: int = DEFAULTS.sd.group_strong_match
    """Match length from which an either arm takes the group's chain (`GroupProposer.strong_match`)."""
    arm: Arm | None = None
    """The fixed arm (with a drafter and no `adaptive`)."""
    adaptive: AdaptiveSettings | None = None
    """Choose SD per step instead of the fixed arm (torch backend only)."""
    backend: Literal["torch", "vllm"] = DEFAULTS.rollout.backend
    hidden: bool = False
    """vLLM only: recompute hidden states for drafter training (the torch engine always has them)."""
    draft_rows: int | None = None
    """Partial rollouts: drafts of the next policy start only while fewer rows than this run (None: any)."""

    def __post_init__(self) -> None:
        if self.drafter is not None and self.adaptive is None and (self.arm is None or self.arm.kind == "plain"):
            raise ValueError(f"a drafter ({self.drafter}) without adaptive SD needs a drafting arm, got {self.arm}")
        if self.backend == "vllm" and self.adaptive is not None:
            raise ValueError("adaptive SD decides per decode step, which vLLM cannot: give a fixed arm")
        if self.backend == "vllm" and self.group:
            raise ValueError("group/history drafts (sd.group) run on the torch engine only")
        if self.backend == "vllm" and self.graphs in ("cuda", "trace"):
            raise ValueError("rollout.graphs is the torch engine's (vLLM captures its own CUDA graphs)")
        if self.group and self.drafter is None:
            raise ValueError("sd.group drafts beside a draft source: set sd.drafter (a drafter, or ngram)")


def _max_nodes(spec: EngineSpec) -> int:
    arms = list(map(Arm.from_label, spec.adaptive.arms)) if spec.adaptive is not None else []
    if spec.arm is not None:
        arms.append(spec.arm)
    return max([PLAIN_NODES, *(max(a.depth, a.nodes) for a in arms)])


def build_engine(
    policy: str, spec: EngineSpec, *, drafter_version: int = -1, weights: Any = None
) -> tuple[Any, AdaptiveSd | None]:
    """(the engine, its adaptive SD controller or None) for the checkpoint directory `policy`, from `weights`
    when given (its contents already read and verified, `store/weights.py`; torch only). The EAGLE drafter
    binds to this policy's embedding and LM head."""
    if spec.backend == "vllm":
        if weights is not None:
            raise ValueError("vLLM's workers read the checkpoint themselves: pass its path, not its tensors")
        from tlt_stream.rollout.vllm.backend import VllmEngine

        drafter = spec.drafter if spec.drafter not in (None, "ngram") else None
        return VllmEngine(policy, settings=vllm_settings(spec), drafter=drafter), None

    from tlt_stream.model import load_model, resolve_dtype
    from tlt_stream.model.graphs import resolve_backend
    from tlt_stream.rollout.adaptive import arm_kinds
    from tlt_stream.rollout.engine import GenerationEngine
    from tlt_stream.rollout.proposers import GroupProposer, MixedProposer, build_proposer

    model = load_model(policy, device=spec.device, dtype=resolve_dtype(spec.dtype, spec.device), weights=weights)
    proposer: Any = None
    if spec.drafter == "ngram" and spec.group:
        proposer = GroupProposer(strong_match=spec.group_strong_match)
    elif spec.drafter is not None:
        proposer = build_proposer(spec.drafter, model)
        if spec.group:
            proposer = MixedProposer(proposer, GroupProposer(strong_match=spec.group_strong_match))
    adaptive = spec.adaptive if proposer is not None else None
    arm = spec.arm if proposer is not None and adaptive is None else None  # adaptive SD sets it step by step
    if arm is not None and arm.kind not in arm_kinds(proposer):
        raise ValueError(f"arm {arm.label} drafts with a source this engine does not have ({type(proposer).__name__})")
    engine = GenerationEngine(
        model,
        spec.max_batch,
        spec.max_len,
        proposer=proposer,
        arm=arm,
        max_draft_nodes=_max_nodes(spec),
        draft_rows=spec.draft_rows,
        graphs=resolve_backend(spec.graphs, model.device),
    )
    controller = AdaptiveSd(engine, adaptive, drafter_version=drafter_version) if adaptive is not None else None
    return engine, controller


def vllm_settings(spec: EngineSpec) -> Any:
    """The vLLM engine's settings for `spec` (pure: vLLM is imported only by the engine itself)."""
    from tlt_stream.rollout.vllm.backend import VllmSettings

    return VllmSettings(
        max_batch=spec.max_batch,
        max_len=spec.max_len,
        temperature=spec.temperature,
        dtype=spec.dtype,
        arm=spec.arm.label if spec.drafter is not None and spec.arm is not None else None,
        hidden="recompute" if spec.hidden else "none",
    )
