"""Engine construction, out of the worker loop: what a worker asks for is what it gets."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tlt_stream.basics.config import DEFAULTS, Config, ConfigError, override
from tlt_stream.rollout.arms import Arm
from tlt_stream.rollout.build import PLAIN_NODES, build_engine, fixed_arm, vllm_settings
from tlt_stream.rollout.proposers import EagleProposer, NgramProposer


@pytest.fixture
def drafter(init_policy: Path, tmp_path: Path) -> Path:
    from tlt_stream.drafter.model import Drafter, save_drafter
    from tlt_stream.model import load_model

    torch.manual_seed(0)
    save_drafter(Drafter(load_model(init_policy).spec), tmp_path / "drafter")
    return tmp_path / "drafter"


def config(**values: object) -> Config:
    """The configuration with `values` (dotted keys under rollout, sd and policy, as `override` takes them) on
    a small engine's shape."""
    return override(DEFAULTS, {"rollout.max_batch": 3, "rollout.max_len": 48, "rollout.temperature": 1.0, **values})


def test_without_a_drafter_the_engine_decodes_plainly(init_policy: Path) -> None:
    engine, adaptive = build_engine(str(init_policy), config(**{"sd.arm": "d4k1v4"}))
    assert adaptive is None and engine.proposer is None and engine.arm is None
    assert (engine.scheduler.max_batch, engine.max_len) == (3, 48)


def test_the_workers_ahead_rows_bounds_where_the_engine_starts_drafts(init_policy: Path) -> None:
    for rows, expected in ((5, 5), (0, None)):
        engine, _ = build_engine(
            str(init_policy), config(**{"policy.partial_rollouts": True, "policy.ahead_rows": rows})
        )
        assert engine.scheduler.draft_rows == expected, "0 means drafts may take any free slot"
    with pytest.raises(ConfigError, match=re.escape("policy.ahead_rows")):
        config(**{"policy.ahead_rows": -1})


def test_the_workers_group_strong_match_reaches_the_group_source(init_policy: Path, drafter: Path) -> None:
    built = config(**{"sd.drafter": str(drafter), "sd.group": True, "sd.group_strong_match": 7})
    engine, adaptive = build_engine(str(init_policy), built)
    assert engine.proposer.group.strong_match == 7
    assert adaptive is not None and Arm.from_label("d6k1v6|g12") in adaptive.tuner.arms, "either arms by default"
    with pytest.raises(ConfigError, match=re.escape("sd.group_strong_match")):
        config(**{"sd.group_strong_match": 0})


def test_a_fixed_arm_is_the_engines_arm_and_an_ngram_source_gets_prompt_lookup(init_policy: Path) -> None:
    fixed = {"sd.drafter": "ngram", "sd.adaptive": False}
    engine, adaptive = build_engine(str(init_policy), config(**fixed, **{"sd.arm": "ngram-d5"}))
    assert adaptive is None and isinstance(engine.proposer, NgramProposer) and engine.arm == Arm.ngram(5)
    engine, _ = build_engine(str(init_policy), config(**fixed, **{"sd.arm": "d3k1v3"}))
    assert engine.arm == Arm.ngram(3), "a drafter chain's depth becomes prompt lookup's"


def test_adaptive_sd_leaves_the_arm_to_its_controller_and_sizes_the_tree_for_every_candidate(
    init_policy: Path, drafter: Path
) -> None:
    arms = ("plain", "d2k1v2", "d6k4v80")
    engine, adaptive = build_engine(
        str(init_policy), config(**{"sd.drafter": str(drafter), "sd.arms": arms}), drafter_version=7
    )
    assert isinstance(engine.proposer, EagleProposer) and engine.arm is None
    assert adaptive is not None and adaptive.engine is engine
    assert engine.max_draft_nodes >= 80 > PLAIN_NODES, "the largest candidate arm fits"


def test_a_drafter_needs_an_arm_or_adaptive_sd_and_vllm_group_drafts_a_fixed_arm() -> None:
    with pytest.raises(ConfigError, match=re.escape("sd.arm: is plain")):
        config(**{"sd.drafter": "ngram", "sd.arm": "plain"})
    with pytest.raises(ConfigError, match=re.escape("sd.adaptive: vLLM's custom proposer")):
        config(**{"sd.drafter": "ngram", "sd.group": True, "sd.adaptive": True, "rollout.backend": "vllm"})
    assert config(**{"sd.drafter": "ngram", "sd.adaptive": True, "rollout.backend": "vllm"}).sd.adaptive


def test_vllm_settings_carry_the_shape_the_arm_and_the_hidden_states() -> None:
    vllm = config(**{"rollout.backend": "vllm", "sd.adaptive": False})
    settings = vllm_settings(vllm, fixed_arm(vllm.sd, "/w/drafter"), hidden=True)
    assert (settings.max_batch, settings.max_len, settings.arm, settings.hidden) == (3, 48, "d4k1v4", "recompute")
    plain = vllm_settings(vllm, None, hidden=False)
    assert plain.arm is None and plain.hidden == "none"


