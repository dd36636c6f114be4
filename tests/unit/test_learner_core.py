"""The learner's update: it moves the policy the way the advantages say, independent of micro-batching."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tlt_stream.basics.messages import Sample, Tensor
from tlt_stream.rl.groups import ReadyGroup
from tlt_stream.rl.learner import LearnerCore, LearnerSettings


def tiny_model(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=24,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config).eval()


def response_logprobs(model: LlamaForCausalLM, prompt: list[int], response: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
    return logp[len(prompt) - 1 :].gather(1, torch.tensor(response)[:, None])[:, 0]


def make_group(model, task: str, responses: list[list[int]], rewards: list[float], prompt=(3, 4, 5)) -> ReadyGroup:
    samples = []
    for i, (response, reward) in enumerate(zip(responses, rewards, strict=True)):
        samples.append(
            Sample(
                sample_id=f"{task}/{i}",
                task_id=task,
                prompt_id=task,
                index=i,
                group_size=len(responses),
                prompt_ids=list(prompt),
                token_ids=Tensor.from_values(response, "int32"),
                logprobs=Tensor.from_torch(response_logprobs(model, list(prompt), response).float()),
                policy_version=0,
                drafter_version=-1,
                reward=reward,
                finish_reason="eos",
                worker_id="w",
            )
        )
    return ReadyGroup(task, samples, [f"0-{i}" for i in range(len(samples))])


GOOD, BAD = [7, 8, 9, 10, 2], [11, 12, 2]


def test_updates_raise_rewarded_responses_and_lower_the_others() -> None:
    model = tiny_model()
    before_good = response_logprobs(model, [3, 4, 5], GOOD).sum()
    before_bad = response_logprobs(model, [3, 4, 5], BAD).sum()
    core = LearnerCore(model, LearnerSettings(lr=3e-2))
    for _ in range(5):
        group = make_group(model, "t", [GOOD, BAD, GOOD, BAD], [1.0, 0.0, 1.0, 0.0])
        metrics = core.step([group])
    assert response_logprobs(model, [3, 4, 5], GOOD).sum() > before_good + 0.5
    assert response_logprobs(model, [3, 4, 5], BAD).sum() < before_bad - 0.5
    assert metrics["updated"] == 1.0 and metrics["reward_mean"] == 0.5 and metrics["trained_tokens"] == 16
    assert core.updates == 5


def test_warmup_ramps_the_learning_rate_from_the_update_count_so_a_resumed_learner_continues_it() -> None:
    settings = LearnerSettings(lr=1e-3, warmup_steps=4)
    assert [settings.lr_at(u) for u in range(6)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3])
    assert LearnerSettings(lr=1e-3).lr_at(0) == 1e-3
    with pytest.raises(ValueError, match="warmup_steps"):
        LearnerSettings(warmup_steps=-1)
    model = tiny_model(6)
    core = LearnerCore(model, settings)
    group = make_group(model, "t", [GOOD, BAD], [1.0, 0.0])
    assert [core.step([group])["lr"] for _ in range(2)] == pytest.approx([2.5e-4, 5e-4])
    resumed = LearnerCore(copy.deepcopy(model), settings)
    resumed.updates = 2  # what the service restores from the checkpoint's version
    assert resumed.step([group])["lr"] == pytest.approx(7.5e-4)
    assert resumed.optimizer.param_groups[0]["lr"] == pytest.approx(7.5e-4)


def test_behaviour_logprobs_from_the_same_weights_give_ratio_one() -> None:
    model = tiny_model(1)
    core = LearnerCore(model, LearnerSettings(lr=1e-3))
    metrics = core.step([make_group(model, "t", [GOOD, BAD], [1.0, 0.0])])
    assert metrics["approx_kl_old"] < 1e-6 and metrics["clip_fraction"] == 0.0


def test_the_update_does_not_depend_on_the_micro_batch_size() -> None:
    base = tiny_model(2)
    groups = [
        make_group(base, "a", [GOOD, BAD, [7, 2]], [1.0, 0.0, 0.5]),
        make_group(base, "b", [[9, 9, 9, 9, 9, 9, 2], BAD], [0.0, 1.0], prompt=(6, 5)),
    ]
    results = []
    for micro in (1, 64):
        model = copy.deepcopy(base)
        core = LearnerCore(model, LearnerSettings(lr=1.0, micro_batch_tokens=micro, max_grad_norm=0.0))
        # Plain SGD makes the step proportional to the gradient: Adam's first step is ~lr * sign(g) and
        # would amplify float rounding in near-zero gradients into visible differences.
        core.optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        core.step(groups)
        results.append({k: v - base.state_dict()[k] for k, v in model.state_dict().items()})
    assert any(bool(delta.abs().max() > 1e-4) for delta in results[0].values()), "the step changed nothing"
    for key in results[0]:
        assert torch.allclose(results[0][key], results[1][key], atol=1e-6), key


def test_degenerate_groups_are_left_out_and_a_step_of_only_them_changes_nothing() -> None:
    model = tiny_model(3)
    before = copy.deepcopy(model.state_dict())
    core = LearnerCore(model, LearnerSettings(lr=1e-2, weight_decay=0.1))
    all_right = make_group(model, "a", [GOOD, GOOD], [1.0, 1.0])
    all_wrong = make_group(model, "b", [BAD, BAD], [0.0, 0.0])
    metrics = core.step([all_right, all_wrong])
    assert metrics["updated"] == 0.0 and metrics["degenerate_groups"] == 2.0 and metrics["trained_tokens"] == 0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    mixed = make_group(model, "c", [GOOD, BAD], [1.0, 0.0])
    metrics = core.step([all_right, mixed])
    assert metrics["degenerate_groups"] == 1.0 and metrics["trained_tokens"] == len(GOOD) + len(BAD)


def test_kl_needs_a_reference_and_is_zero_against_itself() -> None:
    model = tiny_model(4)
    with pytest.raises(ValueError, match="reference"):
        LearnerCore(model, LearnerSettings(kl_coef=0.1))
    core = LearnerCore(model, LearnerSettings(kl_coef=0.1, lr=1e-3), reference=copy.deepcopy(model))
    metrics = core.step([make_group(model, "t", [GOOD, BAD], [1.0, 0.0])])
    assert 0.0 <= metrics["kl_ref"] < 1e-6


def test_temperature_is_applied_to_the_recomputed_logprobs() -> None:
    model = tiny_model(5)
    group = make_group(model, "t", [GOOD, BAD], [1.0, 0.0])  # behaviour logprobs at T = 1
    at_half = LearnerCore(copy.deepcopy(model), LearnerSettings(temperature=0.5)).step([group])
    at_one = LearnerCore(copy.deepcopy(model), LearnerSettings(temperature=1.0)).step([group])
    assert at_one["approx_kl_old"] < 1e-6 < at_half["approx_kl_old"]


def test_the_final_norm_gain_trains_at_its_own_scale_and_everything_else_as_before() -> None:
    base = tiny_model(7)
    plain, scaled = copy.deepcopy(base), copy.deepcopy(base)
    group = make_group(base, "t", [GOOD, BAD, GOOD, BAD], [1.0, 0.0, 1.0, 0.0])
    LearnerCore(plain, LearnerSettings(lr=1e-3)).step([group])
    metrics = LearnerCore(scaled, LearnerSettings(lr=1e-3, final_norm_lr_scale=50.0)).step([group])
    assert metrics["lr"] == pytest.approx(1e-3)  # the reported lr is the base one
    assert metrics["final_norm_gain"] == pytest.approx(float(scaled.model.norm.weight.detach().mean()))
    before = dict(base.named_parameters())
    for (name, p), (_, s) in zip(plain.named_parameters(), scaled.named_parameters(), strict=True):
        moved_plain, moved_scaled = p.detach() - before[name].detach(), s.detach() - before[name].detach()
        if name == "model.norm.weight":
            # Adam's first step is lr * g / (|g| + eps) per coordinate: exactly 50x further with the scale.
            assert moved_plain.abs().max() > 1e-4
            torch.testing.assert_close(moved_scaled, 50.0 * moved_plain, rtol=1e-3, atol=1e-7)
        else:
            torch.testing.assert_close(moved_scaled, moved_plain)


def test_a_final_norm_scale_needs_a_final_norm_and_a_positive_value() -> None:
    with pytest.raises(ValueError, match="final_norm_lr_scale"):
        LearnerSettings(final_norm_lr_scale=0.0)

    class Headless(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(2, 2)

    with pytest.raises(ValueError, match=r"model\.model\.norm\.weight; Headless has none"):
        LearnerCore(Headless(), LearnerSettings(final_norm_lr_scale=2.0))


def test_a_bf16_checkpoint_trains_on_fp32_masters_at_an_rl_learning_rate(tmp_path) -> None:
    from tlt_stream.rl.learner import load_for_training

    tiny_model().to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    saved = {k: v.clone() for k, v in load_for_training(tmp_path / "bf16").state_dict().items()}
    model = load_for_training(tmp_path / "bf16")
    assert {p.dtype for p in model.parameters()} == {torch.float32}, "the master weights are fp32"
    core = LearnerCore(model, LearnerSettings(lr=1e-6))
    for _ in range(2):
        core.step([make_group(model, "t", [GOOD, BAD, GOOD, BAD], [1.0, 0.0, 1.0, 0.0])])
    changed = sum(int((v != saved[k]).sum()) for k, v in model.state_dict().items())
    total = sum(v.numel() for v in saved.values())
    assert changed / total > 0.9, f"only {changed} of {total} weights moved at lr 1e-6"
    assert {o.dtype for s in core.optimizer.state.values() for o in s.values() if o.dim()} == {torch.float32}

    # What the fp32 masters prevent: the same update applied to bf16 weights rounds to nothing.
    naive = tiny_model().to(torch.bfloat16)
    frozen = {k: v.clone() for k, v in naive.state_dict().items()}
    naive_core = LearnerCore(naive, LearnerSettings(lr=1e-6))
    naive_core.step([make_group(naive, "t", [GOOD, BAD, GOOD, BAD], [1.0, 0.0, 1.0, 0.0])])
    changed = sum(int((v != frozen[k]).sum()) for k, v in naive.state_dict().items())
    assert changed / total < 0.1, f"bf16 weights swallow an lr 1e-6 update, yet {changed} of {total} moved"


def test_bf16_compute_runs_the_matmuls_in_bf16_on_fp32_masters_and_matches_fp32_within_bf16_precision() -> None:
    fp32 = tiny_model()
    bf16 = copy.deepcopy(fp32)
    group = make_group(fp32, "t", [GOOD, BAD, GOOD, BAD], [1.0, 0.0, 1.0, 0.0])
    plain = LearnerCore(fp32, LearnerSettings(lr=1e-3, compute_dtype="float32"))
    mixed = LearnerCore(bf16, LearnerSettings(lr=1e-3, compute_dtype="bfloat16"))
    assert plain.compute_dtype == torch.float32 and mixed.compute_dtype == torch.bfloat16
    seen: list[torch.dtype] = []
    hook = bf16.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    a, b = plain.step([group]), mixed.step([group])
    hook.remove()
    assert seen and set(seen) == {torch.bfloat16}, "the forward really ran in bf16"
    assert {p.dtype for p in bf16.parameters()} == {torch.float32}, "masters stay fp32"
    assert {o.dtype for st in mixed.optimizer.state.values() for o in st.values() if o.dim()} == {torch.float32}
    assert b["logprob_mismatch_max"] > a["logprob_mismatch_max"], "bf16 compute is not fp32 compute"
    assert b["logprob_mismatch_max"] < 0.1, "... but within bf16's precision of the rollout's fp32 logprobs"
    moved = [(p2 - p1).abs().max() for p1, p2 in zip(fp32.parameters(), bf16.parameters(), strict=True)]
    assert max(moved) < 1e-3 * 2.5, "the same update to within about one Adam step's size"


def test_auto_compute_is_fp32_on_the_cpu() -> None:
    from tlt_stream.rl.learner import compute_dtype_on

    assert compute_dtype_on("auto", "cpu") == torch.float32
    assert compute_dtype_on("bfloat16", "cpu") == torch.bfloat16
    with pytest.raises(ValueError, match="compute_dtype"):
        LearnerSettings(compute_dtype="float16")


def shifted(group: ReadyGroup, by: float) -> ReadyGroup:
    """The group as a rollout engine whose log-probabilities are off by `by` on every token would report it."""
    samples = [
        s.__class__(
            **{
                **{f: getattr(s, f) for f in s.__struct_fields__},
                "logprobs": Tensor.from_torch(s.logprobs.to_torch() + by),
            }
        )
        for s in group.samples
    ]
    return ReadyGroup(group.task_id, samples, group.entry_ids)


def test_every_update_reports_the_rollout_vs_learner_logprob_mismatch() -> None:
    model = tiny_model()
    same = LearnerCore(copy.deepcopy(model), LearnerSettings(lr=1e-6)).step(
        [make_group(model, "t", [GOOD, BAD, GOOD, BAD], [1.0, 0.0, 1.0, 0.0])]
    )
    assert same["logprob_mismatch_mean"] < 1e-5 and same["logprob_mismatch_max"] < 1e-5
    off = LearnerCore(copy.deepcopy(model), LearnerSettings(lr=1e-6)).step(
        [shifted(make_group(model, "t", [GOOD, BAD, GOOD, BAD], [1.0, 0.0, 1.0, 0.0]), -0.25)]
    )
    assert off["logprob_mismatch_mean"] == pytest.approx(0.25, abs=1e-4)
    assert off["logprob_mismatch_max"] == pytest.approx(0.25, abs=1e-4)


def test_truncated_importance_sampling_weights_tokens_by_the_capped_learner_over_rollout_ratio() -> None:
    model = tiny_model()
    group = make_group(model, "t", [GOOD, BAD, GOOD, BAD], [1.0, 0.0, 1.0, 0.0])
    # The rollout saw every token as e^-1 less likely than the learner does: weight min(e, 2) = 2 everywhere,
    # so the first update is exactly that of lr x 2 without TIS on matching logprobs (Adam is scale-free in
    # the gradient, so compare the loss instead: it doubles).
    plain = LearnerCore(copy.deepcopy(model), LearnerSettings(lr=1e-6)).step([group])
    tis = LearnerCore(copy.deepcopy(model), LearnerSettings(lr=1e-6, tis_cap=2.0)).step([shifted(group, -1.0)])
    assert tis["tis_weight_mean"] == pytest.approx(2.0)
    assert tis["loss"] == pytest.approx(2 * plain["loss"], rel=1e-4)
    uncapped = LearnerCore(copy.deepcopy(model), LearnerSettings(lr=1e-6, tis_cap=10.0)).step([shifted(group, -1.0)])
    assert uncapped["tis_weight_mean"] == pytest.approx(2.718281828, rel=1e-4)


def test_overlong_masking_leaves_cut_off_responses_out_of_the_loss() -> None:
    import msgspec

    model = tiny_model()
    group = make_group(model, "t", [GOOD, BAD, GOOD, BAD], [1.0, 0.0, 1.0, 0.0])
    cut = ReadyGroup(
        group.task_id,
        [msgspec.structs.replace(s, finish_reason="length") if s.index == 0 else s for s in group.samples],
        group.entry_ids,
    )
    kept = LearnerCore(copy.deepcopy(model), LearnerSettings(lr=1e-6)).step([cut])
    masked = LearnerCore(copy.deepcopy(model), LearnerSettings(lr=1e-6, overlong="mask")).step([cut])
    assert kept["truncated"] == masked["truncated"] == 1.0
    assert kept["trained_tokens"] == 16 and masked["trained_tokens"] == 16 - len(GOOD)
