"""The SD tuner: on/off hysteresis, buckets, epsilon-greedy on windowed throughput, tables, drafter changes."""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from statistics import median

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.stats import chi2_threshold, chi_square
from tlt_stream.basics.messages import SdArmReport
from tlt_stream.rollout.arms import Arm
from tlt_stream.rollout.switch import (
    DEFAULT_EDGES,
    SdSwitch,
    SdTable,
    aggregate_reports,
    arm_of_report,
    bucket_of,
    threshold_from_crossover,
)
from tlt_stream.rollout.tuner import DEFAULT_ARMS, SdTuner

PLAIN = Arm.plain()
NGRAM = Arm.ngram(4)
D2 = Arm.drafter(2, 1, 2)
D4 = Arm.drafter(4, 1, 4)
TREE = Arm.drafter(4, 2, 8)
POOL = (PLAIN, NGRAM, D2, D4, TREE, Arm.drafter(6, 4, 16))


def simulate(
    tuner: SdTuner,
    rng: random.Random,
    steps: int,
    rate: Callable[[Arm], float],
    batch: int = 1,
    noise: float = 0.0,
    env: random.Random | None = None,
) -> list[Arm]:
    """Run `steps` choose/record rounds; the reward of an arm is `rate(arm)` times log-normal noise."""
    env = env or random.Random(0)
    picks = []
    for _ in range(steps):
        arm = tuner.choose(batch, rng)
        reward = rate(arm) * math.exp(env.gauss(0.0, noise))
        tuner.record(batch, arm, tokens=64, seconds=64 / reward)
        picks.append(arm)
    return picks


@st.composite
def ranked_arms(draw: st.DrawFn) -> tuple[list[Arm], dict[Arm, float]]:
    """2-6 arms (always plain) with rates 1.4x apart in a random order."""
    others = draw(st.lists(st.sampled_from(POOL[1:]), min_size=1, max_size=len(POOL) - 1, unique=True))
    arms = [PLAIN, *others]
    order = draw(st.permutations(arms))
    return arms, {arm: 100.0 * 1.4**rank for rank, arm in enumerate(order)}


# ---------------------------------------------------------------------------------------------------- arms, buckets


@settings(max_examples=60, deadline=None)
@given(
    edges=st.lists(st.integers(1, 200), min_size=1, max_size=8, unique=True).map(sorted),
    batch=st.integers(1, 300),
)
def test_bucket_i_holds_the_batches_between_edge_i_minus_one_and_edge_i(edges: list[int], batch: int) -> None:
    b = bucket_of(batch, edges)
    assert 0 <= b <= len(edges)
    assert b == len(edges) or batch <= edges[b]
    assert b == 0 or batch > edges[b - 1]


def test_default_buckets() -> None:
    assert [bucket_of(n) for n in (1, 2, 3, 4, 5, 16, 17, 32, 64, 65, 1000)] == [0, 1, 2, 2, 3, 4, 5, 5, 6, 7, 7]
    for bad in ((), (0, 1), (2, 2), (4, 2)):
        with pytest.raises(ValueError):
            bucket_of(1, bad)
    with pytest.raises(ValueError):
        bucket_of(0)


@settings(max_examples=60, deadline=None)
@given(depth=st.integers(1, 12), topk=st.integers(1, 4), data=st.data())
def test_arm_labels_round_trip(depth: int, topk: int, data: st.DataObject) -> None:
    verify = data.draw(st.integers(1, depth * topk * topk))
    group = data.draw(st.integers(1, 16))
    arms = (PLAIN, Arm.ngram(depth), Arm.drafter(depth, topk, verify), Arm.group_source(depth, group))
    for arm in (*arms, Arm.mixed(depth, topk, verify, group)):
        assert Arm.from_label(arm.label) == arm
    assert Arm.drafter(depth, topk, verify).label == f"d{depth}k{topk}v{verify}"
    assert Arm.mixed(depth, topk, verify, group).label == f"d{depth}k{topk}v{verify}+g{group}"
    assert Arm.mixed(depth, topk, verify, group).nodes == verify + group
    either = Arm.either(depth, group)
    assert Arm.from_label(either.label) == either and either.label == f"d{depth}k1v{depth}|g{group}"
    assert either.nodes == max(depth, group) and either.uses_drafter


def test_arms_reject_impossible_configurations() -> None:
    for kind, depth, topk, verify in [
        ("plain", 1, 0, 0),
        ("ngram", 4, 2, 4),
        ("ngram", 0, 1, 0),
        ("drafter", 0, 1, 1),
        ("drafter", 2, 1, 3),
        ("eagle", 2, 1, 2),
        ("group", 0, 0, 4),
        ("group", 4, 1, 4),
    ]:
        with pytest.raises(ValueError):
            Arm(kind, depth, topk, verify)  # type: ignore[arg-type]
    for label in ("", "d4", "ngram", "d4k1v4x", "none"):
        with pytest.raises(ValueError):
            Arm.from_label(label)


# ---------------------------------------------------------------------------------------------------- on/off


def test_threshold_from_the_measured_crossover_keeps_the_band_below_it() -> None:
    switch = SdSwitch.from_crossover(16, 2)
    assert (switch.threshold, switch.off_above) == (13, 15)
    assert threshold_from_crossover(1, 0) == 0
    with pytest.raises(ValueError):
        threshold_from_crossover(0, 1)
    with pytest.raises(ValueError):
        SdSwitch(4, -1)


