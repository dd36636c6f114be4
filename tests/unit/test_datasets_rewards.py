"""Dataset loaders (JSONL, Parquet, verl-style) with clear errors, and the rewards."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tlt_stream.rl.datasets import DatasetError, load_examples
from tlt_stream.rl.rewards import last_boxed, math_reward
from tlt_stream.tasks.repeated_add import RepeatedAddTask, reward, step_text


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def test_jsonl_with_custom_fields(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"q": "1+1?", "meta": {"gold": 2}}, {"q": "2+2?", "meta": {"gold": "4"}}])
    examples = load_examples(path, prompt_field="q", answer_field="meta.gold")
    assert [(e.prompt, e.answer) for e in examples] == [("1+1?", "2"), ("2+2?", "4")]
    assert len({e.prompt_id for e in examples}) == 2


def test_verl_style_parquet_with_chat_messages(tmp_path: Path) -> None:
    table = pa.table(
        {
            "prompt": [[{"role": "user", "content": "What is 3*4?"}]],
            "reward_model": [{"style": "rule", "ground_truth": "12"}],
            "data_source": ["toy"],
        }
    )
    path = tmp_path / "train.parquet"
    pq.write_table(table, path)
    (example,) = load_examples(path, answer_field="reward_model.ground_truth")
    assert example.answer == "12"
    assert example.prompt == "user: What is 3*4?\nassistant:"


def test_chat_messages_use_the_tokenizers_chat_template_when_it_has_one(tmp_path: Path) -> None:
    from tlt_stream.tasks.tokenizer import build_tokenizer

    tokenizer = build_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    path = write_jsonl(tmp_path / "chat.jsonl", [{"prompt": [{"role": "user", "content": "2+2?"}], "answer": 4}])
    (example,) = load_examples(path, tokenizer=tokenizer)
    assert example.prompt == "<|user|>2+2?\n<|assistant|>"
    assert example.answer == "4"


@pytest.mark.parametrize(
    ("rows", "kwargs", "message"),
    [
        ([{"prompt": "x", "answer": "1"}, "{broken"], {}, "d.jsonl: row 2: not valid JSON"),
        ([{"prompt": "x"}], {}, "d.jsonl: row 1: missing field 'answer'"),
        ([{"prompt": "x", "answer": ""}], {}, "row 1: field 'answer' must be a non-empty string or number"),
        ([{"prompt": 5, "answer": "1"}], {}, "row 1: field 'prompt': the prompt must be a string or a list"),
        ([{"prompt": "x", "answer": "1"}], {"answer_field": "reward_model.ground_truth"}, "missing field"),
    ],
)
def test_bad_rows_name_file_row_and_field(tmp_path: Path, rows: list, kwargs: dict, message: str) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(DatasetError, match=message):
        load_examples(path, **kwargs)


def test_bad_files(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="does not exist"):
        load_examples(tmp_path / "missing.jsonl")
    (tmp_path / "d.xlsx").write_bytes(b"PK")
    with pytest.raises(DatasetError, match=r"unsupported dataset format '\.xlsx' \(use \.jsonl, .*\.csv, \.tsv"):
        load_examples(tmp_path / "d.xlsx")
    (tmp_path / "bad.parquet").write_bytes(b"not parquet")
    with pytest.raises(DatasetError, match="not a readable Parquet file"):
        load_examples(tmp_path / "bad.parquet")


@pytest.mark.parametrize(
    ("response", "answer", "expected"),
    [
        ("so \\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("\\boxed{\\frac{3}{6}}", "\\frac12", 1.0),
        ("\\boxed{(x+1)^2}", "x^2+2x+1", 1.0),
        ("first \\boxed{2} then \\boxed{3}", "3", 1.0),
        ("\\boxed{3}", "2", 0.0),
        ("no box: 3", "3", 0.0),
        ("\\boxed{}", "3", 0.0),
        ("\\boxed{\\frac{1}{2", "0.5", 0.0),
    ],
)
def test_math_reward(response: str, answer: str, expected: float) -> None:
    assert math_reward(response, answer) == expected


def test_last_boxed_balances_braces() -> None:
    assert last_boxed("\\boxed{\\frac{a}{b}} x") == "\\frac{a}{b}"
    assert last_boxed("nothing") is None


def test_repeated_add_task_is_deterministic_long_tailed_and_exact() -> None:
    task = RepeatedAddTask()
    a, b = task.problems(400, 7, heldout=False), task.problems(400, 7, heldout=False)
    assert [p.prompt for p in a] == [p.prompt for p in b]
    assert [p.prompt for p in task.problems(400, 8, heldout=False)] != [p.prompt for p in a]
    held = task.problems(200, 7, heldout=True)
    assert not {p.prompt for p in held} & {p.prompt for p in a}, "train and held-out never overlap"
    lengths = sorted(len(p.solution) for p in a)
    median, longest = lengths[len(lengths) // 2], lengths[-1]
    assert longest >= 8 * median, (median, longest)
    for problem in a[:50]:
        assert reward(problem.solution, problem.answer) == 1.0
        assert int(problem.answer) == problem.start + problem.increment * problem.steps
        assert problem.solution.count("\n") == problem.steps
    problem = a[0]
    wrong = problem.solution.replace(f"The answer is {problem.answer}.", f"The answer is {int(problem.answer) + 1}.")
    assert reward(wrong, problem.answer) == 0.0
    assert reward("no answer", problem.answer) == 0.0
    assert reward(problem.solution + " The answer is 0.", problem.answer) == 1.0, "the first stated answer counts"


@pytest.mark.parametrize(
    ("total", "term", "text"),
    [
        (17, 8, "7+8=15, carry 1, 1+1=2"),
        (41, 8, "1+8=9"),
        (3, 7, "3+7=10, carry 1"),
        (199, 1, "9+1=10, carry 1, 19+1=20"),
    ],
)
def test_step_text_writes_single_digit_work_with_carries(total: int, term: int, text: str) -> None:
    assert step_text(total, term) == text


def test_repeated_add_worked_solution_is_arithmetically_consistent() -> None:
    problem = RepeatedAddTask().make(start=96, increment=7, steps=3)
    assert problem.prompt == "Q: Start at 96 and add 7, 3 times.\nA:"
    assert problem.solution == (
        " Step 1/3: 96+7: 6+7=13, carry 1, 9+1=10, total 103.\n"
        "Step 2/3: 103+7: 3+7=10, carry 1, 10+1=11, total 110.\n"
        "Step 3/3: 110+7: 0+7=7, total 117.\n"
        "The answer is 117."
    )
    with pytest.raises(ValueError, match="bad problem"):
        RepeatedAddTask().make(start=1, increment=0, steps=2)


@pytest.mark.parametrize("returned", ["1.0", None, float("nan"), float("inf"), [1.0]])
def test_a_reward_that_returns_no_finite_number_fails_like_one_that_raises(returned) -> None:
    """`float` would take "1.0" and pass NaN on to the learner, which then dead-letters members one by one (the
    group trained without them); here it is the reward's failure, which costs the whole group."""
    from tlt_stream.rl.rewards import RewardError, call_reward

    with pytest.raises(RewardError, match="the reward returned"):
        call_reward(lambda response, answer: returned, "x", "y")
    with pytest.raises(RewardError, match="the reward returned"):
        call_reward(lambda response, answer, **fields: returned, "x", "y", {"id": 1})


def test_a_reward_may_return_any_real_number_or_a_bool() -> None:
    import numpy as np
    import torch

    from tlt_stream.rl.rewards import call_reward

    for returned, score in [(1, 1.0), (0.25, 0.25), (np.float32(0.5), 0.5), (torch.tensor(2.0), 2.0), (True, 1.0)]:
        assert call_reward(lambda response, answer, r=returned: r, "x", "y") == score
