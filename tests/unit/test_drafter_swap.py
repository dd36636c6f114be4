"""Hot swap: a new drafter's weights loaded between decode steps leave in-flight sequences lossless."""

from __future__ import annotations

from pathlib import Path

import torch

from tlt_stream.drafter.model import Drafter
from tlt_stream.model import load_model
from tlt_stream.rollout.engine import GenerationEngine
from tlt_stream.rollout.proposers import EagleProposer, SdArm


def test_swapping_the_drafter_mid_sequence_keeps_greedy_output_identical_to_plain_decoding(init_policy: Path) -> None:
    model = load_model(init_policy)
    prompts = [[5, 9, 12, 7], [8, 3, 3], [30, 31, 32, 33, 34]]
    plain = GenerationEngine(model, 3, 96).generate(prompts, 40, temperature=0.0)

    torch.manual_seed(2)
    first, second = Drafter(model.spec).bind(model), Drafter(model.spec).bind(model)
    engine = GenerationEngine(model, 3, 96, proposer=EagleProposer(first), arm=SdArm(3, 2, 4))
    for i, p in enumerate(prompts):
        engine.add_request(p, 40, 0.0, request_id=i)
    done, steps = {}, 0
    while engine.has_unfinished:
        for result in engine.step():
            done[result.request_id] = result
        steps += 1
        if steps == 3:  # what the worker does when a new version is announced: weights in place
            assert engine.has_unfinished, "the swap must happen with sequences in flight"
            engine.proposer.drafter.load_state_dict(second.state_dict())
    assert engine.rounds > 3, "speculative rounds ran after the swap"
    assert [done[i].token_ids for i in range(3)] == [r.token_ids for r in plain]
    for name, value in second.state_dict().items():
        assert torch.equal(engine.proposer.drafter.state_dict()[name], value)
