"""The learner on checkpoints of the user's own kind, with transformers as the oracle: the recomputed
log-probabilities at the rollout temperature, one GRPO update against a reference written from the
documented formulas, the checkpoint it writes (a Hugging Face checkpoint of the same family), the KL term
against the initial policy, and what a sample that does not fit the policy is refused with."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import msgspec
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from tests.families import as_rope_scaling, build_family, chat_policy
from tlt_stream.basics.messages import Sample, Tensor
from tlt_stream.rl.batches import micro_batches
from tlt_stream.rl.groups import ReadyGroup
from tlt_stream.rl.learner import LearnerCore, LearnerSettings, LossSums, load_for_training
from tlt_stream.rl.sharded import Trainer
from tlt_stream.rl.validate import sample_problem

T = 0.7
"""The rollout temperature of these tests (not 1, so a missing division shows)."""


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def hf_logprobs(model, prompt: list[int], response: list[int], temperature: float = T) -> torch.Tensor:
    """transformers' log_softmax(logits / T) of each response token: the oracle."""
    ids = torch.tensor([prompt + response])
    logits = model(input_ids=ids).logits[0, :-1].float() / temperature
    logp = torch.log_softmax(logits, -1)
    return logp[len(prompt) - 1 :].gather(1, torch.tensor(response)[:, None])[:, 0]


def sample(task: str, i: int, size: int, prompt: list[int], response: list[int], old, reward: float, finish="eos"):
    return Sample(
        sample_id=f"{task}/{i}",
        task_id=task,
        prompt_id=task,
        index=i,
        group_size=size,
        prompt_ids=prompt,
        token_ids=Tensor.from_values(response, "int32"),
        logprobs=Tensor.from_torch(old.detach().float()),
        policy_version=0,
        drafter_version=-1,
        reward=reward,
        finish_reason=finish,
        worker_id="w",
    )


def random_groups(model, rewards: list[list[float]], *, seed: int = 3, noise: float = 0.0) -> list[ReadyGroup]:
    """Groups of random prompts and responses of varied lengths, their behaviour logprobs transformers' own
    (off by `noise` per token: a stale or mismatched rollout), the first member of each cut at the limit."""
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    groups = []
    for g, group_rewards in enumerate(rewards):
        prompt = torch.randint(0, vocab, (int(torch.randint(1, 6, (1,), generator=gen)),), generator=gen).tolist()
        members = []
        for i, reward in enumerate(group_rewards):
            n = int(torch.randint(1, 10, (1,), generator=gen))
            response = torch.randint(0, vocab, (n,), generator=gen).tolist()
            with torch.no_grad():
                old = hf_logprobs(model, prompt, response) + noise * torch.randn(n, generator=gen)
            old = old.clamp(max=0.0)
            finish = "length" if i == 0 else "eos"
            members.append(sample(f"g{g}", i, len(group_rewards), prompt, response, old, reward, finish))
        groups.append(ReadyGroup(f"g{g}", members, [f"0-{i}" for i in range(len(members))]))
    return groups


# -- 1. the recomputed log-probabilities ------------------------------------------------------------------


CASES = {
    "qwen3-bf16-tied": ("qwen3", {}, torch.bfloat16),
    "llama3-rope": ("llama3", {}, torch.float32),
    "yarn-bf16": ("yarn", {}, torch.bfloat16),
    "mistral-head-dim": ("mistral", {}, torch.float32),
    "qwen2-bias-untied": ("qwen2", {"attention_bias": True}, torch.float32),
    "llama-tied-gqa1": ("llama", {"tie_word_embeddings": True, "num_key_value_heads": 1}, torch.bfloat16),
}


