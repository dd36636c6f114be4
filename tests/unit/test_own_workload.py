"""A workload of one's own: datasets visited in epochs, rewards by import path, every EOS id of a checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tlt_stream.basics.config import Config, override
from tlt_stream.model import stop_token_ids
from tlt_stream.rl.datasets import DatasetError, Example, PromptPool, load_examples
from tlt_stream.rl.rewards import RewardError, exact_reward, resolve_reward
from tlt_stream.tasks.tokenizer import build_tokenizer


def examples(n: int, long_every: int = 0) -> list[Example]:
    rows = []
    for i in range(n):
        text = f"{i}+{i}=" if not long_every or i % long_every else "9" * 300
        rows.append(Example(f"p{i}", text, str(2 * i)))
    return rows


def test_a_pool_visits_every_prompt_once_per_epoch_in_an_order_drawn_from_the_seed() -> None:
    tokenizer = build_tokenizer()
    pool = PromptPool(examples(10), tokenizer, seed=3, max_prompt_len=64)
    steps = [pool.prompts(step, 4) for step in range(5)]  # 20 prompts: two whole epochs
    ids = [row[0] for step in steps for row in step]
    assert sorted(ids[:10]) == sorted(ids[10:]) == sorted(f"p{i}" for i in range(10)), "each epoch is a permutation"
    assert ids[:10] != ids[10:], "a new order every epoch"
    again = PromptPool(examples(10), tokenizer, seed=3, max_prompt_len=64)
    assert again.prompts(3, 4) == steps[3], "a pure function of (seed, step): a restarted service continues"
    other = PromptPool(examples(10), tokenizer, seed=4, max_prompt_len=64)
    assert [r[0] for r in other.prompts(0, 10)] != ids[:10]
    prompt_id, text, token_ids, answer = steps[0][0]
    assert token_ids == tokenizer(text, add_special_tokens=False)["input_ids"] and answer == str(2 * int(prompt_id[1:]))


def test_prompts_over_the_limit_are_left_out_and_counted() -> None:
    pool = PromptPool(examples(12, long_every=4), build_tokenizer(), seed=0, max_prompt_len=64)
    assert (len(pool), pool.skipped) == (9, 3)
    assert all(len(ids) <= 64 for _, _, ids, _ in pool.prompts(0, 9))
    with pytest.raises(DatasetError, match=r"all 3 prompts are longer than 8 tokens"):
        PromptPool([Example("a", "9" * 20, "1")] * 3, build_tokenizer(), seed=0, max_prompt_len=8, where="t.jsonl")


def test_the_answer_field_is_found_in_plain_rows_and_in_verl_parquet(tmp_path: Path) -> None:
    plain = tmp_path / "plain.jsonl"
    plain.write_text(json.dumps({"prompt": "1+1=", "answer": 2}) + "\n")
    assert load_examples(plain)[0].answer == "2"
    verl = tmp_path / "verl.parquet"
    rows = [{"prompt": [{"role": "user", "content": "2+2="}], "reward_model": {"ground_truth": "4", "style": "rule"}}]
    pq.write_table(pa.Table.from_pylist(rows), verl)
    assert load_examples(verl)[0].answer == "4"


def test_a_string_prompt_takes_the_chat_template_unless_switched_off(tmp_path: Path) -> None:
    tokenizer = build_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    assert load_examples(path, tokenizer=tokenizer)[0].prompt == "<user>1+1=<assistant>"
    assert load_examples(path, tokenizer=tokenizer, chat_template=False)[0].prompt == "1+1="


def test_rewards_by_name_by_module_and_by_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_reward("exact") is exact_reward and exact_reward(" 4\n", "4") == 1.0
    mine = tmp_path / "my_reward.py"
    mine.write_text("def score(response, answer):\n    return float(len(response) % 2)\n")
    from_file = resolve_reward(f"{mine}:score")
    assert (from_file("ab", "x"), from_file("abc", "x")) == (0.0, 1.0)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert resolve_reward("my_reward:score")("a", "x") == 1.0
    for name, message in [
        ("nope", "unknown reward 'nope'"),
        (f"{tmp_path / 'absent.py'}:f", "does not exist"),
        ("my_reward:missing", "has no function 'missing'"),
        ("no_such_module_here:f", "importing no_such_module_here failed: ModuleNotFoundError"),
    ]:
        with pytest.raises(RewardError, match=message):
            resolve_reward(name)


def test_every_eos_id_of_a_checkpoint_stops_a_response(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 7}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 151643]}))

    class Tokenizer:
        eos_token_id = 151643

    assert stop_token_ids(tmp_path, Tokenizer()) == [7, 151643, 151645]
    (tmp_path / "generation_config.json").write_text("{not json")
    assert stop_token_ids(tmp_path) == [7], "a malformed file counts for nothing"


def test_a_dataset_run_needs_a_tokenizer_and_names_its_limit() -> None:
    from tlt_stream.roles.policy import task_source

    config = override(Config(), {"data.dataset": "/nowhere/train.jsonl"})
    with pytest.raises(ValueError, match=r"data\.dataset needs a tokenizer"):
        task_source(config)


def test_drafter_init_warms_a_drafter_up_on_the_policys_own_responses_and_run_starts_from_it(
    tmp_path: Path, init_policy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    from tlt_stream.commands.cli import main
    from tlt_stream.commands.run.launch import RunPlan, service_config
    from tlt_stream.drafter.model import load_drafter
    from tlt_stream.model import load_model
    from tlt_stream.rollout.arms import Arm
    from tlt_stream.rollout.engine import GenerationEngine
    from tlt_stream.rollout.proposers import EagleProposer

    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i)}) + "\n" for i in range(6)))
    out = tmp_path / "drafter"
    code = main(["drafter", "init", "--policy", str(init_policy), "--dataset", str(train), "--out", str(out),
                 "--samples", "4", "--steps", "3", "--max-len", "48", "--threads", "1"])  # fmt: skip
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["prompts"] == 4 and report["response_tokens"] > 0 and "loss" in report
    policy = load_model(init_policy)
    drafter = load_drafter(out, policy)
    prompt = build_tokenizer()("3+4=", add_special_tokens=False)["input_ids"]
    plain = GenerationEngine(policy, 1, 48).generate([prompt], max_new_tokens=20, temperature=0.0)
    sd = GenerationEngine(policy, 1, 48, proposer=EagleProposer(drafter), arm=Arm.drafter(3, 1, 3))
    assert sd.generate([prompt], max_new_tokens=20, temperature=0.0)[0].token_ids == plain[0].token_ids
    assert torch.is_tensor(drafter.fc.weight)

    config = override(Config(), {"launch.policy": str(init_policy), "launch.drafter": str(out)})
    plan = RunPlan(world=tmp_path / "no-world", run_dir=tmp_path / "run", config=config)
    served = service_config(plan, config)
    assert plan.sd == "eagle" and served.sd.drafter == str(out)
    assert served.drafter.state_dir == str(tmp_path / "run" / "drafter-states"), "and trains it online"


def test_a_reward_gets_the_rows_other_fields_it_asks_for(tmp_path: Path) -> None:
    from tlt_stream.rl.rewards import call_reward

    row = {"prompt": "1+1=", "answer": "2", "difficulty": 3, "meta": {"src": "x"}}
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(row) + "\n")
    (example,) = load_examples(path)
    assert example.fields == {"difficulty": 3, "meta": {"src": "x"}}, "all but the prompt and the answer"
    pool = PromptPool([example], build_tokenizer(), seed=0, max_prompt_len=64)
    assert pool.fields[example.prompt_id] == example.fields

    def named(response: str, answer: str, difficulty: int) -> float:
        return float(difficulty)

    def everything(response: str, answer: str, **row: object) -> float:
        return float(len(row))

    assert call_reward(named, "r", "2", example.fields) == 3.0, "the fields it names"
    assert call_reward(everything, "r", "2", example.fields) == 2.0, "all of them to **kwargs"
    assert call_reward(exact_reward, "2", "2", example.fields) == 1.0, "none to a reward that takes two"


def test_the_tiny_world_can_revisit_a_fixed_pool_in_epochs() -> None:
    from tlt_stream.basics.config import DEFAULTS, override
    from tlt_stream.rl.datasets import PromptPool
    from tlt_stream.roles.policy import RepeatedAddSource, task_source

    assert isinstance(task_source(DEFAULTS), RepeatedAddSource), "fresh problems every step by default"
    pool = task_source(override(DEFAULTS, {"data.pool_size": 12, "policy.seed": 3}))
    assert isinstance(pool, PromptPool) and len(pool) == 12
    epochs = [[row[0] for step in range(e * 3, e * 3 + 3) for row in pool.prompts(step, 4)] for e in range(3)]
    assert all(sorted(e) == sorted(epochs[0]) for e in epochs), "every epoch is the same 12 problems"
    assert epochs[0] != epochs[1], "in another order"
    again = task_source(override(DEFAULTS, {"data.pool_size": 12, "policy.seed": 3}))
    assert [r[0] for r in again.prompts(7, 4)] == [r[0] for r in pool.prompts(7, 4)], "a pure function of seed, step"
    other = task_source(override(DEFAULTS, {"data.pool_size": 12, "policy.seed": 4}))
    assert sorted(r[0] for s in range(3) for r in other.prompts(s, 4)) != sorted(epochs[0])
