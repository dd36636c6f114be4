"""The rollout worker on the vLLM backend, with a CPU stand-in for vLLM's GPU engine.

vLLM cannot run here (no GPU; CI never installs it), so `VllmEngine` is replaced by `CpuVllmEngine`, which
offers the same surface over this project's torch engine and records what the worker asks of it. What is
under test is the worker's side: one engine for the worker's life, every later policy version loaded into
it in place (never a new engine), drafters swapped through it, and the loop's guarantees unchanged (every
dispatched group trained on exactly once, by the version that generated it). Redis and MQTT are real.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any, ClassVar

import pytest

from tests.integration.loop import keep_for_audit
from tlt_stream.basics.config import DEFAULTS, Config, ConfigError, override
from tlt_stream.basics.messages import RolloutStats, codec_for
from tlt_stream.bus.connect import connect_redis
from tlt_stream.bus.streams import Keys
from tlt_stream.commands.cli import main
from tlt_stream.roles.learner import LearnerService
from tlt_stream.roles.policy import PolicyService, RepeatedAddSource
from tlt_stream.roles.rollout_worker import RolloutWorker
from tlt_stream.rollout.vllm import backend as vllm_backend
from tlt_stream.tasks.repeated_add import reward
from tlt_stream.tasks.tokenizer import build_tokenizer

from .loop import planes, stats_of, until_first_done

STEPS, PROMPTS, GROUP = 3, 2, 2


class CpuVllmEngine:
    """`VllmEngine`'s surface over the torch engine (the stand-in for vLLM on a GPU)."""

    built: ClassVar[list[CpuVllmEngine]] = []

    def __init__(self, policy: Any, *, settings: Any, drafter: Any = None) -> None:
        self.settings, self.drafter = settings, drafter
        self.policies = [str(policy)]
        self.arm = None
        self.proposer = None
        self._engine = self._build(policy)
        CpuVllmEngine.built.append(self)

    def _build(self, policy: Any) -> Any:
        from tlt_stream.model import load_model
        from tlt_stream.rollout.engine import GenerationEngine

        return GenerationEngine(load_model(policy), self.settings.max_batch, self.settings.max_len)

    def load_policy(self, path: Any, *, weights: Any = None) -> None:
        assert weights is None, "vLLM's workers read the checkpoint themselves: no verified tensors for it"
        assert not self.has_unfinished, "a policy reload with requests in flight"
        self.policies.append(str(path))
        self._engine = self._build(path)

    @property
    def model(self) -> Any:
        return self._engine.model

    @property
    def has_unfinished(self) -> bool:
        return self._engine.has_unfinished

    @property
    def has_work(self) -> bool:
        return self._engine.has_work

    @property
    def num_running(self) -> int:
        return self._engine.scheduler.num_running + len(self._engine.scheduler.waiting)

    def add_request(self, *args: Any, **kwargs: Any) -> Any:
        return self._engine.add_request(*args, **kwargs)

    def step(self) -> list[Any]:
        return self._engine.step()

    tokens_generated = property(lambda self: self._engine.tokens_generated)
    rounds = property(lambda self: self._engine.rounds)
    plain_steps = property(lambda self: self._engine.plain_steps)


@pytest.mark.redis
@pytest.mark.mqtt
async def test_a_vllm_worker_keeps_one_engine_and_loads_every_version_into_it(
    bus_config: Config, tmp_path: Path, init_policy: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(vllm_backend, "VllmEngine", CpuVllmEngine)
    CpuVllmEngine.built = []
    keys = Keys(bus_config.run)
    redis = connect_redis(bus_config.bus.redis_url)
    await keep_for_audit(redis, keys)  # the learner trims what it checkpointed
    stop = asyncio.Event()
    services: list[asyncio.Task[None]] = []
    try:
        async with planes(bus_config, {"learner": ["policy"], "policy": [], "rollout": []}) as control:
            learner = LearnerService(
                override(bus_config, {"learner.groups_per_step": PROMPTS, "policy.max_staleness": 0}),
                redis,
                control["learner"],
                run_dir=tmp_path / "run",
                init_policy=init_policy,
            )
            dispatcher = PolicyService(
                bus_config,
                redis,
                control["policy"],
                RepeatedAddSource(build_tokenizer(), seed=1),
                prompts_per_step=PROMPTS,
                group_size=GROUP,
                total_steps=STEPS,
            )
            settings = {"rollout.max_batch": 4, "rollout.max_len": 96, "rollout.backend": "vllm"}
            worker = RolloutWorker(
                override(bus_config, settings), redis, control["rollout"], worker_id="w0", reward=reward
            )
            await learner.start()
            services = [
                asyncio.create_task(learner.run(stop, max_updates=STEPS)),
                asyncio.create_task(dispatcher.run(stop)),
                asyncio.create_task(worker.run(stop)),
            ]
            await until_first_done(services, 120)
            stop.set()
            async with asyncio.timeout(30):
                await asyncio.gather(*services)  # every service stops cleanly
        assert len(CpuVllmEngine.built) == 1, "one engine for the worker's life"
        engine = CpuVllmEngine.built[0]
        assert engine.settings.max_batch == 4 and engine.settings.max_len == 96 and engine.settings.arm is None
        assert engine.settings.hidden == "recompute", "hidden windows are streamed, so the engine must make them"
        # Versions 0..STEPS-1 generated the steps, each loaded into the same engine in place (the final version
        # too, when it was announced before the stop).
        assert len(engine.policies) in (STEPS, STEPS + 1) and len(set(engine.policies)) == len(engine.policies)
        expected = {f"s{s:06d}-{i:04d}/{g}" for s in range(STEPS) for i in range(PROMPTS) for g in range(GROUP)}
        assert learner.intake.assembler.ledger == expected and learner.intake.assembler.duplicates == 0
        samples = [codec_for("samples").decode(f[b"m"]) for _, f in await redis.xrange(keys.stream("samples"))]
        assert sorted(s.sample_id for s in samples) == sorted(expected)
        assert all(s.policy_version == s.step for s in samples)
        rollout_stats = await stats_of(redis, keys, RolloutStats)
        assert rollout_stats and all(not m.sd_on and 0 < m.target_forwards <= m.tokens for m in rollout_stats)
    finally:
        stop.set()
        for service in services:
            await asyncio.gather(service, return_exceptions=True)
        await redis.aclose()


def test_adaptive_sd_is_refused_on_the_vllm_backend() -> None:
    with pytest.raises(ConfigError, match="--fixed-sd --sd-arm"):
        override(DEFAULTS, {"sd.drafter": "ngram", "sd.adaptive": True, "rollout.backend": "vllm"})
    with pytest.raises(ConfigError, match=r"rollout\.backend: invalid enum value 'tensorrt'"):
        override(DEFAULTS, {"rollout.backend": "tensorrt"})


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ([], "tlt-stream rollout-worker: the vllm rollout backend needs vLLM"),
        (["--drafter", "ngram"], "configuration error: sd.adaptive: "),  # adaptive SD, the default
        (["--drafter", "ngram", "--adaptive-sd"], "configuration error: sd.adaptive: "),
    ],
)
def test_a_vllm_worker_is_refused_in_one_line_before_it_connects(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], extra: list[str], needle: str
) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError, installed or not
    # An unreachable Redis: a worker that got past the refusal would fail on connecting, not with exit 2.
    argv = ["rollout-worker", "--backend", "vllm", "--redis-url", "redis://127.0.0.1:9/0", *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tlt-stream") and needle in err and "\n" not in err
