"""The planner's simulator against closed forms, its token conservation and determinism, and its inputs.

No timing is asserted: every expected figure is computed by hand from the costs the test hands in.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random

import pytest

from tlt_stream.plan.acceptance import Acceptance, chain_alpha, chain_mean
from tlt_stream.plan.acceptance import from_run as plan_from_run
from tlt_stream.plan.costs import CpuCosts, FixedCosts, micro_batches, slowdown
from tlt_stream.plan.lengths import LengthError, from_lengths, from_run, named, replay_groups, trained_share
from tlt_stream.plan.project import MODES
from tlt_stream.plan.roofline import GPUS, MODELS, GpuCosts
from tlt_stream.plan.simulate import Mode, Setup, simulate
from tlt_stream.rollout.arms import Arm

PLAIN, SD = Mode("a"), Mode("b", sd=True)


def one(length: int, **setup) -> Setup:
    return Setup(prompts=1, group_size=1, steps=1, seed=None, **setup)


def test_one_row_without_sd_takes_length_decode_steps_then_update_and_publish():
    costs = FixedCosts(decode=0.01, learn_per_token=0.002, optimizer_s=0.5, publish_s=0.25)
    r = simulate(PLAIN, one(100), from_lengths([100]), Acceptance(), costs)
    assert r.version_times[1] == pytest.approx(100 * 0.01 + 100 * 0.002 + 0.5 + 0.25)
    assert r.rounds == {"plain": 100}


def test_the_worker_loop_polls_after_each_hop_and_sends_a_finished_group_before_the_learner_sees_it():
    """20 decode steps in hops of 8: polls after steps 8 and 16 and at the row's end (a hop ends early when a
    row finishes), the rows in flight published after that last hop, then the group's output; the update starts
    once it is sent. Closed form."""
    costs = FixedCosts(
        decode=0.01, hop_s=0.001, finish_s=0.002, group_s=0.004, learn_per_token=0.002, optimizer_s=0.5, publish_s=0.25
    )
    r = simulate(PLAIN, one(20, steps_per_hop=8), from_lengths([20]), Acceptance(), costs)
    assert r.version_times[1] == pytest.approx(20 * 0.01 + 3 * 0.001 + 0.002 + 0.004 + 20 * 0.002 + 0.5 + 0.25)
    spent = r.worker_seconds(0.0, r.version_times[1])
    assert spent["plain"] == pytest.approx(0.2) and spent["loop"] == pytest.approx(0.009)
    # without the loop's constants the same run is the engine's steps alone
    bare = simulate(PLAIN, one(20, steps_per_hop=8), from_lengths([20]), Acceptance(), FixedCosts(decode=0.01))
    assert bare.version_times[1] == pytest.approx(0.2) and "loop" not in bare.worker_seconds(0.0, 0.2)


def test_where_the_drafter_trains_each_streamed_row_s_hidden_state_window_costs_its_worker_before_the_group_is_sent():
    """A group of 4 rows of 10 tokens, SD on: each finished row's window costs `window_s` times the share of rows
    streamed (`hidden_share`), charged to the worker's loop before the group is sent, so the update starts that
    much later. Without drafter training, or without SD, no window is sent and nothing is charged. Closed form."""
    costs = FixedCosts(decode=0.01, round=0.01, learn_per_token=0.002, optimizer_s=0.5, publish_s=0.25)
    windowed = dataclasses.replace(costs, window_s=0.008)
    setup = Setup(prompts=1, group_size=4, steps=1, seed=3, max_batch=4, hidden_share=0.5)

    def run(mode: Mode, c: FixedCosts, **change):
        r = simulate(mode, dataclasses.replace(setup, **change), from_lengths([10] * 4), Acceptance(), c)
        return r.version_times[1], r.worker_seconds(0.0, r.version_times[1]).get("loop", 0.0)

    (bare, _), (charged, loop) = run(SD, costs), run(SD, windowed)
    assert charged - bare == pytest.approx(4 * 0.008 * 0.5) and loop == pytest.approx(4 * 0.008 * 0.5)
    assert run(SD, windowed, train_drafter=False) == pytest.approx(run(SD, costs, train_drafter=False))
    assert run(PLAIN, windowed) == pytest.approx(run(PLAIN, costs))
    assert run(SD, windowed, hidden_share=0.0) == pytest.approx((bare, 0.0))
    with pytest.raises(ValueError, match="hidden_share"):
        run(SD, windowed, hidden_share=1.5)


def test_the_update_costs_only_the_groups_with_a_signal():
    """Groups whose rewards are all equal are left out of the update: it costs the trained share's tokens."""
    costs = FixedCosts(decode=0.01, learn_per_token=0.002, optimizer_s=0.5, publish_s=0.25)
    half = dataclasses.replace(one(100), trained_share=0.5)
    r = simulate(PLAIN, half, from_lengths([100]), Acceptance(), costs)
    assert r.version_times[1] == pytest.approx(100 * 0.01 + 50 * 0.002 + 0.5 + 0.25)
    rows = [{"degenerate_groups": d, "trained_groups": ["g"] * 4} for d in (3.0, 1.0)]
    assert trained_share(rows) == 0.5 and trained_share([{"reward_mean": 1.0}]) == 1.0


def test_a_replayed_run_gives_each_group_its_own_lengths_and_trained_share():
    """Two steps of two groups replayed (one worker, one row a group, batch 1): each step's rollout is its
    groups' lengths in dispatch order, each update its groups' trained tokens (closed form); a row that
    names groups out of order, and one with rewards all equal in a group, as a run's metrics record them."""
    rows = [
        {
            "trained_groups": ["s000000-0001", "s000000-0000"],
            "response_lens": [30, 20, 10, 40],
            "rewards": [1.0, 0.0, 0.5, 0.5],
            "trained_tokens": 50.0,
        },
        {"trained_groups": ["s000001-0000", "s000001-0001"], "response_lens": [5, 5, 60, 70], "trained_tokens": 70.0},
    ]
    groups = replay_groups(rows)
    assert groups == (((10, 40), 0.0), ((30, 20), 1.0), ((5, 5), 70 / 140), ((60, 70), 70 / 140))
    costs = FixedCosts(decode=0.01, learn_per_token=0.002, optimizer_s=0.5, publish_s=0.25)
    setup = Setup(prompts=2, group_size=2, steps=2, max_batch=2, seed=3, replay=groups)
    r = simulate(PLAIN, setup, from_lengths([1000]), Acceptance(), costs)
    for step, ((a, share_a), (b, share_b)) in enumerate(zip(groups[::2], groups[1::2], strict=True)):
        rollout = (max(a) + max(b)) * 0.01  # a group's two rows side by side, one group at a time
        update = (sum(a) * share_a + sum(b) * share_b) * 0.002 + 0.5
        assert r.step_times[step] == pytest.approx(rollout + update + 0.25)
    assert r.finished_tokens == sum(sum(g) for g, _ in groups)
    with pytest.raises(ValueError, match="replayed group"):
        simulate(PLAIN, dataclasses.replace(setup, replay=(((10,), 1.5),)), from_lengths([10]), Acceptance(), costs)