def user_checkpoint(tmp_path: Path, case: str) -> Path:
    family, overrides, dtype = CASES[case]
    out = tmp_path / case
    model = build_family(family, out, **overrides)
    if dtype != torch.float32:
        model.to(dtype).save_pretrained(out)
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_learner_logprobs_are_transformers_log_softmax_at_the_rollout_temperature(tmp_path, case) -> None:
    path = user_checkpoint(tmp_path, case)
    oracle = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    core = LearnerCore(load_for_training(path), LearnerSettings(temperature=T, micro_batch_tokens=24))
    groups = random_groups(oracle, [[1.0, 0.0, 0.5], [0.0, 2.0]])
    plan = core.plan(groups)
    used = list(range(len(plan.samples)))
    seen = 0
    for batch in micro_batches(plan.samples, plan.advantages, used, tokens=24, device=torch.device("cpu")):
        with torch.no_grad():
            mine = core._logprobs(core.model, batch)
        mask = batch["mask"]
        assert torch.allclose(mine[mask], batch["old"][mask], atol=2e-5), case
        seen += int(mask.sum())
    assert seen == sum(s.response_len for s in plan.samples)


# -- 2. one update against a reference written from the documented formulas --------------------------------


def reference_loss(model, groups: list[ReadyGroup], s: LearnerSettings) -> torch.Tensor:
    """GRPO as documented (rl/grpo.py, rl/learner.py): A = (r - mean) / (population std + 1e-6) within a group
    (not divided with scale_advantages off), all-equal groups left out, DAPO's overlong mask, the PPO clip
    [1 - clip_low, 1 + clip_high] against the rollout's logprobs (or, with tis_cap, against the learner's own,
    each token weighted by min(p_learner / p_rollout, tis_cap)), summed over tokens and divided by the step's
    response tokens."""
    terms, tokens = [], 0
    for group in groups:
        rewards = torch.tensor([m.reward for m in group.samples], dtype=torch.float64)
        if rewards.max() == rewards.min():
            continue
        adv = rewards - rewards.mean()
        if s.scale_advantages:
            adv = adv / (rewards.std(unbiased=False) + 1e-6)
        for member, a in zip(group.samples, adv.tolist(), strict=True):
            if s.overlong == "mask" and member.finish_reason == "length":
                continue
            logp = hf_logprobs(model, member.prompt_ids, member.token_ids.to_torch().long().tolist(), s.temperature)
            rollout = member.logprobs.to_torch()
            if s.tis_cap is None:
                ratio, weight = (logp - rollout).exp(), torch.ones_like(logp)
            else:
                ratio, weight = (logp - logp.detach()).exp(), (logp.detach() - rollout).exp().clamp(max=s.tis_cap)
            objective = torch.minimum(ratio * a, ratio.clamp(1 - s.clip_low, 1 + s.clip_high) * a) * weight
            terms.append(-objective.sum())
            tokens += member.response_len
    return torch.stack(terms).sum() / tokens


@pytest.mark.parametrize(
    "changes",
    [{}, {"overlong": "mask"}, {"scale_advantages": False}, {"tis_cap": 1.5}, {"clip_low": 0.05, "clip_high": 0.05}],
    ids=["plain", "overlong-mask", "unscaled", "tis", "tight-clip"],
)
def test_one_update_is_the_documented_grpo_loss_and_gradient(tmp_path, changes) -> None:
    path = user_checkpoint(tmp_path, "qwen3-bf16-tied")
    base = load_for_training(path)
    # The third group is degenerate (all rewards equal): it is left out and counted.
    groups = random_groups(base, [[1.0, 0.0, 0.5, 0.0], [0.0, 1.0], [2.0, 2.0, 2.0], [3.0, -1.0, 0.25, 7.0]], noise=0.3)
    settings = LearnerSettings(lr=1e-3, temperature=T, micro_batch_tokens=16, **changes)
    core = LearnerCore(copy.deepcopy(base), settings)
    plan = core.plan(groups)
    assert plan.figures["degenerate_groups"] == 1.0
    assert all(plan.samples[i].task_id != "g2" for i in plan.used)
    sums = LossSums()
    core.optimizer.zero_grad(set_to_none=True)
    core.backward(plan, sums, total=plan.total)

    oracle = copy.deepcopy(base).train()
    expected = reference_loss(oracle, groups, settings)
    expected.backward()
    assert sums.loss == pytest.approx(float(expected.detach()), rel=1e-5, abs=1e-7)
    for (name, mine), theirs in zip(core.model.named_parameters(), oracle.parameters(), strict=True):
        assert theirs.grad is not None and mine.grad is not None, name
        assert torch.allclose(mine.grad, theirs.grad, atol=5e-6, rtol=1e-4), name


