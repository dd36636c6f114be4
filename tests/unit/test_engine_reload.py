"""One engine for a worker's life: each policy version and each drafter is loaded into it in place."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tlt_stream.basics.errors import CheckpointError
from tlt_stream.drafter.model import Drafter, save_drafter
from tlt_stream.model import load_model
from tlt_stream.rollout.arms import Arm
from tlt_stream.rollout.engine import GenerationEngine
from tlt_stream.rollout.proposers import EagleProposer

PROMPTS = [[5, 9, 12, 7], [8, 3, 3], [30, 31, 32, 33, 34]]


def next_version(init_policy: Path, out: Path, *, seed: int = 3, **config: object) -> Path:
    """`init_policy` with every weight moved (what an RL update does), saved as a new checkpoint."""
    hf = AutoModelForCausalLM.from_pretrained(init_policy)
    for key, value in config.items():
        setattr(hf.config, key, value)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.5 * torch.randn_like(p))
    hf.save_pretrained(out, safe_serialization=True)
    return out


def sampled(engine: GenerationEngine) -> list[list[int]]:
    return [r.token_ids for r in engine.generate(PROMPTS, 30, temperature=1.0, seed=7)]


def test_a_policy_loaded_in_place_generates_as_a_fresh_engine_on_it(init_policy: Path, tmp_path: Path) -> None:
    v1 = next_version(init_policy, tmp_path / "v1")
    model = load_model(init_policy)
    torch.manual_seed(1)
    drafter = Drafter(model.spec).bind(model)
    engine = GenerationEngine(model, 3, 96, proposer=EagleProposer(drafter), arm=Arm.drafter(3, 1, 3))
    before = sampled(engine)
    storage = {name: t.data_ptr() for name, t in model.state_dict().items()}

    engine.load_policy(v1)

    fresh = load_model(v1)
    twin = Drafter(fresh.spec)
    twin.load_state_dict(drafter.state_dict())
    rebuilt = GenerationEngine(fresh, 3, 96, proposer=EagleProposer(twin.bind(fresh)), arm=Arm.drafter(3, 1, 3))
    assert sampled(engine) == sampled(rebuilt), "as an engine built on the new version"
    assert sampled(engine) != before, "the new weights are in use"
    assert {name: t.data_ptr() for name, t in model.state_dict().items()} == storage, "loaded in place"
    # The drafter borrows the model's embedding and LM head, so it drafts against the new version at once.
    assert torch.equal(drafter._require_bound()[0], fresh.embed_tokens.weight)
    assert engine.rounds > 0


def test_load_policy_refuses_rows_in_flight_and_another_architecture(init_policy: Path, tmp_path: Path) -> None:
    engine = GenerationEngine(load_model(init_policy), 2, 64)
    wider = next_version(init_policy, tmp_path / "wider", rms_norm_eps=1e-3)
    with pytest.raises(CheckpointError, match="different architecture"):
        engine.load_policy(wider)
    engine.add_request(PROMPTS[0], 10, 0.0)
    with pytest.raises(RuntimeError, match="in flight"):
        engine.load_policy(next_version(init_policy, tmp_path / "v1"))


def test_swapping_the_drafter_mid_sequence_keeps_greedy_output_identical_to_plain_decoding(
    init_policy: Path, tmp_path: Path
) -> None:
    model = load_model(init_policy)
    plain = GenerationEngine(model, 3, 96).generate(PROMPTS, 40, temperature=0.0)

    torch.manual_seed(2)
    first, second = Drafter(model.spec).bind(model), Drafter(model.spec).bind(model)
    path = save_drafter(second, tmp_path / "second")
    engine = GenerationEngine(model, 3, 96, proposer=EagleProposer(first), arm=Arm.drafter(3, 2, 4))
    for i, p in enumerate(PROMPTS):
        engine.add_request(p, 40, 0.0, request_id=i)
    done, steps = {}, 0
    while engine.has_unfinished:
        for result in engine.step():
            done[result.request_id] = result
        steps += 1
        if steps == 3:  # what the worker does when a new version is announced: weights in place
            assert engine.has_unfinished, "the swap must happen with sequences in flight"
            engine.load_drafter(path)
    assert engine.rounds > 3, "speculative rounds ran after the swap"
    assert [done[i].token_ids for i in range(3)] == [r.token_ids for r in plain]
    for name, value in second.state_dict().items():
        assert torch.equal(engine.proposer.drafter.state_dict()[name], value)
    with pytest.raises(RuntimeError, match="without an EAGLE drafter"):
        GenerationEngine(model, 1, 16).load_drafter(path)