def test_the_learner_costs_the_micro_batches_it_makes_in_closed_form():
    """`learn_rows_s` batches rows as `rl/batches.py` does (longest first, `tokens // width` rows padded to
    the first's width) and charges each micro-batch B W (token + attn W); the shapes are the learner's own."""
    import torch

    from tlt_stream.basics.messages import Sample, Tensor
    from tlt_stream.rl.batches import micro_batches as learner_batches

    rows, prompt = [100, 50, 50, 7], 10
    assert micro_batches(rows, prompt, 150) == [(1, 110), (2, 60), (1, 17)]
    costs = CpuCosts(step_s=0.0, row_s=0.0, learn_token_s=1e-3, learn_attn_s=1e-5, micro_batch_tokens=150)
    expect = 110 * (1e-3 + 1e-5 * 110) + 2 * 60 * (1e-3 + 1e-5 * 60) + 17 * (1e-3 + 1e-5 * 17)
    assert costs.learn_rows_s(rows, prompt) == pytest.approx(expect)
    assert CpuCosts(step_s=0.0, row_s=0.0, learn_tokens_per_s=100.0).learn_rows_s(rows, prompt) == pytest.approx(2.07)
    samples = [
        Sample(
            sample_id=f"t/{i}", task_id="t", prompt_id="t", index=i, group_size=len(rows), prompt_ids=[5] * prompt,
            token_ids=Tensor.from_values([7] * n, "int32"), logprobs=Tensor.from_values([-1.0] * n, "float32"),
            policy_version=0, drafter_version=-1, reward=float(i % 2), finish_reason="eos", worker_id="w0",
        )
        for i, n in enumerate(rows)
    ]  # fmt: skip
    made = learner_batches(samples, torch.zeros(len(rows)), list(range(len(rows))), tokens=150, device="cpu")
    assert [(b["ids"].shape[0], b["ids"].shape[1]) for b in made] == micro_batches(rows, prompt, 150)


def test_equal_rows_in_one_batch_cost_length_times_the_batch_step():
    costs = CpuCosts(step_s=0.003, row_s=0.0005, learn_tokens_per_s=1e12)
    setup = Setup(prompts=4, group_size=8, steps=1, seed=None)
    r = simulate(PLAIN, setup, from_lengths([50]), Acceptance(), costs)
    assert r.version_times[1] == pytest.approx(50 * (0.003 + 0.0005 * 32))
    assert r.emitted == 32 * 50


def test_a_batch_of_rows_pays_the_ragged_mask_and_one_row_does_not():
    """`ragged_s` is charged to every decode step of more than one row (a run's rows differ in context, so the
    torch engine builds a mask) and never to a lone row: a group of two rows of 40 and 10 tokens (closed form)."""
    costs = CpuCosts(step_s=0.001, row_s=0.0001, ragged_s=0.0005, learn_tokens_per_s=1e12)
    assert costs.decode_s(1, 100.0) == pytest.approx(0.0011) and costs.decode_s(2, 100.0) == pytest.approx(0.0017)
    setup = Setup(prompts=1, group_size=2, steps=1, seed=None, arms=())
    r = simulate(PLAIN, setup, from_lengths([40, 10]), Acceptance(), costs)
    assert r.version_times[1] == pytest.approx(10 * 0.0017 + 30 * 0.0011)


def test_a_padded_engine_attends_every_row_over_the_longest_context():
    """The torch engine pads a batch's rows to its longest context (`model/layers.py`); a paged engine reads
    each row's own. Two slots, rows of 10, 30 and 10 tokens: the third starts beside the second's 10 tokens,
    so for 10 steps the longest context is 10 past the mean (closed form: 2 rows x 10 steps x 5 tokens more)."""
    ctx_s, prompt = 1e-3, 8
    setup = Setup(prompts=3, group_size=1, steps=1, max_batch=2, prompt_len=prompt, seed=None, arms=())
    total = {}
    for padded in (False, True):
        costs = CpuCosts(step_s=0.0, row_s=0.0, ctx_s=ctx_s, learn_tokens_per_s=1e12, padded=padded)
        total[padded] = simulate(PLAIN, setup, from_lengths([10, 30, 10]), Acceptance(), costs).version_times[1]
    together = sum(2 * (prompt + k) for k in range(10))  # first and second rows
    alone = sum(prompt + 20 + j for j in range(10))  # the second row's last 10 tokens
    beside = {False: sum(2 * (prompt + 5 + j) for j in range(10)), True: sum(2 * (prompt + 10 + j) for j in range(10))}
    for padded in (False, True):
        assert total[padded] == pytest.approx(ctx_s * (together + beside[padded] + alone))
    assert total[True] - total[False] == pytest.approx(ctx_s * 2 * 10 * 5)


@pytest.mark.parametrize("length,tokens", [(100, 4.0), (101, 4.0), (7, 3.0)])
def test_sd_with_constant_acceptance_takes_ceil_length_over_tokens_rounds(length, tokens):
    costs = FixedCosts(decode=1.0, round=1.5)
    setup = one(length, arms=("d4k1v4",), crossover=2, margin=0)
    r = simulate(SD, setup, from_lengths([length]), Acceptance.uniform(tokens), costs)
    rounds = math.ceil(length / tokens)
    assert r.rounds == {"d4k1v4": rounds}
    assert r.version_times[1] == pytest.approx(1.5 * rounds)


def test_sd_rounds_with_drawn_acceptance_match_the_renewal_mean():
    """Rounds to emit L tokens at mean mu per round: L / mu, variance ~ L sigma^2 / mu^3; z = 4 (false alarm
    ~6e-5 per check)."""
    arm, mean, length = Arm.from_label("d4k1v4"), 2.5, 4000
    acceptance = Acceptance.uniform(mean)
    alpha = chain_alpha(mean, arm.depth)
    probs = [alpha**k * (1 - alpha) for k in range(arm.depth)] + [alpha**arm.depth]
    var = sum(p * (k + 1) ** 2 for k, p in enumerate(probs)) - mean**2
    setup = Setup(prompts=1, group_size=1, steps=1, seed=7, arms=("d4k1v4",), crossover=2, margin=0, epsilon=0.0)
    r = simulate(SD, setup, from_lengths([length]), acceptance, FixedCosts())
    expected, sd = length / mean, math.sqrt(length * var / mean**3)
    assert abs(r.rounds["d4k1v4"] - expected) < 4 * sd + 1


