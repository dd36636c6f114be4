"""An update accumulated group by group is the batch update over the same groups (one process).

The reference is `LearnerCore.step` over the same groups in the same order, on a copy of the same policy.
With plain SGD at lr 1 a parameter moves by exactly minus its clipped gradient, so the parameters compare
the update itself; AdamW divides by the root of the second moment, which turns a gradient at rounding
noise into a step of up to lr whatever its size, so its comparison bounds what noise can do.

Bounds (fp32): every parameter within rtol 1e-6 (its own rounding, about 8 ulp) + 1e-5 x the largest
parameter move of the update (summation order of the gradient; measured up to 1.8e-6 over 30 seeds).
bf16 autocast: within 2e-2 of the largest move, as bf16 compute is from fp32 compute.
"""

from __future__ import annotations

import copy
import random
from pathlib import Path

import msgspec
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tlt_stream.basics.messages import Sample, Tensor
from tlt_stream.rl.accumulate import StepAccumulator, dropout_of
from tlt_stream.rl.groups import ReadyGroup
from tlt_stream.rl.learner import LearnerCore, LearnerSettings

VOCAB = 32
FIGURES = ("loss", "clip_fraction", "approx_kl_old", "kl_ref", "grad_norm", "logprob_mismatch_mean")
FIGURES += ("logprob_mismatch_max",)
"""Figures of the forward passes (other padding, other kernel shapes) or summed in another order."""
EXACT = ("groups", "samples", "reward_mean", "accuracy", "degenerate_groups", "truncated", "trained_tokens")
EXACT += ("lr", "updated", "response_len_mean", "response_len_max")
"""Figures that need no forward pass: the same numbers."""


def tiny_model(seed: int, **extra: object) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        max_position_embeddings=64,
        **extra,
    )
    return LlamaForCausalLM(config).eval()


def random_groups(
    rng: random.Random, count: int, prefix: str, *, version: int = 0, vocab: int = VOCAB
) -> list[ReadyGroup]:
    """`count` groups of 1-6 samples: prompts of 1-5 tokens, responses of 0-12 tokens (empty ones count for
    nothing), rewards from {0, 0.5, 1} (some groups all equal: degenerate), some cut off at the length limit,
    behaviour logprobs far from the policy's (ratios away from 1, so the PPO clip bites)."""
    out = []
    for g in range(count):
        size, task = rng.randint(1, 6), f"{prefix}{g}"
        prompt = [rng.randrange(1, vocab) for _ in range(rng.randint(1, 5))]
        samples = []
        for i in range(size):
            n = rng.randint(0, 12)
            samples.append(
                Sample(
                    sample_id=f"{task}/{i}",
                    task_id=task,
                    prompt_id=task,
                    index=i,
                    group_size=size,
                    prompt_ids=prompt,
                    token_ids=Tensor.from_values([rng.randrange(1, vocab) for _ in range(n)], "int32"),
                    logprobs=Tensor.from_values([-rng.uniform(1.5, 4.5) for _ in range(n)], "float32"),
                    policy_version=version,
                    drafter_version=-1,
                    reward=rng.choice([0.0, 0.5, 1.0]),
                    finish_reason=rng.choice(["eos", "length"]),
                    worker_id="w",
                )
            )
        out.append(ReadyGroup(task, samples, [f"{task}-{i}" for i in range(size)]))
    return out


def pair(base: LlamaForCausalLM, settings: LearnerSettings, *, sgd: bool) -> tuple[LearnerCore, LearnerCore]:
    """Two learners on copies of `base`: the batch one and the one to accumulate (plain SGD at lr 1 if `sgd`)."""
    cores = []
    for _ in range(2):
        model = copy.deepcopy(base)
        core = LearnerCore(model, settings)
        if sgd:
            core.optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        cores.append(core)
    return cores[0], cores[1]


def params(core: LearnerCore) -> dict[str, torch.Tensor]:
    return {name: p.detach() for name, p in core.model.named_parameters()}


def assert_same_update(
    batch: LearnerCore, accumulated: LearnerCore, before: dict[str, torch.Tensor], what: str
) -> None:
    """Every parameter of `accumulated` within the fp32 bound of `batch`'s (moved from `before`)."""
    moved = max(float((p - before[n]).abs().max()) for n, p in params(batch).items())
    for name, a in params(batch).items():
        b = params(accumulated)[name]
        assert bool(((b - a).abs() <= 1e-6 * a.abs() + 1e-5 * moved).all()), f"{what} {name}: {(b - a).abs().max()}"


