"""Group and history drafts inside vLLM: a proposer for `speculative_config` `method = "custom_class"`.

vLLM builds the class named by `speculative_config.model` in each worker with its `VllmConfig`
(`v1/spec_decode/custom_class_proposer.py`) and calls `propose(sampled_token_ids, num_tokens_no_spec,
token_ids_cpu, slot_mappings=...)` after every step that sampled (`gpu_model_runner.propose_draft_token_ids`;
the CPU model runner inherits it): every running row's tokens, but no request ids and no prompt lengths.
Group drafts need both (siblings are the rows of one prompt; a finished sibling's response stays as history),
so the worker extension binds the model runner after the engine starts (`tlt_bind_group`), and the proposer
reads `input_batch.req_ids` and `num_prompt_tokens` of the rows it is given, in the same order.

The index is this project's (`rollout/suffix.py`): one suffix automaton per prompt, holding the prompt and
every response to it (running and finished, the newest `max_docs` kept, the least recently used prompts
dropped past `max_prompts`), as `rollout/proposers/group.py` keeps it for the torch engine. A row's draft is
the most frequent continuation of the longest suffix of its own tokens that occurred and was continued: a
chain of point masses, which vLLM verifies with its rejection sampler (lossless at any temperature, as the
n-gram drafts are). vLLM's custom proposers are not told the step's K, so chains are `num_speculative_tokens`
long and a batch-size schedule does not apply to them (`config.dynamic_schedule` refuses group tables).

Imported only inside vLLM's worker (by the import path `GROUP_PROPOSER`); no vllm import of its own.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from tlt_stream.rollout.suffix import SuffixAutomaton

__all__ = ["GROUP_PROPOSER", "GroupDrafts"]

MAX_MATCH = 12
"""The longest suffix of a row's tokens looked up (the torch engine's `GroupProposer` default)."""


@dataclass
class _Row:
    key: tuple[int, ...]
    doc: int
    history: list[int]
    seen: int
    """Tokens of the row indexed so far (prompt included)."""


class GroupDrafts:
    """vLLM's custom proposer over the responses to each row's prompt (module docstring)."""

    def __init__(self, vllm_config: Any, *, max_docs: int = 64, max_prompts: int = 256) -> None:
        self.k = int(vllm_config.speculative_config.num_speculative_tokens)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.max_docs, self.max_prompts = max_docs, max_prompts
        self.runner: Any = None
        self.indexes: OrderedDict[tuple[int, ...], SuffixAutomaton] = OrderedDict()
        self.rows: dict[str, _Row] = {}
        self._docs = 0
        self.drafted = 0
        """Rows given a non-empty chain so far (what the test reads to tell the proposer ran)."""

    def bind(self, runner: Any) -> None:
        """The model runner whose `input_batch` names the rows `propose` is given."""
        self.runner = runner

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """No model: the drafts come from the index."""

    def remember(self, prompt: list[int], response: list[int]) -> None:
        """A finished response to `prompt` produced elsewhere (earlier epochs, another worker): history."""
        index = self._index(tuple(prompt))
        self._docs += 1
        index.extend(self._docs, [*prompt[-MAX_MATCH:], *response])
        self._bound(index)

    def propose(
        self, sampled_token_ids: list[list[int]], num_tokens_no_spec: Any, token_ids_cpu: Any, slot_mappings: Any = None
    ) -> list[list[int]]:
        if self.runner is None:
            raise RuntimeError("GroupDrafts is not bound to its model runner: call the extension's tlt_bind_group")
        batch = self.runner.input_batch
        out: list[list[int]] = []
        live: set[str] = set()
        for i, sampled in enumerate(sampled_token_ids):
            req_id = batch.req_ids[i] if i < len(batch.req_ids) else None
            if req_id is None:
                out.append([])
                continue
            live.add(req_id)
            n = int(num_tokens_no_spec[i])
            row = self.rows.get(req_id)
            if row is None:
                prompt = [int(t) for t in token_ids_cpu[i, : int(batch.num_prompt_tokens[i])]]
                row = self.rows[req_id] = self._start(prompt)
            if n > row.seen:
                tokens = [int(t) for t in token_ids_cpu[i, row.seen : n]]
                row.history.extend(tokens)
                self.indexes[row.key].extend(row.doc, tokens)
                row.seen = n
            room = min(self.k, self.max_model_len - n - 1)
            if not sampled or room <= 0:
                out.append([])
                continue
            chain, _ = self.indexes[row.key].chain(row.history, length=room, max_match=MAX_MATCH)
            self.drafted += bool(chain)
            out.append(chain)
        for req_id in set(self.rows) - live:  # finished (or preempted): its response stays as history
            row = self.rows.pop(req_id)
            if row.key in self.indexes:
                self._bound(self.indexes[row.key])
        return out

    def _index(self, key: tuple[int, ...]) -> SuffixAutomaton:
        index = self.indexes.get(key)
        if index is None:
            index = self.indexes[key] = SuffixAutomaton()
            index.extend("prompt", key)
        self.indexes.move_to_end(key)
        in_use = {row.key for row in self.rows.values()} | {key}
        for old in list(self.indexes):
            if len(self.indexes) <= self.max_prompts:
                break
            if old not in in_use:
                del self.indexes[old]
        return index

    def _start(self, prompt: list[int]) -> _Row:
        key = tuple(prompt)
        index = self._index(key)
        self._docs += 1
        index.extend(self._docs, list(key[-MAX_MATCH:]))  # a sibling's first tokens are found after the prompt
        return _Row(key, self._docs, list(prompt), len(prompt))

    def _bound(self, index: SuffixAutomaton) -> None:
        live = {row.doc for row in self.rows.values()}
        finished = [d for d in index.documents if d != "prompt" and d not in live]
        for doc in finished[: max(0, len(finished) - self.max_docs)]:  # the oldest responses go first
            index.remove(doc)


GROUP_PROPOSER = f"{GroupDrafts.__module__}.{GroupDrafts.__qualname__}"
"""`speculative_config.model` for `method = "custom_class"`."""