def test_drawn_acceptance_has_the_chain_mean():
    """Mean of 20,000 draws within 4 standard errors (false alarm ~6e-5)."""
    arm, acceptance, rng = Arm.from_label("d6k1v6"), Acceptance.uniform(3.2), random.Random(1)
    draws = [acceptance.draw(arm, 0, rng) for _ in range(20_000)]
    mean = sum(draws) / len(draws)
    sd = math.sqrt(sum((d - mean) ** 2 for d in draws) / len(draws))
    assert abs(mean - 3.2) < 4 * sd / math.sqrt(len(draws))
    assert min(draws) == 1 and max(draws) <= arm.most_tokens == arm.depth + 1


def test_chain_alpha_inverts_chain_mean():
    for depth in (1, 4, 8):
        for alpha in (0.1, 0.5, 0.9):
            assert chain_alpha(chain_mean(alpha, depth), depth) == pytest.approx(alpha, abs=1e-9)


def test_switch_off_above_threshold_keeps_plain_decoding():
    """Crossover 1 means threshold 0: SD never turns on, and with above_crossover plain no arm runs."""
    setup = Setup(prompts=2, group_size=4, steps=2, seed=3, arms=("plain", "d4k1v4"), crossover=1, margin=0)
    setup = Setup(**{**setup.__dict__, "above_crossover": "plain"})
    r = simulate(SD, setup, named("uniform:10:60"), Acceptance.uniform(4.0), FixedCosts(round=0.1))
    assert set(r.rounds) == {"plain"}


def test_overlapped_learner_ends_one_optimizer_step_after_the_last_group():
    """Two one-row groups of 10 and 100 tokens, 1 s per decode step, 0.1 s per learned token, 5 s optimizer:
    batch update 100 + 11 + 5 = 116 s; overlapped: the first group learned by t = 11, the last 100 + 10 + 5."""
    costs = FixedCosts(decode=1.0, learn_per_token=0.1, optimizer_s=5.0)
    setup = Setup(prompts=2, group_size=1, steps=1, seed=None)
    lengths = from_lengths([10, 100])
    batch = simulate(PLAIN, setup, lengths, Acceptance(), costs)
    overlapped = simulate(Mode("o", overlapped=True), setup, lengths, Acceptance(), costs)
    assert batch.version_times[1] == pytest.approx(116.0)
    assert overlapped.version_times[1] == pytest.approx(115.0)


def test_partial_rollouts_draft_ahead_park_and_pay_the_reverification_in_closed_form():
    """Partial rollouts at staleness 0: step 1's group (rows of 20 and 3 tokens) drafts beside step 0's (two of
    10) and parks, 4 tokens ahead or at its end; at version 1 the worker loads and re-verifies both rows (the
    engine's formula: 2 rows padded to the prompt and the longest held), the 3-token row is then done and the
    other runs 16 more steps. Closed form with 10 ms steps whatever the batch."""
    costs = CpuCosts(
        step_s=0.01, row_s=0.0, learn_tokens_per_s=1000.0, optimizer_s=0.05, publish_s=0.02, load_s=0.03,
        reverify_step_s=0.004, reverify_token_s=1e-4, cores=float("inf"),
    )  # fmt: skip
    setup = Setup(
        prompts=1, group_size=2, steps=2, max_batch=4, prompt_len=8, seed=None, ahead_tokens=4, kept_share=1.0
    )
    r = simulate(Mode("g", partial=True), setup, from_lengths([10, 10, 20, 3]), Acceptance(), costs)
    reverify = 0.004 + 1e-4 * 2 * (8 + 4)
    assert costs.reverify_s([4, 3, 0], 8) == pytest.approx(reverify)  # a row holding nothing is not re-verified
    assert r.step_times[0] == pytest.approx(10 * 0.01 + 20 / 1000 + 0.05 + 0.02)
    assert r.step_times[1] == pytest.approx(0.03 + reverify + 16 * 0.01 + 23 / 1000 + 0.05 + 0.02)
    assert r.emitted == r.finished_tokens == 43 and r.discarded_tokens == 0
    assert CpuCosts(step_s=0.0, row_s=0.0, prefill_token_s=1e-3).reverify_s([4, 3], 8) == pytest.approx(7e-3)
    # where the worker's time went over step 1 (version 1 to 2): the load, the re-verification, 16 plain steps,
    # and idle through the update and its publication
    spent = r.worker_seconds(r.version_times[1], r.version_times[2])
    idle = 23 / 1000 + 0.05 + 0.02
    assert spent == pytest.approx({"load": 0.03, "reverify": reverify, "plain": 0.16, "idle": idle})
    assert r.summary()["worker_s_per_step"] == pytest.approx(
        {"load": 0.03, "reverify": reverify, "plain": 0.16, "idle": idle}, abs=1e-4
    )


def test_colocated_learner_stops_generation_during_the_update():
    """Streaming with staleness 1 overlaps step 1's rollout with update 0 unless the devices are shared."""
    costs = FixedCosts(decode=1.0, learn_per_token=1.0)
    stream = Mode("c", max_staleness=1)
    setup = Setup(prompts=1, group_size=1, steps=2, seed=None, max_batch=1)
    apart = simulate(stream, setup, from_lengths([10]), Acceptance(), costs)
    shared = simulate(stream, Setup(**{**setup.__dict__, "colocated": True}), from_lengths([10]), Acceptance(), costs)
    assert apart.version_times == [0.0, 20.0, 30.0]  # row 1 generated 10..20 while update 0 ran
    assert shared.version_times == [0.0, 20.0, 40.0]  # row 1 waited for update 0: 20..30, then update 1


def test_contention_law_and_its_fallback_in_closed_form():
    """`slowdown`: 1 + k_t u with the fitted k per thread count (the last beyond the list); without k, the
    proportional share max(1, (t + u) / cores); 1 on devices of one's own."""
    fitted = CpuCosts(step_s=0.001, row_s=0.0, engine_k=(0.5, 2.0), learner_k=(0.1,), cores=2.0)
    assert slowdown(fitted, "engine", 1, 0.4) == pytest.approx(1.2)
    assert slowdown(fitted, "engine", 2, 0.4) == pytest.approx(1.8)
    assert slowdown(fitted, "engine", 4, 0.4) == pytest.approx(1.8)
    assert slowdown(fitted, "learner", 2, 1.5) == pytest.approx(1.15)
    share = CpuCosts(step_s=0.001, row_s=0.0, cores=2.0)
    assert slowdown(share, "engine", 2, 1.0) == pytest.approx(1.5) and slowdown(share, "engine", 1, 0.5) == 1.0
    assert slowdown(FixedCosts(), "engine", 2, 5.0) == 1.0


