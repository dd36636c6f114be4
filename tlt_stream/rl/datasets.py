"""Real datasets: rows of a JSONL, JSON, CSV, TSV or Parquet file (`dataset_files`) with a prompt and a
reference answer, verl-style parquet included.

A row becomes an `Example(prompt_id, prompt_text, answer)`. Field names are configurable (dotted paths
reach into nested records, e.g. `reward_model.ground_truth`, or name a flat column written with a dot, as
a CSV header may). A prompt may be a string or a list of chat messages (`[{"role": ..., "content": ...}]`,
as in verl's parquet files); messages are rendered with the tokenizer's chat template when it has one, else
as "role: content" lines. A bad row stops loading with one line naming the file, the row and the field.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

from tlt_stream.basics.common import stable_hex
from tlt_stream.rl.dataset_files import FORMATS, DatasetError, jsonl_lines, read_rows

__all__ = [
    "ANSWER_FIELDS",
    "DatasetError",
    "Example",
    "PromptPool",
    "jsonl_lines",
    "load_examples",
    "pool_from_config",
]

ANSWER_FIELDS = ("answer", "reward_model.ground_truth")
"""Where a row's reference answer is looked for when no field is named: a plain row's, then verl's."""


@dataclass(frozen=True)
class Example:
    prompt_id: str
    prompt: str
    answer: str
    fields: dict[str, Any] = field(default_factory=dict)
    """The row's other top-level fields, handed to a reward that asks for them by name."""


def _field(row: Any, dotted: str) -> Any:
    if isinstance(row, dict) and dotted in row:  # a flat column named with a dot, as a CSV header may write it
        return row[dotted]
    node = row
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            raise KeyError(dotted)
        node = node[part]
    return node


def _has(row: Any, dotted: str) -> bool:
    try:
        _field(row, dotted)
    except KeyError:
        return False
    return True


def _fields_hint(row: dict, role: str) -> str:
    """What the first row holds and the setting that names its `role` ("prompt" or "answer") field: a first
    row without the field is most often a file whose column is named otherwise (a CSV's `question`)."""
    names = [str(name) for name in row]
    shown = ", ".join(names[:12]) + (f", ... ({len(names)} in all)" if len(names) > 12 else "")
    return f" (the row's fields: {shown or 'none'}; set data.{role}_field to the one that holds the {role})"


def _render(
    prompt: Any, tokenizer: Any, where: str, chat_template: bool = True, enable_thinking: bool | None = None
) -> str:
    templated = chat_template and tokenizer is not None and getattr(tokenizer, "chat_template", None)
    extra = {} if enable_thinking is None else {"enable_thinking": enable_thinking}  # Qwen3's switch
    if isinstance(prompt, str):
        if not prompt.strip():
            raise DatasetError(f"{where}: the prompt is empty")
        if templated:
            return _templated(tokenizer, [{"role": "user", "content": prompt}], where, extra)
        return prompt
    if (
        isinstance(prompt, list)
        and prompt
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in prompt
        )
    ):
        if templated:
            return _templated(tokenizer, prompt, where, extra)
        return "\n".join(f"{m['role']}: {m['content']}" for m in prompt) + "\nassistant:"
    raise DatasetError(f"{where}: the prompt must be a string or a list of {{role, content}} messages")


def _templated(tokenizer: Any, messages: list[dict[str, str]], where: str, extra: dict[str, Any]) -> str:
    """The messages rendered by the tokenizer's chat template; a template that refuses them (some raise on a
    role they do not take, as Mistral's on a system turn) is the row's error, in one line."""
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra)
    except Exception as exc:  # jinja2's TemplateError and whatever the template itself raises
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DatasetError(f"{where}: the tokenizer's chat template refused the prompt ({reason})") from None


