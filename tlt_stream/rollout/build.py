"""Building a rollout engine from the configuration: the backend, the batch shape, the draft source and how
the SD arm is chosen. Plain code, no bus: the rollout worker calls it on its first policy version (later
versions are loaded into the same engine in place), tests and benchmarks call it directly.

What the sections forbid together (vLLM with adaptive SD or group drafts, a plain arm beside a drafter) is
refused when the configuration is loaded (`config/rules.py`); what only the built draft source can tell (an
arm it cannot draft) is refused here.
"""

from __future__ import annotations

from typing import Any

from tlt_stream.basics.config import Config, SdConfig
from tlt_stream.rollout.adaptive import AdaptiveSd
from tlt_stream.rollout.arms import Arm

__all__ = ["build_engine", "fixed_arm", "vllm_settings"]

PLAIN_NODES = 64
"""Draft-tree nodes the torch engine's buffers hold at least (room for any arm a table may name)."""


def fixed_arm(sd: SdConfig, drafter: str | None) -> Arm:
    """The arm SD runs when it is not adaptive: `sd.arm`, made a prompt-lookup chain of its depth for the
    n-gram source, and a group arm when group drafts stand in for prompt lookup (they include it)."""
    arm = Arm.from_label(sd.arm)
    if drafter == "ngram" and arm.kind == "drafter":
        arm = Arm.ngram(arm.depth)
    if drafter == "ngram" and sd.group and arm.kind == "ngram":
        arm = Arm.group_source(arm.depth, arm.depth)
    return arm


def _max_nodes(sd: SdConfig, adaptive: bool, arm: Arm | None) -> int:
    arms = list(map(Arm.from_label, sd.arms)) if adaptive else []
    if arm is not None:
        arms.append(arm)
    return max([PLAIN_NODES, *(max(a.depth, a.nodes) for a in arms)])


def build_engine(
    policy: str,
    config: Config,
    *,
    device: str = "cpu",
    drafter: str | None = None,
    hidden: bool = False,
    drafter_version: int = -1,
    weights: Any = None,
) -> tuple[Any, AdaptiveSd | None]:
    """(the engine, its adaptive SD controller or None) for the checkpoint directory `policy`, shaped by
    `config.rollout` and drafting as `config.sd` says, on a resolved `device`. `drafter` is the draft source
    when it is not `sd.drafter` (a newer version of the drafter; None: `sd.drafter`); `hidden` says hidden
    states will be asked for (drafter training): vLLM recomputes them, the torch engine's rows are sized
    with their buffer; `weights` are the
    policy's tensors already read and verified (`store/weights.py`; torch only). The EAGLE drafter binds to
    this policy's embedding and LM head."""
    own, sd = config.rollout, config.sd
    source = drafter or sd.drafter
    if sd.group and source is None:
        raise ValueError("sd.group drafts beside a draft source: set sd.drafter (a drafter, or ngram)")
    adaptive = sd.adaptive and source is not None
    arm = fixed_arm(sd, source) if source is not None and not adaptive else None
    if own.backend == "vllm":
        if weights is not None:
            raise ValueError("vLLM's workers read the checkpoint themselves: pass its path, not its tensors")
        from tlt_stream.rollout.vllm.backend import VllmEngine
        from tlt_stream.rollout.vllm.tuning import VllmTuning, deepest_chain

        eagle = source if source not in (None, "ngram") else None
        if adaptive:  # built with the deepest chain the tuner may pick; its schedule then picks per bucket
            arm = deepest_chain(sd.arms, "drafter" if eagle is not None else "ngram")
            if arm is None:
                raise ValueError(f"adaptive SD on vLLM tunes chains of its draft source: none among {sd.arms}")
        engine = VllmEngine(policy, settings=vllm_settings(config, arm, hidden=hidden), drafter=eagle)
        if not adaptive:
            return engine, None
        try:
            return engine, VllmTuning(engine, sd, drafter_version=drafter_version)
        except BaseException:
            engine.close()
            raise

    from tlt_stream.model import load_model, resolve_dtype
    from tlt_stream.model.graphs import resolve_backend
    from tlt_stream.model.sizing import engine_bytes_per_row, fitting_rows, free_memory
    from tlt_stream.rollout.adaptive import arm_kinds
    from tlt_stream.rollout.engine import GenerationEngine
    from tlt_stream.rollout.proposers import GroupProposer, MixedProposer, build_proposer

    model = load_model(policy, device=device, dtype=resolve_dtype(own.dtype, device), weights=weights)
    proposer: Any = None
    if source == "ngram" and sd.group:
        proposer = GroupProposer(strong_match=sd.group_strong_match)
    elif source is not None:
        proposer = build_proposer(source, model)
        if sd.group:
            proposer = MixedProposer(proposer, GroupProposer(strong_match=sd.group_strong_match))
    if arm is not None and arm.kind not in arm_kinds(proposer):
        raise ValueError(f"arm {arm.label} drafts with a source this engine does not have ({type(proposer).__name__})")
    nodes = _max_nodes(sd, adaptive, arm)
    graphs = resolve_backend(own.graphs, model.device)
    drafter_model = getattr(proposer, "drafter", None)  # EAGLE: its one layer keeps its own cache
    per_row = engine_bytes_per_row(
        model.spec,
        own.max_len,
        model.dtype,
        headroom=nodes + 1 if proposer is not None else 0,
        drafter=drafter_model.spec if drafter_model is not None else None,
        hidden=hidden,
        graph_tokens=nodes + 1 if graphs is not None else 0,
    )
    budget = int(own.kv_cache_gib * 2**30) if own.kv_cache_gib is not None else free_memory(model.device) // 2
    engine = GenerationEngine(
        model,
        fitting_rows(per_row, own.max_batch, budget, own.max_len),
        own.max_len,
        proposer=proposer,
        arm=arm,
        max_draft_nodes=nodes,
        draft_rows=config.policy.ahead_rows or None,
        graphs=graphs,
    )
    engine.row_bytes = per_row
    controller = AdaptiveSd(engine, sd, drafter_version=drafter_version) if adaptive else None
    return engine, controller


def vllm_settings(config: Config, arm: Arm | None, *, hidden: bool) -> Any:
    """The vLLM engine's settings (pure: vLLM is imported only by the engine itself)."""
    from tlt_stream.rollout.vllm.backend import VllmSettings

    own = config.rollout
    return VllmSettings(
        max_batch=own.max_batch,
        max_len=own.max_len,
        temperature=own.temperature,
        dtype=own.dtype,
        arm=arm.label if arm is not None else None,
        edges=config.sd.edges,
        hidden="recompute" if hidden else "none",
        partial_rollouts=config.policy.partial_rollouts,
    )