# -- 3. the checkpoint written after an update ---------------------------------------------------------------


def trained_trainer(path: Path, **settings) -> Trainer:
    trainer = Trainer(LearnerSettings(lr=1e-2, temperature=T, **settings), "cpu")
    core = trainer.build(path)
    oracle = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    metrics = core.step(random_groups(oracle, [[1.0, 0.0, 0.5], [0.0, 2.0, 1.0]]))
    assert metrics["updated"] == 1.0
    return trainer


@pytest.mark.parametrize("family", ["qwen3", "llama3"])
def test_a_bf16_chat_checkpoint_comes_back_as_the_same_family_with_its_keys_tokenizer_and_generation_config(
    tmp_path, family
) -> None:
    from tlt_stream.model.loader import load_tokenizer

    user = chat_policy(family, tmp_path / "user", positions=128)
    as_rope_scaling(user)  # RoPE written the way checkpoints from before transformers 5 carry it
    cfg = json.loads((user / "config.json").read_text())
    cfg.update(torch_dtype="bfloat16", my_own_key={"kept": True})
    (user / "config.json").write_text(json.dumps(cfg))
    AutoModelForCausalLM.from_pretrained(user).to(torch.bfloat16).save_pretrained(user)
    assert json.loads((user / "config.json").read_text())["dtype"] == "bfloat16"

    trainer = trained_trainer(user)
    model = trainer.core.model
    assert {p.dtype for p in model.parameters()} == {torch.float32}, "fp32 masters whatever the checkpoint's dtype"
    info = trainer.save(
        tmp_path / "checkpoints",
        step=1,
        ledger={"g0/0"},
        extra={},
        tokenizer=load_tokenizer(user),
        keep=2,
        publish_dtype=torch.bfloat16,
    )
    trainer.wait_for_writes()
    ids = torch.randint(0, model.config.vocab_size, (2, 11))
    with torch.no_grad():
        own = model(input_ids=ids).logits
    theirs = AutoConfig.from_pretrained(user).to_dict()
    for directory, dtype in ((info.policy_dir, torch.bfloat16), (info.master_dir, torch.float32)):
        loaded = AutoModelForCausalLM.from_pretrained(directory).eval()
        assert type(loaded).__name__ == type(model).__name__
        assert loaded.dtype == dtype and json.loads((directory / "config.json").read_text())["dtype"] == str(dtype)[6:]
        state = loaded.state_dict()
        assert all(torch.equal(state[k], v.to(dtype)) for k, v in model.state_dict().items()), directory.name
        with torch.no_grad():
            logits = loaded(input_ids=ids).logits.float()
        if dtype == torch.float32:
            assert torch.equal(logits, own), "the master is the learner's updated weights"
        tied = loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
        assert tied == bool(model.config.tie_word_embeddings)
        written = AutoConfig.from_pretrained(directory).to_dict()
        ignore = {"dtype", "_name_or_path", "transformers_version"}
        assert {k: v for k, v in written.items() if k not in ignore} == {
            k: v for k, v in theirs.items() if k not in ignore
        }, "every key of the user's config means the same (RoPE scaling, eos, tying, their own keys)"
        assert written["my_own_key"] == {"kept": True}
        assert (
            json.loads((directory / "generation_config.json").read_text())["eos_token_id"]
            == json.loads((user / "generation_config.json").read_text())["eos_token_id"]
        )
        mine_tok, user_tok = AutoTokenizer.from_pretrained(directory), AutoTokenizer.from_pretrained(user)
        chat = [{"role": "user", "content": "what is 3 plus 4?"}]
        assert mine_tok.apply_chat_template(chat, add_generation_prompt=True) == user_tok.apply_chat_template(
            chat, add_generation_prompt=True
        )
        assert (mine_tok.eos_token, len(mine_tok)) == (user_tok.eos_token, len(user_tok))