def assert_same_figures(a: dict[str, float], b: dict[str, float], what: str) -> None:
    """The same figures, under the same names (the accumulated update's timings besides)."""
    assert set(b) - set(a) == {"accumulate_seconds", "apply_seconds"} and set(a) <= set(b), what
    for key in EXACT:
        assert b.get(key) == a.get(key), f"{what}: {key}"
    for key in (k for k in FIGURES if k in a):
        assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), f"{what}: {key}"


@pytest.mark.parametrize("seed", range(8))
def test_the_accumulated_update_is_the_batch_update_for_any_arrival_order_micro_batch_and_group_size(seed: int) -> None:
    rng = random.Random(seed)
    torch.set_num_threads(1)
    base = tiny_model(seed)
    settings = LearnerSettings(
        lr=1.0,
        micro_batch_tokens=rng.choice([1, 7, 16, 40, 1000]),
        max_grad_norm=rng.choice([0.0, 0.05, 100.0]),  # none, always biting, never biting
        overlong=rng.choice(["keep", "mask"]),
    )
    batch, accumulated = pair(base, settings, sgd=True)
    step = StepAccumulator(accumulated, rng.randint(1, 5))
    for update in range(3):
        groups = random_groups(rng, step.groups_per_step, f"u{update}g")
        rng.shuffle(groups)  # the order the groups complete in
        before = {n: p.clone() for n, p in params(batch).items()}
        expected = batch.step(groups)
        ready = list(groups)
        while ready:  # one group at a time, as they complete
            assert step.take([ready.pop(0)]) == (not ready)
        got = step.finish()
        assert_same_figures(expected, got, f"seed {seed} update {update}")
        if expected["updated"]:
            assert_same_update(batch, accumulated, before, f"seed {seed} update {update}")
        assert all(p.grad is None for p in accumulated.model.parameters()), "gradients are cleared after a step"
    assert accumulated.updates == batch.updates


def test_adamw_kl_to_a_reference_and_truncated_importance_sampling_accumulate_the_same() -> None:
    rng = random.Random(11)
    base = tiny_model(11)
    settings = LearnerSettings(lr=1e-2, micro_batch_tokens=24, max_grad_norm=0.5, kl_coef=0.05, tis_cap=2.0)
    reference = copy.deepcopy(base)
    batch, accumulated = (LearnerCore(copy.deepcopy(base), settings, reference=reference) for _ in range(2))
    step = StepAccumulator(accumulated, 4)
    for update in range(3):
        groups = random_groups(rng, 4, f"u{update}g")
        before = {n: p.clone() for n, p in params(batch).items()}
        expected = batch.step(groups)
        assert step.take(list(groups))
        got = step.finish()
        assert_same_figures(expected, got, f"update {update}")
        assert got["kl_ref"] > 0 or update == 0
        assert got["tis_weight_mean"] == pytest.approx(expected["tis_weight_mean"], rel=1e-6)
        # AdamW: lr x g / (|g| + eps) per coordinate; a coordinate whose gradient is rounding noise of a
        # larger sum moves by up to lr either way. Measured: at most 3e-4 x lr here.
        for name, a in params(batch).items():
            assert float((a - params(accumulated)[name]).abs().max()) <= 1e-2 * settings.lr * (update + 1), name
        assert any(float((p - before[n]).abs().max()) > settings.lr / 2 for n, p in params(batch).items())


def test_bf16_compute_accumulates_within_bf16_precision_of_the_batch_update() -> None:
    rng = random.Random(3)
    base = tiny_model(3)
    groups = random_groups(rng, 4, "g")
    moves = {}
    arms = (("fp32", "float32", False), ("batch", "bfloat16", False), ("acc", "bfloat16", True))
    for name, dtype, accumulate in arms:
        core = LearnerCore(copy.deepcopy(base), LearnerSettings(lr=1.0, micro_batch_tokens=7, compute_dtype=dtype))
        core.optimizer = torch.optim.SGD(core.model.parameters(), lr=1.0)
        if accumulate:
            step = StepAccumulator(core, len(groups))
            step.take(list(groups))
            step.finish()
        else:
            core.step(groups)
        pairs = zip(core.model.parameters(), base.parameters(), strict=True)
        moves[name] = torch.cat([(p - q).detach().flatten() for p, q in pairs])
    scale = float(moves["fp32"].abs().max())
    assert scale > 1e-3
    for a, b in (("batch", "fp32"), ("acc", "fp32"), ("acc", "batch")):
        assert float((moves[a] - moves[b]).abs().max()) <= 2e-2 * scale, (a, b)
    assert not torch.equal(moves["acc"], moves["fp32"]), "bf16 compute really ran"