def test_the_wait_per_forward_and_a_fit_made_beside_load_in_closed_form():
    """The engine's law adds w u per forward per second of work; `without_background` inverts the law for the
    constants a fit measured beside u busy cores, so the quiet model slowed by the same u gives the fitted
    step back (to rounding), and a decode step of the fit equals the quiet step slowed."""
    fitted = CpuCosts(
        step_s=0.003, row_s=0.0002, ctx_s=1e-7, ragged_s=0.0004, draft_step_s=0.002, learn_tokens_per_s=5000.0,
        optimizer_s=0.1, engine_k=(0.5, 2.0), engine_wait_s=(0.0, 0.001), learner_k=(0.1, 0.4), publish_s=0.3,
    )  # fmt: skip
    assert slowdown(fitted, "engine", 2, 0.5, forwards_per_s=100.0) == pytest.approx(1 + 2.0 * 0.5 + 0.001 * 0.5 * 100)
    quiet = fitted.without_background(0.5, 0.25, threads=2)
    assert quiet.step_s == pytest.approx((0.003 - 0.0005) / 2.0) and quiet.row_s == pytest.approx(0.0001)
    assert quiet.draft_step_s == pytest.approx((0.002 - 0.0005) / 2.0)
    assert quiet.learn_tokens_per_s == pytest.approx(5000.0 * 1.1) and quiet.optimizer_s == pytest.approx(0.1 / 1.1)
    assert quiet.publish_s == 0.3
    for b, ctx in [(1, 50.0), (64, 300.0)]:  # one forward: quiet x (1 + k u) + w u = the fit's step
        assert quiet.decode_s(b, ctx) * 2.0 + 0.0005 == pytest.approx(fitted.decode_s(b, ctx))
    with pytest.raises(ValueError, match="contention"):
        CpuCosts(step_s=0.001, row_s=0.0).without_background(0.5, 0.5, threads=1)


def test_a_measured_contention_curve_is_interpolated_and_inverted_in_closed_form(tmp_path):
    """With the contention bench's measured curve, `slowdown` is the piecewise-linear curve through its points
    (extended from the last two, the last thread count's curve beyond the list, never below 1) in place of the
    law; `without_background` divides it out; a saved model keeps its curves."""
    curve = ((0.0, 1.0), (0.2, 1.3), (0.6, 2.5))
    fitted = CpuCosts(
        step_s=0.003, row_s=0.0002, learn_tokens_per_s=5000.0, optimizer_s=0.1, engine_k=(9.0,), learner_k=(9.0,),
        engine_curve=(((0.0, 1.0), (1.0, 1.1)), curve), learner_curve=(((0.0, 1.0), (0.5, 0.9)),),
    )  # fmt: skip
    assert slowdown(fitted, "engine", 2, 0.1) == pytest.approx(1.15)
    assert slowdown(fitted, "engine", 2, 0.4) == pytest.approx(1.9)
    assert slowdown(fitted, "engine", 2, 1.0) == pytest.approx(2.5 + 3.0 * 0.4)  # beyond: the last slope
    assert slowdown(fitted, "engine", 3, 0.4) == pytest.approx(1.9)
    assert slowdown(fitted, "engine", 1, 0.5) == pytest.approx(1.05)
    assert slowdown(fitted, "learner", 2, 0.25) == 1.0  # a curve below 1 (noise) slows nothing
    quiet = fitted.without_background(0.4, 0.0, threads=2)
    assert quiet.step_s == pytest.approx(0.003 / 1.9) and quiet.row_s == pytest.approx(0.0002 / 1.9)
    assert quiet.learn_tokens_per_s == pytest.approx(5000.0)
    fitted.save(tmp_path / "cpu.json")
    assert CpuCosts.load(tmp_path / "cpu.json") == fitted


def test_background_cores_slow_every_step_and_the_update_by_the_law():
    """One row of 100 tokens, 10 ms a step, 1000 tokens/s learned, 0.5 background cores: steps at 1 + 0.8 x 0.5,
    the update at 1 + 0.2 x 0.5, publication unchanged; the worker's and learner's threads never overlap
    (synchronous), so the background is all there is."""
    costs = CpuCosts(
        step_s=0.01, row_s=0.0, learn_tokens_per_s=1000.0, publish_s=0.25, engine_k=(0.8,), learner_k=(0.2,)
    )
    loaded = dataclasses.replace(one(100), background_cores=0.5)
    r = simulate(PLAIN, loaded, from_lengths([100]), Acceptance(), costs)
    assert r.version_times[1] == pytest.approx(100 * 0.01 * 1.4 + 0.1 * 1.1 + 0.25)
    quiet = simulate(PLAIN, one(100), from_lengths([100]), Acceptance(), costs)
    assert quiet.version_times[1] == pytest.approx(100 * 0.01 + 0.1 + 0.25)


def test_a_busy_learner_counts_as_other_work_for_a_worker_step():
    """Streaming: step 1's rollout runs beside update 0, each slowed by the other's thread (u = 1 core) while
    both run, at the law's rates (processor sharing: the update is slowed only while the rollout runs)."""
    costs = CpuCosts(step_s=1.0, row_s=0.0, learn_tokens_per_s=0.1, engine_k=(0.5,), learner_k=(0.25,))
    stream = Mode("c", max_staleness=1)
    setup = Setup(prompts=1, group_size=1, steps=2, seed=None, max_batch=1)
    r = simulate(stream, setup, from_lengths([10]), Acceptance(), costs)
    # row 0: 10 steps alone (0..10). From 10, update 0 (10 tokens / 0.1 = 100 s of work) beside row 1 (10 s of
    # work): row 1 at rate 1 / 1.5 ends at 25; the update did 15 / 1.25 = 12 s of work by then, the other 88 s
    # alone: announced at 113; update 1 alone: 213
    assert r.version_times == pytest.approx([0.0, 113.0, 213.0])


CPU = CpuCosts(
    step_s=0.004, row_s=0.0004, node_frac=0.5, round_s_fixed=0.002, draft_step_s=0.001, draft_row_s=0.0001,
    learn_tokens_per_s=20_000, publish_s=0.3, load_s=0.2,
)  # fmt: skip


@pytest.mark.parametrize("name", list(MODES))
def test_every_simulated_token_is_generated_exactly_once(name):
    setup = Setup(prompts=6, group_size=4, steps=4, seed=11, max_batch=16)
    r = simulate(MODES[name], setup, named("lognormal:80:0.8:600"), Acceptance.uniform(2.5), CPU)
    assert r.emitted == pytest.approx(r.finished_tokens + r.in_flight_tokens + r.discarded_tokens)
    assert len(r.version_times) == setup.steps + 1  # dropped groups are sent again: every step is made