@settings(max_examples=60, deadline=None)
@given(
    crossover=st.integers(2, 64),
    margin=st.integers(0, 8),
    batches=st.lists(st.integers(1, 80), min_size=1, max_size=200),
)
def test_the_switch_follows_its_rules_and_counts_every_change(crossover: int, margin: int, batches: list[int]) -> None:
    switch = SdSwitch.from_crossover(crossover, margin)
    changes, previous = 0, switch.on
    for batch in batches:
        on = switch.update(batch)
        assert on == switch.on
        if batch <= switch.threshold:
            assert on
        elif batch > switch.off_above:
            assert not on
        else:
            assert on == previous  # inside the band the state holds
        assert switch.changed == (on != previous)
        changes += on != previous
        previous = on
        if margin < crossover:
            assert not on or batch < crossover  # never on where SD was measured to lose
    assert switch.switches == changes


@settings(max_examples=60, deadline=None)
@given(threshold=st.integers(1, 32), margin=st.integers(1, 8), data=st.data())
def test_no_flapping_on_a_batch_size_oscillating_within_the_margin(
    threshold: int, margin: int, data: st.DataObject
) -> None:
    band = st.integers(threshold, threshold + margin)
    batches = data.draw(st.lists(band, min_size=20, max_size=200))
    switch = SdSwitch(threshold, margin)
    states = [switch.update(b) for b in batches]
    assert switch.switches <= 1  # at most the first turn-on, never back
    assert switch.switches == int(any(states))
    assert states == sorted(states)  # once on, it stays on


def test_switches_both_ways_when_the_batch_moves_clearly() -> None:
    switch = SdSwitch.from_crossover(16, 2)  # on at <= 13, off above 15
    drain = list(range(64, 0, -1))
    refill = list(range(1, 65))
    states = [switch.update(b) for b in drain]
    assert states.index(True) == drain.index(13) and all(states[drain.index(13) :])
    assert switch.switches == 1
    states = [switch.update(b) for b in refill]
    assert states.index(False) == refill.index(16) and not any(states[refill.index(16) :])
    assert switch.switches == 2
    oscillate = [12, 15, 13, 14, 15, 12, 15]  # back in the band: turned on at 12, stays on
    assert [switch.update(b) for b in oscillate] == [True] * len(oscillate)
    assert switch.switches == 3


# ---------------------------------------------------------------------------------------------------- tuner


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), epsilon=st.floats(0.0, 1.0), ranking=ranked_arms())
def test_untried_arms_are_tried_first_in_order(
    seed: int, epsilon: float, ranking: tuple[list[Arm], dict[Arm, float]]
) -> None:
    arms, rates = ranking
    tuner = SdTuner(arms, epsilon=epsilon, drafter_version=0)
    picks = simulate(tuner, random.Random(seed), len(arms), rates.__getitem__, batch=3)
    assert picks == arms


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    epsilon=st.floats(0.05, 0.2),
    noise=st.floats(0.0, 0.1),
    window=st.integers(9, 21),
    ranking=ranked_arms(),
)
def test_converges_to_the_best_arm_and_again_after_a_shift(
    seed: int, epsilon: float, noise: float, window: int, ranking: tuple[list[Arm], dict[Arm, float]]
) -> None:
    arms, rates = ranking
    tuner = SdTuner(arms, epsilon=epsilon, window=window, drafter_version=0)
    rng, env = random.Random(seed), random.Random(seed + 1)
    best = max(rates, key=rates.__getitem__)
    picks = simulate(tuner, rng, 1500, rates.__getitem__, noise=noise, env=env)
    assert tuner.greedy(1) == best
    assert Counter(picks[-500:])[best] / 500 >= 1 - epsilon - 0.08

    shifted = dict(rates)
    shifted[best] = min(rates.values()) / 1.4  # the best arm collapses: the runner-up takes over
    runner_up = max(shifted, key=shifted.__getitem__)
    picks = simulate(tuner, rng, 1500, shifted.__getitem__, noise=noise, env=env)
    assert tuner.greedy(1) == runner_up
    assert Counter(picks[-500:])[runner_up] / 500 >= 1 - epsilon - 0.08

    worst = min(shifted, key=shifted.__getitem__)
    risen = dict(shifted)
    risen[worst] = max(shifted.values()) * 1.4  # the worst arm becomes the best: found only by exploring
    simulate(tuner, rng, 4000, risen.__getitem__, noise=noise, env=env)
    assert tuner.greedy(1) == worst


def test_the_estimate_ignores_rare_fast_spikes_a_mean_of_rates_would_follow() -> None:
    env = random.Random(3)

    def rate(arm: Arm) -> float:
        if arm == D4:
            return 1000.0 if env.random() < 0.2 else 50.0  # mean of rates 240, throughput ~61
        return 100.0

    tuner = SdTuner([PLAIN, D4], epsilon=0.2, window=15, drafter_version=0)
    picks = simulate(tuner, random.Random(1), 1000, rate)
    assert tuner.greedy(1) == PLAIN
    assert Counter(picks[-300:])[PLAIN] >= 200


def test_kept_estimates_follow_every_change_of_their_window() -> None:
    """A window keeps its estimate between changes; after records, a decay and a reset, every rate the tuner
    reports equals the estimate computed afresh from the window's steps."""
    tuner = SdTuner([PLAIN, D2, D4, TREE], window=6, drafter_version=0, contexts=2)
    env = random.Random(3)

    def check() -> None:
        for (bucket, arm), window in tuner._windows.items():
            assert tuner.rate(DEFAULT_EDGES[bucket], arm) == (tuner.estimate(list(window)) if window else None)
        for window in tuner._context_windows.values():  # what a decision in a context goes by
            assert not window or tuner.estimate(window) == tuner.estimate(list(window))

    for step in range(200):
        arm = env.choice([PLAIN, D2, D4, TREE])
        tuner.record(env.choice([1, 2, 64]), arm, env.randint(1, 9), env.uniform(0.5, 2.0), context=step % 2)
        tuner.rate(1, arm)  # reads (and keeps) estimates between changes
        tuner.rate(1, arm, context=step % 2)
        if step % 17 == 0:
            check()
    tuner.on_new_drafter(1, "decay")
    check()
    tuner.on_new_drafter(2, "reset")
    check()


