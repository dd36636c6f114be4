"""Lossless re-verification in the engine: `load_policy(path, reverify=True)` with requests in flight.

Evidence comes from Hugging Face transformers (greedy continuations, log-probabilities, hidden states and
exact joint distributions of the new policy), from a replica of the rule written here, and from the same
requests run one by one. Chi-square tests run at a false-alarm rate of 1e-4 each, with fixed seeds.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from tests.stats import chi2_threshold, chi_square
from tlt_stream.drafter.model import Drafter
from tlt_stream.model import load_model
from tlt_stream.rollout.acceptance import sample_from
from tlt_stream.rollout.arms import Arm
from tlt_stream.rollout.engine import GenerationEngine
from tlt_stream.rollout.proposers import EagleProposer, GroupProposer, MixedProposer

# One xdist worker runs this module, so its module-scoped fixtures are built once.
pytestmark = pytest.mark.xdist_group("test_engine_reverify")


def save_policy(out: Path, seed: int, **config: object) -> tuple[torch.nn.Module, Path]:
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(Qwen2Config(**config)).eval()
    hf.save_pretrained(out, safe_serialization=True)
    return hf, out


def next_version(hf: torch.nn.Module, out: Path, seed: int, scale: float) -> tuple[torch.nn.Module, Path]:
    """`hf` with every weight moved by `scale` x N(0, 1) noise (what an RL update does), saved in `out`."""
    moved = AutoModelForCausalLM.from_config(hf.config).eval()
    moved.load_state_dict(hf.state_dict())
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(scale * torch.randn_like(p))
    moved.save_pretrained(out, safe_serialization=True)
    return moved, out


TINY = dict(
    hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
    vocab_size=5, initializer_range=0.5,
)  # fmt: skip
WIDE = dict(
    hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=41, initializer_range=0.25,
)  # fmt: skip
EOS = 0


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[torch.nn.Module, Path]]:
    """Three versions of a policy over 5 tokens: q, then p, then a third."""
    root = tmp_path_factory.mktemp("tiny")
    return [save_policy(root / f"v{i}", 11 + i, **TINY) for i in range(3)]


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[torch.nn.Module, Path]]:
    """Three versions of a policy over 41 tokens, each an update of the one before: greedy responses agree
    for a while, then part."""
    root = tmp_path_factory.mktemp("wide")
    versions = [save_policy(root / "v0", 3, **WIDE)]
    for i in (1, 2):
        versions.append(next_version(versions[-1][0], root / f"v{i}", 3 + i, 0.005))
    return versions


@torch.no_grad()
def hf_greedy(hf, prompt: list[int], max_new: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False, eos_token_id=EOS,
        pad_token_id=EOS,
    )[0, len(prompt) :].tolist()  # fmt: skip
    return out[: out.index(EOS) + 1] if EOS in out else out


@torch.no_grad()
def hf_scores(hf, prompt: list[int], tokens: list[int], temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The policy's log-probability of each token (T = 1 at temperature 0) and its final-norm states over
    every input position but the last."""
    out = hf(torch.tensor([prompt + tokens]), output_hidden_states=True)
    n = len(prompt)
    logits = out.logits[0, n - 1 : n - 1 + len(tokens)]
    t = temperature if temperature > 0 else 1.0
    logp = torch.log_softmax(logits / t, dim=-1).gather(1, torch.tensor(tokens)[:, None]).squeeze(1)
    return logp, out.hidden_states[-1][0, : n - 1 + len(tokens)]


@torch.no_grad()
def exact_joint(hf, prompt: list[int], length: int, temperature: float, eos: int | None) -> dict[tuple, float]:
    """Every complete response of at most `length` tokens (ending at its first EOS, if any) and its
    probability under `hf` at `temperature`."""
    vocab = hf.config.vocab_size
    every = itertools.product(range(vocab), repeat=length)
    outcomes = list(dict.fromkeys(seq[: seq.index(eos) + 1] if eos in seq else seq for seq in every))
    padded = torch.tensor([prompt + list(s) + [0] * (length - len(s)) for s in outcomes])
    logp = torch.log_softmax(hf(padded).logits[:, len(prompt) - 1 : -1] / temperature, dim=-1)
    probs = {}
    for i, seq in enumerate(outcomes):
        probs[seq] = float(logp[i, torch.arange(len(seq)), torch.tensor(seq)].sum().exp())
    return probs