def test_a_step_of_degenerate_groups_only_changes_nothing_as_in_the_batch_update() -> None:
    base = tiny_model(4)
    same = [msgspec.structs.replace(s, reward=1.0) for g in random_groups(random.Random(4), 3, "d") for s in g.samples]
    by_task: dict[str, list[Sample]] = {}
    for s in same:
        by_task.setdefault(s.task_id, []).append(s)
    groups = [ReadyGroup(t, ss, [s.sample_id for s in ss]) for t, ss in by_task.items()]
    core = LearnerCore(copy.deepcopy(base), LearnerSettings(lr=1e-2, weight_decay=0.1))
    step = StepAccumulator(core, len(groups))
    step.take(list(groups))
    metrics = step.finish()
    assert metrics["updated"] == 0.0 and metrics["trained_tokens"] == 0 and core.updates == 0
    assert all(torch.equal(p, q) for p, q in zip(core.model.parameters(), base.parameters(), strict=True))


def test_the_step_never_takes_more_than_its_groups_and_takes_them_from_the_front() -> None:
    core = LearnerCore(tiny_model(5), LearnerSettings(lr=1e-3))
    groups = random_groups(random.Random(5), 5, "q")
    ready = list(groups)
    step = StepAccumulator(core, 3)
    assert step.take(ready)
    assert step.groups == groups[:3] and ready == groups[3:], "the first three, in order; the rest stay queued"
    assert step.take(ready) and ready == groups[3:]
    with pytest.raises(ValueError, match="already has its 3 groups"):
        step.add(groups[3])
    step.finish()
    assert not step.take(ready) and step.groups == groups[3:] and ready == []
    with pytest.raises(ValueError, match="has 2 of its 3 groups"):
        step.finish()


def test_a_policy_with_dropout_is_refused_naming_where() -> None:
    assert dropout_of(tiny_model(0)) == []
    with pytest.raises(ValueError, match=r"without dropout.*attention_dropout = 0\.1"):
        StepAccumulator(LearnerCore(tiny_model(0, attention_dropout=0.1), LearnerSettings()), 2)
    plain = tiny_model(0)
    plain.model.layers[0].mlp.add_module("drop", torch.nn.Dropout(0.2))
    assert dropout_of(plain) == ["model.layers.0.mlp.drop (p = 0.2)"]


def test_a_group_that_breaks_its_backward_voids_the_step_like_the_batch_update_and_a_retry_recomputes() -> None:
    """A group whose forward raises (a token outside the vocabulary) while other groups of the step are already
    accumulated: `finish` raises what the batch update raises, nothing is applied, the gradients are cleared;
    the retry over the surviving groups (the bad one taken out) is the batch update over them."""
    rng = random.Random(6)
    base = tiny_model(6)
    groups = random_groups(rng, 4, "b")
    for g in groups:  # every group has a signal, so the update does happen
        g.samples[:] = [msgspec.structs.replace(s, reward=float(i % 2)) for i, s in enumerate(g.samples)]
    groups = [g for g in groups if len(g.samples) > 1 and any(s.response_len for s in g.samples)][:3]
    bad_sample = msgspec.structs.replace(
        groups[1].samples[0],
        token_ids=Tensor.from_values([VOCAB + 5], "int32"),
        logprobs=Tensor.from_values([-2.0], "float32"),
    )
    bad = ReadyGroup("bad", [bad_sample, *groups[1].samples[1:]], groups[1].entry_ids)
    batch, accumulated = pair(base, LearnerSettings(lr=1.0, micro_batch_tokens=16), sgd=True)
    attempt = [groups[0], groups[2], bad]
    with pytest.raises(IndexError):
        batch.step(attempt)
    step = StepAccumulator(accumulated, 3)
    assert step.take(list(attempt))
    with pytest.raises(IndexError):
        step.finish()
    assert accumulated.updates == 0 and step.groups == []
    assert all(p.grad is None for p in accumulated.model.parameters())
    assert all(torch.equal(p, q) for p, q in zip(accumulated.model.parameters(), base.parameters(), strict=True))
    survivors = [groups[0], groups[2], groups[1]]
    before = {n: p.clone() for n, p in params(batch).items()}
    expected = batch.step(survivors)
    assert step.take(list(survivors))
    assert_same_figures(expected, step.finish(), "retry")
    assert_same_update(batch, accumulated, before, "retry")