def _number_text(value: numbers.Real | Decimal, where: str) -> str:
    """A numeric reference answer as text: a whole number as an integer ("67", not "67.0", which an exact
    reward would never match; 1.5e25 as the 26 digits written, not a float's binary expansion), another as its
    shortest form in positional notation ("0.0000001", not "1e-07"); NaN and infinities (a null of a float
    column) are refused."""
    finite = value.is_finite() if isinstance(value, Decimal) else math.isfinite(value)
    if not finite:
        raise DatasetError(f"{where} is {value}: a reference answer must be a finite number")
    if isinstance(value, numbers.Integral):
        return str(int(value))
    if not isinstance(value, Decimal):  # the float as written (its shortest form): 1.5e25 is not 1500...285212672
        value = Decimal(str(float(value)))
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


def load_examples(
    path: str | Path,
    *,
    prompt_field: str = "prompt",
    answer_field: str | None = None,
    tokenizer: Any = None,
    chat_template: bool = True,
    enable_thinking: bool | None = None,
) -> list[Example]:
    """Every row of a JSONL, JSON, CSV, TSV or Parquet file as an `Example`. `answer_field` None: the first of
    `ANSWER_FIELDS` the first row has (verl-style parquet keeps it in `reward_model.ground_truth`). String
    prompts are rendered as one user turn with the tokenizer's chat template when `chat_template` and the
    tokenizer has one; message lists always are. `enable_thinking` goes to the template when not None.

    A row's id is a hash of its rendered prompt and answer, and of its row number when an earlier row has the
    same two: the same file gives the same ids on every load (a restarted service finds its prompts again),
    and every row its own id, so its other fields (`PromptPool.fields`) are its own."""
    path = Path(path)
    if path.is_dir():
        raise DatasetError(f"{path}: is a directory; name the dataset file ({FORMATS})")
    if not path.is_file():
        raise DatasetError(f"{path}: dataset file does not exist")
    examples = []
    seen: set[str] = set()
    for number, row in read_rows(path):
        where = f"{path}: row {number}"
        if not isinstance(row, dict):
            raise DatasetError(f"{where}: expected an object")
        if answer_field is None:
            answer_field = next((f for f in ANSWER_FIELDS if _has(row, f)), ANSWER_FIELDS[0])
        try:
            prompt = _field(row, prompt_field)
        except KeyError:
            hint = _fields_hint(row, "prompt") if not examples else ""
            raise DatasetError(f"{where}: missing field {prompt_field!r}{hint}") from None
        try:
            answer = _field(row, answer_field)
        except KeyError:
            hint = _fields_hint(row, "answer") if not examples else ""
            raise DatasetError(f"{where}: missing field {answer_field!r}{hint}") from None
        if isinstance(answer, numbers.Real | Decimal) and not isinstance(answer, bool):
            answer = _number_text(answer, f"{where}: field {answer_field!r}")
        if not isinstance(answer, str) or not answer.strip():
            raise DatasetError(f"{where}: field {answer_field!r} must be a non-empty string or number")
        text = _render(prompt, tokenizer, f"{where}: field {prompt_field!r}", chat_template, enable_thinking)
        key = f"{text}\x00{answer}"
        prompt_id = stable_hex(key if key not in seen else f"{key}\x00{number}", 16)
        seen.add(key)
        used = {name if name in row else name.split(".")[0] for name in (prompt_field, answer_field)}
        examples.append(Example(prompt_id, text, answer, {k: v for k, v in row.items() if k not in used}))
    if not examples:
        raise DatasetError(f"{path}: no rows")
    return examples