def drive(engine: GenerationEngine, loads: dict[int, Path]) -> tuple[dict, dict[int, int]]:
    """Step to the end, loading `loads[i]` with re-verification before step i (counted from 0); returns the
    results by request id and the speculative rounds run by then at each load."""
    done: dict = {}
    rounds_at: dict[int, int] = {}
    for i in itertools.count():
        if i in loads:
            rounds_at[i] = engine.rounds
            engine.load_policy(loads[i], reverify=True)
        if not engine.has_unfinished:
            break
        if i > max(loads, default=-1) and engine.num_parked and not engine.num_running:
            raise AssertionError("drafts parked with no version left to re-verify them")
        for r in engine.step():
            done[r.request_id] = r
    return done, rounds_at


def park_all(engine: GenerationEngine) -> None:
    """Step until every request added so far is a parked draft (none may finish: drafts wait)."""
    while engine.num_running or engine.scheduler.num_waiting:
        assert engine.step() == []


# ------------------------------------------------------------------------------------------ distribution


@pytest.mark.slow
@pytest.mark.parametrize("eos", [None, EOS])
def test_drafts_of_every_length_reverified_under_a_new_policy_follow_its_distribution(tiny, eos) -> None:
    """Drafts of 0..3 tokens from q (0: still queued at the load), re-verified under p and continued: each
    group's whole responses follow p's exact joint distribution, with p's logprobs. One-token drafts that
    were rejected follow the residual norm(max(0, p - q)) at their first token."""
    (hf_q, q_path), (hf_p, p_path), _ = tiny
    prompt, length, temperature, n = [1, 2, 3, 1, 2], 3, 0.9, 2000
    engine = GenerationEngine(load_model(q_path), 256, 8)
    eos_ids = [] if eos is None else [eos]
    for k in (1, 2, 3):
        for i in range(n):
            engine.add_request(
                prompt, length, temperature, seed=k * n + i, eos_ids=eos_ids, request_id=(k, i), ahead_limit=k
            )
    park_all(engine)
    assert engine.num_parked == 3 * n
    for i in range(n):  # drafts not started yet: nothing to verify, they just run under p
        engine.add_request(prompt, length, temperature, seed=i, eos_ids=eos_ids, request_id=(0, i), ahead_limit=1)
    done, _ = drive(engine, {0: p_path})
    assert engine.reverify_passes >= 3 * n // 256, "more drafts than slots: verified in passes, most resumed"
    expected = exact_joint(hf_p, prompt, length, temperature, eos)
    scores: dict[tuple, torch.Tensor] = {}
    for k in range(4):
        results = [done[(k, i)] for i in range(n)]
        stat, df = chi_square(Counter(tuple(r.token_ids) for r in results), expected, n)
        assert stat < chi2_threshold(df), (k, eos, stat, chi2_threshold(df))
        for r in results:
            assert (r.reverifications, r.tokens_kept + r.tokens_discarded > 0) == ((1, True) if k else (0, False))
            assert r.tokens_kept + r.tokens_discarded <= k, "a draft never runs past its budget"
            key = tuple(r.token_ids)
            if key not in scores:
                scores[key] = hf_scores(hf_p, prompt, r.token_ids, temperature)[0]
            assert torch.allclose(torch.tensor(r.logprobs), scores[key], atol=1e-4), "the new policy's logprobs"
    assert engine.tokens_kept == sum(r.tokens_kept for r in done.values())
    assert engine.tokens_discarded == sum(r.tokens_discarded for r in done.values()) > 0
    if eos is None:  # one-token drafts rejected at their only token: the residual at the root
        cut = [r.token_ids[0] for r in (done[(1, i)] for i in range(n)) if r.tokens_discarded]
        with torch.no_grad():
            p, q = (torch.softmax(hf(torch.tensor([prompt])).logits[0, -1] / temperature, -1) for hf in (hf_p, hf_q))
        rate = 1 - float(torch.minimum(p, q).sum())  # P(reject) = 1 - sum_x min(p(x), q(x))
        assert abs(len(cut) / n - rate) < 5 * math.sqrt(rate * (1 - rate) / n), (len(cut), rate)  # 5 sigma: < 1e-6
        residual = (p - q).clamp(min=0)
        residual /= residual.sum()
        # Every cut token lies where p > q (a resample from p would also give the others); where the residual
        # has more than one such token, their frequencies follow it.
        stat, df = chi_square(Counter((t,) for t in cut), {(t,): float(x) for t, x in enumerate(residual)}, len(cut))
        assert df == 0 or stat < chi2_threshold(df), (stat, Counter(cut), residual)