def test_the_window_forgets_old_measurements() -> None:
    tuner = SdTuner([PLAIN, D4], window=4, drafter_version=0)
    for seconds in (1.0, 1.0, 1.0, 1.0, 4.0, 4.0):
        tuner.record(1, D4, 400, seconds)
    assert tuner.rate(1, D4) == 160.0  # 1,600 tokens in 1 + 1 + 4 + 4 seconds
    tuner.record(1, D4, 400, 4.0)
    tuner.record(1, D4, 400, 4.0)
    assert tuner.rate(1, D4) == 100.0 and tuner.samples(1, D4) == 4  # the four fast steps are gone


def test_a_skewed_sd_arm_is_judged_by_its_throughput_not_its_typical_step() -> None:
    """An SD step emits 1 token or a whole accepted chain in about the same time: per-step rates are skewed
    (their median is the 1-token step's) while plain's are not. The arm with more tokens per second wins."""
    env = random.Random(4)

    def step(arm: Arm) -> tuple[int, float]:
        if arm == D4:  # 1 token (60%) or 7 (40%) per 1.0 s: 3.4 tokens/s, median per-step rate 1
            return (1 if env.random() < 0.6 else 7), 1.0 * math.exp(env.gauss(0.0, 0.05))
        return 2, 1.0 * math.exp(env.gauss(0.0, 0.05))  # plain: 2 tokens/s, steady

    tuner = SdTuner([PLAIN, D4], epsilon=0.1, drafter_version=0)
    rng, picks = random.Random(2), []
    for _ in range(600):
        arm = tuner.choose(1, rng)
        tokens, seconds = step(arm)
        tuner.record(1, arm, tokens, seconds)
        picks.append(arm)
    # A window of 16 such steps estimates 3.4 +- 0.7 tokens/s, so plain leads now and then; mostly D4 runs
    # (with the median of per-step rates it would run only when explored, ~5% of steps).
    assert Counter(picks[-300:])[D4] >= 210


def test_one_stalled_step_does_not_flip_the_choice() -> None:
    tuner = SdTuner([PLAIN, D4], epsilon=0.0, drafter_version=0)
    for _ in range(16):
        tuner.record(1, PLAIN, 100, 1.0)
        tuner.record(1, D4, 150, 1.0)
    tuner.record(1, D4, 150, 60.0)  # a pause of a minute inside one step
    assert tuner.greedy(1) == D4 and tuner.rate(1, D4) == 150.0


def test_buckets_are_independent() -> None:
    rates = {1: {PLAIN: 100.0, NGRAM: 120.0, D4: 300.0}, 32: {PLAIN: 3000.0, NGRAM: 1500.0, D4: 1800.0}}
    tuner = SdTuner([PLAIN, NGRAM, D4], epsilon=0.1, drafter_version=0)
    rng = random.Random(7)
    simulate(tuner, rng, 300, rates[1].__getitem__, batch=1)
    assert tuner.greedy(1) == D4
    assert tuner.rates(32) == {} and tuner.greedy(32) == PLAIN  # untouched: first untried
    assert [tuner.choose(20, rng) for _ in range(5)] == [PLAIN] * 5  # bucket of 17..32, untried
    simulate(tuner, rng, 300, rates[32].__getitem__, batch=32)
    assert tuner.greedy(32) == tuner.greedy(17) == PLAIN
    assert tuner.greedy(1) == D4 and tuner.rates(1)[D4] == pytest.approx(300.0)
    assert tuner.rates(2) == {}


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), epsilon=st.floats(0.0, 0.5), n_arms=st.integers(2, len(POOL)))
def test_exploration_frequency_is_epsilon(seed: int, epsilon: float, n_arms: int) -> None:
    arms = list(POOL[:n_arms])
    tuner = SdTuner(arms, epsilon=epsilon, drafter_version=0)
    for i, arm in enumerate(arms):
        tuner.record(1, arm, 100 + i, 1.0)
    greedy = tuner.greedy(1)
    rng = random.Random(seed)
    n = 3000
    picks = Counter(tuner.choose(1, rng) for _ in range(n))
    explored = n - picks[greedy]
    sigma = math.sqrt(n * epsilon * (1 - epsilon))
    assert abs(explored - epsilon * n) <= 4.5 * sigma + 1
    if epsilon > 0.2:
        assert set(picks) == set(arms)  # exploration reaches every arm