# -- 4. the KL term against the initial policy ------------------------------------------------------------


def test_a_kl_coefficient_trains_against_the_initial_policy_also_after_a_resume(tmp_path) -> None:
    """learner.kl_coef > 0 used to stop the learner at start ("cannot load the policy (kl_coef > 0 needs a
    frozen reference model)"): nothing loaded the reference. It is the initial policy, learner.policy."""
    from tlt_stream.basics.config import DEFAULTS

    user = user_checkpoint(tmp_path, "qwen3-bf16-tied")
    config = msgspec.structs.replace(
        DEFAULTS, learner=msgspec.structs.replace(DEFAULTS.learner, kl_coef=0.5, lr=1e-2, policy=str(user))
    )
    settings = LearnerSettings.from_config(config)
    assert settings.kl_coef == 0.5 and settings.reference == str(user)
    trainer = Trainer(settings, "cpu")
    core = trainer.build(user)
    initial = {k: v.clone() for k, v in core.model.state_dict().items()}
    assert core.reference is not None and core.reference is not core.model
    assert not any(p.requires_grad for p in core.reference.parameters())
    oracle = AutoModelForCausalLM.from_pretrained(user, dtype=torch.float32).eval()
    first = core.step(random_groups(oracle, [[1.0, 0.0, 0.5], [0.0, 2.0, 1.0]]))
    assert first["kl_ref"] == pytest.approx(0.0, abs=1e-9), "the first update starts at the reference"
    second = core.step(random_groups(oracle, [[1.0, 0.0, 0.5], [0.0, 2.0, 1.0]], seed=4))
    assert second["kl_ref"] > 0, "the policy moved away from its reference"
    info = trainer.save(
        tmp_path / "ck", step=2, ledger=set(), extra={}, tokenizer=None, keep=2, publish_dtype=torch.float32
    )
    trainer.wait_for_writes()

    resumed = Trainer(settings, "cpu").build(info.master_dir, step=info.step)
    assert resumed.reference is not None
    ref = resumed.reference.state_dict()
    assert all(torch.equal(ref[k], v) for k, v in initial.items()), "the reference is the initial policy"
    assert any(not torch.equal(resumed.model.state_dict()[k], v) for k, v in initial.items())
    third = resumed.step(random_groups(oracle, [[1.0, 0.0, 0.5], [0.0, 2.0, 1.0]], seed=5))
    assert third["kl_ref"] > 0

    with pytest.raises(ValueError, match=r"initial policy \(learner.policy\)"):
        Trainer(LearnerSettings(kl_coef=0.5), "cpu").build(info.master_dir, step=info.step)


# -- 5. samples that do not fit the user's policy ---------------------------------------------------------


def test_a_sample_outside_the_users_vocabulary_or_context_is_named_in_one_line(tmp_path) -> None:
    user = user_checkpoint(tmp_path, "mistral-head-dim")
    model = load_for_training(user)
    vocab = int(model.get_input_embeddings().weight.shape[0])
    positions = model.config.max_position_embeddings

    def problem(prompt: list[int], response: list[int], reward: float = 1.0) -> str | None:
        s = sample("t", 0, 2, prompt, response, torch.full((len(response),), -1.0), reward)
        return sample_problem(s, vocab_size=vocab, max_positions=positions, newest_version=0)

    assert problem([1, 2], [vocab - 1]) is None, "the last embedded id is inside the vocabulary"
    assert problem([1] * (positions - 3), [2, 3, 4]) is None, "prompt + response may fill the context"
    for bad, words in [
        (problem([1, 2], [3, vocab]), f"token id {vocab}, outside the policy's vocabulary of {vocab}"),
        (problem([vocab + 5, 2], [3]), f"token id {vocab + 5}, outside the policy's vocabulary of {vocab}"),
        (problem([1] * (positions - 2), [2, 3, 4]), f"{positions + 1} tokens, longer than the policy's {positions}"),
        (problem([1, 2], [3], reward=math.nan), "reward nan is not finite"),
    ]:
        assert bad is not None and words in bad and "\n" not in bad