@pytest.mark.slow
@pytest.mark.parametrize("versions", [1, 2])
def test_version_changes_mid_generation_with_sd_and_parked_rows_leave_the_last_policys_distribution(
    tiny, versions: int
) -> None:
    """Rows running with EAGLE drafts (none, 1 or 2 tokens ahead allowed) see one or two version changes
    after their first steps, before any can finish; the first three tokens of every response follow the
    last version's exact joint distribution."""
    paths = [path for _, path in tiny]
    prompt, temperature, n = [3, 1, 4, 1], 0.9, 2400
    model = load_model(paths[0])
    torch.manual_seed(0)
    engine = GenerationEngine(
        model, n, 14, proposer=EagleProposer(Drafter(model.spec).bind(model)), arm=Arm.drafter(2, 1, 2)
    )
    for i in range(n):
        engine.add_request(prompt, 10, temperature, seed=i, request_id=i, ahead_limit=[None, 1, 2][i % 3])
    loads = {1 + v: paths[1 + v] for v in range(versions)}
    done, rounds_at = drive(engine, loads)
    assert len(done) == n and all(len(r.token_ids) == 10 for r in done.values())
    assert all(r.reverifications == versions for r in done.values())
    assert engine.rounds > rounds_at[1 + versions - 1], "speculative rounds ran after the last change"
    expected = exact_joint(tiny[versions][0], prompt, 3, temperature, None)
    stat, df = chi_square(Counter(tuple(r.token_ids[:3]) for r in done.values()), expected, n)
    assert stat < chi2_threshold(df), (versions, stat, chi2_threshold(df))


@pytest.fixture(scope="module")
def tiny_update(tiny, tmp_path_factory: pytest.TempPathFactory) -> list[tuple[torch.nn.Module, Path]]:
    """q (the first tiny version) and p, q moved by a small update: about half the old tokens are kept, so
    how each one is accepted matters."""
    return [tiny[0], next_version(tiny[0][0], tmp_path_factory.mktemp("tiny_update") / "v1", 21, 0.05)]


@torch.no_grad()
def chain(hf, prompt: list[int], length: int, pick) -> list[int]:
    """`length` tokens after `prompt`, each `pick` (argmax or argmin) of `hf`'s next-token logits."""
    tokens: list[int] = []
    for _ in range(length):
        tokens.append(int(pick(hf(torch.tensor([prompt + tokens])).logits[0, -1])))
    return tokens


