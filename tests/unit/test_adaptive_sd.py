"""Adaptive SD on a real engine: lossless across on/off switches and arm changes, and measuring as it goes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tlt_stream.basics.config import SdConfig
from tlt_stream.drafter.model import Drafter
from tlt_stream.model import load_model
from tlt_stream.rollout.adaptive import AdaptiveSd
from tlt_stream.rollout.arms import MAX_DRAFT_DEPTH, Arm
from tlt_stream.rollout.engine import GenerationEngine
from tlt_stream.rollout.proposers import EagleProposer, GroupProposer, MixedProposer, NgramProposer


class SteadyClock:
    """A clock that moves `tick` seconds each time it is read: every step the controller times lasts `tick`,
    so what it measures (tokens per second) and hence the arms it picks are the same on a busy machine."""

    def __init__(self, tick: float = 0.001) -> None:
        self.now, self.tick = 0.0, tick

    def __call__(self) -> float:
        self.now += self.tick
        return self.now


def drain(adaptive: AdaptiveSd, prompts: list[list[int]], lengths: list[int]) -> dict[int, list[int]]:
    for i, (p, n) in enumerate(zip(prompts, lengths, strict=True)):
        adaptive.engine.add_request(p, n, 0.0, request_id=i)
    done = {}
    while adaptive.engine.has_unfinished:
        for result in adaptive.step():
            done[result.request_id] = result.token_ids
    return done


@pytest.mark.parametrize("kind", ["drafter", "ngram", "mixed"])
def test_switching_sd_and_arms_mid_sequence_keeps_greedy_output_identical(init_policy: Path, kind: str) -> None:
    model = load_model(init_policy)
    prompts = [[5 + i, 9, 12, 7, 5 + i, 9] for i in range(6)]
    lengths = [4, 8, 14, 20, 30, 44]  # the batch drains 6 -> 1, as a rollout's tail does
    plain = GenerationEngine(model, 6, 96).generate(prompts, 44, temperature=0.0)
    torch.manual_seed(0)
    if kind == "ngram":
        proposer = NgramProposer()
    else:
        eagle = EagleProposer(Drafter(model.spec).bind(model))
        proposer = MixedProposer(eagle, GroupProposer()) if kind == "mixed" else eagle
    engine = GenerationEngine(model, 6, 96, proposer=proposer)
    # On at batch <= 3, off above 4: the drain crosses it; epsilon 0.5 makes arms change from step to step.
    mixed_arms = ("plain", "d2k1v2", "group-d8v8", "d4k2v8+g8", "d2k1v2|g6")
    arms = mixed_arms if kind == "mixed" else SdConfig().arms
    adaptive = AdaptiveSd(engine, SdConfig(crossover=5, margin=1, epsilon=0.5, seed=1, arms=arms), clock=SteadyClock())
    done = drain(adaptive, prompts, lengths)
    assert [done[i] for i in range(6)] == [r.token_ids[:n] for r, n in zip(plain, lengths, strict=True)]
    assert adaptive.switch.switches >= 1 and engine.rounds > 0 and engine.plain_steps > 0
    labels = {label for (_, label) in adaptive.log.chosen}
    assert "plain" in labels and len(labels - {"plain"}) >= 2, f"several {kind} arms were tried: {labels}"
    assert all(label == "plain" or label.startswith("ngram") == (kind == "ngram") for label in labels)
    if kind == "mixed":  # the drafter's, the group's and merged arms all ran, and switching between them
        assert any(label.startswith("group") for label in labels) and any("+g" in label for label in labels)
        assert any("|g" in label for label in labels)
    reports = adaptive.drain_reports()
    assert reports and all(r.tokens > 0 and r.seconds > 0 for r in reports)
    assert adaptive.drain_reports() == [], "reports are handed out once"


def test_a_published_table_is_exploited_and_a_new_drafter_is_noted(init_policy: Path) -> None:
    model = load_model(init_policy)
    engine = GenerationEngine(model, 4, 96, proposer=EagleProposer(Drafter(model.spec).bind(model)))
    adaptive = AdaptiveSd(engine, SdConfig(crossover=8, margin=1, epsilon=0.0), clock=SteadyClock())
    best = Arm.from_label("d2k1v2")
    assert adaptive.adopt({b: best for b in range(8)} | {0: Arm.from_label("ngram-d4")}, drafter_version=0)
    drain(adaptive, [[5, 9, 12]] * 2, [12, 12])
    assert {label for (_, label) in adaptive.log.chosen} <= {"plain", "d2k1v2"}, "ngram is not this engine's"
    assert any(label == "d2k1v2" for (_, label) in adaptive.log.chosen)
    assert adaptive.on_new_drafter(1) and not adaptive.on_new_drafter(1)


def test_an_engine_without_a_proposer_is_refused(init_policy: Path) -> None:
    with pytest.raises(ValueError, match="proposer"):
        AdaptiveSd(GenerationEngine(load_model(init_policy), 2, 32))


@pytest.mark.parametrize("above", ["measure", "plain"])
def test_above_the_crossover_an_arm_measured_faster_than_plain_runs_unless_told_plain(
    init_policy: Path, above: str
) -> None:
    model = load_model(init_policy)
    engine = GenerationEngine(model, 4, 96, proposer=EagleProposer(Drafter(model.spec).bind(model)))
    settings = SdConfig(crossover=2, margin=0, epsilon=0.0, above_crossover=above)  # on at batch 1 only
    adaptive = AdaptiveSd(engine, settings, clock=SteadyClock())
    faster = Arm.from_label("d2k1v2")
    for batch in (2, 3, 4):  # measured where the switch is off: d2k1v2 beat plain there, often enough
        adaptive.tuner.record(batch, Arm.plain(), 100, 1.0)
        for _ in range(adaptive.tuner.confirm):
            adaptive.tuner.record(batch, faster, 300, 1.0)
    drain(adaptive, [[5, 9, 12]] * 4, [16, 16, 16, 16])
    wide = {label for (bucket, label), steps in adaptive.log.chosen.items() if bucket >= 1 and steps}
    assert wide == ({"d2k1v2"} if above == "measure" else {"plain"}), adaptive.log.chosen


def test_the_group_context_grades_how_far_each_row_follows_what_the_prompts_responses_wrote() -> None:
    group = GroupProposer(max_match=8, strong_match=4)
    prompt = [1, 2, 3]
    group.remember(prompt, [10, 11, 12, 13, 14, 15])  # a sibling that finished
    for slot in (0, 1, 2):
        group.reset_slot(slot, prompt)
        group.observe(slot, prompt[1:])  # the engine observes prompt[1:], then the response
    assert group.context(3) == 1, "the prompt's 3 tokens match, and the sibling went on after them"
    group.observe(0, [10, 11, 12])  # follows the sibling: '1 2 3 10 11 12' matches 6 tokens
    group.observe(1, [40, 41, 42])  # wrote what nothing wrote before: no match with a continuation
    group.observe(2, [7, 12, 13])  # '12 13' matches 2 tokens (13 was followed by 14): half of strong
    assert [group.context(1)] == [2]
    group.move_slot(1, 0)  # the rows the engine runs are 0..B-1: context reads them in slot order
    group.move_slot(2, 1)
    assert group.context(1) == 0 and group.context(2) == 1  # (0 + 1) / 2, halves rounded up


@pytest.mark.parametrize("context_rows", [0, 6])
def test_each_step_is_chosen_and_recorded_in_the_group_context_read_before_it(
    init_policy: Path, context_rows: int
) -> None:
    model = load_model(init_policy)
    torch.manual_seed(0)
    group = GroupProposer(strong_match=2)
    prompts = [[5, 9, 12, 7, 5, 9]] * 4
    group.remember(prompts[0], GenerationEngine(model, 1, 96).generate(prompts[:1], 30, temperature=0.0)[0].token_ids)
    engine = GenerationEngine(
        model, 4, 96, proposer=MixedProposer(EagleProposer(Drafter(model.spec).bind(model)), group)
    )
    arms = ("plain", "d2k1v2", "group-d8v8", "d2k1v2|g6")
    adaptive = AdaptiveSd(
        engine,
        SdConfig(crossover=5, margin=1, epsilon=0.3, arms=arms, context_rows=context_rows),
        clock=SteadyClock(),
    )
    read, chosen, recorded = [], [], []
    context, choose, record = group.context, adaptive.tuner.choose, adaptive.tuner.record
    group.context = lambda batch: read.append(context(batch)) or read[-1]  # type: ignore[method-assign]
    adaptive.tuner.choose = lambda *a, **k: chosen.append(k["context"]) or choose(*a, **k)  # type: ignore[method-assign]
    adaptive.tuner.record = lambda *a, **k: recorded.append(k["context"]) or record(*a, **k)  # type: ignore[method-assign]
    plain = GenerationEngine(model, 4, 96).generate(prompts, 30, temperature=0.0)
    done = drain(adaptive, prompts, [30, 24, 18, 12])
    assert [done[i] for i in range(4)] == [r.token_ids[:n] for r, n in zip(plain, [30, 24, 18, 12], strict=True)]
    if context_rows == 0:
        assert adaptive.tuner.contexts == 1 and read == [] and set(chosen) == {0}
        return
    assert adaptive.tuner.contexts == 3
    assert chosen == [0, *read], (
        "the first step only prefills (no row to read), then every choice is made in the context read before it"
    )
    assert set(recorded) <= set(read) and len(recorded) > 0
    assert 2 in read, "rows following the remembered response read as following strongly"


def test_each_arms_reports_count_the_rows_its_rounds_ran_as_the_requests_own_rounds_show(init_policy: Path) -> None:
    """`rows` in the arm reports is what makes a run's acceptance per arm and bucket readable (`tokens / rows`):
    checked against the rounds each request's own record lists (`accept_lengths`, kept by the engine)."""
    model = load_model(init_policy)
    torch.manual_seed(0)
    engine = GenerationEngine(model, 6, 96, proposer=EagleProposer(Drafter(model.spec).bind(model)))
    adaptive = AdaptiveSd(engine, SdConfig(crossover=5, margin=1, epsilon=0.5, seed=1), clock=SteadyClock())
    prompts, lengths = [[5 + i, 9, 12, 7] for i in range(6)], [4, 8, 14, 20, 30, 44]
    for i, (p, n) in enumerate(zip(prompts, lengths, strict=True)):
        engine.add_request(p, n, 0.0, request_id=i)
    results = adaptive.step()  # admits all 6 (6 slots), prefills them, then runs one round: not measured
    assert engine.scheduler.num_waiting == 0 and adaptive.drain_reports() == []
    first_sd = adaptive.arm.kind != "plain"
    first_rows, first_tokens = (6, engine.tokens_generated - 6) if first_sd else (0, 0)
    while engine.has_unfinished:
        results += adaptive.step()
    assert len(results) == 6
    reports = adaptive.drain_reports()
    sd = [r for r in reports if r.arm.kind != "plain"]
    plain = [r for r in reports if r.arm.kind == "plain"]
    assert sd and plain, [r.arm.label for r in reports]
    # Every later step was measured: the SD arms' rounds are exactly the requests' SD rounds after the first
    # step, and a plain step emits one token per running row.
    assert sum(r.rows for r in sd) + first_rows == sum(len(r.accept_lengths) for r in results)
    assert sum(r.tokens for r in sd) + first_tokens == sum(sum(r.accept_lengths) for r in results)
    assert all(r.tokens == r.rows for r in plain)