def test_a_non_finite_gradient_norm_voids_the_step_and_clears_what_was_accumulated() -> None:
    rng = random.Random(7)
    base = tiny_model(7)
    groups = [g for g in random_groups(rng, 8, "n") if len(g.samples) > 2][:2]
    for g in groups:
        g.samples[:] = [msgspec.structs.replace(s, reward=float(i % 2)) for i, s in enumerate(g.samples)]
    # A behaviour logprob of -1e30 makes the ratio inf; with a negative advantage the unclipped term wins.
    loser = next(s for s in groups[1].samples if s.reward == 0.0 and s.response_len)
    poisoned = msgspec.structs.replace(loser, logprobs=Tensor.from_values([-1e30] * loser.response_len, "float32"))
    blown = ReadyGroup(groups[1].task_id, [poisoned if s is loser else s for s in groups[1].samples], [])
    batch, accumulated = pair(base, LearnerSettings(lr=1.0), sgd=True)
    with pytest.raises(FloatingPointError):
        batch.step([groups[0], blown])
    step = StepAccumulator(accumulated, 2)
    step.take([groups[0], blown])
    with pytest.raises(FloatingPointError):
        step.finish()
    assert all(p.grad is None for p in accumulated.model.parameters()) and accumulated.updates == 0
    before = {n: p.clone() for n, p in params(batch).items()}
    expected = batch.step(groups)
    step.take(list(groups))
    assert_same_figures(expected, step.finish(), "after the void")
    assert_same_update(batch, accumulated, before, "after the void")


def test_discard_clears_the_step_and_hands_back_its_groups() -> None:
    base = tiny_model(8)
    groups = random_groups(random.Random(8), 3, "x")
    core = LearnerCore(copy.deepcopy(base), LearnerSettings(lr=1e-2))
    step = StepAccumulator(core, 4)
    step.take(list(groups))
    assert step.discard() == groups and step.groups == []
    assert all(p.grad is None for p in core.model.parameters())


def test_the_accumulated_failpoint_kills_with_a_group_accumulated_and_nothing_applied() -> None:
    """`learner.accumulated` is where a fault test kills a learner mid-step: inside `add`, once a group was taken
    into the step (its gradients in), before the step is applied; a degenerate group reaches it too (the fault
    runs' random policy makes every group degenerate)."""
    import os
    import signal
    import subprocess
    import sys

    code = (
        "import random, torch\n"
        "from tests.unit.test_accumulate import random_groups, tiny_model\n"
        "from tlt_stream.rl.accumulate import StepAccumulator\n"
        "from tlt_stream.rl.learner import LearnerCore, LearnerSettings\n"
        "import msgspec\n"
        "from tlt_stream.rl.groups import ReadyGroup\n"
        "g = random_groups(random.Random(1), 1, 'k')[0]\n"
        "same = ReadyGroup('same', [msgspec.structs.replace(s, reward=1.0) for s in g.samples], [])\n"
        "mixed = [msgspec.structs.replace(s, reward=float(i % 2)) for i, s in enumerate(g.samples)]\n"
        "signal = ReadyGroup('sig', mixed, [])\n"
        "step = StepAccumulator(LearnerCore(tiny_model(1), LearnerSettings()), 3)\n"
        "step.add(same)\n"
        "print('survived', flush=True)\n"
        "step.add(signal)\n"
    )
    env = {**os.environ, "TLT_FAILPOINTS": "learner.accumulated=kill", "OMP_NUM_THREADS": "1"}
    root = Path(__file__).parents[2]
    done = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    assert done.stdout.splitlines() == []
    assert "failpoint learner.accumulated: kill" in done.stderr