@pytest.mark.slow
@pytest.mark.parametrize("history", ["good", "adversarial"])
def test_group_drafts_around_a_reverification_leave_the_new_policys_distribution(tiny_update, history) -> None:
    """Groups of 8 sibling rows of one prompt draft for each other with the group source (`GroupProposer`)
    and from a remembered history: 12 copies each of q's and p's most likely responses (good), or of their
    least likely ones (adversarial: fewer drafted tokens accepted). Two speculative steps under q (drafts
    parked after 2, 4 or 6 tokens, or running), then p is loaded with re-verification and the rows finish
    under p, with group drafts again; then q comes back for the next group. Over 300 groups, the first three
    tokens follow p's exact joint distribution (chi-square, false-alarm rate 1e-4) and every logprob is p's.
    T = 1.5 flattens the tiny model so that the ratio p/q of a drafted token matters: taking a group-drafted
    token's q as its draft's point mass (1) instead of the target's probability fails here, as do keeping
    every old token and resampling a rejection from p instead of the residual."""
    (hf_q, q_path), (hf_p, p_path) = tiny_update
    prompt, temperature, max_new, size, groups = [3, 1, 4, 1], 1.5, 10, 8, 300
    pick = torch.argmax if history == "good" else torch.argmin
    remembered = [chain(hf, prompt, max_new, pick) for hf in (hf_q, hf_p)]
    proposer = GroupProposer(max_match=4, max_docs=24)
    engine = GenerationEngine(
        load_model(q_path), size, len(prompt) + max_new, proposer=proposer, arm=Arm.group_source(3, 4)
    )
    done: dict = {}
    accepted = Counter()
    for g in range(groups):
        for response in remembered * 12:  # the newest history: the 24 finished responses the index keeps
            proposer.remember(prompt, response)
        for i in range(size):
            engine.add_request(
                prompt, max_new, temperature, seed=g * size + i, request_id=(g, i), ahead_limit=[None, 2, 4, 6][i % 4]
            )
        accepted["q"] -= engine.accepted_by["group"]
        assert engine.step() == [] and engine.step() == [], "nothing finishes under q: 1 + 2 x 4 < 10 tokens"
        accepted["q"] += engine.accepted_by["group"]
        accepted["p"] -= engine.accepted_by["group"]
        engine.load_policy(p_path, reverify=True)
        while engine.has_unfinished:
            done.update((r.request_id, r) for r in engine.step())
        accepted["p"] += engine.accepted_by["group"]
        engine.load_policy(q_path)
    assert accepted["q"] > 0 and accepted["p"] > 0, "group drafts were accepted under both versions"
    results = list(done.values())
    assert len(results) == size * groups and all(r.reverifications == 1 for r in results)
    expected = exact_joint(hf_p, prompt, 3, temperature, None)
    stat, df = chi_square(Counter(tuple(r.token_ids[:3]) for r in results), expected, len(results))
    assert stat < chi2_threshold(df), (history, stat, chi2_threshold(df))
    assert sum(r.tokens_kept for r in results) > 0 and sum(r.tokens_discarded for r in results) > 0
    ids = torch.tensor([prompt + r.token_ids for r in results])
    with torch.no_grad():
        logp = torch.log_softmax(hf_p(ids).logits[:, len(prompt) - 1 : -1] / temperature, dim=-1)
    scored = logp.gather(2, ids[:, len(prompt) :, None]).squeeze(2)
    assert torch.allclose(torch.tensor([r.logprobs for r in results]), scored, atol=1e-4), "p's logprobs"


# ----------------------------------------------------------------------------------------------- greedy

PROMPTS = [[5, 9, 12, 7], [8, 3, 3], [30, 31, 32, 33, 34, 35, 36], [2], [17, 4, 4, 4, 17, 4], [9, 9]]
LIMITS = [None, 3, 1, None, 7, 40]


def sd_engine(model, kind: str, max_batch: int, max_prefill_tokens: int | None = None) -> GenerationEngine:
    torch.manual_seed(1)
    if kind == "plain":
        return GenerationEngine(model, max_batch, 64, max_prefill_tokens=max_prefill_tokens)
    eagle = EagleProposer(Drafter(model.spec).bind(model))
    proposer, arm = {
        "eagle-chain": (eagle, Arm.drafter(3, 1, 3)),
        "eagle-tree": (eagle, Arm.drafter(3, 2, 5)),
        "mixed": (MixedProposer(eagle, GroupProposer(max_match=4)), Arm.mixed(2, 2, 3, 4)),
    }[kind]
    return GenerationEngine(model, max_batch, 64, max_prefill_tokens=max_prefill_tokens, proposer=proposer, arm=arm)


