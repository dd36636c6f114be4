"""Real datasets: JSONL and Parquet rows with a prompt and a reference answer, verl-style parquet included.

A row becomes an `Example(prompt_id, prompt_text, answer)`. Field names are configurable (dotted paths
reach into nested records, e.g. `reward_model.ground_truth`). A prompt may be a string or a list of chat
messages (`[{"role": ..., "content": ...}]`, as in verl's parquet files); messages are rendered with the
tokenizer's chat template when it has one, else as "role: content" lines. A bad row stops loading with
one line naming the file, the row and the field.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tlt_stream.common import stable_hex

__all__ = ["DatasetError", "Example", "load_examples"]


class DatasetError(Exception):
    """A dataset file or row is unusable; the message names the file, row and field."""


@dataclass(frozen=True)
class Example:
    prompt_id: str
    prompt: str
    answer: str


def _rows(path: Path) -> Iterator[tuple[int, Any]]:
    if path.suffix == ".jsonl":
        try:
            lines = path.read_text().splitlines()
        except OSError as exc:
            raise DatasetError(f"{path}: cannot read ({exc.strerror or exc})") from None
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                yield number, json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{path}: row {number}: not valid JSON ({exc.msg})") from None
    elif path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DatasetError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow)") from None
        try:
            table = pq.read_table(path)
        except Exception as exc:  # pyarrow raises several types for a bad file
            raise DatasetError(f"{path}: not a readable Parquet file ({exc})") from None
        for number, row in enumerate(table.to_pylist(), start=1):
            yield number, row
    else:
        raise DatasetError(f"{path}: unsupported dataset format {path.suffix!r} (use .jsonl or .parquet)")


def _field(row: Any, dotted: str) -> Any:
    node = row
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            raise KeyError(dotted)
        node = node[part]
    return node


def _render(prompt: Any, tokenizer: Any, where: str) -> str:
    if isinstance(prompt, str):
        if not prompt.strip():
            raise DatasetError(f"{where}: the prompt is empty")
        return prompt
    if (
        isinstance(prompt, list)
        and prompt
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in prompt
        )
    ):
        if tokenizer is not None and getattr(tokenizer, "chat_template", None):
            return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        return "\n".join(f"{m['role']}: {m['content']}" for m in prompt) + "\nassistant:"
    raise DatasetError(f"{where}: the prompt must be a string or a list of {{role, content}} messages")


def load_examples(
    path: str | Path,
    *,
    prompt_field: str = "prompt",
    answer_field: str = "answer",
    tokenizer: Any = None,
) -> list[Example]:
    """Every row of a JSONL or Parquet file as an `Example`. For verl-style parquet use
    `answer_field="reward_model.ground_truth"`."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"{path}: dataset file does not exist")
    examples = []
    for number, row in _rows(path):
        where = f"{path}: row {number}"
        if not isinstance(row, dict):
            raise DatasetError(f"{where}: expected an object")
        try:
            prompt = _field(row, prompt_field)
        except KeyError:
            raise DatasetError(f"{where}: missing field {prompt_field!r}") from None
        try:
            answer = _field(row, answer_field)
        except KeyError:
            raise DatasetError(f"{where}: missing field {answer_field!r}") from None
        if isinstance(answer, int | float) and not isinstance(answer, bool):
            answer = str(answer)
        if not isinstance(answer, str) or not answer.strip():
            raise DatasetError(f"{where}: field {answer_field!r} must be a non-empty string or number")
        text = _render(prompt, tokenizer, f"{where}: field {prompt_field!r}")
        prompt_id = stable_hex(f"{text}\x00{answer}", 16)
        examples.append(Example(prompt_id, text, answer))
    if not examples:
        raise DatasetError(f"{path}: no rows")
    return examples