def test_exploration_draws_arms_by_how_close_they_measured_to_the_best() -> None:
    """The odds stated in SdTuner's docstring, computed here from the recorded rates, not by the tuner:
    weight = max(floor, (rate / best) ** power), rate = max(pooled over the window, pooled over the latest 4
    steps) (5 equal-time steps: one run). Chi-square at 1e-4."""
    tuner = SdTuner(POOL, epsilon=1.0, window=5, drafter_version=0)  # explores on every step
    measured = {PLAIN: [100.0] * 5, NGRAM: [90.0] * 5, D2: [70.0] * 5, D4: [50.0] * 5, TREE: [20.0] * 5}
    measured[POOL[5]] = [20.0] * 4 + [95.0]  # improved: its latest steps count, not only the window
    for arm, rates in measured.items():
        for rate in rates:
            tuner.record(64, arm, int(rate * 10), 10.0)
    assert tuner.greedy(64) == PLAIN
    others = [arm for arm in POOL if arm != PLAIN]
    pooled = {arm: max(sum(r) / len(r), sum(r[-4:]) / 4) for arm, r in measured.items()}  # equal seconds
    weights = {arm: max(0.1, (pooled[arm] / 100.0) ** 4) for arm in measured if arm != PLAIN}
    total = sum(weights.values())
    rng, n = random.Random(11), 6000
    picks = Counter(tuner.choose(64, rng) for _ in range(n))
    assert PLAIN not in picks
    stat, df = chi_square(picks, {arm: weights[arm] / total for arm in others}, n)
    assert stat < chi2_threshold(df), (stat, df, picks)
    assert picks[TREE] < picks[D2] < picks[NGRAM], "an arm at a fifth of the best is drawn least"


def test_where_sd_is_not_expected_plain_runs_until_an_explored_arm_is_confirmed_faster() -> None:
    tuner = SdTuner([PLAIN, D2, D4, TREE], epsilon=0.0, window=8, confirm=3, drafter_version=0)
    rng = random.Random(0)
    assert [tuner.choose(64, rng, expect_sd=False) for _ in range(5)] == [PLAIN] * 5, "untried arms wait"
    tuner.record(64, PLAIN, 100, 1.0)
    tuner.record(64, D4, 300, 1.0)
    tuner.record(64, D4, 300, 1.0)
    assert tuner.greedy(64, expect_sd=False) == PLAIN, "two good measurements are not yet confirmed"
    assert tuner.greedy(64) == D2, "where SD is expected, untried arms come first"
    tuner.record(64, D4, 300, 1.0)
    assert tuner.greedy(64, expect_sd=False) == D4
    for _ in range(8):
        tuner.record(64, D4, 50, 1.0)  # it got slower than plain
    assert tuner.greedy(64, expect_sd=False) == PLAIN
    assert tuner.greedy(1, expect_sd=False) == PLAIN, "another bucket: nothing measured, the baseline"


def test_where_sd_is_not_expected_an_unconfirmed_faster_arm_is_challenged_until_it_settles() -> None:
    """An arm measured faster than plain but not yet confirmed runs with probability `challenge` (here 1)
    until it is confirmed (then it is the exploit arm) or falls behind (then plain again, after at most
    `confirm` - 1 steps); with `challenge` 0 only exploration would measure it."""
    rng = random.Random(0)
    tuner = SdTuner([PLAIN, D2, D4, TREE], epsilon=0.0, window=8, confirm=3, drafter_version=0, challenge=1.0)
    tuner.record(64, PLAIN, 100, 1.0)
    tuner.record(64, D4, 300, 1.0)
    assert tuner.greedy(64, expect_sd=False) == PLAIN, "one measurement is not confirmed"
    assert tuner.choose(64, rng, expect_sd=False) == D4, "the challenger runs"
    tuner.record(64, D4, 300, 1.0)
    assert tuner.choose(64, rng, expect_sd=False) == D4
    tuner.record(64, D4, 300, 1.0)
    assert tuner.greedy(64, expect_sd=False) == D4, "confirmed faster: the exploit arm"
    assert tuner.greedy(1, expect_sd=True) == PLAIN, "another bucket is not affected"

    fluke = SdTuner([PLAIN, D2, D4, TREE], epsilon=0.0, window=8, confirm=3, drafter_version=0, challenge=1.0)
    fluke.record(64, PLAIN, 100, 1.0)
    fluke.record(64, TREE, 140, 1.0)  # one lucky step of an arm that runs at 50
    picks = []
    for _ in range(6):
        arm = fluke.choose(64, rng, expect_sd=False)
        fluke.record(64, arm, 50 if arm == TREE else 100, 1.0)
        picks.append(arm)
    assert picks == [TREE, PLAIN, PLAIN, PLAIN, PLAIN, PLAIN], "a fluke costs at most confirm - 1 steps"

    off = SdTuner([PLAIN, D2, D4, TREE], epsilon=0.0, window=8, confirm=3, drafter_version=0, challenge=0.0)
    off.record(64, PLAIN, 100, 1.0)
    off.record(64, D4, 300, 1.0)
    assert [off.choose(64, rng, expect_sd=False) for _ in range(5)] == [PLAIN] * 5, "without challenges: plain"