def test_the_rollout_dtype_is_a_setting_bf16_on_cuda_fp32_on_the_cpu_by_default(init_policy: Path) -> None:
    from tlt_stream.model import resolve_dtype

    assert resolve_dtype("auto", "cpu") == torch.float32 and resolve_dtype("auto", "cuda:0") == torch.bfloat16
    assert resolve_dtype("bfloat16", "cpu") == torch.bfloat16
    fp32, _ = build_engine(str(init_policy), config())
    bf16, _ = build_engine(str(init_policy), config(**{"rollout.dtype": "bfloat16"}))
    assert next(fp32.model.parameters()).dtype == torch.float32
    assert {p.dtype for p in bf16.model.parameters()} == {torch.bfloat16}
    result = bf16.generate([[3, 4, 5]], max_new_tokens=5, temperature=0.0)[0]
    assert len(result.token_ids) >= 1, "a bf16 engine decodes (its logprobs go to the learner as fp32)"


def test_group_drafts_sit_beside_the_drafter_or_replace_prompt_lookup(init_policy: Path, drafter: Path) -> None:
    from tlt_stream.rollout.proposers import GroupProposer, MixedProposer

    arms = ("plain", "d2k1v2", "ngram-d4", "group-d8v8", "d4k2v8+g40")
    engine, adaptive = build_engine(
        str(init_policy), config(**{"sd.drafter": str(drafter), "sd.group": True, "sd.arms": arms})
    )
    assert isinstance(engine.proposer, MixedProposer) and adaptive is not None
    assert {a.label for a in adaptive.tuner.arms} == {"plain", "d2k1v2", "group-d8v8", "d4k2v8+g40"}
    assert engine.max_draft_nodes >= 48, "a merged arm's drafter and group nodes both fit"
    fixed = {"sd.drafter": "ngram", "sd.group": True, "sd.adaptive": False}
    engine, _ = build_engine(str(init_policy), config(**fixed, **{"sd.arm": "group-d6v6"}))
    assert isinstance(engine.proposer, GroupProposer) and engine.arm == Arm.group_source(6, 6)
    engine, _ = build_engine(str(init_policy), config(**fixed, **{"sd.arm": "ngram-d6"}))
    assert engine.arm == Arm.group_source(6, 6), "group drafts stand in for prompt lookup (they include it)"
    lookup = {"sd.drafter": "ngram", "sd.adaptive": False, "sd.arm": "group-d6v6"}  # no group source beside it
    with pytest.raises(ValueError, match="does not have"):
        build_engine(str(init_policy), config(**lookup))
    on_vllm = config(**fixed, **{"sd.arm": "ngram-d4", "rollout.backend": "vllm"})  # vLLM's custom proposer
    assert vllm_settings(on_vllm, fixed_arm(on_vllm.sd, "ngram"), hidden=False).arm == "group-d4v4"
    eagle = {**fixed, "sd.drafter": str(drafter), "sd.arm": "d4k1v4", "rollout.backend": "vllm"}
    with pytest.raises(ConfigError, match=re.escape("sd.group: the vllm backend runs one draft source per engine")):
        config(**eagle)
    with pytest.raises(ConfigError, match=r"sd\.group: drafts beside a draft source"):
        config(**{"sd.group": True, "launch.sd": "off"})
    # A run's configuration leaves sd.drafter to `tlt-stream run` (launch.sd gives the workers their source); a
    # worker's own configuration without a source is refused where its engine is built.
    assert config(**{"sd.group": True}).sd.group
    with pytest.raises(ValueError, match=r"set sd\.drafter"):
        build_engine(str(init_policy), config(**{"sd.group": True}))


def test_a_run_with_group_drafts_gives_its_workers_a_source_and_refuses_none(tmp_path: Path) -> None:
    from tlt_stream.commands.args import load
    from tlt_stream.commands.cli import build_parser
    from tlt_stream.commands.run.launch import RunPlan, service_config
    from tlt_stream.tasks.shipped import SHIPPED

    for sd, expected in (("eagle", "drafter"), ("ngram", "ngram")):
        args = build_parser().parse_args(["run", "--group-drafts", "--sd", sd])
        run = load(args)
        plan = RunPlan(world=SHIPPED, run_dir=tmp_path / "run", config=run, cores=2)
        worker = service_config(plan, run)
        assert worker.sd.group and worker.sd.drafter is not None and worker.sd.drafter.endswith(expected)
    with pytest.raises(ConfigError, match=r"sd\.group"):
        load(build_parser().parse_args(["run", "--group-drafts", "--sd", "off"]))


def test_the_workers_graphs_setting_reaches_the_engine(init_policy: Path) -> None:
    assert DEFAULTS.rollout.graphs == "off"
    engine, _ = build_engine(str(init_policy), config(**{"rollout.graphs": "trace"}))
    assert engine.graphs is not None and engine.graphs.backend == "trace" and engine.graphs.cache is engine.cache
    for setting in ("off", "auto"):  # auto: CUDA graphs on a CUDA device only
        assert build_engine(str(init_policy), config(**{"rollout.graphs": setting}))[0].graphs is None
    with pytest.raises(ValueError, match="CUDA device"):
        build_engine(str(init_policy), config(**{"rollout.graphs": "cuda"}))
    with pytest.raises(ConfigError, match="vLLM captures"):
        config(**{"rollout.backend": "vllm", "rollout.graphs": "cuda"})
