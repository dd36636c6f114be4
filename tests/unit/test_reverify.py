"""Re-verification of partial responses as plain code: the scheduler's parking and hand-back, and the rule
itself (`rollout/reverify.py`) against exact distributions.

The distribution tests draw many independent drafts from q in one vectorised call (fixed seed), re-verify
them under p with `accepted_prefix` and `resample`, continue under p, and compare the whole sequences with
p's exact joint distribution by a chi-square test at a false-alarm rate of 1e-4 per test.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from tests.stats import chi2_threshold, chi_square
from tlt_stream.rollout.reverify import accepted_prefix, resample
from tlt_stream.rollout.scheduler import Scheduler, Sequence, SequenceStatus

# ------------------------------------------------------------------------------------------- scheduler


def draft(rid: int, limit: int | None, max_new: int = 5, eos: tuple[int, ...] = (9,)) -> Sequence:
    return Sequence(rid, [1, 2, 3], max_new, frozenset(eos), 1.0, ahead_limit=limit)


def test_a_draft_parks_at_its_token_budget_or_at_its_end_and_an_ordinary_request_does_not() -> None:
    s = draft(0, 2)
    s.status = SequenceStatus.RUNNING
    assert not s.append(4, -0.1)
    assert s.append(5, -0.2), "the second token used the budget"
    assert s.status is SequenceStatus.PARKED and s.finish_reason is None and not s.is_finished
    with pytest.raises(ValueError, match="PARKED"):
        s.append(6, 0.0)

    ended = draft(1, 3)
    ended.status = SequenceStatus.RUNNING
    assert ended.append(9, -0.3), "an EOS under the old policy may be rejected by the new one: it waits"
    assert ended.status is SequenceStatus.PARKED and ended.finish_reason == "eos"

    plain = draft(2, None)
    plain.status = SequenceStatus.RUNNING
    assert not plain.append(4, 0.0) and not plain.append(5, 0.0) and plain.append(9, 0.0)
    assert plain.is_finished
    with pytest.raises(ValueError, match="ahead_limit"):
        draft(3, 0)


def test_reverified_keeps_a_prefix_with_new_logprobs_and_counts_what_it_kept() -> None:
    s = draft(0, 3)
    s.status = SequenceStatus.RUNNING
    for t in (4, 5, 9):
        s.append(t, -1.0)
    assert s.status is SequenceStatus.PARKED and s.finish_reason == "eos"
    assert not s.reverified([-0.5]), "the EOS was discarded: the response goes on"
    assert (s.token_ids, s.logprobs, s.finish_reason, s.status) == ([4], [-0.5], None, SequenceStatus.RUNNING)
    assert (s.tokens_kept, s.tokens_discarded, s.reverifications, s.ahead_limit) == (1, 2, 1, None)
    assert not s.append(6, -0.1) and not s.append(7, -0.1), "no longer a draft: no parking"

    ended = draft(1, 3)
    ended.status = SequenceStatus.RUNNING
    for t in (4, 9):
        ended.append(t, -1.0)
    assert ended.reverified([-0.2, -0.3]), "every token kept, EOS included: finished"
    assert ended.is_finished and ended.finish_reason == "eos" and ended.logprobs == [-0.2, -0.3]
    with pytest.raises(ValueError, match="kept 3 of 2"):
        ended.reverified([0.0] * 3)


def test_parked_rows_leave_their_slots_and_a_new_version_hands_back_every_row_with_tokens() -> None:
    sched = Scheduler(max_batch=3)
    for rid, limit in enumerate([1, None, 2, None]):
        sched.add(draft(rid, limit))
    first = sched.admit()
    for s in first:
        s.append(4, -1.0)
    finished, moves = sched.retire()
    assert finished == [] and [s.request_id for s in sched.parked] == [0]
    assert [(m.src, m.dst) for m in moves] == [(2, 0)], "the tail row moved into the parked row's hole"
    assert [(s.request_id, s.slot) for s in sched.running] == [(2, 0), (1, 1)]
    assert sched.num_waiting == 1 and not sched.is_idle
    late = draft(9, 4)
    sched.add(late)
    sched.running[0].append(5, -1.0)  # request 2 reaches its budget
    sched.retire()

    rows = sched.new_version()
    assert [s.request_id for s in rows] == [1, 0, 2], "running in slot order, then parked in parking order"
    assert sched.running == [] and sched.parked == [] and all(s.slot is None for s in rows)
    assert [s.request_id for s in sched.waiting] == [3, 9]
    assert late.ahead_limit is None, "a draft not started has nothing from the old version: ordinary now"

    for s in rows:
        s.reverified(s.logprobs)
    sched.place(rows[:2])
    assert [(s.request_id, s.slot) for s in sched.running] == [(1, 0), (0, 1)]
    sched.requeue(rows[2:])
    assert [s.request_id for s in sched.waiting] == [2, 3, 9], "a verified row resumes first"
    assert rows[2].num_prefill_tokens == 3 + 2 - 1, "it resumes over its prompt and tokens but the last"
    assert [s.request_id for s in sched.new_version()] == [1, 0, 2], "queued to resume: it holds tokens"


def test_passes_respect_the_batch_and_the_prefill_budget() -> None:
    def sizes(sched: Scheduler, lengths: list[int]) -> list[int]:
        seqs = [Sequence(i, [1] * n, 4) for i, n in enumerate(lengths)]
        passes = sched.passes(seqs)
        assert [s for batch in passes for s in batch] == seqs, "every row once, in order"
        return [len(batch) for batch in passes]

    assert sizes(Scheduler(3), [4] * 7) == [3, 3, 1]
    assert sizes(Scheduler(8, max_prefill_tokens=10), [3, 3, 3, 12, 2, 5]) == [3, 1, 2]
    assert sizes(Scheduler(8, max_prefill_tokens=10), []) == []


# ---------------------------------------------------------------------------------------------- the rule

V, L = 4, 3


def tables(seed: int) -> torch.Tensor:
    """A next-token distribution for every prefix of length < L, `[sum V^m, V]` (rows by `prefix_index`)."""
    g = torch.Generator().manual_seed(seed)
    rows = sum(V**m for m in range(L))
    return torch.softmax(torch.randn(rows, V, generator=g, dtype=torch.float64) * 1.5, dim=-1)


def prefix_index(prefix: torch.Tensor) -> torch.Tensor:
    """Row of `tables` for each prefix `[N, m]`: prefixes of length m after those shorter (base-V code)."""
    m = prefix.shape[1]
    code = torch.zeros(prefix.shape[0], dtype=torch.long)
    for i in range(m):
        code = code * V + prefix[:, i]
    return code + sum(V**j for j in range(m))


def draw(dist: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    return torch.multinomial(dist, 1, generator=g).squeeze(1)


def joint(p: torch.Tensor) -> dict[tuple[int, ...], float]:
    out = {}
    for seq in itertools.product(range(V), repeat=L):
        prob = 1.0
        for m in range(L):
            prob *= float(p[prefix_index(torch.tensor([seq[:m]], dtype=torch.long).view(1, m))[0], seq[m]])
        out[seq] = prob
    return out


def reverify_and_continue(p: torch.Tensor, q: torch.Tensor, k: int, n: int, seed: int) -> tuple[torch.Tensor, ...]:
    """n drafts of k tokens from q, re-verified under p with the rule, continued under p to L tokens.
    Returns (sequences [n, L], kept [n], the draft [n, k])."""
    g = torch.Generator().manual_seed(seed)
    seqs = torch.zeros(n, 0, dtype=torch.long)
    for _ in range(k):
        seqs = torch.cat([seqs, draw(q[prefix_index(seqs)], g)[:, None]], dim=1)
    drafts = seqs.clone()
    if k:
        at = [prefix_index(seqs[:, :i]) for i in range(k)]
        p_logp = torch.stack([p[at[i], seqs[:, i]] for i in range(k)], dim=1).log()  # [n, k]
        q_logp = torch.stack([q[at[i], seqs[:, i]] for i in range(k)], dim=1).log()
        kept = accepted_prefix(
            p_logp, q_logp, torch.zeros(n, k, dtype=torch.bool), torch.rand(n, k, generator=g, dtype=torch.float64),
            torch.full((n,), k), torch.zeros(n, dtype=torch.bool),
        )  # fmt: skip
        out = []
        for c in range(k + 1):  # rows that kept c tokens: resample at c (or continue after k)
            sel = (kept == c).nonzero().squeeze(1)
            if not len(sel):
                continue
            prefix = seqs[sel, :c]
            if c == L:
                out.append((sel, prefix))
                continue
            here = prefix_index(prefix)
            rejected = torch.full((len(sel),), c < k)
            token = resample(p[here], q[here], rejected, torch.rand(len(sel), generator=g, dtype=torch.float64))
            out.append((sel, torch.cat([prefix, token[:, None]], dim=1)))
        width = max(s.shape[1] for _, s in out)
        grown = torch.full((n, width), -1, dtype=torch.long)
        for sel, s in out:
            grown[sel, : s.shape[1]] = s
    else:
        kept, grown = torch.zeros(n, dtype=torch.long), seqs
    # Continue under p, row by row length (each row's length is known from `kept`).
    final = torch.zeros(n, L, dtype=torch.long)
    for length in range(L + 1):
        sel = ((grown >= 0).sum(dim=1) == length).nonzero().squeeze(1)
        s = grown[sel, :length]
        while s.shape[1] < L:
            s = torch.cat([s, draw(p[prefix_index(s)], g)[:, None]], dim=1)
        final[sel] = s
    return final, kept, drafts


@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_reverified_and_continued_drafts_follow_the_new_policys_joint_distribution(k: int) -> None:
    p, q = tables(1), tables(2)
    n = 20_000
    final, kept, _ = reverify_and_continue(p, q, k, n, seed=10 + k)
    observed: dict = {}
    for row in final.tolist():
        observed[tuple(row)] = observed.get(tuple(row), 0) + 1
    stat, df = chi_square(observed, joint(p), n)
    assert stat < chi2_threshold(df), (k, stat, chi2_threshold(df))
    if k:
        assert 0 < int((kept < k).sum()) < n, "some drafts were cut, some kept whole"
    # The same drafts without the rule (kept whole, then continued under p) are q's prefix: detectably off.
    if k == 3:
        drafted: dict = {}
        for row in reverify_and_continue(q, q, k, n, seed=10 + k)[0].tolist():
            drafted[tuple(row)] = drafted.get(tuple(row), 0) + 1
        assert chi_square(drafted, joint(p), n)[0] > chi2_threshold(df), "the test can tell q from p"


def test_the_token_at_a_rejection_follows_the_residual() -> None:
    """One-token drafts: where the draft was rejected, the new token follows norm(max(0, p - q)) at the root,
    not p (a plain resample from p would fail this)."""
    p, q = tables(1), tables(2)
    n = 40_000
    final, kept, drafts = reverify_and_continue(p, q, 1, n, seed=5)
    rejected = kept == 0
    assert bool((final[rejected, 0] != drafts[rejected, 0]).all()), "a rejected token never comes back"
    residual = (p[0] - q[0]).clamp(min=0)
    residual = residual / residual.sum()
    observed: dict = {}
    for t in final[rejected, 0].tolist():
        observed[(t,)] = observed.get((t,), 0) + 1
    expected = {(t,): float(residual[t]) for t in range(V)}
    stat, df = chi_square(observed, expected, int(rejected.sum()))
    assert stat < chi2_threshold(df), (stat, observed, expected)
    rate = 1 - float(torch.minimum(p[0], q[0]).sum())  # P(reject) = 1 - sum_x min(p, q)
    assert abs(float(rejected.float().mean()) - rate) < 5 * math.sqrt(rate * (1 - rate) / n)


def test_greedy_rows_keep_exactly_the_argmax_prefix_and_resample_the_argmax() -> None:
    is_argmax = torch.tensor([[True, True, False, True], [True, True, True, True], [False, True, True, True]])
    kept = accepted_prefix(
        torch.zeros(3, 4), torch.zeros(3, 4), is_argmax, torch.zeros(3, 4), torch.tensor([4, 3, 4]),
        torch.ones(3, dtype=torch.bool),
    )  # fmt: skip
    assert kept.tolist() == [2, 3, 0]
    p = torch.zeros(2, 5).scatter_(1, torch.tensor([[3], [1]]), 1.0)  # one-hot argmax 3, then 1
    q = torch.zeros(2, 5).scatter_(1, torch.tensor([[2], [0]]), 1.0)  # the rejected tokens
    token = resample(p, q, torch.tensor([True, False]), torch.zeros(2, dtype=torch.float64))
    assert token.tolist() == [3, 1]


def test_sampled_acceptance_is_u_below_p_over_q_and_ignores_padding() -> None:
    p = torch.tensor([[0.5, 0.2, 0.9]]).log()
    q = torch.tensor([[0.25, 0.4, 0.3]]).log()
    greedy = torch.zeros(1, dtype=torch.bool)
    none = torch.zeros(1, 3, dtype=torch.bool)

    def keep(u: list[float], length: int = 3) -> int:
        return int(accepted_prefix(p, q, none, torch.tensor([u], dtype=torch.float64), torch.tensor([length]), greedy))

    assert keep([0.99, 0.49, 0.0]) == 3, "p >= q: always kept; 0.49 < 0.2 / 0.4"
    assert keep([0.0, 0.51, 0.0]) == 1
    assert keep([0.0, 0.0, 0.0], length=2) == 2, "padding is never kept"