@pytest.mark.parametrize("kind", ["plain", "eagle-chain", "eagle-tree", "mixed"])
def test_greedy_rows_after_a_version_change_are_the_new_policys_greedy_responses(wide, kind: str) -> None:
    """Running, parked and queued rows (3 slots for 6 requests, a small prefill budget) see a version change
    at step 4: every response is token-identical to transformers' greedy response of the new policy, and
    the tokens kept are exactly the old greedy response's agreement with the new one."""
    (hf_q, q_path), (hf_p, p_path), _ = wide
    max_new = 24
    old = [hf_greedy(hf_q, p, max_new) for p in PROMPTS]
    new = [hf_greedy(hf_p, p, max_new) for p in PROMPTS]
    assert any(len(r) < max_new for r in new), "some rows stop early on EOS"
    engine = sd_engine(load_model(q_path), kind, 3, max_prefill_tokens=16)
    for i, (p, limit) in enumerate(zip(PROMPTS, LIMITS, strict=True)):
        engine.add_request(p, max_new, 0.0, eos_ids=[EOS], request_id=i, return_hidden=True, ahead_limit=limit)
    done, rounds_at = drive(engine, {4: p_path})
    for i, p in enumerate(PROMPTS):
        r = done[i]
        assert r.token_ids == new[i], (kind, i)
        scored, hidden = hf_scores(hf_p, p, r.token_ids, 0.0)
        assert torch.allclose(torch.tensor(r.logprobs), scored, atol=1e-4)
        assert torch.allclose(torch.cat([r.prompt_hidden, r.hidden]), hidden, atol=1e-4), "the new policy's states"
        checked = r.tokens_kept + r.tokens_discarded
        agree = next((j for j, (a, b) in enumerate(zip(old[i], new[i], strict=False)) if a != b), len(old[i]))
        assert r.tokens_kept == min(agree, checked), (i, r.tokens_kept, checked, agree)
        assert checked <= min(LIMITS[i] or max_new, len(old[i])), "the old response, at most its budget, was checked"
    assert sum(r.reverifications for r in done.values()) >= 3, "rows in flight were re-verified"
    assert sum(r.tokens_discarded for r in done.values()) > 0 and engine.tokens_kept > 0
    if kind != "plain":
        assert engine.rounds > rounds_at[4], "SD went on after the change"


def test_greedy_rows_through_two_version_changes_are_the_last_policys(wide) -> None:
    paths = [path for _, path in wide]
    expected = [hf_greedy(wide[2][0], p, 30) for p in PROMPTS]
    engine = sd_engine(load_model(paths[0]), "eagle-tree", 4)
    for i, (p, limit) in enumerate(zip(PROMPTS, LIMITS, strict=True)):
        engine.add_request(p, 30, 0.0, eos_ids=[EOS], request_id=i, ahead_limit=limit)
    done, _ = drive(engine, {3: paths[1], 6: paths[2]})
    assert [done[i].token_ids for i in range(len(PROMPTS))] == expected
    assert max(r.reverifications for r in done.values()) == 2


