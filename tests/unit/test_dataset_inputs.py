"""Dataset and `tlt-stream generate` inputs at their edges: how JSONL lines are split and decoded, numeric
answers, rows that repeat one another, prompts the context has no room for, and an unusable `--output`."""

from __future__ import annotations

import json
from decimal import Decimal
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tlt_stream.commands.cli import main
from tlt_stream.commands.generate import InputError, read_prompts
from tlt_stream.rl.datasets import DatasetError, PromptPool, load_examples, pool_from_config
from tlt_stream.rl.rewards import call_reward
from tlt_stream.tasks.tokenizer import build_tokenizer

# Raw separators a JSON string may hold (json.dumps(..., ensure_ascii=False) writes them as they are).
SEPARATORS = "a\u2028b\u0085c\u2029d\x1ce"


def write_bytes(path: Path, rows: list[dict], *, newline: str = "\n", bom: bool = False) -> Path:
    text = newline.join(json.dumps(r, ensure_ascii=False) for r in rows) + newline
    path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + text.encode())
    return path


@pytest.mark.parametrize(("newline", "bom"), [("\n", False), ("\r\n", False), ("\n", True), ("\r\n", True)])
def test_jsonl_rows_split_at_newlines_only(tmp_path: Path, newline: str, bom: bool) -> None:
    rows = [{"prompt": f"Q: {SEPARATORS}?", "answer": "1"}, {"prompt": "Q: 2?", "answer": "2"}]
    path = write_bytes(tmp_path / "d.jsonl", rows, newline=newline, bom=bom)
    examples = load_examples(path)
    assert [(e.prompt, e.answer) for e in examples] == [(f"Q: {SEPARATORS}?", "1"), ("Q: 2?", "2")]

    tokenizer_dir = tmp_path / "tokenizer"
    build_tokenizer().save_pretrained(tokenizer_dir)
    rows = [{"prompt_ids": [5, 6]}, {"prompt": f"x{SEPARATORS}"}]
    prompts = read_prompts(write_bytes(tmp_path / "in.jsonl", rows, newline=newline, bom=bom), tokenizer_dir, 100)
    assert len(prompts) == 2 and prompts[0] == [5, 6] and len(prompts[1]) == len(f"x{SEPARATORS}")


def test_a_file_that_is_not_utf8_is_named_in_one_line(tmp_path: Path) -> None:
    data = b'{"prompt": "ok", "answer": "1"}\n{"prompt": "caf\xe9", "answer": "2"}\n'
    (tmp_path / "d.jsonl").write_bytes(data)
    with pytest.raises(DatasetError, match=r"d\.jsonl: row 2: not UTF-8 text"):
        load_examples(tmp_path / "d.jsonl")
    (tmp_path / "in.jsonl").write_bytes(data.replace(b'"answer": "1"', b'"x": 1'))
    with pytest.raises(InputError, match=r"in\.jsonl:2: not UTF-8 text"):
        read_prompts(tmp_path / "in.jsonl", tmp_path, 100)


def test_numeric_answers_are_written_as_an_exact_reward_expects(tmp_path: Path) -> None:
    rows = [{"prompt": "a", "answer": 67.0}, {"prompt": "b", "answer": 0.5}, {"prompt": "c", "answer": 7}]
    path = write_bytes(tmp_path / "d.jsonl", rows)
    assert [e.answer for e in load_examples(path)] == ["67", "0.5", "7"]
    table = pa.table(
        {"prompt": ["a", "b"], "answer": pa.array([Decimal("67.00"), Decimal("0.50")], pa.decimal128(5, 2))}
    )
    pq.write_table(table, tmp_path / "d.parquet")
    assert [e.answer for e in load_examples(tmp_path / "d.parquet")] == ["67", "0.5"]


@pytest.mark.parametrize(("literal", "shown"), [("NaN", "nan"), ("Infinity", "inf"), ("-Infinity", "-inf")])
def test_a_non_finite_answer_is_refused(tmp_path: Path, literal: str, shown: str) -> None:
    (tmp_path / "d.jsonl").write_text(f'{{"prompt": "a", "answer": 1}}\n{{"prompt": "b", "answer": {literal}}}\n')
    with pytest.raises(DatasetError, match=rf"d\.jsonl: row 2: field 'answer' is {shown}: .* finite number"):
        load_examples(tmp_path / "d.jsonl")


