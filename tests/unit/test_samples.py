"""What a worker streams per finished generation: the scored Sample and a hidden window a drafter can train on."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tlt_stream.basics.messages import PromptGroup, codec_for
from tlt_stream.drafter.train import Window
from tlt_stream.model import load_model
from tlt_stream.rl.samples import hidden_window, make_sample
from tlt_stream.rollout.arms import Arm
from tlt_stream.rollout.engine import GenerationEngine
from tlt_stream.rollout.proposers import NgramProposer


@pytest.fixture
def model(init_policy: Path):
    return load_model(init_policy)


def group(prompt: list[int], size: int = 2) -> PromptGroup:
    return PromptGroup(task_id="s000003-0001", prompt_id="p1", prompt_ids=prompt, answer="7", group_size=size, step=3)


@pytest.mark.parametrize("sd", [False, True])
def test_the_window_holds_the_states_a_full_forward_pass_computes(model, sd: bool) -> None:
    """Every row is the policy's state at that position, whether the tokens came from plain or SD steps."""
    prompts = [[5, 9, 12, 7, 30], [8, 3]]
    engine = GenerationEngine(
        model, 2, 64, proposer=NgramProposer() if sd else None, arm=Arm.drafter(3, 1, 3) if sd else None
    )
    results = engine.generate(prompts, 20, temperature=1.0, seed=3, return_hidden=True)
    for result in results:
        window = hidden_window(result, "t/0", 4, dtype="float32")
        sequence = result.prompt_ids + result.token_ids
        assert window.token_ids == sequence[:-1] and window.prompt_len == len(result.prompt_ids)
        cache = model.new_cache(1, len(sequence))
        with torch.inference_mode():
            full = model(torch.tensor([sequence]), torch.arange(len(sequence))[None], cache)[0]  # [L, H]
        torch.testing.assert_close(window.hidden.to_torch(), full[: len(sequence) - 1], atol=2e-4, rtol=1e-3)
        # It is exactly the drafter trainer's window format, and it survives the wire.
        decoded = codec_for("hidden").decode(codec_for("hidden").encode(window))
        Window(torch.tensor(decoded.token_ids), decoded.hidden.to_torch(), decoded.prompt_len)
        assert decoded.policy_version == 4 and decoded.sample_id == "t/0"


def test_bfloat16_windows_halve_the_bytes_and_keep_the_values_close(model) -> None:
    engine = GenerationEngine(model, 1, 64)
    (result,) = engine.generate([[5, 9, 12]], 10, temperature=1.0, seed=1, return_hidden=True)
    wide = hidden_window(result, "t/0", 0, dtype="float32")
    narrow = hidden_window(result, "t/0", 0)
    assert narrow.hidden.dtype == "bfloat16" and len(narrow.hidden.data) * 2 == len(wide.hidden.data)
    torch.testing.assert_close(narrow.hidden.to_torch().float(), wide.hidden.to_torch(), atol=0.05, rtol=0.02)


def test_a_generation_without_hidden_states_has_no_window(model) -> None:
    (result,) = GenerationEngine(model, 1, 64).generate([[5, 9]], 4, temperature=1.0, seed=1)
    with pytest.raises(ValueError, match="return_hidden"):
        hidden_window(result, "t/0", 0)


def test_the_sample_carries_the_group_the_versions_and_tokens_per_forward(model) -> None:
    engine = GenerationEngine(model, 1, 64, proposer=NgramProposer(), arm=Arm.drafter(3, 1, 3))
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    (result,) = engine.generate([prompt], 24, temperature=0.0)
    sample = make_sample(
        result,
        group(prompt),
        1,
        reward=1.0,
        policy_version=2,
        drafter_version=-1,
        worker_id="w0",
        gen_seconds=0.5,
    )
    assert sample.sample_id == "s000003-0001/1" and sample.task_id == "s000003-0001" and sample.step == 3
    assert sample.token_ids.to_torch().tolist() == result.token_ids
    assert sample.logprobs.to_torch().tolist() == pytest.approx(result.logprobs)
    assert (sample.policy_version, sample.drafter_version, sample.reward) == (2, -1, 1.0)
    accepts = result.accept_lengths
    forwards = len(accepts) + len(result.token_ids) - sum(accepts)
    assert sample.accept_length == pytest.approx(len(result.token_ids) / forwards)
    assert sample.accept_length >= 1.0


def test_hidden_share_picks_a_stable_uniform_subset_apart_from_the_held_out_split() -> None:
    from tlt_stream.basics.config import DEFAULTS, ConfigError, override
    from tlt_stream.roles.drafter_trainer import _held_out
    from tlt_stream.roles.worker.tasks import streams_hidden

    ids = [f"s{step:06d}-{p:04d}/{g}" for step in range(50) for p in range(16) for g in range(8)]
    chosen = [i for i in ids if streams_hidden(i, 0.25)]
    assert abs(len(chosen) / len(ids) - 0.25) < 0.02
    assert chosen == [i for i in ids if streams_hidden(i, 0.25)], "stable"
    assert all(streams_hidden(i, 1.0) for i in ids[:100]), "share 1: every sample"
    # The trainer holds back ~10% of the windows it receives by another hash: still ~10% of the chosen ones.
    held = sum(_held_out(i, 10) for i in chosen) / len(chosen)
    assert 0.07 < held < 0.13
    for bad in (0.0, -0.5, 1.5):
        with pytest.raises(ConfigError, match=r"rollout\.hidden_share"):
            override(DEFAULTS, {"rollout.hidden_share": bad})
