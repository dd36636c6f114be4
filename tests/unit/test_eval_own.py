"""`tlt-stream eval` on a policy of one's own: held-out prompts of one's own dataset scored with one's own reward
(transformers' greedy decoding is the oracle), and a policy that is not a tiny-world one refused without them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.families import chat_policy
from tlt_stream.commands.cli import main

PROMPTS = ["what is 3 plus 4?", "what is 12 plus 5?", "Question: what is 20 plus 1?", "what is 7 plus 7?"]
REWARD = "def parity(response, answer, difficulty):\n    return float((len(response) + difficulty) % 2 == 0)\n"
MAX_LEN = 48


@pytest.fixture(scope="module")
def own(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return chat_policy("qwen3", tmp_path_factory.mktemp("own") / "policy", positions=256)


def test_a_policy_of_ones_own_is_not_scored_on_the_tiny_task(own: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """It was: the character tokenizer's prompts, which the policy cannot read, and exit code 0."""
    assert main(["eval", "--model", str(own), "--n", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tlt-stream eval: ") and "\n" not in err
    assert "not a tiny-world policy" in err and "--dataset FILE" in err


def test_eval_scores_ones_own_held_out_prompts_with_ones_own_reward_as_transformers_decodes_them(
    own: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    data = tmp_path / "held_out.json"  # a JSON array, a field the reward asks for beside the answer
    data.write_text(json.dumps([{"prompt": p, "answer": "x", "difficulty": i} for i, p in enumerate(PROMPTS)]))
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD)
    argv = ["eval", "--model", str(own), "--dataset", str(data), "--reward", f"{reward}:parity", "--n", "4",
            "--temperature", "0", "--json", "--set", "data.chat_template=false",
            "--set", f"rollout.max_len={MAX_LEN}"]  # fmt: skip
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)

    tokenizer = AutoTokenizer.from_pretrained(own)
    model = AutoModelForCausalLM.from_pretrained(own, dtype=torch.float32)
    rewards, lengths, cut = [], [], 0
    for i, prompt in enumerate(PROMPTS):
        ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
        budget = MAX_LEN - ids.shape[1]
        out = model.generate(ids, max_new_tokens=budget, do_sample=False)[0, ids.shape[1] :].tolist()
        response = tokenizer.decode(out, skip_special_tokens=True)
        rewards.append(float((len(response) + i) % 2 == 0))
        lengths.append(len(out))
        cut += len(out) == budget and out[-1] not in model.generation_config.eos_token_id
    assert report["prompts"] == 4 and report["dataset"] == str(data)
    assert report["accuracy"] == sum(r >= 1 for r in rewards) / 4
    assert report["mean_reward"] == pytest.approx(sum(rewards) / 4)
    assert report["length_mean"] == pytest.approx(sum(lengths) / 4)
    assert report["truncated"] == pytest.approx(cut / 4)
    assert 0 < sum(rewards) < 4, "a reward that tells responses apart"


def test_ones_own_dataset_scored_with_the_tiny_tasks_reward_is_warned_of(
    own: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The default reward reads the tiny task's `answer: N` lines: on another dataset it scores ~0 silently."""
    data = tmp_path / "held_out.jsonl"
    data.write_text(json.dumps({"prompt": PROMPTS[0], "answer": "7"}) + "\n")
    argv = ["eval", "--model", str(own), "--dataset", str(data), "--n", "1", "--set", f"rollout.max_len={MAX_LEN}"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "warning: the reward is repeated_add (the tiny task's, the default) on a dataset of your own" in err
    assert main([*argv, "--reward", "exact"]) == 0
    assert "warning" not in capsys.readouterr().err