def test_challenges_adopt_a_faster_arm_above_the_crossover_in_fewer_steps() -> None:
    """In a wide bucket with nine arms and epsilon 0.1, the steps until the exploit arm is the one arm faster
    than plain, over 20 seeded runs: fewer with challenges (median; 53.5 against 122 when written) than with
    exploration alone, and the steps spent on arms slower than plain do not grow by more than a few per run."""
    arms = [PLAIN, NGRAM, D2, D4, TREE, Arm.drafter(6, 4, 16), Arm.drafter(6, 1, 6), Arm.ngram(6), Arm.drafter(3, 1, 3)]
    rates = {arm: 100.0 for arm in arms} | {D4: 160.0, TREE: 60.0, NGRAM: 80.0}

    def run(challenge: float, seed: int) -> tuple[int, int]:
        tuner = SdTuner(arms, epsilon=0.1, window=48, drafter_version=0, challenge=challenge)
        rng, env = random.Random(seed), random.Random(seed + 1)
        adopted, slow = None, 0
        for step in range(400):
            arm = tuner.choose(64, rng, expect_sd=False)
            tuner.record(64, arm, 64, 64 / (rates[arm] * math.exp(env.gauss(0.0, 0.2))))
            slow += rates[arm] < rates[PLAIN]
            if adopted is None and tuner.greedy(64, expect_sd=False) == D4:
                adopted = step
        assert adopted is not None
        return adopted, slow

    with_challenges = [run(0.5, seed) for seed in range(20)]
    without = [run(0.0, seed) for seed in range(20)]
    assert median([a for a, _ in with_challenges]) < 0.75 * median([a for a, _ in without]), (with_challenges, without)
    assert median([s for _, s in with_challenges]) <= median([s for _, s in without]) + 5


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), noise=st.floats(0.0, 0.1), ranking=ranked_arms())
def test_where_sd_is_not_expected_exploring_finds_an_arm_that_beats_plain(
    seed: int, noise: float, ranking: tuple[list[Arm], dict[Arm, float]]
) -> None:
    arms, rates = ranking
    tuner = SdTuner(arms, epsilon=0.1, window=9, drafter_version=0)
    rng, env = random.Random(seed), random.Random(seed + 1)
    picks = []
    for _ in range(1500):
        arm = tuner.choose(64, rng, expect_sd=False)
        tuner.record(64, arm, 64, 64 / (rates[arm] * math.exp(env.gauss(0.0, noise))))
        picks.append(arm)
    best = max(rates, key=rates.__getitem__)
    assert tuner.greedy(64, expect_sd=False) == best
    assert Counter(picks[-500:])[best] / 500 >= 1 - 0.1 - 0.08


def test_choices_are_deterministic_given_the_seed() -> None:
    def run(seed: int) -> list[str]:
        tuner = SdTuner(POOL, epsilon=0.3, drafter_version=0)
        rates = {arm: 100.0 + 10 * i for i, arm in enumerate(POOL)}
        return [a.label for a in simulate(tuner, random.Random(seed), 300, rates.__getitem__, noise=0.1)]

    assert run(5) == run(5)
    assert run(5) != run(6)


def test_invalid_input_is_refused() -> None:
    with pytest.raises(ValueError):
        SdTuner([D4, TREE])  # no plain or n-gram arm
    with pytest.raises(ValueError):
        SdTuner([PLAIN, PLAIN])
    with pytest.raises(ValueError):
        SdTuner([PLAIN], epsilon=1.5)
    with pytest.raises(ValueError, match="challenge"):
        SdTuner([PLAIN], challenge=-0.1)
    with pytest.raises(ValueError):
        SdTuner([PLAIN], window=0)
    tuner = SdTuner([PLAIN, D4])
    with pytest.raises(ValueError):
        tuner.record(1, TREE, 10, 1.0)
    with pytest.raises(ValueError):
        tuner.record(1, PLAIN, 10, 0.0)
    with pytest.raises(ValueError):
        tuner.on_new_drafter(1, "forget")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------------- tables


@dataclass(frozen=True)
class Report:
    worker_id: str
    drafter_version: int
    bucket: int
    depth: int
    topk: int
    verify: int
    tokens: int
    seconds: float
    proposer: str = "drafter"


def report(worker: str, version: int, bucket: int, arm: Arm, tokens: int, seconds: float) -> Report:
    proposer = "ngram" if arm.kind == "ngram" else "drafter"
    return Report(worker, version, bucket, arm.depth, arm.topk, arm.verify, tokens, seconds, proposer)


def test_two_workers_reports_give_one_table_by_pooled_rate() -> None:
    worker_a = [
        report("a", 1, 0, PLAIN, 100, 1.0),
        report("a", 1, 0, D4, 2700, 9.0),  # 300 tok/s over 9 s
        report("a", 1, 4, PLAIN, 900, 1.0),
    ]
    worker_b = [
        report("b", 1, 0, D4, 100, 1.0),  # 100 tok/s over 1 s: pooled 2800 / 10 s = 280 (a mean of rates: 200)
        report("b", 1, 0, NGRAM, 500, 2.0),  # 250 tok/s
        report("b", 1, 4, D4, 600, 1.0),
        report("b", 1, 4, TREE, 300, 0.5),
    ]
    table = aggregate_reports(worker_a + worker_b)
    assert table.best == {0: D4, 4: PLAIN}
    assert table.drafter_version == 1
    assert table.rates[0] == {PLAIN: 100.0, D4: 280.0, NGRAM: 250.0}
    assert table.rates[4] == {PLAIN: 900.0, D4: 600.0, TREE: 600.0}


def test_wire_reports_aggregate_and_ties_go_to_the_simpler_arm() -> None:
    wire = [
        SdArmReport(worker_id="a", drafter_version=0, bucket=2, depth=0, topk=0, verify=0, tokens=500, seconds=2.0),
        SdArmReport(worker_id="b", drafter_version=0, bucket=2, depth=4, topk=1, verify=4, tokens=250, seconds=1.0),
        SdArmReport(worker_id="b", drafter_version=0, bucket=3, depth=4, topk=2, verify=8, tokens=250, seconds=1.0),
        SdArmReport(worker_id="a", drafter_version=0, bucket=3, depth=4, topk=1, verify=4, tokens=250, seconds=1.0),
    ]
    assert arm_of_report(wire[0]) == PLAIN and arm_of_report(wire[1]) == D4
    table = aggregate_reports(wire)
    assert table.best == {2: PLAIN, 3: D4}
    assert aggregate_reports(reversed(wire)).best == table.best
    assert aggregate_reports([]) == SdTable(best={}, drafter_version=-1)