class PromptPool:
    """The training prompts of a dataset, tokenised, visited in epochs: epoch e is a permutation of the pool
    drawn from (seed, e), and step s takes the `count` prompts after the first s x count of the endless
    sequence of epochs. A pure function of (seed, step, count), so a restarted policy service continues
    exactly where it was. Prompts over `max_prompt_len` tokens are left out at load and counted (`skipped`); with
    `vocab_size` (the policy's), a prompt holding a token id the policy does not embed is refused: the tokenizer
    is not the policy's, and every prompt it writes would be dead-lettered by the workers."""

    def __init__(
        self,
        examples: list[Example],
        tokenizer: Any,
        *,
        seed: int,
        max_prompt_len: int,
        where: str = "",
        vocab_size: int | None = None,
    ):
        self.seed = seed
        self.max_prompt_len = max_prompt_len
        self.rows: list[tuple[str, str, list[int], str]] = []
        self.fields: dict[str, dict[str, Any]] = {}
        """prompt_id -> the row's other fields (`PromptGroup.fields`)."""
        self.skipped = 0
        from tlt_stream.model.loader import prompt_encoder

        encode = prompt_encoder(tokenizer)
        for example in examples:
            ids = encode(example.prompt)
            if vocab_size is not None and ids and max(ids) >= vocab_size:
                raise DatasetError(
                    f"{where or 'the dataset'}: the prompt {example.prompt[:40]!r} holds token id {max(ids)}, outside "
                    f"the policy's vocabulary of {vocab_size} (the tokenizer has {len(tokenizer)} tokens): use the "
                    "policy's own tokenizer (data.tokenizer)"
                )
            if not ids or len(ids) > max_prompt_len:
                self.skipped += 1
                continue
            self.rows.append((example.prompt_id, example.prompt, list(ids), example.answer))
            if example.fields:
                self.fields[example.prompt_id] = example.fields
        if not self.rows:
            raise DatasetError(
                f"{where or 'the dataset'}: all {len(examples)} prompts are longer than {max_prompt_len} tokens "
                "(data.max_prompt_len)"
            )
        self._orders: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return len(self.rows)

    def _order(self, epoch: int) -> list[int]:
        import random

        from tlt_stream.basics.common import stable_int

        if epoch not in self._orders:
            if len(self._orders) > 2:
                self._orders.clear()
            order = list(range(len(self.rows)))
            random.Random(stable_int(f"prompt-pool/{self.seed}/{epoch}", 12)).shuffle(order)
            self._orders[epoch] = order
        return self._orders[epoch]

    def epoch_of(self, step: int, count: int) -> int:
        return step * count // len(self.rows)

    def prompts(self, step: int, count: int) -> list[tuple[str, str, list[int], str]]:
        """`count` (prompt_id, prompt text, prompt token ids, reference answer) for `step`."""
        out = []
        for k in range(step * count, (step + 1) * count):
            epoch, i = divmod(k, len(self.rows))
            out.append(self.rows[self._order(epoch)[i]])
        return out


def pool_from_config(path: str, config: Any, tokenizer: Any, *, seed: int, max_len: int | None = None) -> PromptPool:
    """The prompts of the dataset file `path` as the configuration reads them (`data.*`: fields, chat
    template, prompt limit; the limit defaults to `PROMPT_LEN` tokens, at most half of the context `max_len`,
    else of `rollout.max_len`). Whatever `data.max_prompt_len` says, a prompt kept leaves the context room
    for one response token at least: a longer one would only be dead-lettered by the worker. Token ids are
    checked against the vocabulary of the policy `learner.policy` where it is set (`PromptPool`)."""
    data = config.data
    examples = load_examples(
        path,
        prompt_field=data.prompt_field,
        answer_field=data.answer_field,
        tokenizer=tokenizer,
        chat_template=data.chat_template,
        enable_thinking=data.enable_thinking,
    )
    from tlt_stream.model.sizing import prompt_limit

    context = max_len or config.rollout.max_len
    limit = prompt_limit(data.max_prompt_len, context)
    if context is not None:
        limit = min(limit, context - 1)
    from tlt_stream.model.loader import checkpoint_vocab

    policy = config.learner.policy
    vocab = checkpoint_vocab(policy) if policy is not None else None
    return PromptPool(examples, tokenizer, seed=seed, max_prompt_len=limit, where=path, vocab_size=vocab)
