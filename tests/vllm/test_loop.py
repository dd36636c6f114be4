"""The RL loop with vLLM rollout workers: `tlt-stream run --set rollout.backend=vllm` on a world vLLM's CPU
attention takes (head_dim 32), the policy service, a vLLM rollout worker and the learner as processes of their
own on the test's Redis and MQTT, audited afterwards from outside the services: Redis's count of entries ever
added to the `prompts` and `samples` streams, the samples themselves (an `audit` consumer group keeps them from
the learner's trimming), every checkpoint's ledger, the control plane (Redis mirror and MQTT's retained
messages), the drafter-training states on disk, the `hidden` stream against transformers, the worker's
registry record, and vLLM's own log lines in the worker's log.

The drafter is trained online in the worker's idle time, published and swapped into the running engine.
Idle periods of a run this short last a fraction of a second (the learner's step), so whether a slice is
judged before the run ends would be chance; the test makes one long idle period instead: the learner stops
itself (failpoint `learner.accumulated`, SIGSTOP) with the first group of step 0 taken, the worker (its step-0
tasks done, step 1 waiting for policy version 1) trains until it publishes a drafter, and the test resumes the
learner. Steps 1 and 2 must then run on that drafter."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import json
import os
import signal
import sys
from collections import Counter
from pathlib import Path

import pytest
import redis.asyncio as aioredis
import torch

from tests.integration.loop import keep_for_audit
from tests.vllm.conftest import Oracle, hf_policy, requires_vllm
from tlt_stream.basics.config import Config
from tlt_stream.basics.messages import DrafterVersion, HiddenWindow, Sample, codec_for
from tlt_stream.bus.control import read_mirror
from tlt_stream.bus.streams import Keys

pytestmark = [*requires_vllm, pytest.mark.redis, pytest.mark.mqtt]

STEPS, PROMPTS, GROUP = 3, 2, 4
WORKER = "rollout-0"
TRAINING = {
    "rollout.hidden_share": 1.0,  # every sample's windows (the default quarter is 6 windows in this run)
    "drafter.min_windows": 4,  # step 0's 8 windows: 7 to train on, 1 held out (10 %, by sample id) to judge on
    "drafter.judge_every_steps": 1,
    "drafter.slice_seconds": 1.0,
    "drafter.lr": 1e-3,  # the world's drafter is random, not a converged warm-up one
    "drafter.lr_warmup_steps": 0,
    "learner.accumulate": True,  # groups are taken one by one: the failpoint stops the learner inside step 1
}
NORM = "layer.post_attention_layernorm.weight"
"""The drafter tensor the worker reads back from vLLM after a swap (`roles/worker/drafters.py`)."""


def world(root: Path) -> Path:
    from tlt_stream.drafter.model import Drafter, save_drafter
    from tlt_stream.model import load_model

    hf_policy(root / "policy", seed=0)
    torch.manual_seed(1)
    save_drafter(Drafter(load_model(root / "policy").spec), root / "drafter")
    return root


def run_pids(run: str, *, module: str | None = None) -> list[int]:
    """Live processes of this run (their command lines carry its name), or only its service `module`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if run.encode() in argv and (module is None or module.encode() in argv):
                found.append(int(entry.name))
    return found


def norm_sha256(drafter: Path) -> str:
    """sha256 of the float32 bytes of the drafter checkpoint's NORM, read from its file here."""
    from safetensors.torch import load_file

    return hashlib.sha256(load_file(str(drafter / "model.safetensors"))[NORM].float().numpy().tobytes()).hexdigest()


class Watch:
    """What the test reads while the run goes: the worker's registry record and every drafter version the
    control plane's Redis mirror announced (the mirror keeps only the newest)."""

    def __init__(self, redis: aioredis.Redis, keys: Keys) -> None:
        self.redis, self.keys = redis, keys
        self.read_backs: set[str] = set()
        self.drafters: dict[int, DrafterVersion] = {}

    async def once(self) -> None:
        info = await self.redis.hgetall(self.keys.worker(WORKER))
        if (held := info.get(b"drafter_read_back")) is not None:
            self.read_backs.add(held.decode())
        announced = (await read_mirror(self.redis, self.keys)).get("drafter")
        if isinstance(announced, DrafterVersion):
            self.drafters[announced.version] = announced

    async def run(self) -> None:
        while True:
            await self.once()
            await asyncio.sleep(0.1)