def test_reports_from_an_older_drafter_are_ignored_for_drafter_arms_only() -> None:
    old = [report("a", 1, 0, D4, 5000, 1.0), report("a", 1, 0, PLAIN, 100, 1.0), report("a", 1, 1, NGRAM, 300, 1.0)]
    new = [report("b", 2, 0, D4, 150, 1.0), report("b", 2, 0, PLAIN, 300, 1.0), report("b", 2, 1, D4, 200, 1.0)]
    assert aggregate_reports(old + new[:1]).best[0] == D4  # the old drafter's report would win
    table = aggregate_reports(old + new)
    assert table.drafter_version == 2
    assert table.rates[0] == {D4: 150.0, PLAIN: 200.0}  # plain pooled over both workers, D4 only from v2
    assert table.best == {0: PLAIN, 1: NGRAM}  # the v1 n-gram report still counts
    no_drafter = [report("a", -1, 0, D4, 5000, 1.0), report("a", -1, 0, PLAIN, 100, 1.0)]
    assert aggregate_reports(no_drafter).best == {0: PLAIN}


@settings(max_examples=60, deadline=None)
@given(
    measurements=st.lists(
        st.tuples(
            st.sampled_from("abc"),
            st.integers(-1, 3),
            st.integers(0, 3),
            st.sampled_from(POOL),
            st.integers(0, 5000),
            st.floats(0.01, 10.0),
        ),
        min_size=1,
        max_size=30,
    ),
    seed=st.integers(0, 1000),
)
def test_aggregation_is_order_free_split_free_and_picks_the_top_rate(measurements: list, seed: int) -> None:
    reports = [report(*m) for m in measurements]
    table = aggregate_reports(reports)
    shuffled = list(reports)
    random.Random(seed).shuffle(shuffled)
    assert aggregate_reports(shuffled).best == table.best
    halves = [replace(r, tokens=t, seconds=r.seconds / 2) for r in reports for t in (r.tokens // 2, -(-r.tokens // 2))]
    split = aggregate_reports(halves)
    assert split.rates.keys() == table.rates.keys()
    for bucket, rates in table.rates.items():
        assert split.rates[bucket] == pytest.approx(rates)
        top = sorted(rates.values(), reverse=True)
        if len(top) == 1 or top[0] > top[1] * (1 + 1e-9):
            assert split.best[bucket] == table.best[bucket]
    merged: dict[tuple, Report] = {}
    for r in reports:
        key = (r.drafter_version, r.bucket, arm_of_report(r))
        had = merged.get(key)
        merged[key] = r if had is None else replace(had, tokens=had.tokens + r.tokens, seconds=had.seconds + r.seconds)
    merged_rates = aggregate_reports(merged.values()).rates  # each report weighs by the time it measured
    assert merged_rates.keys() == table.rates.keys()
    assert all(merged_rates[b] == pytest.approx(table.rates[b]) for b in table.rates)
    newest = max(r.drafter_version for r in reports)
    assert table.drafter_version == newest
    for bucket, arm in table.best.items():
        assert all(table.rates[bucket][arm] >= rate for rate in table.rates[bucket].values())
    for r in reports:
        arm = arm_of_report(r)
        counted = not arm.uses_drafter or r.drafter_version == newest >= 0
        assert (arm in table.rates.get(r.bucket, {})) or not counted
    for bucket, rates in table.rates.items():
        for arm in rates:
            sources = [r for r in reports if r.bucket == bucket and arm_of_report(r) == arm]
            assert not arm.uses_drafter or any(r.drafter_version == newest >= 0 for r in sources)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), epsilon=st.floats(0.0, 0.3))
def test_a_late_worker_exploits_the_table_from_its_first_choice(seed: int, epsilon: float) -> None:
    worker_a = [report("a", 0, 0, TREE, 400, 1.0), report("a", 0, 0, PLAIN, 100, 1.0)]
    worker_b = [report("b", 0, 4, NGRAM, 900, 1.0), report("b", 0, 4, PLAIN, 800, 1.0)]
    table = aggregate_reports(worker_a + worker_b)
    tuner = SdTuner([PLAIN, NGRAM, D4, TREE], epsilon=epsilon, drafter_version=0)
    assert tuner.adopt_table(table)
    rng = random.Random(seed)
    first = [tuner.choose(1, rng) for _ in range(400)]
    explored = sum(arm != TREE for arm in first)
    assert abs(explored - 400 * epsilon) <= 4.5 * math.sqrt(400 * epsilon * (1 - epsilon)) + 1
    if epsilon == 0:
        assert tuner.choose(1, rng) == TREE and tuner.choose(16, rng) == NGRAM
    assert tuner.greedy(1) == TREE and tuner.greedy(9) == NGRAM
    assert tuner.greedy(2) == PLAIN  # no entry for that bucket: untried first


def test_table_arms_the_tuner_cannot_use_are_ignored() -> None:
    table = SdTable(best={0: D4, 1: Arm.drafter(8, 4, 24)}, drafter_version=0)
    tuner = SdTuner([PLAIN, NGRAM, D4], epsilon=0.0)  # no drafter yet
    tuner.adopt_table(table)
    assert tuner.greedy(1) == PLAIN
    tuner.on_new_drafter(0, "decay")
    assert tuner.greedy(1) == D4
    assert tuner.greedy(2) == PLAIN  # not one of its arms


# ---------------------------------------------------------------------------------------------------- drafters


def measured_tuner(window: int = 16) -> SdTuner:
    tuner = SdTuner([PLAIN, NGRAM, D4, TREE], window=window, drafter_version=0)
    for batch in (1, 32):
        for _ in range(window):
            for rate, arm in ((100, PLAIN), (150, NGRAM), (300, D4), (250, TREE)):
                tuner.record(batch, arm, rate, 1.0)
    return tuner


