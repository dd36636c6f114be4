"""The client-side pieces of partial rollouts on vLLM without vLLM (`rollout/vllm/requests.py`, `partial.py`):
streamed outputs as vLLM's `LLMEngine.step` returns them (DELTA), drafts parked when vLLM ends them, a row's
state after a re-verification, and batching that changes nothing. The engine itself: tests/vllm/test_partial.py."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from tlt_stream.model import load_model
from tlt_stream.rollout.reverify import verify_rows
from tlt_stream.rollout.vllm.partial import derived_seed, reverify_rows
from tlt_stream.rollout.vllm.requests import Pending, Requests


def delta(key: str, tokens: list[int], *, finished: bool = False, reason: str | None = None, stop=None):
    """One DELTA `RequestOutput`: the step's new tokens, each with its log-prob (-0.5 - token / 100)."""
    completion = SimpleNamespace(
        token_ids=tokens,
        logprobs=[{t: SimpleNamespace(logprob=-0.5 - t / 100)} for t in tokens],
        finish_reason=reason,
        stop_reason=stop,
        spec_decode_metrics=None,
    )
    return SimpleNamespace(request_id=key, finished=finished, outputs=[completion], prompt_token_ids=None)


def row(rid: object, *, ahead: int | None = None, max_new: int = 10, eos: tuple[int, ...] = (0,)) -> Pending:
    return Pending(rid, [5, 6], frozenset(eos), False, stream=True, max_new_tokens=max_new, ahead_limit=ahead)


def test_drafts_park_when_vllm_ends_them_and_other_rows_finish() -> None:
    requests = Requests()
    requests.add("a", row("a", ahead=3))  # reaches its limit
    requests.add("b", row("b", ahead=3))  # ends at an EOS id before it
    requests.add("c", row("c"))  # an ordinary streamed request
    assert requests.collect([delta("a", [7, 8]), delta("b", [9]), delta("c", [4, 4])]) == ([], [])
    done, abort = requests.collect(
        [
            delta("a", [3], finished=True, reason="length"),
            delta("b", [0], finished=True, reason="stop", stop=0),
            delta("c", [1, 0], finished=True, reason="stop", stop=0),
        ]
    )
    assert abort == [] and [r.request_id for r, _ in done] == ["c"]
    (result, _), parked = done[0], requests.parked
    assert result.token_ids == [4, 4, 1, 0] and result.finish_reason == "eos"
    assert result.logprobs == pytest.approx([-0.54, -0.54, -0.51, -0.5])
    assert [(p.request_id, p.token_ids, p.finish) for p in parked] == [("a", [7, 8, 3], None), ("b", [9, 0], "eos")]
    assert len(requests) == 0
    keys, rows = requests.take_all()
    assert keys == [] and [p.request_id for p in rows] == ["a", "b"] and not requests.parked


def test_a_draft_at_its_whole_budget_parks_as_ended() -> None:
    requests = Requests()
    requests.add("a", row("a", ahead=8, max_new=2))
    requests.collect([delta("a", [7, 8], finished=True, reason="length")])
    assert requests.parked[0].finish == "length"


def test_a_row_after_its_reverification() -> None:
    p = row("p")
    p.token_ids, p.logprobs = [7, 8, 9], [-1.0, -1.0, -1.0]
    assert not p.reverified([-0.1], 4, -0.2)  # kept one, resampled one: it goes on
    assert (p.token_ids, p.logprobs, p.tokens_kept, p.tokens_discarded) == ([7, 4], [-0.1, -0.2], 1, 2)
    assert p.reverified([-0.1, -0.3], 0, -0.4) and p.finish == "eos"  # the new token is an EOS id
    ended = row("e")
    ended.token_ids, ended.logprobs, ended.finish = [7, 0], [-1.0, -1.0], "eos"
    assert ended.reverified([-0.1, -0.2], 3, -0.3)  # kept all of an ended response: stays ended, nothing added
    assert ended.token_ids == [7, 0] and ended.finish == "eos"
    cut = row("c")
    cut.token_ids, cut.logprobs, cut.finish = [7, 0], [-1.0, -1.0], "eos"
    assert not cut.reverified([-0.1], 3, -0.3) and cut.token_ids == [7, 3] and cut.finish is None
    full = row("f", max_new=2)
    full.token_ids, full.logprobs = [7], [-1.0]
    assert full.reverified([-0.1], 3, -0.3) and full.finish == "length"


def test_derived_seeds_differ_per_part_and_stay_put() -> None:
    assert derived_seed(None, "x") is None
    seeds = {derived_seed(7, "continue", 1, n) for n in range(50)} | {derived_seed(7, "accept", 0)}
    assert len(seeds) == 51 and derived_seed(7, "accept", 0) == derived_seed(7, "accept", 0) < 2**63


@pytest.fixture(scope="module")
def versions(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root = tmp_path_factory.mktemp("partial")
    out = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        config = Qwen2Config(
            hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
            vocab_size=7, initializer_range=0.5,
        )  # fmt: skip
        AutoModelForCausalLM.from_config(config).save_pretrained(root / f"v{seed}")
        out.append(root / f"v{seed}")
    return out


def test_rows_judged_in_batches_as_in_one_pass(versions: list[Path]) -> None:
    """Greedy and sampled rows of different lengths: small batches (`max_tokens`) give what one pass of
    `verify_rows` gives with the same uniforms."""
    q, p = (load_model(v) for v in versions)
    rows = []
    for i in range(6):
        r = Pending(i, [1, 2, 3][: 1 + i % 3], frozenset(), False, stream=True, max_new_tokens=9, seed=40 + i)
        r.temperature = 0.0 if i % 2 else 1.0
        r.token_ids = [(i + j) % 7 for j in range(1 + i)]
        r.logprobs = [-1.5] * len(r.token_ids)
        rows.append(r)
    small = reverify_rows(p, q, rows, max_tokens=8)
    assert small.passes > 2
    generators = []
    for r in rows:
        g = torch.Generator().manual_seed(derived_seed(r.seed, "accept", 0)) if r.temperature > 0 else None
        generators.append(g)
    width = max(len(r.prompt_ids) + len(r.token_ids) for r in rows)
    whole = verify_rows(
        p, p.new_cache(len(rows), width), 0, [r.prompt_ids for r in rows], [r.token_ids for r in rows],
        [r.logprobs for r in rows], [r.temperature for r in rows], generators, q,
    )  # fmt: skip
    assert small.next_tokens == whole.next_tokens
    for a, b in zip(small.kept_logprobs, whole.kept_logprobs, strict=True):
        assert a == pytest.approx(b, abs=1e-5)
