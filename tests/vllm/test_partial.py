"""Lossless partial rollouts on the running vLLM engine (`rollout/vllm/partial.py`): rows in flight and parked
drafts re-verified at a new policy version and continued in vLLM. One engine (plain, inline), built with
`VllmSettings(partial_rollouts=True)`.

The oracle is transformers on the new version alone: its greedy decoding from scratch, its log-softmax, its
final-norm hidden states and its exact joint distribution of the first tokens (chi-square at a false-alarm
rate of 1e-4 each, fixed seeds). Two new versions: B, an independent random checkpoint of the same
architecture (its responses part from A's at once), and A', A moved by a small update (responses agree for
a while, so how the old tokens are accepted matters).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.stats import chi2_threshold, chi_square
from tests.vllm.conftest import Oracle, closing, prompt_ids, requires_vllm, settings

pytestmark = requires_vllm

ROWS = 512
"""vLLM's max_num_seqs here: the sampled test's rows run (and are re-verified) in a few large batches."""


def moved(models: dict[str, Path], scale: float) -> Path:
    """The policy A with every weight moved by `scale` x N(0, 1) (what an RL update does), saved once."""
    from transformers import AutoModelForCausalLM

    out = models["policy"].parent / f"policy_moved_{scale}"
    if not out.exists():
        model = AutoModelForCausalLM.from_pretrained(models["policy"], dtype=torch.float32)
        torch.manual_seed(5)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(scale * torch.randn_like(p))
        model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def near(models: dict[str, Path]) -> Path:
    """A' for sampling: next-token distributions 0.2-0.6 apart in total variation from A's."""
    return moved(models, 0.005)


@pytest.fixture(scope="module")
def near_greedy(models: dict[str, Path]) -> Path:
    """A' for greedy rows: on prompt_ids(9, seed=31) its greedy responses part from A's at the first token
    (prompts 0-4) or after 9-12 tokens (prompts 5-8)."""
    return moved(models, 0.015)


@pytest.fixture(scope="module")
def engine(models: dict[str, Path], engine_dir: Path) -> Iterator:
    from tlt_stream.rollout.vllm.backend import VllmEngine

    made = settings(engine_dir, hidden="recompute", partial_rollouts=True, max_batch=ROWS, max_len=128)
    yield from closing(VllmEngine(models["policy"], settings=made))


@pytest.fixture
def on_a(engine, models: dict[str, Path]) -> Iterator:
    """The engine on policy A, idle, before and after the test."""
    assert not engine.has_unfinished
    engine.load_policy(models["policy"])
    yield engine
    assert not engine.has_unfinished
    engine.load_policy(models["policy"])


def finish(engine) -> dict:
    """Step to the end; the results by request id."""
    done = {}
    while engine.has_work:
        for result in engine.step():
            done[result.request_id] = result
    assert not engine.has_unfinished, "parked drafts left with no version to re-verify them"
    return done


def step_until_parked(engine) -> None:
    """Step until every request is a parked draft; none may finish (drafts wait for the next version)."""
    while engine.num_running:
        assert engine.step() == []


KINDS = {"draft": (8, 0, 1), "running": (5, 6, 7), "queued": (2, 3, 4)}
"""Which of prompt_ids(9, seed=31) each kind of row gets in the greedy test."""


@pytest.mark.parametrize("version", ["policy_b", "near"])
def test_greedy_rows_reverified_at_a_new_version_are_its_greedy_decoding_from_scratch(
    on_a, models: dict[str, Path], near_greedy: Path, oracle: Oracle, version: str
) -> None:
    """Greedy rows of three kinds at the switch: drafts parked after 4 tokens, rows running under A for a few
    steps, and rows still queued. After the switch every response is transformers' greedy decoding under the
    new version from scratch, with its log-probs (T = 1, the greedy convention) and hidden states."""
    engine = on_a
    new = models["policy_b"] if version == "policy_b" else near_greedy
    oracle_new = Oracle(new)
    prompts = prompt_ids(9, seed=31)
    for i in KINDS["draft"]:
        engine.add_request(prompts[i], 40, 0.0, request_id=("draft", i), ahead_limit=4, return_hidden=True)
    step_until_parked(engine)
    assert engine.num_parked == 3 and not engine.has_work
    for i in KINDS["running"]:
        engine.add_request(prompts[i], 40, 0.0, request_id=("running", i))
    for _ in range(6):
        assert engine.step() == []  # 40 tokens each: none ends under A
    for i in KINDS["queued"]:
        engine.add_request(prompts[i], 40, 0.0, request_id=("queued", i), ahead_limit=2)
    engine.load_policy(new, reverify=True)
    done = finish(engine)
    assert len(done) == 9
    new_greedy = {i: oracle_new.greedy(p, 40) for i, p in enumerate(prompts)}
    old_greedy = {i: oracle.greedy(p, 40) for i, p in enumerate(prompts)}
    kept = 0
    for (kind, i), result in done.items():
        prompt, expected = prompts[i], new_greedy[i]
        assert result.token_ids == expected, (kind, i)
        assert result.finish_reason == "length"
        torch.testing.assert_close(
            torch.tensor(result.logprobs), torch.tensor(oracle_new.logprobs(prompt, expected, 0.0)), atol=2e-4, rtol=0
        )
        assert result.reverifications == (1 if kind != "queued" else 0)
        if kind == "draft":
            assert result.tokens_kept + result.tokens_discarded == 4  # it waited at its ahead_limit
            assert result.token_ids[: result.tokens_kept] == old_greedy[i][: result.tokens_kept]
            reference = oracle_new.final_hidden(prompt + expected)
            assert result.hidden is not None and result.prompt_hidden is not None
            torch.testing.assert_close(result.hidden, reference[len(prompt) - 1 : -1], atol=1e-4, rtol=1e-4)
        if kind == "running":
            assert result.tokens_kept + result.tokens_discarded >= 6
        kept += result.tokens_kept
    assert sum(new_greedy[i] != old_greedy[i] for i in range(9)) >= 6, "A's greedy differs from the new version's"
    if version == "near":  # A' agrees with A for a while: old tokens were kept, and then some were not
        assert kept >= 12 and sum(r.tokens_discarded for r in done.values()) > 0


def test_a_parked_draft_that_ended_stays_ended_when_every_token_is_kept(on_a, models: dict[str, Path], oracle: Oracle):
    """Drafts parked at their limit and one that ended at an EOS id before it, re-verified under the same
    weights (every greedy token kept): the ended one comes back as it was, the others go on to A's greedy."""
    engine = on_a
    prompts = prompt_ids(3, seed=36)
    free = [oracle.greedy(p, 24) for p in prompts]
    # an EOS id among the first prompt's tokens 2-3 that the others' first 6 tokens avoid
    eos = next(t for t in free[0][1:3] if all(t not in f[:6] for f in free[1:]))
    ends = free[0].index(eos) + 1
    for i, p in enumerate(prompts):
        engine.add_request(p, 24, 0.0, eos_ids=[eos], request_id=i, ahead_limit=6)
    step_until_parked(engine)
    assert engine.num_parked == 3 and engine.step() == [] and engine.num_parked == 3  # they wait
    engine.load_policy(models["policy"], reverify=True)
    done = finish(engine)
    assert done[0].token_ids == free[0][:ends] and done[0].finish_reason == "eos"
    assert (done[0].tokens_kept, done[0].tokens_discarded) == (ends, 0)
    for i in (1, 2):
        cut = free[i].index(eos) + 1 if eos in free[i] else 24
        assert done[i].token_ids == free[i][:cut] and (done[i].tokens_kept, done[i].tokens_discarded) == (6, 0)