@pytest.mark.parametrize("kind", ["plain", "eagle-tree", "mixed"])
def test_logprobs_after_two_version_changes_while_rows_run_are_the_newest_policys(wide, kind: str) -> None:
    """Rows at T = 0.9 and T = 0 (8 slots for 12 requests, some of them drafts parked ahead) run through two
    version changes: every response's logprobs, over the tokens kept through both re-verifications and the
    ones generated after, are the last version's (transformers), and tokens were both kept and generated
    after the second change. (A row finished between the changes carries the version it finished under.)
    Leaving the first version's logprobs on the tokens the second change kept fails here."""
    paths = [path for _, path in wide]
    engine = sd_engine(load_model(paths[0]), kind, 8)
    requests = {}
    for i, (prompt, limit) in enumerate(itertools.product(PROMPTS, [None, 4])):
        temperature = 0.9 if i % 3 else 0.0
        requests[i] = (prompt, temperature)
        engine.add_request(prompt, 24, temperature, seed=90 + i, eos_ids=[EOS], request_id=i, ahead_limit=limit)
    done: dict = {}
    version: dict = {}
    counts = []
    loads = {3: paths[1], 6: paths[2]}
    for step in itertools.count():
        if step in loads:
            counts.append((engine.tokens_kept, engine.tokens_generated))
            engine.load_policy(loads[step], reverify=True)
            counts.append((engine.tokens_kept, engine.tokens_generated))
        if not engine.has_unfinished:
            break
        for r in engine.step():
            done[r.request_id], version[r.request_id] = r, sum(at <= step for at in loads)
    assert len(done) == len(requests)
    assert counts[3][0] > counts[2][0], "the second change kept tokens"
    assert engine.tokens_generated > counts[3][1], "tokens were generated after it"
    assert sum(r.reverifications == 2 for r in done.values()) >= 6
    for i, r in done.items():
        prompt, temperature = requests[i]
        assert r.reverifications <= version[i]
        scored = hf_scores(wide[version[i]][0], prompt, r.token_ids, temperature)[0]
        assert torch.allclose(torch.tensor(r.logprobs), scored, atol=1e-4), (kind, i, version[i])


# ---------------------------------------------------------------------------------------- batch and rows


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_batched_reverification_gives_the_rows_of_one_by_one(wide, temperature: float) -> None:
    """Drafts of mixed prompt and partial lengths, re-verified as one batch (4 slots for 6 requests, a
    prefill budget that splits the passes: some verified in place, some resumed) or each alone."""
    (_, q_path), (_, p_path), _ = wide

    def run(rows: list[int], max_batch: int, budget: int | None) -> dict:
        engine = GenerationEngine(load_model(q_path), max_batch, 64, max_prefill_tokens=budget)
        for i in rows:
            limit = [2, 5, 1, 9, 3, 6][i]
            engine.add_request(
                PROMPTS[i], 20, temperature, seed=40 + i, eos_ids=[EOS], request_id=i, return_hidden=True,
                ahead_limit=limit,
            )  # fmt: skip
        park_all(engine)
        engine.load_policy(p_path, reverify=True)
        done, _ = drive(engine, {})
        return done

    batched = run(list(range(len(PROMPTS))), 4, 24)
    alone = {i: run([i], 1, None)[i] for i in range(len(PROMPTS))}
    for i in range(len(PROMPTS)):
        a, b = batched[i], alone[i]
        assert a.token_ids == b.token_ids, i
        assert (a.tokens_kept, a.tokens_discarded, a.reverifications) == (b.tokens_kept, b.tokens_discarded, 1)
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-4
        assert torch.allclose(a.hidden, b.hidden, atol=1e-4) and torch.allclose(
            a.prompt_hidden, b.prompt_hidden, atol=1e-4
        )
    assert sum(r.tokens_discarded for r in batched.values()) > 0


