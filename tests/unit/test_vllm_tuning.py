"""The per-bucket tuner on the vLLM backend without vLLM: the step meter driven as vLLM's model runner drives
it, and `VllmTuning` on an engine stub whose steps are scripted (the real engine: tests/vllm/test_eagle.py)."""

from __future__ import annotations

import itertools
from types import SimpleNamespace
from typing import Any

from tlt_stream.basics.config import DEFAULTS
from tlt_stream.rollout.arms import Arm
from tlt_stream.rollout.vllm.measure import Step, StepMeter
from tlt_stream.rollout.vllm.tuning import VllmTuning, deepest_chain, pool_steps, tunable_arms


class _Runner:
    """vLLM's model runner as far as the meter sees it: `execute_model` returns None, `sample_tokens` the
    output listing each row's emitted tokens."""

    def __init__(self) -> None:
        self.emitted: list[list[int]] = []

    def execute_model(self, scheduler_output: Any, intermediate_tensors: Any = None) -> None:
        return None

    def sample_tokens(self, grammar_output: Any) -> Any:
        return SimpleNamespace(sampled_token_ids=self.emitted)


def _step(runner: _Runner, scheduled: dict[str, int], drafts: dict[str, list[int]], k: int, emitted: list[int]):
    runner.emitted = [[0] * n for n in emitted]
    out = SimpleNamespace(num_scheduled_tokens=scheduled, scheduled_spec_decode_tokens=drafts,
                          num_spec_tokens_to_schedule=k)  # fmt: skip
    runner.execute_model(out)
    runner.sample_tokens(None)


def test_the_meter_records_decode_steps_of_one_chain_length_only() -> None:
    ticks = itertools.count()
    meter = StepMeter(clock=lambda: float(next(ticks)))  # every step takes 1 "second"
    runner = _Runner()
    meter.install(runner)
    _step(runner, {"a": 9, "b": 7}, {}, 4, [1, 1])  # prefill: not an arm's cost
    _step(runner, {"a": 5, "b": 5}, {"a": [1] * 4, "b": [2] * 4}, 4, [3, 5])  # d4: 8 tokens
    _step(runner, {"a": 5, "b": 1}, {"a": [1] * 4}, 4, [2, 1])  # a new row without drafts yet, still d4
    _step(runner, {"a": 5, "c": 3}, {"a": [1] * 4}, 4, [1, 1])  # c prefills its last 3 prompt tokens
    _step(runner, {"a": 5}, {"a": [1] * 4}, 0, [2])  # verifies K=4 drafts, drafts none next: a change
    _step(runner, {"a": 1}, {}, 0, [1])  # plain
    assert meter.drain() == [(2, 4, 8, 1.0, 8), (2, 4, 3, 1.0, 4), (1, 0, 1, 1.0, 0)]
    assert meter.drain() == []


def test_steps_are_pooled_per_bucket_and_arm() -> None:
    steps = [Step(1, 4, 5, 1.0, 4), Step(1, 4, 3, 1.0, 4), Step(3, 0, 3, 0.5, 0), Step(40, 4, 60, 2.0, 160)]
    arm = {0: Arm.plain(), 4: Arm.drafter(4, 1, 4)}.__getitem__
    pooled = {(m.bucket, m.arm.label): (m.tokens, m.seconds, m.steps) for m in pool_steps(steps, arm, (1, 4, 16))}
    assert pooled == {(0, "d4k1v4"): (8, 2.0, 2), (1, "plain"): (3, 0.5, 1), (3, "d4k1v4"): (60, 2.0, 1)}


def test_the_arms_one_vllm_engine_can_switch_between() -> None:
    labels = DEFAULTS.sd.arms
    assert deepest_chain(labels, "drafter") == Arm.drafter(6, 1, 6)
    assert deepest_chain(labels, "ngram") == Arm.ngram(6)
    assert [a.label for a in tunable_arms(labels, "drafter", 4)] == ["plain", "d2k1v2", "d4k1v4"]
    assert [a.label for a in tunable_arms(labels, "ngram", 6)] == ["plain", "ngram-d4", "ngram-d6"]