def test_a_new_drafter_resets_only_drafter_arm_statistics() -> None:
    tuner = measured_tuner()
    tuner.adopt_table(SdTable(best={0: D4}, drafter_version=0))
    assert tuner.on_new_drafter(1, "reset")
    for batch in (1, 32):
        assert tuner.rates(batch) == {PLAIN: 100.0, NGRAM: 150.0}
        assert tuner.samples(batch, D4) == tuner.samples(batch, TREE) == 0
    assert tuner.table is None  # measured with the old drafter
    assert tuner.greedy(1) == D4  # tried again first
    assert not tuner.adopt_table(SdTable(best={0: TREE}, drafter_version=0))  # a late copy of the old table
    assert tuner.adopt_table(SdTable(best={0: TREE}, drafter_version=1))
    assert not tuner.on_new_drafter(1) and not tuner.on_new_drafter(0)  # versions only move forward
    assert tuner.table is not None and tuner.drafter_version == 1


def test_a_new_drafter_decays_drafter_arm_statistics_to_a_prior() -> None:
    tuner = measured_tuner(window=16)
    table = SdTable(best={0: D4}, drafter_version=0)
    tuner.adopt_table(table)
    assert tuner.on_new_drafter(1, "decay")
    assert tuner.table is table
    assert tuner.samples(1, D4) == 4 and tuner.rate(1, D4) == 300.0  # 16 samples now weigh 4
    assert tuner.rates(1)[PLAIN] == 100.0 and tuner.samples(1, PLAIN) == 16
    for _ in range(8):
        tuner.record(1, D4, 50, 1.0)
    assert tuner.rate(1, D4) == 50.0  # without the decay, 8 of the 16 old steps would hold it at 175
    assert tuner.rate(32, D4) == 300.0


# ---------------------------------------------------------------------------------------------------- contexts

GROUP = Arm.group_source(8, 8)
FOLLOWING = {(PLAIN, 0): 100.0, (D4, 0): 150.0, (GROUP, 0): 50.0, (PLAIN, 2): 100.0, (D4, 2): 150.0, (GROUP, 2): 400.0}
"""Rates by (arm, context): the group arm is fast while the row follows a sibling (context 2), slow after."""


