"""Accumulated updates on two gloo ranks (FSDP2) against batch updates on one process.

Each rank is its own process under torchrun's environment (`test_sharded_learner.start_ranks`); rank 0 feeds
a `StepAccumulator` the groups of each attempt one at a time, as they would complete, and the other rank
follows its commands. The attempts include groups of one sample or one trained sample (one rank idle in
their rounds), degenerate groups (no round at all), a step voided by a non-finite gradient norm (every rank
sees it in APPLY) and one voided before any collective of its last group (a sample without a prompt token:
DISCARD clears what the ranks accumulated), each followed by its retry. The reference runs the same attempts
through `LearnerCore.step` in this process. Both use plain SGD at lr 1, so a parameter moves by exactly minus
its clipped gradient and the parameters compare the updates themselves (bound as in `test_accumulate.py`).
Every rank counts its forward passes: FSDP's collectives run once per forward and backward, so equal counts
are the equal numbers of rounds the ranks must run however unevenly the groups arrive.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import msgspec
import pytest
import torch
from safetensors.torch import load_file

from tests.unit.test_accumulate import random_groups
from tests.unit.test_sharded_learner import finish_ranks, start_ranks, tiny_policy, weights
from tlt_stream.basics.messages import Tensor
from tlt_stream.rl.groups import ReadyGroup
from tlt_stream.rl.learner import LearnerSettings
from tlt_stream.rl.sharded import Trainer

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("test_sharded_learner")]

SETTINGS = LearnerSettings(lr=1.0, micro_batch_tokens=24, max_grad_norm=0.5)
GROUPS_PER_STEP = 3


def attempts() -> list[list[ReadyGroup]]:
    """The updates tried, in order, each a list of groups in the order they complete."""
    rng = random.Random(5)

    def signal(prefix: str, count: int) -> list[ReadyGroup]:
        out = []
        for g in random_groups(rng, count, prefix, vocab=25):
            samples = [msgspec.structs.replace(s, reward=float(i % 2)) for i, s in enumerate(g.samples)]
            out.append(ReadyGroup(g.task_id, samples, g.entry_ids))
        return out

    one = random_groups(rng, 1, "single", vocab=25)[0]  # one sample: degenerate, no round
    first = [*signal("a", 2), ReadyGroup(one.task_id, one.samples[:1], one.entry_ids[:1])]
    b = signal("b", 3)
    loser = next(s for g in b[1:] for s in g.samples if s.reward == 0.0 and s.response_len)
    blown_samples = [
        msgspec.structs.replace(s, logprobs=Tensor.from_values([-1e30] * s.response_len, "float32"))
        if s is loser
        else s
        for s in next(g for g in b[1:] if loser in g.samples).samples
    ]
    blown = ReadyGroup(loser.task_id, blown_samples, [])
    c = signal("c", 3)
    no_prompt = ReadyGroup("np", [msgspec.structs.replace(s, prompt_ids=[]) for s in c[2].samples], [])
    last = random_groups(rng, GROUPS_PER_STEP, "d", vocab=25)
    return [
        first,
        [b[0], blown, *(g for g in b[1:] if g.task_id != loser.task_id)],  # non-finite norm: voided
        b,
        [c[0], c[1], no_prompt],  # c[0] and c[1] accumulated on both ranks, then voided: DISCARD
        c,
        last,
    ]


def run(step_fn, finish=None) -> list[dict[str, float] | str]:
    """Each attempt through `step_fn(groups)` (or, accumulating, its groups one by one then `finish()`): its
    metrics, or the name of the error that voided it."""
    rows: list[dict[str, float] | str] = []
    for groups in attempts():
        try:
            if finish is None:
                rows.append(step_fn(groups))
            else:
                for group in groups:
                    step_fn(group)
                rows.append(finish())
        except (FloatingPointError, ValueError) as exc:
            rows.append(type(exc).__name__)
    return rows


def counting_forwards() -> list[int]:
    """Count this process's policy forwards (each one a round of FSDP collectives)."""
    from tlt_stream.rl import learner

    count, real = [0], learner.LearnerCore._logprobs

    def counted(self, model, batch):
        count[0] += 1
        return real(self, model, batch)

    learner.LearnerCore._logprobs = counted
    return count