def test_a_stale_group_behind_a_fresh_one_is_dropped_and_sent_again_in_closed_form():
    """Staleness 1, two workers of two rows, two one-row groups a step, 1 s a decode step, lengths in order
    100, 1, 1, 1, 1, 1, then 5. Group 0 (version 0, 100 tokens) finishes at t = 100 behind group 5 (version 1)
    while the learner is at version 2: 2 - 0 > 1, so it is dropped although it is not first in the queue (it
    used to be trained), and sent again: its replacement of 5 tokens ends at 105, the last update with it."""
    setup = Setup(prompts=2, group_size=1, steps=3, seed=None, max_batch=2, workers=2)
    lengths = from_lengths([100, 1, 1, 1, 1, 1, 5])
    r = simulate(Mode("c", max_staleness=1), setup, lengths, Acceptance(), FixedCosts(decode=1.0))
    assert r.version_times == pytest.approx([0.0, 1.0, 2.0, 105.0])
    assert r.dropped_groups == 1
    assert r.emitted == r.finished_tokens == 100 + 5 * 1 + 5


def test_a_colocated_overlapped_learner_gives_the_devices_back_between_groups():
    """The overlapped learner on the rollout's own devices learns each group as it arrives, and the workers
    resume after each; they were never woken again and the simulation ended without its steps. Two one-row
    groups of 10 and 100 tokens, 1 s a decode step, 0.1 s a learned token: the first group is learned over
    10..11 while the other's generation waits, which then ends at 101 and is learned by 111, then 5 s of
    optimizer."""
    costs = FixedCosts(decode=1.0, learn_per_token=0.1, optimizer_s=5.0)
    setup = Setup(prompts=2, group_size=1, steps=2, seed=None, colocated=True)
    r = simulate(Mode("o", overlapped=True), setup, from_lengths([10, 100]), Acceptance(), costs)
    assert len(r.version_times) == 3
    assert r.version_times[1] == pytest.approx(10 + 1 + 90 + 10 + 5)


def test_the_same_seed_gives_the_same_run_and_another_seed_another():
    setup = Setup(prompts=6, group_size=4, steps=3, seed=5)
    run = lambda s: simulate(MODES["b_sync_tlt"], s, named("lognormal:80:0.8:600"), Acceptance.uniform(2.5), CPU)  # noqa: E731
    assert run(setup).summary() == run(setup).summary()
    assert run(setup).summary() != run(Setup(**{**setup.__dict__, "seed": 6})).summary()