def stretches(tuner: SdTuner, steps: int, *, contexts: bool) -> tuple[Counter, float]:
    """A row that follows a sibling for 40 steps, then leaves it for 40, and so on: the tuner chooses with the
    context (or without), each step is recorded with its context; (picks of the second half by (context,
    arm), simulated seconds per token of the second half)."""
    rng, env = random.Random(1), random.Random(2)
    picks: Counter = Counter()
    tokens = seconds = 0.0
    for step in range(steps):
        context = 2 if (step // 40) % 2 else 0
        told = context if contexts else 0
        arm = tuner.choose(1, rng, context=told)
        rate = FOLLOWING[arm, context] * math.exp(env.gauss(0.0, 0.05))
        tuner.record(1, arm, 64, 64 / rate, context=told)
        if step >= steps // 2:
            picks[context, arm] += 1
            tokens, seconds = tokens + 64, seconds + 64 / rate
    return picks, seconds / tokens


def test_with_contexts_an_arm_is_judged_in_the_state_the_step_runs_in() -> None:
    arms = (PLAIN, D4, GROUP)
    aware = SdTuner(arms, epsilon=0.1, contexts=3, drafter_version=0)
    picks, per_token = stretches(aware, 2000, contexts=True)
    assert aware.greedy(1, context=0) == D4 and aware.greedy(1, context=2) == GROUP
    for context, best in ((0, D4), (2, GROUP)):
        ran = {arm: n for (c, arm), n in picks.items() if c == context}
        assert max(ran, key=ran.__getitem__) == best, (context, ran)
    assert aware.rate(1, GROUP, context=2) == pytest.approx(400.0, rel=0.1)
    assert aware.rate(1, GROUP, context=0) == pytest.approx(50.0, rel=0.1)
    # The premise: judged per bucket only, the group arm's window fills while it wins and carries it on into the
    # stretches where it loses (and back), so the same rows cost more per token.
    blind = SdTuner(arms, epsilon=0.1, drafter_version=0)
    blind_picks, blind_per_token = stretches(blind, 2000, contexts=False)
    assert blind_picks[0, GROUP] > picks[0, GROUP]
    assert per_token < blind_per_token


def test_a_new_context_starts_from_the_buckets_estimates_instead_of_trying_every_arm_again() -> None:
    tuner = SdTuner((PLAIN, D4, GROUP), epsilon=0.0, contexts=3, drafter_version=0)
    for arm, rate in ((PLAIN, 100.0), (D4, 300.0), (GROUP, 200.0)):
        for _ in range(8):
            tuner.record(1, arm, int(rate), 1.0, context=0)
    rng = random.Random(0)
    assert {tuner.choose(1, rng, context=1) for _ in range(20)} == {D4}  # nothing was measured in context 1
    assert tuner.rate(1, GROUP, context=1) == tuner.rate(1, GROUP) == 200.0
    for _ in range(tuner.context_confirm - 1):  # below `confirm` steps the context's own window is not trusted yet
        tuner.record(1, D4, 50, 1.0, context=1)
    assert tuner.greedy(1, context=1) == D4
    tuner.record(1, D4, 50, 1.0, context=1)
    assert tuner.greedy(1, context=1) == GROUP and tuner.greedy(1, context=0) == D4


def test_a_tables_arm_gives_way_only_to_an_arm_confirmed_faster_in_the_steps_context() -> None:
    tuner = SdTuner((PLAIN, D4, GROUP), epsilon=0.0, contexts=3, drafter_version=0)
    assert tuner.adopt_table(SdTable(best={0: D4}, drafter_version=0))
    for _ in range(tuner.context_confirm):
        tuner.record(1, GROUP, 400, 1.0, context=2)
    assert tuner.greedy(1, context=2) == D4, "the table's arm is not measured in context 2: the table holds"
    for _ in range(tuner.context_confirm):
        tuner.record(1, D4, 150, 1.0, context=2)
        tuner.record(1, D4, 300, 1.0, context=0)
        tuner.record(1, GROUP, 50, 1.0, context=0)
    assert tuner.greedy(1, context=2) == GROUP and tuner.greedy(1, context=0) == D4
    single = SdTuner((PLAIN, D4, GROUP), epsilon=0.0, drafter_version=0)  # one context: the table always holds
    single.adopt_table(SdTable(best={0: D4}, drafter_version=0))
    for _ in range(8):
        single.record(1, GROUP, 400, 1.0)
        single.record(1, D4, 150, 1.0)
    assert single.greedy(1) == D4


def test_a_new_drafter_resets_its_arms_windows_in_every_context() -> None:
    tuner = SdTuner((PLAIN, D4, GROUP), epsilon=0.0, contexts=3, drafter_version=0)
    for _ in range(8):
        tuner.record(1, D4, 900, 1.0, context=2)
        tuner.record(1, GROUP, 400, 1.0, context=2)
        tuner.record(1, PLAIN, 100, 1.0, context=2)
    assert tuner.greedy(1, context=2) == D4
    assert tuner.on_new_drafter(1, "reset")
    for _ in range(tuner.context_confirm - 1):  # the new drafter, measured too briefly in context 2 to be judged there
        tuner.record(1, D4, 80, 1.0, context=2)
    assert tuner.rate(1, D4, context=2) == 80.0, "judged by its bucket's window, not the old drafter's 900"
    assert tuner.greedy(1, context=2) == GROUP


def test_contexts_are_checked() -> None:
    with pytest.raises(ValueError, match="contexts"):
        SdTuner((PLAIN, D4), contexts=0)
    tuner = SdTuner((PLAIN, D4), contexts=3)
    for bad in (-1, 3):
        with pytest.raises(ValueError, match="context"):
            tuner.choose(1, random.Random(0), context=bad)
        with pytest.raises(ValueError, match="context"):
            tuner.record(1, PLAIN, 1, 1.0, context=bad)
    with pytest.raises(ValueError, match="context"):
        SdTuner((PLAIN, D4)).choose(1, random.Random(0), context=1)
    with pytest.raises(ValueError, match="context"):
        SdTuner((PLAIN, D4)).record(1, PLAIN, 1, 1.0, context=1)


# ---------------------------------------------------------------------------------------------------- fallback


def test_before_any_drafter_only_plain_and_ngram_are_chosen() -> None:
    tuner = SdTuner([D4, PLAIN, TREE, NGRAM], epsilon=1.0)
    rng = random.Random(0)
    picks = Counter(tuner.choose(1, rng) for _ in range(200))
    assert set(picks) == {PLAIN} and tuner.eligible_arms() == [PLAIN, NGRAM]  # untried first, no exploring
    rates = {PLAIN: 100.0, NGRAM: 180.0, D4: 1000.0, TREE: 1000.0}
    picks = Counter(simulate(tuner, rng, 400, rates.__getitem__))
    assert set(picks) == {PLAIN, NGRAM}
    tuner.epsilon = 0.1
    simulate(tuner, rng, 200, rates.__getitem__)
    assert tuner.greedy(1) == NGRAM
    assert tuner.on_new_drafter(0)
    assert tuner.choose(1, rng) == D4  # eligible now, and untried
    simulate(tuner, rng, 200, rates.__getitem__)
    assert tuner.greedy(1) in (D4, TREE)


@pytest.mark.parametrize("fallback", [PLAIN, NGRAM])
def test_when_acceptance_collapses_the_same_measurements_pick_the_fallback(fallback: Arm) -> None:
    rates = {PLAIN: 100.0, NGRAM: 80.0, D4: 300.0, TREE: 250.0}
    if fallback == NGRAM:
        rates[NGRAM] = 120.0
    tuner = SdTuner([PLAIN, NGRAM, D4, TREE], epsilon=0.1, window=9, drafter_version=0)
    rng = random.Random(11)
    simulate(tuner, rng, 300, rates.__getitem__, noise=0.05)
    assert tuner.greedy(1) == D4
    collapsed = {arm: (rate / 4 if arm.uses_drafter else rate) for arm, rate in rates.items()}
    picks = simulate(tuner, rng, 400, collapsed.__getitem__, noise=0.05)
    assert tuner.greedy(1) == fallback
    assert Counter(picks[-200:])[fallback] >= 160
    table = aggregate_reports(
        [report("a", 0, 0, arm, int(collapsed[arm] * 10), 10.0) for arm in (PLAIN, NGRAM, D4, TREE)]
    )
    assert table.best == {0: fallback}


def test_default_arms_match_the_benchmarked_set() -> None:
    assert [a.label for a in DEFAULT_ARMS] == ["plain", "ngram-d6", "d2k1v2", "d4k1v4", "d6k1v6", "d4k2v8", "d6k4v16"]
    assert DEFAULT_EDGES == (1, 2, 4, 8, 16, 32, 64)
    assert SdTuner().eligible_arms() == [Arm.plain(), Arm.ngram(6)]