def test_each_old_response_is_re_verified_as_its_own_rows_draft_only(wide) -> None:
    """Sixteen rows of one prompt at T = 1 (their responses differ) drafting for each other (EAGLE and the
    group source) in 6 slots: running, parked (2 or 5 tokens ahead) and not yet started at the version
    change. Per request id: the tokens kept are a prefix of that row's own tokens before the change, kept +
    discarded is its own length, a rejected token is one the new policy gives less probability than the old
    one did (else it is always kept) and is not the token that follows, and the logprobs are the new
    policy's of the row's own response. Handing a sibling's old response to a row, or verifying a row's
    tokens with a sibling's as the draft, fails here."""
    (_, q_path), (hf_p, p_path), _ = wide
    prompt, temperature, rows = PROMPTS[0], 1.0, 16
    engine = sd_engine(load_model(q_path), "mixed", 6)
    for i in range(rows):
        engine.add_request(
            prompt, 20, temperature, seed=70 + i, eos_ids=[EOS], request_id=i, ahead_limit=[None, 2, 5, None][i % 4]
        )
    done: dict = {}
    for _ in range(4):
        done.update((r.request_id, r) for r in engine.step())
    sched = engine.scheduler
    held = [*sched.running, *sched.parked, *(s for s in sched.waiting if s.token_ids)]
    before = {s.request_id: (list(s.token_ids), list(s.logprobs)) for s in held}
    assert len(before) >= 8 and sched.num_parked >= 2 and sched.num_running >= 4
    assert len({tuple(tokens) for tokens, _ in before.values()}) == len(before), "the rows' drafts differ"
    engine.load_policy(p_path, reverify=True)
    done.update(drive(engine, {})[0])
    assert len(done) == rows
    rejected = 0
    for rid, (old, old_logp) in before.items():
        r = done[rid]
        kept = r.tokens_kept
        assert r.token_ids[:kept] == old[:kept], (rid, "kept a prefix of another row's tokens")
        assert r.reverifications == 1 and kept + r.tokens_discarded == len(old), rid
        scored = hf_scores(hf_p, prompt, r.token_ids, temperature)[0]
        assert torch.allclose(torch.tensor(r.logprobs), scored, atol=1e-4), rid
        if kept < len(old):
            rejected += 1
            assert r.token_ids[kept] != old[kept], (rid, "a rejected token never comes back")
            p_old = hf_scores(hf_p, prompt, old[: kept + 1], temperature)[0][kept]
            assert float(p_old) < old_logp[kept], (rid, "rejected a token the new policy gives more probability")
    assert rejected >= 2 and sum(done[rid].tokens_kept for rid in before) > 0


def test_the_rows_random_stream_goes_on_through_a_reverification(tiny) -> None:
    """The engine's tokens equal a replica of the rule on transformers' distributions that draws, from one
    generator per request: a uniform per draft token, then k + 1 (acceptance, then the next token), then a
    uniform per token. A replica that re-seeds the generator at the re-verification does not match."""
    (hf_q, q_path), (hf_p, p_path), _ = tiny
    prompt, temperature, k, max_new = [2, 4, 1], 0.9, 2, 5

    @torch.no_grad()
    def dist(hf, seq: list[int]) -> torch.Tensor:
        return torch.softmax(hf(torch.tensor([seq])).logits[0, -1].double() / temperature, dim=-1)

    def draw(probs: torch.Tensor, u: torch.Tensor) -> int:
        return int(sample_from(probs[None], u.view(1)))

    def replica(seed: int, reseed: bool) -> list[int]:
        g = torch.Generator().manual_seed(seed)
        tokens: list[int] = []
        while len(tokens) < k:
            tokens.append(draw(dist(hf_q, prompt + tokens), torch.rand((), generator=g, dtype=torch.float64)))
        if reseed:
            g.manual_seed(seed)
        u = torch.rand(k + 1, generator=g, dtype=torch.float64)
        kept = 0
        while kept < k:
            p, q = (dist(hf, prompt + tokens[:kept])[tokens[kept]] for hf in (hf_p, hf_q))
            if not u[kept] * q < p:
                break
            kept += 1
        p_next = dist(hf_p, prompt + tokens[:kept])
        weights = (p_next - dist(hf_q, prompt + tokens[:kept])).clamp(min=0) if kept < k else p_next
        tokens = [*tokens[:kept], draw(weights, u[k])]
        while len(tokens) < max_new:
            tokens.append(draw(dist(hf_p, prompt + tokens), torch.rand((), generator=g, dtype=torch.float64)))
        return tokens

    engine = GenerationEngine(load_model(q_path), 8, 16)
    seeds = range(24)
    for s in seeds:
        engine.add_request(prompt, max_new, temperature, seed=s, request_id=s, ahead_limit=k)
    park_all(engine)
    done, _ = drive(engine, {0: p_path})
    got = [done[s].token_ids for s in seeds]
    assert got == [replica(s, reseed=False) for s in seeds]
    assert got != [replica(s, reseed=True) for s in seeds], "the check tells a re-seeded stream apart"
    assert any(done[s].tokens_discarded for s in seeds) and any(done[s].tokens_kept == k for s in seeds)