class _Engine:
    """A `VllmEngine` as `VllmTuning` uses it: its arm, `set_schedule`, `step`, measured steps."""

    def __init__(self) -> None:
        self.arm = Arm.drafter(4, 1, 4)
        self.schedules: list[dict[int, str]] = []
        self.steps: list[Step] = []

    def arm_of(self, k: int) -> Arm:
        return Arm.plain() if k == 0 else Arm.drafter(k, 1, k)

    def set_schedule(self, table: dict[int, str]) -> list[list[int]]:
        self.schedules.append(dict(table))
        return []

    def step(self) -> list[Any]:
        return []

    def drain_steps(self) -> list[Step]:
        steps, self.steps = self.steps, []
        return steps


def test_the_tuner_picks_each_buckets_arm_from_vllms_measurements_and_adopts_a_table() -> None:
    from msgspec.structs import replace

    sd = replace(DEFAULTS.sd, edges=(4, 16), epsilon=0.0, crossover=9, margin=0)  # SD expected at <= 8 rows
    engine = _Engine()
    engine.steps = [Step(8, 4, 400, 1.0, 32)]  # run before the tuner existed: not its measurement
    tuning = VllmTuning(engine, sd, drafter_version=0, every=2)
    assert [a.label for a in tuning.tuner.arms] == ["plain", "d2k1v2", "d4k1v4"]
    assert engine.schedules[-1] == {0: "plain", 1: "plain", 2: "plain"}  # untried arms in order: plain first
    # Bucket 0 (<= 4 rows): plain 10 tok/s, d2 20, d4 30; bucket 1 (5-16 rows): d4 measured slower than plain.
    rates = {(1, 0): 10, (1, 2): 20, (1, 4): 30, (8, 0): 80, (8, 4): 40}
    for _ in range(3):
        engine.steps = [Step(rows, k, tokens, 1.0, rows * k) for (rows, k), tokens in rates.items()]
        tuning.step()
        tuning.step()  # every second step: the steps vLLM measured are read, the schedule chosen again
    assert engine.schedules[-1] == {0: "d4k1v4", 1: "plain", 2: "plain"}
    reports = {(m.bucket, m.arm.label): (m.tokens, m.steps) for m in tuning.drain_reports()}
    assert reports[(0, "d4k1v4")] == (90, 3) and reports[(1, "plain")] == (240, 3)
    assert tuning.drain_reports() == []
    # A published table (another worker measured d2 best in bucket 0 and d4 in bucket 2); a tree it cannot run
    # is ignored.
    assert tuning.adopt({0: Arm.drafter(2, 1, 2), 1: Arm.drafter(4, 2, 8), 2: Arm.drafter(4, 1, 4)}, 0)
    assert engine.schedules[-1] == {0: "d2k1v2", 1: "plain", 2: "d4k1v4"}
    assert tuning.summary()["schedule"] == engine.schedules[-1]


def test_a_vllm_worker_with_a_fixed_arm_reports_its_engines_measurements_as_arm_reports() -> None:
    """`RolloutReports.send` on a vLLM engine without the tuner: the engine's measured steps, pooled per bucket
    and arm, go to `stats` as `SdArmReport`s, as the torch engine's adaptive controller's do."""
    import asyncio

    from tlt_stream.basics.messages import RolloutStats, SdArmReport
    from tlt_stream.roles.worker.reports import RolloutReports
    from tlt_stream.rollout.adaptive import ArmMeasurement

    sent: list[Any] = []

    class Producer:
        async def send_one(self, stream: str, entry: Any) -> None:
            sent.append(entry)

        async def send(self, stream: str, entries: list[Any]) -> None:
            sent.extend(entries)

    engine = SimpleNamespace(
        arm=Arm.drafter(4, 1, 4),
        num_running=3,
        drain_measurements=lambda: [
            ArmMeasurement(2, Arm.drafter(4, 1, 4), 90, 3.0, 6),
            ArmMeasurement(5, Arm.plain(), 40, 2.0, 40),
        ],
    )
    loader = SimpleNamespace(engine=engine, adaptive=None, version=2)
    drafters = SimpleNamespace(version=0, collapses=0)
    reports = RolloutReports(Producer(), "w", None, loader, drafters)  # type: ignore[arg-type]
    asyncio.run(reports.send())
    assert isinstance(sent[0], RolloutStats)
    arms = [(r.bucket, r.proposer, r.depth, r.tokens, r.steps) for r in sent[1:] if isinstance(r, SdArmReport)]
    assert arms == [(2, "drafter", 4, 90, 6), (5, "plain", 0, 40, 40)]