def test_each_arms_reports_count_the_context_its_steps_attended_over_as_the_rows_own_tokens_show(
    init_policy: Path,
) -> None:
    """`contexts` in the arm reports (`contexts / steps`: the longest running row's context at a step's start,
    what the planner's check charges a round at) against the running rows' own prompts and tokens, read before
    every step: the KV cache holds a row's prompt and every token but the last, which the step feeds."""
    model = load_model(init_policy)
    torch.manual_seed(0)
    engine = GenerationEngine(model, 6, 160, proposer=EagleProposer(Drafter(model.spec).bind(model)))
    adaptive = AdaptiveSd(engine, SdConfig(crossover=5, margin=1, epsilon=0.5, seed=1), clock=SteadyClock())
    prompts, lengths = [[5 + i, 9, 12, 7] + [3] * (7 * i) for i in range(6)], [4, 8, 14, 20, 30, 44]
    for i, (p, n) in enumerate(zip(prompts, lengths, strict=True)):
        engine.add_request(p, n, 0.0, request_id=i)
    adaptive.step()  # admits and prefills all 6: not measured
    adaptive.drain_reports()
    longest, steps = [], 0
    while engine.has_unfinished:
        longest.append(max(len(s.prompt_ids) + len(s.token_ids) - 1 for s in engine.scheduler.running))
        adaptive.step()
        steps += 1
    reports = adaptive.drain_reports()
    assert sum(r.steps for r in reports) == steps
    assert sum(r.contexts for r in reports) == sum(longest)
    assert {r.arm.kind for r in reports} >= {"plain", "drafter"}
    assert min(longest) >= len(prompts[-1]) and max(longest) > min(longest)


@pytest.mark.parametrize("label", ["ngram-d257", "group-d257v8", "d257k1v257", "d257k1v257|g8", "d257k2v8+g8"])
def test_no_arm_drafts_deeper_than_the_cap(label: str) -> None:
    """A configured arm deeper than `MAX_DRAFT_DEPTH` would stall every round; it is refused when read."""
    with pytest.raises(ValueError, match=f"at most {MAX_DRAFT_DEPTH} levels"):
        Arm.from_label(label)
    assert Arm.from_label(label.replace("257", str(MAX_DRAFT_DEPTH))).depth == MAX_DRAFT_DEPTH