def test_length_laws_and_run_directories(tmp_path):
    assert named("const:7").lengths == (7,) * 4096
    law = named("lognormal:100:1.0:500")
    assert max(law.lengths) == 500 and law.summary()["p50"] == pytest.approx(100, rel=0.02)
    with pytest.raises(LengthError):
        named("zipf:1")
    with pytest.raises(LengthError):
        from_run(tmp_path)
    rows = [{"version": v, "response_lens": [v, 2 * v]} for v in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert sorted(from_run(tmp_path).lengths) == [2, 3, 4, 6]  # the first step left out
    rows = [{"response_len_p50": 100, "response_len_p90": 200, "response_len_max": 300}] * 2
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    fitted = from_run(tmp_path)
    assert max(fitted.lengths) <= 300 and fitted.summary()["p50"] == pytest.approx(100, rel=0.05)


def test_roofline_decode_at_batch_one_is_the_weights_over_bandwidth():
    costs = GpuCosts(GPUS["h100"], MODELS["7B"], bw_frac=0.8, step_overhead_s=0.002)
    weights = 2 * MODELS["7B"].params
    assert costs.decode_s(1, 0) == pytest.approx(weights / (3.35e12 * 0.8) + 0.002)
    assert MODELS["7B"].total_params == pytest.approx(7.62e9, rel=0.01)  # the published 7.61B
    assert MODELS["32B"].total_params == pytest.approx(32.8e9, rel=0.01)  # the published 32.5B + its head


def test_plan_command_refuses_bad_input_in_one_line(capsys, tmp_path):
    from tlt_stream.commands.cli import main

    for argv in (
        ["plan", "--gpu", "h900", "--lengths", "const:5", "--acceptance", "2"],
        ["plan", "--from-run", str(tmp_path), "--gpu", "h100"],
        ["plan", "--lengths", "const:5", "--acceptance", "2", "--gpu", "h100", "--model-size=-7B"],
        ["plan", "--lengths", "const:5", "--acceptance", "2", "--gpu", "h100", "--prompts", "-1"],
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("tlt-stream plan:") and "\n" not in err


def test_plan_command_json(capsys):
    from tlt_stream.commands.cli import main

    argv = ["plan", "--lengths", "uniform:20:200", "--acceptance", "3", "--gpu", "h100", "--steps", "2"]
    assert main([*argv, "--seeds", "1", "--json", "-q", "--no-recommend", "--modes", "a_sync_plain,b_sync_tlt"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["kind"].startswith("PROJECTION")
    assert set(out["modes"]) == {"a_sync_plain", "b_sync_tlt"} and out["modes"]["a_sync_plain"]["speedup_over_a"] == 1


def test_plan_from_run_reads_lengths_and_acceptance(tmp_path, capsys):
    """A run's per-sample lengths, and its SD samples' tokens per forward weighted by length (a sample that
    ran without speculating, 1 token per forward, is left out), every step but the first."""
    from tlt_stream.commands.cli import main
    from tlt_stream.commands.plan import _run_acceptance

    rows = [
        {"version": 1, "response_lens": [5, 5], "accept_lengths": [9.0, 9.0]},  # the first step: left out
        {"version": 2, "response_lens": [300, 100, 50], "accept_lengths": [3.0, 1.0, 1.0]},
        {"version": 3, "response_lens": [100], "accept_lengths": [1.0]},
    ]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert _run_acceptance(str(tmp_path))[0] == pytest.approx(3.0)  # only rows with SD: 300 tokens / 100 forwards
    argv = ["plan", "--from-run", str(tmp_path), "--gpu", "a100", "--steps", "2", "--seeds", "1", "--json", "-q"]
    assert main([*argv, "--no-recommend", "--modes", "a_sync_plain"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["inputs"]["lengths"]["max"] == 300 and out["inputs"]["acceptance"]["tokens_per_round"] == 3.0
    assert (tmp_path / "plan.png").stat().st_size > 0  # the plot, drawn beside the run by default


def test_acceptance_table_per_arm_and_bucket(tmp_path):
    from tlt_stream.commands.plan import PlanInputError, _table

    path = tmp_path / "acc.json"
    path.write_text(json.dumps({"d4k1v4": {"0": 3.5, "*": 2.0}, "*": {"2": 1.5}}))
    table = _table(str(path), Acceptance.uniform(1.2))
    d4, d6 = Arm.from_label("d4k1v4"), Arm.from_label("d6k1v6")
    assert table.mean(d4, 0) == 3.5 and table.mean(d4, 5) == 2.0
    assert table.mean(d6, 2) == 1.5 and table.mean(d6, 3) == 1.2  # the fallback for the rest
    path.write_text(json.dumps({"d4k1v4": 3}))
    with pytest.raises(PlanInputError):
        _table(str(path), Acceptance.uniform(1.2))


def test_plan_from_run_takes_each_arms_acceptance_per_bucket_from_the_timeline(tmp_path, capsys):
    """The SD arm reports a run's timeline keeps (tokens and the rows their rounds ran) give each arm's tokens per
    round per bucket, the arm's pooled figure in its other buckets, and the samples' figure for other arms."""
    from tlt_stream.commands.cli import main

    rows = [{"version": v, "response_lens": [300, 100], "accept_lengths": [3.0, 1.0]} for v in (1, 2)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    report = {"kind": "sd_arm", "worker_id": "w", "drafter_version": 0, "proposer": "drafter", "seconds": 1.0}
    arms = [
        {**report, "bucket": 0, "depth": 4, "topk": 1, "verify": 4, "tokens": 30, "rows": 10},
        {**report, "bucket": 0, "depth": 4, "topk": 1, "verify": 4, "tokens": 10, "rows": 5},  # pooled: 40 / 15
        {**report, "bucket": 2, "depth": 4, "topk": 1, "verify": 4, "tokens": 20, "rows": 10},
        {**report, "bucket": 2, "depth": 0, "topk": 0, "verify": 0, "proposer": "plain", "tokens": 8, "rows": 8},
        {**report, "bucket": 3, "depth": 2, "topk": 1, "verify": 2, "tokens": 99, "rows": 0},  # no rows counted
    ]
    timeline = [{"kind": "rollout", "tokens": 5}, *arms]
    (tmp_path / "timeline.jsonl").write_text("\n".join(json.dumps(r) for r in timeline) + "\n")
    acc = plan_from_run(tmp_path, fallback=3.0)
    d4, d2 = Arm.from_label("d4k1v4"), Arm.from_label("d2k1v2")
    assert acc.mean(d4, 0) == pytest.approx(40 / 15) and acc.mean(d4, 2) == 2.0
    assert acc.mean(d4, 5) == pytest.approx(60 / 25) and acc.mean(d2, 3) == 3.0
    argv = ["plan", "--from-run", str(tmp_path), "--gpu", "a100", "--steps", "1", "--seeds", "1", "--json", "-q"]
    assert main([*argv, "--no-recommend", "--modes", "a_sync_plain", "--plot", str(tmp_path / "p.png")]) == 0
    out = json.loads(capsys.readouterr().out)["inputs"]["acceptance"]
    assert "timeline.jsonl" in out["source"] and out["table"]["d4k1v4@2"] == 2.0 and out["table"]["*@*"] == 3.0
    (tmp_path / "timeline.jsonl").write_text(json.dumps(arms[-1]) + "\n")  # nothing with rows: the samples' figure
    assert plan_from_run(tmp_path, fallback=3.0) is None


def test_acceptance_given_for_one_arm_spreads_by_the_budget_law(capsys):
    from tlt_stream.commands.cli import main

    argv = ["plan", "--lengths", "const:64", "--gpu", "h100", "--model-size", "7B", "--rollout-gpus", "1"]
    argv += ["--acceptance", "6.4", "--acceptance-arm", "d8k4v48", "--arms", "d8k4v8,d8k4v48"]
    assert main([*argv, "--steps", "1", "--seeds", "1", "--no-recommend", "--json", "-q"]) == 0
    out = json.loads(capsys.readouterr().out)["inputs"]
    assert out["setup"]["arms"] == ["plain", "d8k4v8", "d8k4v48"] and out["acceptance"]["table"] == {"d8k4v48@*": 6.4}
    assert main([*argv[:-4], "--acceptance-arm", "plain", "--steps", "1", "-q"]) == 2


def test_a_round_deep_in_a_response_pays_every_node_s_and_candidate_s_attention_over_the_context():
    """round_s at context C, by the module docstring's formula: a verified node attends the whole context
    (`node_ctx_frac` of the decode token's `ctx_s` each), and so does every drafted candidate (`draft_ctx_s`)."""
    costs = dataclasses.replace(CPU, ctx_s=1e-6, node_ctx_frac=0.5, draft_ctx_s=2e-7)
    arm, b = Arm.from_label("d4k2v8"), 16
    for ctx in (100, 400):
        verify = 0.004 + 0.002 + 0.0004 * b * (1 + 0.5 * arm.nodes) + 1e-6 * b * ctx * (1 + 0.5 * arm.nodes)
        drafts = arm.depth * (0.001 + b * arm.topk * (0.0001 + 2e-7 * ctx))
        assert costs.round_s(b, arm, ctx) == pytest.approx(verify + drafts)
    # a quiet machine's constants (`without_background`): every cost of a round scaled alike
    quiet = dataclasses.replace(costs, engine_curve=((), ((0.0, 1.0), (1.0, 1.5))), learner_curve=((), ((0.0, 1.0),)))
    quiet = quiet.without_background(1.0, 0.0, 2)
    assert quiet.round_s(b, arm, 400) == pytest.approx(costs.round_s(b, arm, 400) / 1.5)


SWITCHING = dict(after_round_frac=0.2, after_round_decay=0.5, after_one_plain_frac=0.04, after_plain_frac=0.1,
                 after_plain_steps=4)  # fmt: skip


def test_a_step_after_the_other_kind_pays_the_switch_in_closed_form():
    """A plain step j steps after a round pays after_round_frac * decay^(j-1) of a decode step; a round after k
    plain steps pays after_one_plain_frac at k = 1, linear up to after_plain_frac at after_plain_steps and
    beyond; nothing back to back, before any round, on a GPU or in the hand-computable model."""
    costs = dataclasses.replace(CPU, **SWITCHING)
    arm, plain = Arm.from_label("d4k1v4"), Arm.plain()
    d, r = costs.decode_s(8, 100), costs.round_s(8, arm, 100)
    assert costs.switch_s(8, plain, 100, None) == costs.switch_s(8, arm, 100, None) == 0.0
    assert costs.switch_s(8, plain, 100, 0) == pytest.approx(0.2 * d)
    assert costs.switch_s(8, plain, 100, 2) == pytest.approx(0.2 * 0.25 * d)
    assert costs.switch_s(8, plain, 100, 1, repeat=3) == pytest.approx(0.2 * (0.5 + 0.25 + 0.125) * d)
    assert costs.switch_s(8, arm, 100, 0) == 0.0
    assert costs.switch_s(8, arm, 100, 1) == pytest.approx(0.04 * r)
    assert costs.switch_s(8, arm, 100, 2) == pytest.approx((0.04 + 0.06 / 3) * r)
    assert costs.switch_s(8, arm, 100, 4) == pytest.approx(0.1 * r) == costs.switch_s(8, arm, 100, 40)
    assert CPU.switch_s(8, plain, 100, 0) == CPU.switch_s(8, arm, 100, 5) == 0.0
    assert FixedCosts().switch_s(8, arm, 100, 5) == 0.0
    assert GpuCosts(MODELS["7B"], GPUS["h100"]).switch_s(8, plain, 100, 0) == 0.0
    for bad in ({"after_round_decay": 1.0}, {"after_plain_frac": -1.0}, {"after_plain_steps": 0}):
        assert dataclasses.replace(costs, **bad)._unusable() is not None


UNIT_STEPS = CpuCosts(step_s=1.0, row_s=0.0, round_s_fixed=1.0, learn_tokens_per_s=1e12)
"""A decode step of 1 s and a round of 2 s whatever the rows and context; an update of no time."""


def short_and_long(steps: int):
    """(Setup, lengths): a group of 8 rows a step, 4 of 3 tokens and 4 of 30, one `d4k1v4` arm, SD on at 4 rows
    and below and plain above, no drafter training; lengths in order (no seed)."""
    setup = Setup(
        prompts=1, group_size=8, steps=steps, seed=None, max_batch=8, arms=("d4k1v4",), crossover=5, margin=0,
        above_crossover="plain", train_drafter=False,
    )  # fmt: skip
    return setup, from_lengths([3, 3, 3, 3, 30, 30, 30, 30])


def test_the_simulator_charges_each_switch_between_plain_steps_and_rounds_in_closed_form():
    """Two steps of one group of 8 rows, 4 of 3 tokens and 4 of 30; SD on at 4 rows and below, plain above.
    Each step: 3 plain steps of 1 s (the short rows end), then 9 rounds of 2 s emitting 3 tokens each. With the
    switching constants, each step's first round follows 3 plain steps (0.04 + 0.06 * 2 / 3 of a round), and the
    second step's plain steps follow the first step's last round (0.2 * (1 + 0.5 + 0.25) of a decode step); the
    first step's plain steps follow no round and pay nothing."""
    base, (setup, lengths) = UNIT_STEPS, short_and_long(steps=2)
    plain = simulate(SD, setup, lengths, Acceptance.uniform(3.0), base)
    assert plain.version_times == pytest.approx([0.0, 21.0, 42.0], abs=1e-6)
    assert plain.rounds == {"plain": 6, "d4k1v4": 18}
    switched = simulate(SD, setup, lengths, Acceptance.uniform(3.0), dataclasses.replace(base, **SWITCHING))
    first_round = (0.04 + 0.06 * 2 / 3) * 2.0
    after_round = 0.2 * (1 + 0.5 + 0.25) * 1.0
    assert switched.version_times == pytest.approx(
        [0.0, 21.0 + first_round, 42.0 + 2 * first_round + after_round], abs=1e-6
    )
    assert switched.rounds == plain.rounds


def test_the_tuner_judges_an_arm_by_what_its_step_would_cost_after_the_steps_run_in_closed_form():
    """One group of 8 rows, 4 of 3 tokens and 4 of 30; SD on at 4 rows and below. Back to back a round (2 s,
    2.1 tokens a row) beats a plain step (1 s, 1 token); after 3 plain steps the round would cost 8% more
    (0.04 + 0.06 * 2 / 3), 2.16 s: 0.97 tokens a second a row, below plain's 1. The tuner that judges steps as
    they would run keeps decoding plain (27 more steps, the round after more plain steps costlier still); the one
    that judges them back to back speculates (ceil(27 / 2.1) = 13 rounds)."""
    costs, (setup, lengths) = dataclasses.replace(UNIT_STEPS, **SWITCHING), short_and_long(steps=1)
    as_run = simulate(SD, setup, lengths, Acceptance.uniform(2.1), costs)
    assert as_run.rounds == {"plain": 30}
    back_to_back = dataclasses.replace(setup, judged_as_run=False)
    assert simulate(SD, back_to_back, lengths, Acceptance.uniform(2.1), costs).rounds == {"plain": 3, "d4k1v4": 13}


def test_a_drafter_round_pays_for_the_draft_tokens_its_rows_accept_in_closed_form():
    """accept_s per row and draft token accepted, on a drafter arm's round only (an n-gram round has no drafter
    to catch up, a plain step accepts nothing); scaled with the engine; charged in a round's switch; a negative
    constant refused."""
    costs = dataclasses.replace(CPU, accept_s=5e-5, **SWITCHING)
    arm, ngram, plain = Arm.from_label("d4k1v4"), Arm.from_label("ngram-d4"), Arm.plain()
    assert costs.round_s(8, arm, 100, 3.0) - costs.round_s(8, arm, 100) == pytest.approx(5e-5 * 8 * 3.0)
    assert costs.round_s(8, arm, 100, -1.0) == costs.round_s(8, arm, 100)
    for other in (ngram, plain):
        assert costs.round_s(8, other, 100, 3.0) == costs.round_s(8, other, 100)
    assert costs.engine_slower(1.5).round_s(8, arm, 100, 3.0) == pytest.approx(1.5 * costs.round_s(8, arm, 100, 3.0))
    assert costs.switch_s(8, arm, 100, 1, accepted=3.0) == pytest.approx(0.04 * costs.round_s(8, arm, 100, 3.0))
    assert "accept_s" in (dataclasses.replace(CPU, accept_s=-1e-6)._unusable() or "")


def test_the_simulator_charges_a_round_for_what_its_rows_accept_and_the_tuner_weighs_it_in_closed_form():
    """One group of 8 rows, 4 of 3 tokens and 4 of 30; SD on at 4 rows and below; rounds of 2 s emitting 3 tokens
    a row (2 of them accepted draft tokens), plain steps of 1 s. At accept_s = 0.05 a round costs 2 + 0.05 * 4 * 2
    = 2.4 s, 5 tokens a second against plain's 4: 3 plain steps, then 9 rounds, 24.6 s. At 0.2 a round costs 3.6 s,
    3.3 tokens a second: the tuner decodes plain, 30 steps of 1 s."""
    setup, lengths = short_and_long(steps=1)
    costs = dataclasses.replace(UNIT_STEPS, accept_s=0.05)
    run = simulate(SD, setup, lengths, Acceptance.uniform(3.0), costs)
    assert run.rounds == {"plain": 3, "d4k1v4": 9}
    assert run.version_times == pytest.approx([0.0, 24.6], abs=1e-6)
    dear = simulate(SD, setup, lengths, Acceptance.uniform(3.0), dataclasses.replace(costs, accept_s=0.2))
    assert dear.rounds == {"plain": 30}
    assert dear.version_times == pytest.approx([0.0, 30.0], abs=1e-6)


def test_the_drafter_s_catch_up_over_unseen_prompts_in_closed_form():
    """catch_up_s: this CPU's drafter runs over every row of the round padded to the row holding most unseen
    pairs; the GPU's over each row's own (a prefill of the drafter); nothing in the hand-computable model; scaled
    with the engine; a negative constant refused."""
    costs = dataclasses.replace(CPU, catch_up_token_s=2e-6)
    assert costs.catch_up_s([0, 60, 30, 0]) == pytest.approx(2e-6 * 4 * 60)
    assert costs.catch_up_s([0, 0]) == costs.catch_up_s([]) == 0.0
    assert costs.engine_slower(2.0).catch_up_s([10]) == pytest.approx(2 * costs.catch_up_s([10]))
    gpu = GpuCosts(GPUS["h100"], MODELS["7B"])
    assert gpu.catch_up_s([0, 60, 30]) == pytest.approx(gpu.catch_up_s([90]))
    flops = gpu.gpu.bf16_flops * gpu.flop_frac
    assert gpu.catch_up_s([90]) == pytest.approx(90 * 2 * MODELS["7B"].drafter_params / flops)
    assert FixedCosts().catch_up_s([60]) == 0.0
    assert "catch_up_token_s" in (dataclasses.replace(CPU, catch_up_token_s=-1e-9)._unusable() or "")


def test_the_first_drafter_round_after_a_prefill_or_a_reverification_pays_the_catch_up_in_closed_form():
    """Admitted rows hold their prompts unseen by the drafter until its next round; re-verified rows their prompts
    and kept tokens. One group of 8 (SD at 4 rows and below): its 4 long rows' prompts (32 tokens) are caught up at
    the step's first round, after 3 plain steps: 0.01 * 4 * 32 s more, once. Partial rollouts with SD (the
    closed-form partial case: step 0's two rows and step 1's drafts admitted together, the draft of 20 tokens held
    4 when re-verified and the one of 3 done by it): 4 rows of an 8-token prompt at the first round, then the one
    row left after the re-verification, its prompt and 4 tokens."""
    setup, lengths = short_and_long(steps=1)
    base = simulate(SD, setup, lengths, Acceptance.uniform(3.0), UNIT_STEPS)
    costs = dataclasses.replace(UNIT_STEPS, catch_up_token_s=0.01)
    caught = simulate(SD, setup, lengths, Acceptance.uniform(3.0), costs)
    assert caught.rounds == base.rounds == {"plain": 3, "d4k1v4": 9}
    assert caught.version_times[1] - base.version_times[1] == pytest.approx(0.01 * 4 * 32)
    costs = CpuCosts(
        step_s=0.01, row_s=0.0, round_s_fixed=0.01, learn_tokens_per_s=1000.0, optimizer_s=0.05, publish_s=0.02,
        load_s=0.03, reverify_step_s=0.004, reverify_token_s=1e-4, cores=float("inf"),
    )  # fmt: skip
    partial = Setup(
        prompts=1, group_size=2, steps=2, max_batch=4, prompt_len=8, seed=None, ahead_tokens=4, kept_share=1.0,
        arms=("d4k1v4",), crossover=100, margin=0, train_drafter=False,
    )  # fmt: skip
    mode, four = Mode("g", sd=True, partial=True), Acceptance.uniform(4.0)
    runs = [
        simulate(mode, partial, from_lengths([10, 10, 20, 3]), four, dataclasses.replace(costs, catch_up_token_s=c))
        for c in (0.0, 1e-3)
    ]
    extra = [b - a for a, b in zip(runs[0].step_times, runs[1].step_times, strict=True)]
    assert extra == pytest.approx([1e-3 * 4 * 8, 1e-3 * 1 * (8 + 4)])


def test_an_engine_made_slower_leaves_the_learner_publication_and_loading_as_measured():
    from tlt_stream.rollout.arms import Arm

    costs = CpuCosts(
        step_s=0.002, row_s=1e-4, ctx_s=1e-6, prefill_token_s=1e-4, learn_tokens_per_s=100.0, load_s=0.3, publish_s=0.2
    )
    slow = costs.engine_slower(1.5)
    assert slow.round_s(8, Arm("plain"), 40) == pytest.approx(1.5 * costs.round_s(8, Arm("plain"), 40))
    assert slow.prefill_s(30) == pytest.approx(1.5 * costs.prefill_s(30))
    assert slow.reverify_s([4, 3], 8) == pytest.approx(1.5 * costs.reverify_s([4, 3], 8))
    assert slow.learn_rows_s([10, 20], 8) == costs.learn_rows_s([10, 20], 8)
    assert (slow.load_s, slow.publish_s) == (0.3, 0.2)
    with pytest.raises(ValueError):
        costs.engine_slower(0.0)


def test_the_drafters_training_slows_an_update_only_where_the_learner_leaves_it_a_core():
    """One group, then the worker idle: it trains the drafter (one thread, the lowest priority) beside the
    whole update. Streaming on two cores (the learner's one thread) leaves the training a core: the update is
    slowed by the learner's law at one busy core, 1 + k_1. Synchronous (the learner's two threads take both
    cores): the training gets none, and the update pays `learner_beside_training` in its stead (1: nothing),
    all of it where the update leaves no core, none of it where it leaves one."""
    costs = CpuCosts(
        step_s=0.01, row_s=0.0, learn_tokens_per_s=100.0, learner_k=(0.5, 3.0), engine_k=(0.0, 0.0), cores=2.0
    )
    lengths = from_lengths([20])

    def update_s(mode: Mode, threads: int, train: bool, beside: float = 1.0) -> float:
        setup = Setup(
            prompts=1, group_size=1, steps=1, seed=None, max_batch=1, worker_threads=threads,
            learner_threads=threads, train_drafter=train,
        )  # fmt: skip
        charged = dataclasses.replace(costs, learner_beside_training=beside)
        return simulate(mode, setup, lengths, Acceptance(), charged).learner_s[0]

    stream, sync = Mode("c", sd=True, max_staleness=1), Mode("b", sd=True)
    alone = update_s(sync, 2, train=False)
    assert alone == pytest.approx(20 / 100.0)
    assert update_s(stream, 1, train=True) == pytest.approx(1.5 * update_s(stream, 1, train=False))
    assert update_s(sync, 2, train=True) == pytest.approx(alone)
    assert update_s(sync, 2, train=True, beside=1.2) == pytest.approx(1.2 * alone)
    assert update_s(sync, 2, train=False, beside=1.2) == pytest.approx(alone)  # nothing trains beside it
    assert update_s(stream, 1, train=True, beside=1.2) == pytest.approx(update_s(stream, 1, train=True))