def test_parked_drafts_wait_for_a_reverifying_load_and_nothing_else(wide, tmp_path: Path) -> None:
    (_, q_path), (_, p_path), _ = wide
    engine = GenerationEngine(load_model(q_path), 2, 32)
    engine.add_request(PROMPTS[0], 10, 0.0, request_id="a", ahead_limit=2)
    park_all(engine)
    assert (engine.num_parked, engine.num_running, engine.has_unfinished) == (1, 0, True)
    assert engine.step() == [] and engine.num_parked == 1, "stepping does not release a parked draft"
    with pytest.raises(RuntimeError, match="in flight"):
        engine.load_policy(p_path)
    engine.load_policy(p_path, reverify=True)
    assert engine.num_parked == 0 and engine.num_running == 1
    done, _ = drive(engine, {})
    assert done["a"].reverifications == 1 and len(done["a"].token_ids) == 10


def count_forwards(model: torch.nn.Module, counter: Counter) -> None:
    """Count `model`'s forward passes in `counter["forwards"]` (once per model object)."""
    if getattr(model, "_counted", False):
        return
    real = model.forward

    def counted(*args: object, **kwargs: object) -> object:
        counter["forwards"] += 1
        return real(*args, **kwargs)

    model.forward, model._counted = counted, True


def test_a_sample_counts_the_forwards_of_discarded_tokens_too(tiny) -> None:
    """Drafts that ran ahead under q with SD accepting whole rounds (an oracle of q's greedy response), then
    lost most of their tokens to p's re-verification, some ending soon after on EOS: the SD rounds that
    emitted the discarded tokens stay in `accept_lengths`, so a tokens-per-forward figure over the kept
    tokens alone had a count of forwards at or below zero (a worker once streamed such a sample; the
    learner could not decode it, and the on-policy step waited for it). The sample's `accept_length` is the
    tokens emitted over the target forwards that emitted them: it survives the wire, lies between 1 and a
    round's most (depth + 1), and is at least the emitted tokens over every target forward the engine ran
    for the request (counted here by wrapping the policy's forward)."""
    from tlt_stream.basics.messages import PromptGroup, codec_for
    from tlt_stream.rl.samples import make_sample
    from tlt_stream.rollout.proposers import OracleProposer

    (hf_q, q_path), (_, p_path), _ = tiny
    codec, arm, max_new = codec_for("samples"), Arm.drafter(3, 1, 3), 14
    kept_too_few = 0
    for prompt in ([a, b] for a in range(1, 5) for b in range(5)):
        model, counter = load_model(q_path), Counter()
        oracle = OracleProposer({tuple(prompt[1:]): hf_greedy(hf_q, prompt, max_new)}, TINY["vocab_size"])
        engine = GenerationEngine(model, 1, 64, proposer=oracle, arm=arm)
        count_forwards(engine.model, counter)
        engine.add_request(prompt, max_new, 0.0, eos_ids=[EOS], request_id=0, ahead_limit=13)
        park_all(engine)
        engine.load_policy(p_path, reverify=True)
        count_forwards(engine.model, counter)  # the same object, or a new one: its forwards count too
        (result,) = drive(engine, {})[0].values()
        accepts, emitted = result.accept_lengths, len(result.token_ids) + result.tokens_discarded
        kept_too_few += sum(accepts) >= len(accepts) + len(result.token_ids)
        group = PromptGroup(task_id="s000001-0001", prompt_id="p", prompt_ids=prompt, answer="1", group_size=1)
        sample = make_sample(
            result, group, 0, reward=0.0, policy_version=1, drafter_version=0, worker_id="w", gen_seconds=0.1
        )
        assert codec.decode(codec.encode(sample)).accept_length == sample.accept_length
        assert 1.0 <= sample.accept_length <= arm.depth + 1, (prompt, sample.accept_length)
        assert sample.accept_length >= emitted / counter["forwards"] - 1e-9, (prompt, emitted, counter)
    assert kept_too_few, "some draft's rounds emitted more tokens than its rounds and kept tokens (the case)"
