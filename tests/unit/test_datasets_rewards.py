"""Dataset loaders (JSONL, Parquet, verl-style) with clear errors, and the rewards."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tlt_stream.rl.datasets import DatasetError, load_examples
from tlt_stream.rl.rewards import last_boxed, math_reward
from tlt_stream.tasks.running_sum import RunningSumTask, reward


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
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(DatasetError, match=r"unsupported dataset format '\.csv'"):
        load_examples(tmp_path / "d.csv")
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


def test_running_sum_task_is_deterministic_long_tailed_and_exact() -> None:
    task = RunningSumTask()
    a, b = task.problems(400, 7, heldout=False), task.problems(400, 7, heldout=False)
    assert [p.prompt for p in a] == [p.prompt for p in b]
    assert [p.prompt for p in task.problems(400, 8, heldout=False)] != [p.prompt for p in a]
    held = task.problems(200, 7, heldout=True)
    assert not {p.prompt for p in held} & {p.prompt for p in a}, "train and held-out never overlap"
    lengths = sorted(len(p.solution) for p in a)
    median, longest = lengths[len(lengths) // 2], lengths[-1]
    assert longest >= 8 * median, (median, longest)
    problem = a[0]
    assert reward(problem.solution, problem.answer) == 1.0
    assert (
        reward(problem.solution.replace(f"The answer is {problem.answer}.", "The answer is 0."), problem.answer) == 0.0
    )
    assert reward("no answer", problem.answer) == 0.0
    assert int(problem.answer) == sum(problem.terms)