def test_repeated_rows_keep_their_own_fields(tmp_path: Path) -> None:
    row = {"prompt": "Q: Start at 63 and add 2, 2 times.\nA:", "answer": "67"}
    path = write_bytes(tmp_path / "d.jsonl", [{**row, "id": i} for i in range(4)])
    pool = PromptPool(load_examples(path), build_tokenizer(), seed=0, max_prompt_len=64)

    def reward(response: str, answer: str, id: int) -> float:
        return float(id)

    seen = [call_reward(reward, "67", answer, pool.fields.get(pid)) for pid, _, _, answer in pool.rows]
    assert seen == [0.0, 1.0, 2.0, 3.0]
    assert [e.prompt_id for e in load_examples(path)] == [r[0] for r in pool.rows]  # the same on every load
    single = write_bytes(tmp_path / "one.jsonl", [{**row, "id": 0}])
    assert load_examples(single)[0].prompt_id == pool.rows[0][0]  # a row met once keeps its id


@pytest.mark.parametrize("where", ["argument", "rollout.max_len"])
def test_the_prompt_limit_leaves_room_for_a_response(tmp_path: Path, where: str) -> None:
    from tlt_stream.basics.config import Config, override

    rows = [{"prompt": "x" * 15, "answer": "1"}, {"prompt": "y" * 16, "answer": "2"}, {"prompt": "z", "answer": "3"}]
    path = write_bytes(tmp_path / "d.jsonl", rows)
    values = {"data.max_prompt_len": 1000} | ({"rollout.max_len": 16} if where == "rollout.max_len" else {})
    config = override(Config(), values)
    max_len = 16 if where == "argument" else None
    pool = pool_from_config(str(path), config, build_tokenizer(), seed=0, max_len=max_len)
    assert pool.max_prompt_len == 15 and pool.skipped == 1
    assert sorted(len(ids) for _, _, ids, _ in pool.rows) == [1, 15]


def checkpoint(path: Path, *, positions: int, weights: bool) -> Path:
    """A tiny Qwen2 checkpoint of `positions` positions with no EOS id (responses run to their budget); with
    `weights` False only its config.json, which is all a refusal before the model loads may read."""
    from transformers import Qwen2Config

    config = Qwen2Config(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=64,
        max_position_embeddings=positions,
        eos_token_id=None,
        bos_token_id=None,
        architectures=["Qwen2ForCausalLM"],
    )
    if weights:
        import torch
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(path, safe_serialization=True)
    else:
        config.save_pretrained(path)
    return path


def generate(tmp_path: Path, model: Path, rows: list[dict], output: Path, max_new: int = 12) -> int:
    source = write_bytes(tmp_path / "in.jsonl", rows)
    argv = ["generate", "--model", str(model), "--input", str(source), "--output", str(output)]
    return main([*argv, "--max-new-tokens", str(max_new), "--batch-size", "2"])


def test_generate_refuses_a_prompt_the_context_has_no_room_for(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = checkpoint(tmp_path / "ckpt", positions=16, weights=False)
    rows = [{"prompt_ids": [5] * 4}, {"prompt_ids": [6] * 16}]
    assert generate(tmp_path, model, rows, tmp_path / "out.jsonl") == 2
    err = capsys.readouterr().err
    assert "in.jsonl:2: the prompt is 16 tokens and the model's context 16" in err and "Traceback" not in err
    assert not (tmp_path / "out.jsonl").exists()


def test_generate_cuts_responses_at_the_context(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = checkpoint(tmp_path / "ckpt", positions=16, weights=True)
    assert generate(tmp_path, model, [{"prompt_ids": [5] * 10}, {"prompt_ids": [6, 7]}], tmp_path / "o.jsonl") == 0
    err = capsys.readouterr().err
    assert "warning: 1 of 2 prompts + --max-new-tokens 12 pass the model's context 16" in err
    out = [json.loads(line) for line in (tmp_path / "o.jsonl").read_text().splitlines()]
    assert [(len(r["token_ids"]), r["finish_reason"]) for r in out] == [(6, "length"), (12, "length")]


def test_generate_refuses_an_output_directory_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = checkpoint(tmp_path / "ckpt", positions=64, weights=False)
    (tmp_path / "out").mkdir()
    assert generate(tmp_path, model, [{"prompt_ids": [5, 6]}], tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert f"--output {tmp_path / 'out'}: is a directory" in err and "Traceback" not in err
