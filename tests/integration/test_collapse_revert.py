"""No silent collapse (issue 23 point 5), end to end: a worker drafting well with a trained EAGLE drafter is sent
a drafter that drafts badly; it must notice the collapse from its first rounds, say so in `stats`, go back to
the drafter before, and never take the bad one again.

Evidence the worker did not write: the collapse is real (both drafters' acceptance measured here, offline,
on the same prompt, by engines of the test's own), and after the revert the engine's drafter weights are the
good drafter's, tensor for tensor, as read from its checkpoint on disk.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.integration.test_group_drafts_worker import worker_on_version_0
from tests.integration.test_rl_loop import learner_and_worker_planes, redis_entries
from tlt_stream.basics.config import Config
from tlt_stream.basics.messages import DrafterVersion, PromptGroup, RolloutStats, codec_for
from tlt_stream.bus.control import ControlPlane
from tlt_stream.bus.producer import StreamProducer
from tlt_stream.bus.streams import Keys
from tlt_stream.rollout.arms import Arm
from tlt_stream.store.digest import directory_sha256
from tlt_stream.tasks.tokenizer import build_tokenizer

pytestmark = [pytest.mark.redis, pytest.mark.mqtt]

ARM = Arm.drafter(4, 1, 4)
PROMPTS = ["Start at 4 and add 3, 2 times.\n", "Start at 1 and add 5, 3 times.\n", "Start at 9 and add 2, 4 times.\n"]


def good_and_bad_drafters(policy_dir: Path, out: Path, prompts: list[list[int]]) -> tuple[Path, Path]:
    """A drafter trained on the policy's own greedy responses (it drafts them well) and a random one."""
    from tlt_stream.drafter.model import Drafter, save_drafter
    from tlt_stream.model import load_model
    from tlt_stream.rollout.warmup import policy_windows, warm_up_drafter

    windows = policy_windows(policy_dir, prompts, max_len=96, stops=[], seed=0, temperature=0.0, batch=8)
    good = out / "good"
    warm_up_drafter(policy_dir, windows, steps=60, lr=3e-3, seed=0, out=good)
    bad = out / "bad"
    torch.manual_seed(123)
    save_drafter(Drafter(load_model(policy_dir).spec), bad)
    return good, bad


def acceptance(policy_dir: Path, drafter_dir: Path, prompts: list[list[int]]) -> float:
    """Accepted / drafted nodes of `drafter_dir` on greedy rows of `prompts`, measured by an engine of the test's
    own (the same arm the worker uses)."""
    from tlt_stream.drafter.model import load_drafter
    from tlt_stream.model import load_model
    from tlt_stream.rollout.engine import GenerationEngine
    from tlt_stream.rollout.proposers import EagleProposer

    policy = load_model(policy_dir)
    engine = GenerationEngine(policy, 4, 96, proposer=EagleProposer(load_drafter(drafter_dir, policy)), arm=ARM)
    engine.generate(prompts, 48, 0.0)
    return engine.accepted_by["eagle"] / engine.drafted_by["eagle"]


async def test_a_drafter_that_collapses_acceptance_is_reported_and_replaced_by_the_one_before(
    bus_config: Config, tmp_path: Path, init_policy: Path, one_backend: str
) -> None:
    tokenizer = build_tokenizer()
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    good, bad = good_and_bad_drafters(init_policy, tmp_path, prompts)
    before, after = acceptance(init_policy, good, prompts), acceptance(init_policy, bad, prompts)
    assert after < 0.5 * before, f"the set-up is no collapse: {before:.2f} -> {after:.2f}"

    keys = Keys(bus_config.run)
    settings = {
        "rollout.max_batch": 4, "rollout.max_len": 96, "rollout.max_response_len": 48, "rollout.temperature": 0.0,
        "sd.drafter": str(good), "sd.adaptive": False, "sd.arm": ARM.label, "sd.collapse_min_drafted": 32,
    }  # fmt: skip
    async with learner_and_worker_planes(bus_config) as planes:
        publisher = ControlPlane(bus_config, planes.redis, role="drafter", owns=["drafter"])
        running = asyncio.create_task(publisher.run(planes.stop))
        await asyncio.wait_for(publisher.connected.wait(), 20)
        worker = await worker_on_version_0(bus_config, planes, settings, tmp_path, init_policy)
        producer = StreamProducer(planes.redis, keys, bus_config.bus)

        async def task(name: str, prompt: list[int]) -> None:
            group = PromptGroup(task_id=name, prompt_id=name, prompt_ids=prompt, answer="0", group_size=2)
            await producer.send("prompts", [group])
            await worker.run(planes.stop, max_tasks=1)

        async with asyncio.timeout(180):
            for i, prompt in enumerate(prompts):  # the good drafter's acceptance: the baseline
                await task(f"good{i}", prompt)
            await publisher.publish(
                DrafterVersion(version=1, location=str(bad), sha256=directory_sha256(bad), policy_version=0)
            )
            while publisher.version("drafter") < 1 or worker.control.version("drafter") < 1:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
            for i, prompt in enumerate(prompts):  # swapped in between steps, judged after 32 drafted nodes
                await task(f"bad{i}", prompt)
        planes.stop.set()
        await running

    verdicts = [v for v in worker.drafters.watch.verdicts if v.kind == "drafter" and v.version == 1]
    assert len(verdicts) == 1 and verdicts[0].collapsed, worker.drafters.watch.verdicts
    assert worker.drafters.collapses == 1 and 1 in worker.drafters.refused
    stats = [codec_for("stats").decode(f[b"m"]) for _, f in await redis_entries(bus_config, keys, "stats")]
    assert [s for s in stats if isinstance(s, RolloutStats)][-1].collapses == 1, "the collapse is in `stats`"
    # Back on the good drafter: the engine's weights are the good checkpoint's, read from disk.
    on_disk = {k: v for f in good.glob("*.safetensors") for k, v in load_file(f).items()}
    live = worker.loader.engine.proposer.drafter.state_dict()
    own = {k: v for k, v in live.items() if k in on_disk}
    assert own and own.keys() == on_disk.keys(), (sorted(live)[:5], sorted(on_disk)[:5])
    for name, tensor in on_disk.items():
        torch.testing.assert_close(own[name], tensor.to(own[name].dtype), rtol=0, atol=0, msg=name)