def with_sgd(trainer: Trainer) -> None:
    """Plain SGD at lr 1 on the built policy (rank 0's build and every BUILD a follower is told)."""
    real = trainer.build

    def build(*args, **kwargs):
        core = real(*args, **kwargs)
        core.optimizer = torch.optim.SGD(core.model.parameters(), lr=1.0)
        return core

    trainer.build = build  # type: ignore[method-assign]


def save(trainer: Trainer, root: Path, step: int) -> None:
    trainer.save(root, step=step, ledger=set(), extra={}, tokenizer=None, keep=2, publish_dtype=torch.float32)


def rank_main(spec: str) -> None:
    from tlt_stream.rl.accumulate import StepAccumulator
    from tlt_stream.rl.ranks import join_ranks, leave_ranks
    from tlt_stream.rl.sharded import follow

    args = json.loads(spec)
    torch.set_num_threads(1)
    link = join_ranks("cpu", timeout_s=120)
    assert link is not None
    forwards = counting_forwards()
    settings = LearnerSettings(**{**SETTINGS.__dict__, "activation_checkpointing": True})
    trainer = Trainer(settings, "cpu", link)
    with_sgd(trainer)
    root, init, out = Path(args["root"]), Path(args["init"]), Path(args["out"])
    if link.leader:
        core = trainer.build(init)
        step = StepAccumulator(core, GROUPS_PER_STEP)
        rows = run(step.add, step.finish)
        trainer.save(
            root, step=core.updates, ledger=set(), extra={}, tokenizer=None, keep=2, publish_dtype=torch.float32
        )
        trainer.stop()
        out.write_text(json.dumps(rows))
    else:
        follow(trainer, root=root, init_policy=init)
    out.with_suffix(f".forwards-{link.rank}").write_text(str(forwards[0]))
    leave_ranks(link)


def test_two_ranks_accumulating_make_the_single_process_batch_updates(tmp_path: Path) -> None:
    init = tiny_policy(tmp_path / "init")
    torch.set_num_threads(1)
    single = Trainer(SETTINGS, "cpu")
    with_sgd(single)
    core = single.build(init)
    expected = run(core.step)
    save(single, tmp_path / "single", core.updates)
    out = tmp_path / "two.json"
    finish_ranks(start_ranks(2, entry="tests.unit.test_accumulate_ranks:rank_main", root=str(tmp_path / "two"),
                             init=str(init), out=str(out)))  # fmt: skip
    got = json.loads(out.read_text())
    assert [r if isinstance(r, str) else "applied" for r in expected] == [
        "applied", "FloatingPointError", "applied", "ValueError", "applied", "applied"
    ]  # fmt: skip
    assert [r if isinstance(r, str) else r["trained_tokens"] for r in got] == [
        r if isinstance(r, str) else r["trained_tokens"] for r in expected
    ]
    for a, b in zip(expected, got, strict=True):
        if isinstance(a, str):
            continue
        for key in ("trained_tokens", "samples", "degenerate_groups", "lr", "updated"):
            assert b[key] == a[key], key
        for key in ("loss", "grad_norm", "clip_fraction", "approx_kl_old", "logprob_mismatch_mean"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key
    assert all(r["grad_norm"] > SETTINGS.max_grad_norm for r in expected if not isinstance(r, str)), "clip bites"
    a, b = weights(tmp_path / "single", core.updates), weights(tmp_path / "two", core.updates)
    start = load_file(init / "model.safetensors")
    moved = max(float((a[k] - start[k]).abs().max()) for k in a)
    assert moved > 1e-3
    for key in a:
        assert bool(((b[key] - a[key]).abs() <= 1e-6 * a[key].abs() + 1e-5 * moved).all()), key
    counts = [int((out.with_suffix(f".forwards-{r}")).read_text()) for r in range(2)]
    assert counts[0] == counts[1] > 0, f"forwards per rank {counts}"