async def hold_learner_for_a_drafter(redis: aioredis.Redis, keys: Keys, out: Path, watch: Watch, run: str) -> None:
    """Keep every sample for the audit; wait for the learner to stop itself at its first group and for the
    idle worker to publish a drafter; then resume the learner."""
    while not await redis.exists(keys.stream("samples")):  # noqa: ASYNC110 - a key appearing, no event to wait on
        await asyncio.sleep(0.05)
    await keep_for_audit(redis, keys)  # before any trimming: the learner trims after its first update at the earliest
    log = out / "logs" / "learner.log"
    while not (log.is_file() and "failpoint learner.accumulated: stop" in log.read_text()):  # noqa: ASYNC110
        await asyncio.sleep(0.1)
    try:
        async with asyncio.timeout(240):  # a slice of 1 s and its judgement take a few seconds
            while not watch.drafters:  # noqa: ASYNC110 - the mirror is polled (Watch), no event to wait on
                await asyncio.sleep(0.1)
    except TimeoutError:
        raise AssertionError("the idle worker published no drafter in 240 s while the learner was held") from None
    (learner,) = run_pids(run, module="services.learner")
    os.kill(learner, signal.SIGCONT)


async def test_the_loop_on_vllm_trains_every_sample_once_and_swaps_in_its_online_drafter(
    one_backend: str, bus_config: Config, tmp_path: Path
) -> None:
    from tlt_stream.commands.doctor_checks import inspect_mqtt
    from tlt_stream.store.digest import verify_directory

    keys = Keys(bus_config.run)
    out = tmp_path / "run"
    armed = tmp_path / "failpoints"
    armed.mkdir()
    settings = [arg for key, value in TRAINING.items() for arg in ("--set", f"{key}={str(value).lower()}")]
    command = [
        *(sys.executable, "-m", "tlt_stream.commands.cli", "run", "--run", bus_config.run),
        *("--world", str(world(tmp_path / "w"))),
        *("--out", str(out), "--steps", str(STEPS), "--prompts-per-step", str(PROMPTS), "--group-size", str(GROUP)),
        *("--max-len", "96", "--eval", "0", "--fixed-sd", "--set", "rollout.backend=vllm", *settings),
    ]
    env = {
        **os.environ,
        "TLT_REDIS_URL": bus_config.bus.redis_url,
        "TLT_MQTT_URL": bus_config.bus.mqtt_url,
        "TLT_FAILPOINTS": f"learner.accumulated=stop:once={armed / 'learner'}",  # the first group only
    }
    process = await asyncio.create_subprocess_exec(*command, env=env, stderr=asyncio.subprocess.PIPE)
    redis = aioredis.Redis.from_url(bus_config.bus.redis_url)
    watch = Watch(redis, keys)
    watching = asyncio.create_task(watch.run())
    try:
        async with asyncio.timeout(600):
            finished = asyncio.create_task(process.communicate())
            holding = asyncio.create_task(hold_learner_for_a_drafter(redis, keys, out, watch, bus_config.run))
            await asyncio.wait([finished, holding], return_when=asyncio.FIRST_COMPLETED)
            assert holding.done(), f"the run ended before a drafter was published: {finished.result()[1][-3000:]!r}"
            holding.result()
            _, stderr = await finished
        assert process.returncode == 0, stderr.decode()[-3000:]
        await watch.once()
        added = {}
        for name in ("prompts", "samples"):
            info = {
                str(k, "utf-8") if isinstance(k, bytes) else k: v
                for k, v in (await redis.xinfo_stream(keys.stream(name))).items()
            }
            added[name] = int(info["entries-added"])
        samples: dict[str, Sample] = {}
        for _, fields in await redis.xrange(keys.stream("samples")):
            sample = codec_for("samples").decode(fields[b"m"])
            samples[sample.sample_id] = sample
        windows: list[HiddenWindow] = [
            codec_for("hidden").decode(fields[b"m"]) for _, fields in await redis.xrange(keys.stream("hidden"))
        ]
        mirror = (await read_mirror(redis, keys))["drafter"]
        retained = (await inspect_mqtt(bus_config, timeout=10))["retained"]
    finally:
        watching.cancel()
        for pid in run_pids(bus_config.run):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        await redis.aclose()
    worker_log = (out / "logs" / f"{WORKER}.log").read_text()
    assert worker_log.count("Initializing a V1 LLM engine") == 1, "one vLLM engine for the worker's life"
    assert "Injected <class 'tlt_stream.rollout.vllm.extension.TltWorkerExtension'>" in worker_log

    # Every sample trained exactly once, on-policy.
    assert added == {"prompts": STEPS * PROMPTS, "samples": STEPS * PROMPTS * GROUP}, added  # none sent twice
    ledgers = [
        set(json.loads((out / "checkpoints" / f"step-{step:08d}" / "ledger.json").read_text()))
        for step in range(1, STEPS + 1)
    ]
    assert all(a <= b for a, b in itertools.pairwise(ledgers)), "a ledger lost a sample"
    trained = [ledgers[0], *(b - a for a, b in itertools.pairwise(ledgers))]
    assert sum(len(update) for update in trained) == len(ledgers[-1]) == added["samples"], "each trained once"
    for step, update in enumerate(trained, start=1):  # on-policy: update k trains the groups dispatched at k - 1
        groups = Counter(sample_id.split("/")[0] for sample_id in update)
        assert len(groups) == PROMPTS and set(groups.values()) == {GROUP}, groups
        assert all(group.startswith(f"s{step - 1:06d}-") for group in groups), (step, groups)
    assert set(samples) == ledgers[-1] and {s.worker_id for s in samples.values()} == {WORKER}

    # A drafter version published on the control plane, a training state of this run, intact.
    assert isinstance(mirror, DrafterVersion) and mirror.version >= 1
    assert retained[f"tlt/{bus_config.run}/drafter"]["version"] == mirror.version, "retained on MQTT too"
    states = out / "drafter-states"
    for version in watch.drafters.values():
        assert Path(version.location).parent.parent == states, version.location
        verify_directory(version.location, version.sha256)

    # Its slices trained on windows of the vLLM worker's samples: the states' records name trained samples;
    # held-out ones are never trained on; the windows are transformers' hidden states of the samples' tokens.
    records = [json.loads((state / "trainer.json").read_text()) for state in sorted(states.iterdir())]
    first = min(watch.drafters.values(), key=lambda v: v.version)
    first_step = json.loads((Path(first.location).parent / "trainer.json").read_text())["step"]
    before_first = {i for r in records if r["step"] <= first_step for i in r["metadata"]["windows_added"]}
    trained_on = {i for r in records for i in r["metadata"]["windows_added"]}
    held_out = {i for r in records for i in r["metadata"]["held_out_added"]}
    assert before_first and all(i.startswith("s000000-") for i in before_first), before_first  # step 0's
    assert trained_on <= ledgers[-1] and held_out <= ledgers[-1] and not trained_on & held_out
    assert {w.sample_id for w in windows} == ledgers[-1], "every sample's window (hidden_share 1)"
    oracles: dict[int, Oracle] = {}
    for window in windows:
        sample = samples[window.sample_id]
        tokens = [*sample.prompt_ids, *sample.token_ids.to_torch().tolist()]
        assert window.token_ids == tokens[:-1] and window.prompt_len == len(sample.prompt_ids)
        version = window.policy_version
        assert version == sample.policy_version
        if version not in oracles:  # version 0 is the world's policy (its step-0 copy is pruned by then)
            policy = out / "checkpoints" / f"step-{version:08d}" / "policy" if version else tmp_path / "w" / "policy"
            oracles[version] = Oracle(policy)
        oracle = oracles[version]
        reference = oracle.final_hidden(window.token_ids).to(torch.bfloat16)  # the wire dtype
        torch.testing.assert_close(window.hidden.to_torch(), reference)

    # The worker swapped it into its one engine: vLLM's draft weights, read back after the swap, are the
    # published checkpoint's (not the warm-up drafter's), and steps 1-2 ran on an online drafter.
    warm_up = norm_sha256(tmp_path / "w" / "drafter")
    checked = [
        held
        for held in watch.read_backs
        if (version := int(held.split(":")[0])) in watch.drafters
        and held == f"{version}:{norm_sha256(Path(watch.drafters[version].location))}"
    ]
    assert checked and all(not held.endswith(warm_up) for held in checked), (watch.read_backs, watch.drafters)
    by_step = {step: [s for s in samples.values() if s.sample_id.startswith(f"s{step:06d}-")] for step in range(STEPS)}
    assert {s.drafter_version for s in by_step[0]} == {0}, "step 0 ran on the warm-up drafter"
    assert all(s.drafter_version >= first.version for step in (1, 2) for s in by_step[step]), "steps 1-2 on it"
    accept = {step: sum(s.accept_length for s in group) / len(group) for step, group in by_step.items()}
    print(f"drafter versions {sorted(watch.drafters)}; mean accept length per step {accept}")