def exact_first_three(oracle: Oracle, prompt: list[int]) -> tuple[dict, dict]:
    """transformers' exact joint of tokens 1-2 at T = 1 and marginal of token 3 after `prompt`."""
    first = oracle.next_probs([prompt], 1.0)[0]  # [V]
    second = oracle.next_probs([[*prompt, x] for x in range(first.numel())], 1.0)  # [V, V]
    joint = first[:, None] * second
    pairs = {(a, b): float(joint[a, b]) for a in range(joint.shape[0]) for b in range(joint.shape[1])}
    likely = [(a, b) for (a, b), p in pairs.items() if p > 1e-7]
    third = oracle.next_probs([[*prompt, a, b] for a, b in likely], 1.0)  # [pairs, V]
    weights = torch.tensor([pairs[pair] for pair in likely])
    assert math.isclose(float(weights.sum()), 1.0, abs_tol=1e-4)  # the pairs left out hold no mass
    marginal = (weights[:, None] * third).sum(0) / weights.sum()
    return pairs, {x: float(p) for x, p in enumerate(marginal)}


def test_sampled_rows_reverified_at_a_new_version_follow_its_distribution(on_a, near: Path, oracle: Oracle) -> None:
    """1,200 rows of one prompt at T = 1, 3 tokens each, sampled under A: drafts parked after 1 and after 2
    tokens, and rows running with 1-2 tokens (or still queued) at the switch to A'. Tokens 1-2 (joint) and
    token 3 (marginal) of the final responses follow A''s exact distribution (chi-square, false alarm 1e-4
    each), and A's distribution would fail the same test by far: old tokens kept as they were would be seen."""
    engine = on_a
    oracle_new = Oracle(near)
    (prompt,) = prompt_ids(1, seed=22)
    n = 400
    for k in (1, 2):
        for i in range(n):
            engine.add_request(prompt, 3, 1.0, seed=1000 * k + i, request_id=(k, i), ahead_limit=k)
    step_until_parked(engine)
    for i in range(n):
        engine.add_request(prompt, 3, 1.0, seed=5000 + i, request_id=(0, i))
    engine.step()
    engine.load_policy(near, reverify=True)
    done = finish(engine)
    results = list(done.values())
    assert len(results) == 3 * n and all(len(r.token_ids) == 3 for r in results)
    assert sum(r.reverifications for r in results) >= 2 * n
    assert sum(done[(0, i)].reverifications for i in range(n)) > 0, "no row was running with tokens at the switch"
    kept, discarded = sum(r.tokens_kept for r in results), sum(r.tokens_discarded for r in results)
    assert kept > 0.2 * 3 * n and discarded > 0.2 * 3 * n, (kept, discarded)  # both branches ran, often
    joint, third = exact_first_three(oracle_new, prompt)
    observed = Counter((r.token_ids[0], r.token_ids[1]) for r in results)
    stat, df = chi_square(observed, joint, 3 * n)
    assert stat < chi2_threshold(df), f"tokens 1-2: chi-square {stat:.1f} on {df} df"
    stat3, df3 = chi_square(Counter(r.token_ids[2] for r in results), third, 3 * n)
    assert stat3 < chi2_threshold(df3), f"token 3: chi-square {stat3:.1f} on {df3} df"
    old_joint, _ = exact_first_three(oracle, prompt)  # what keeping A's tokens would give (the expected statistic)
    shift = sum((old_joint[c] - p) ** 2 / p for c, p in joint.items() if p * 3 * n >= 5) * 3 * n
    print(f"chi-square: tokens 1-2 {stat:.1f} on {df} df (threshold {chi2_threshold(df):.1f}; A's distribution would "
          f"give {shift:.0f}), token 3 {stat3:.1f} on {df3} df; tokens kept {kept}, discarded {discarded}")  # fmt: skip
    assert shift > 4 * chi2_threshold(df), "A and A' too close for this test to see a lossy re-verification"
    for r in results[:: 3 * n // 40]:  # the new version's log-probs, kept tokens included
        expected = oracle_new.logprobs(prompt, r.token_ids, 1.0)
        torch.testing.assert_close(torch.tensor(r.logprobs), torch.tensor(expected), atol=2e-4, rtol=0)


def test_partial_rollouts_need_the_setting(models: dict[str, Path], tmp_path: Path) -> None:
    """An engine built without `partial_rollouts` refuses drafts and re-verification in one line (no engine is
    started: the refusal comes first)."""
    from tlt_stream.rollout.vllm.backend import VllmEngine
    from tlt_stream.rollout.vllm.config import UnsupportedSetting

    bare = object.__new__(VllmEngine)  # the refusals read only the settings
    bare.settings = settings(tmp_path)
    with pytest.raises(UnsupportedSetting, match=r"VllmSettings\(partial_rollouts=True\)"):
        bare.add_request([1, 2], 4, ahead_limit=2)
    with pytest.raises(UnsupportedSetting, match=r"VllmSettings\(partial_rollouts=True\)"):
        bare.load_policy(models["policy_b"], reverify=True)
