"""`tlt-stream generate` end to end: JSONL in, JSONL out in input order, SD output equal to plain."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from tlt_stream.drafter.model import Drafter, save_drafter
from tlt_stream.model import load_model
from tlt_stream.tasks.tokenizer import build_tokenizer

# One xdist worker runs this module, so its module-scoped fixtures are built once.
pytestmark = pytest.mark.xdist_group("test_generate_cli")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tokenizer = build_tokenizer()
    config = Qwen2Config(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=len(tokenizer),
        initializer_range=0.3,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("ckpt")
    AutoModelForCausalLM.from_config(config).save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    torch.manual_seed(1)
    save_drafter(Drafter(load_model(path).spec), path / "drafter")
    return path


def generate(checkpoint: Path, tmp_path: Path, rows: list, *extra: str) -> subprocess.CompletedProcess[str]:
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "tlt_stream.commands.cli",
            "generate",
            "--model",
            str(checkpoint),
            "--input",
            str(source),
            "--output",
            str(tmp_path / "out.jsonl"),
            "--max-new-tokens",
            "12",
            "--batch-size",
            "2",
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def outputs(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]


ROWS = [{"prompt_ids": [5, 6, 7, 8]}, {"prompt": "Q: 1+2=?\nA:"}, {"prompt_ids": [9]}, {"prompt": "abcabcabc"}]


def test_plain_and_speculative_outputs_agree_in_input_order(checkpoint: Path, tmp_path: Path) -> None:
    plain = generate(checkpoint, tmp_path, ROWS)
    assert plain.returncode == 0, plain.stderr
    reference = outputs(tmp_path)
    assert len(reference) == 4
    for row in reference:
        assert set(row) == {"token_ids", "logprobs", "finish_reason", "accept_lengths"}
        assert len(row["token_ids"]) == len(row["logprobs"]) and row["finish_reason"] in ("eos", "length")
        assert row["accept_lengths"] == []
    for drafter in (str(checkpoint / "drafter"), "ngram"):
        result = generate(checkpoint, tmp_path, ROWS, "--drafter", drafter, "--depth", "3", "--topk", "2")
        assert result.returncode == 0, result.stderr
        speculative = outputs(tmp_path)
        assert [r["token_ids"] for r in speculative] == [r["token_ids"] for r in reference]
        assert all(sum(r["accept_lengths"]) == len(r["token_ids"]) - 1 for r in speculative)
        summary = json.loads(result.stderr.strip().splitlines()[-1])
        assert summary["sd"] == "d3k2v6" and summary["tokens"] == sum(len(r["token_ids"]) for r in reference)


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([{"prompt_ids": [1]}, "{not json"], "in.jsonl:2: not valid JSON"),
        ([{"prompt_ids": [1]}, {"prompt_ids": [1, 100000]}], "in.jsonl:2: token id 100000 is outside the vocabulary"),
        ([{"text": "x"}], "in.jsonl:1: expected 'prompt_ids' or 'prompt', got keys ['text']"),
        ([{"prompt_ids": []}], "in.jsonl:1: 'prompt_ids' must be a non-empty list of integers"),
    ],
)
def test_a_bad_row_is_named(checkpoint: Path, tmp_path: Path, rows: list, message: str) -> None:
    result = generate(checkpoint, tmp_path, rows)
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr


def test_a_missing_checkpoint_is_one_line(tmp_path: Path) -> None:
    result = generate(tmp_path / "nope", tmp_path, [{"prompt_ids": [1]}])
    assert result.returncode == 2 and "checkpoint directory does not exist" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_text_prompt_the_models_vocabulary_cannot_hold_is_named_with_its_line(
    checkpoint: Path, tmp_path: Path
) -> None:
    """A checkpoint whose tokenizer is not its model's (ids past the embedding): the line was a request
    number and an id range, naming neither the file nor the tokenizer."""
    import shutil

    from tests.families import chat_tokenizer

    other = tmp_path / "other"
    shutil.copytree(checkpoint, other)
    chat_tokenizer(["<|endoftext|>"], "<|endoftext|>", "").save_pretrained(other)  # ~300 tokens
    result = generate(other, tmp_path, [{"prompt_ids": [1]}, {"prompt": "Question: what is 39 plus 6?"}])
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "in.jsonl:2: the prompt tokenises to id" in result.stderr and "is not the model's" in result.stderr
