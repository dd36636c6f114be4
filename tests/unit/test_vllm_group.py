"""The group proposer vLLM runs as its custom_class proposer (`rollout/vllm/group.py`), driven here as vLLM's
model runner drives it (`propose` with each row's tokens in `token_ids_cpu`, the rows named by the runner's
input batch), without vLLM. On the running engine: tests/vllm/test_group.py."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from tlt_stream.rollout.vllm.group import GroupDrafts

K, MAX_LEN = 4, 64


class Batch:
    """The rows of vLLM's input batch: request id, prompt length and tokens per row."""

    def __init__(self) -> None:
        self.req_ids: list[str | None] = []
        self.num_prompt_tokens = np.zeros(8, dtype=np.int64)
        self.tokens = np.zeros((8, MAX_LEN), dtype=np.int64)
        self.lengths = np.zeros(8, dtype=np.int64)

    def set(self, rows: list[tuple[str, list[int], list[int]]]) -> None:
        self.req_ids = [rid for rid, _, _ in rows]
        for i, (_, prompt, response) in enumerate(rows):
            self.num_prompt_tokens[i] = len(prompt)
            self.tokens[i, : len(prompt) + len(response)] = [*prompt, *response]
            self.lengths[i] = len(prompt) + len(response)


def proposer() -> tuple[GroupDrafts, Batch]:
    config = SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=K),
        model_config=SimpleNamespace(max_model_len=MAX_LEN),
    )
    drafts, batch = GroupDrafts(config), Batch()
    drafts.bind(SimpleNamespace(input_batch=batch))
    return drafts, batch


def step(drafts: GroupDrafts, batch: Batch, rows: list[tuple[str, list[int], list[int]]]) -> list[list[int]]:
    batch.set(rows)
    return drafts.propose([[1]] * len(rows), batch.lengths, batch.tokens)


def test_a_sibling_drafts_what_a_finished_sibling_wrote_after_the_same_tokens() -> None:
    drafts, batch = proposer()
    prompt, response = [1, 2, 3], [10, 11, 12, 13, 14, 15, 16]
    for n in range(1, len(response) + 1):  # request a generates alone, token by token, then finishes
        step(drafts, batch, [("a", prompt, response[:n])])
    step(drafts, batch, [("other", [9, 9], [5])])  # a left the batch: its response stays as history
    assert step(drafts, batch, [("b", prompt, [10])]) == [[11, 12, 13, 14]]
    assert step(drafts, batch, [("c", [7], [8]), ("b", prompt, [10, 11, 12])]) == [[], [13, 14, 15, 16]]
    assert step(drafts, batch, [("d", [4, 4, 4], [6])]) == [[]], "another prompt: nothing to draft from"
    assert drafts.drafted == 2


def test_rows_without_a_sampled_token_or_room_get_no_draft() -> None:
    drafts, batch = proposer()
    prompt = list(range(1, 40))
    step(drafts, batch, [("a", prompt, list(range(40, 64)))])  # 63 tokens: up to max_len
    step(drafts, batch, [])
    batch.set([("b", prompt, [40])])
    assert drafts.propose([[]], batch.lengths, batch.tokens) == [[]], "no token sampled this step"
    batch.set([("b", prompt, list(range(40, 62)))])
    assert drafts.propose([[1]], batch.lengths, batch.tokens) == [[62, 63]], "two positions left before max_len"


def test_an_unbound_proposer_says_what_is_missing() -> None:
    config = SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=K),
        model_config=SimpleNamespace(max_model_len=MAX_LEN),
    )
    with pytest.raises(RuntimeError, match="tlt_bind_group"):
        GroupDrafts(config).propose([[1]], np.array([3]), np.zeros((1, 8), dtype=np.int64))


def test_a_remembered_response_is_history_for_the_prompts_first_request() -> None:
    drafts, batch = proposer()
    drafts.remember([1, 2, 3], [10, 11, 12, 13, 14, 15])  # another worker's response
    assert step(drafts, batch, [("a", [1, 2, 3], [10])]) == [[11, 12, 13, 14]]
    assert step(drafts, batch, [("b", [3, 2, 1], [10])]) == [[]], "another prompt's history is not drafted from"
