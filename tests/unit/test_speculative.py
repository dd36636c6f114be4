"""Speculative decoding is lossless: greedy output is token-identical to plain decoding and to transformers,
sampled output follows the target distribution exactly, and reported logprobs are the target's.

Proposers under test: the EAGLE drafter (random, i.e. bad, weights; chain and tree arms), the n-gram
proposer, and `OracleProposer`, which knows the reference greedy continuation and hides the right token
among wrong siblings at every level, so deep acceptance and KV compaction are exercised.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from tlt_stream.drafter.model import Drafter, load_drafter, save_drafter
from tlt_stream.model import load_model
from tlt_stream.rollout.acceptance import DraftTree
from tlt_stream.rollout.arms import Arm
from tlt_stream.rollout.engine import GenerationEngine
from tlt_stream.rollout.proposers import (
    EagleProposer,
    GroupProposer,
    MixedProposer,
    NgramProposer,
    OracleProposer,
    Proposal,
)

# One xdist worker runs this module, so its module-scoped fixtures are built once.
pytestmark = pytest.mark.xdist_group("test_speculative")

VOCAB = 41
EOS = 0


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory):
    config = Qwen2Config(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        initializer_range=0.25,
    )
    torch.manual_seed(3)
    hf = AutoModelForCausalLM.from_config(config).eval()
    path = tmp_path_factory.mktemp("target")
    hf.save_pretrained(path, safe_serialization=True)
    return hf, load_model(path)


def prompts(seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [6, 1, 11, 3, 8, 2, 14]
    out = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in lengths]
    out[3] = [5, 6, 7, 5, 6, 7, 5, 6]  # repetitive: n-gram lookups hit
    return out


def hf_greedy(hf, prompt: list[int], max_new: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new,
        do_sample=False,
        eos_token_id=EOS,
        pad_token_id=EOS,
    )[0, len(prompt) :].tolist()
    return out[: out.index(EOS) + 1] if EOS in out else out


def eagle(model, seed: int = 0) -> EagleProposer:
    torch.manual_seed(seed)
    return EagleProposer(Drafter(model.spec).bind(model))


@pytest.mark.parametrize(
    ("proposer_kind", "arm"),
    [
        ("eagle", Arm.drafter(4, 1, 4)),
        ("eagle", Arm.drafter(3, 3, 12)),
        ("ngram", Arm.drafter(5, 1, 5)),
        ("scripted", Arm.drafter(4, 1, 4)),
        ("scripted", Arm.drafter(5, 3, 15)),
    ],
)
def test_greedy_speculative_equals_plain_and_transformers(models, proposer_kind: str, arm: Arm) -> None:
    hf, model = models
    ps = prompts()
    reference = [hf_greedy(hf, p, 24) for p in ps]
    assert any(len(r) < 24 for r in reference), "some rows stop early on EOS"
    plain = GenerationEngine(model, 3, 64).generate(ps, 24, eos_ids=[EOS])
    assert [r.token_ids for r in plain] == reference
    if proposer_kind == "eagle":
        proposer = eagle(model)
    elif proposer_kind == "ngram":
        proposer = NgramProposer()
    else:
        proposer = OracleProposer({tuple(p[1:]): r for p, r in zip(ps, reference, strict=True)}, VOCAB)
    engine = GenerationEngine(model, 3, 64, proposer=proposer, arm=arm)
    results = engine.generate(ps, 24, eos_ids=[EOS])
    assert [r.token_ids for r in results] == reference
    for spec, ref in zip(results, plain, strict=True):
        assert spec.finish_reason == ref.finish_reason
        assert max(abs(a - b) for a, b in zip(spec.logprobs, ref.logprobs, strict=True)) < 1e-4
        assert sum(spec.accept_lengths) == len(spec.token_ids) - 1, "every token after prefill came from SD"
    if proposer_kind == "scripted":
        rounds = [a for r in results for a in r.accept_lengths]
        assert max(rounds) == arm.depth + 1, "the scripted path is accepted to full depth plus the bonus"


def test_switching_sd_on_and_off_mid_sequence_is_lossless(models) -> None:
    _, model = models
    ps = prompts(1)
    plain = GenerationEngine(model, 4, 64).generate(ps, 20, eos_ids=[EOS])
    engine = GenerationEngine(model, 4, 64, proposer=eagle(model, 1))
    ids = [engine.add_request(p, 20, eos_ids=[EOS]) for p in ps]
    arms = itertools.cycle([None, Arm.drafter(3, 1, 3), Arm.drafter(2, 2, 4), None, None, Arm.drafter(4, 2, 6)])
    done = {}
    while engine.has_unfinished:
        engine.arm = next(arms)
        for r in engine.step():
            done[r.request_id] = r
    assert [done[i].token_ids for i in ids] == [r.token_ids for r in plain]


def test_hidden_states_and_logprobs_match_a_full_forward(models) -> None:
    hf, model = models
    ps = prompts(2)[:4]
    engine = GenerationEngine(model, 4, 64, proposer=eagle(model, 2), arm=Arm.drafter(3, 2, 6))
    results = engine.generate(ps, 12, temperature=0.8, seed=5, return_hidden=True)
    for r in results:
        ids = torch.tensor([r.prompt_ids + r.token_ids])
        out = hf(ids, output_hidden_states=True)
        n = len(r.prompt_ids)
        logits = out.logits[0, n - 1 : n - 1 + len(r.token_ids)]
        expected = torch.log_softmax(logits / 0.8, dim=-1).gather(1, torch.tensor(r.token_ids)[:, None]).squeeze(1)
        assert torch.allclose(torch.tensor(r.logprobs), expected, atol=1e-4)
        hidden = out.hidden_states[-1][0, n - 1 : n - 1 + len(r.token_ids)]
        assert torch.allclose(r.hidden, hidden, atol=1e-4)


def test_drafter_catch_up_matches_a_full_drafter_forward(models) -> None:
    """After rounds of drafting, rollback and catch-up, the drafter's cache equals a clean recomputation."""
    _, model = models
    proposer = eagle(model, 4)
    engine = GenerationEngine(model, 2, 64, proposer=proposer, arm=Arm.drafter(3, 2, 6))
    engine.add_request(prompts(4)[2], 15, request_id="a", return_hidden=True)
    for _ in range(4):
        engine.step()
    seq = engine.scheduler.running[0]
    # Feed the pending pairs, then compare the drafter's last prediction with one full forward.
    root = proposer._catch_up(1)  # [1, H]
    tokens = seq.prompt_ids[1:] + seq.token_ids
    full_model_hidden = model(
        torch.tensor([seq.prompt_ids + seq.token_ids[:-1]]),
        torch.arange(len(tokens))[None],
        model.new_cache(1, 128),
    )[0]  # target features at positions 0..L-1
    fresh = proposer.drafter.new_cache(1, 128)
    drafted = proposer.drafter(
        torch.tensor([tokens]), full_model_hidden[None], torch.arange(1, len(tokens) + 1)[None], fresh
    )
    assert int(proposer.cache.lengths[0]) == len(tokens)
    assert torch.allclose(root[0], drafted[0, -1], atol=1e-4)


def test_drafter_save_load_round_trip(models, tmp_path) -> None:
    _, model = models
    torch.manual_seed(9)
    drafter = Drafter(model.spec).bind(model)
    save_drafter(drafter, tmp_path / "d", metadata={"policy_version": 3})
    loaded = load_drafter(tmp_path / "d", model)
    assert set(loaded.state_dict()) == {k for k in drafter.state_dict()}
    assert all(
        torch.equal(a, b) for a, b in zip(drafter.state_dict().values(), loaded.state_dict().values(), strict=True)
    )
    assert "embed" not in " ".join(loaded.state_dict()), "the borrowed embedding and head are not saved"


# ------------------------------------------------------------------------------------------- distribution

ALPHA_Z = 3.719  # false-alarm rate 1e-4


def chi2_threshold(df: int) -> float:
    return df * (1 - 2 / (9 * df) + ALPHA_Z * math.sqrt(2 / (9 * df))) ** 3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    config = Qwen2Config(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=4,
        initializer_range=0.5,
    )
    torch.manual_seed(11)
    hf = AutoModelForCausalLM.from_config(config).eval()
    path = tmp_path_factory.mktemp("tiny")
    hf.save_pretrained(path, safe_serialization=True)
    return hf, load_model(path)


class SelfProposer:
    """Drafts with the target itself (q = p): chains are always accepted, so the bonus path is exercised;
    trees propose the target's top-k at every level. Needs to know the first prompt token."""

    def __init__(self, hf, first_token: int, temperature: float, seed: int = 0) -> None:
        self.hf, self.first, self.temperature = hf, first_token, temperature
        self.history: dict[int, list[int]] = {}
        self.rng = torch.Generator().manual_seed(seed)

    def allocate(self, max_batch: int, max_len: int) -> None:
        pass

    def reset_slot(self, slot: int, prompt=()) -> None:
        self.history[slot] = [self.first]

    def move_slot(self, src: int, dst: int) -> None:
        self.history[dst] = self.history.pop(src)

    def observe(self, slot: int, tokens: list[int], features: torch.Tensor) -> None:
        self.history[slot].extend(tokens)

    def observe_step(self, rows: list[int], tokens: list[int], features: torch.Tensor) -> None:
        for row, token in zip(rows, tokens, strict=True):
            self.history[row].append(token)

    @torch.no_grad()
    def _p(self, seq: list[int]) -> torch.Tensor:
        return torch.softmax(self.hf(torch.tensor([seq])).logits[0, -1] / self.temperature, dim=-1)

    def propose(self, batch: int, arm: Arm, temperatures: torch.Tensor, generators: list) -> Proposal:
        tokens, parents, qs = [], [], []
        for slot in range(batch):
            seq = list(self.history[slot])
            if arm.topk == 1:
                row, row_q = [], []
                for _ in range(arm.depth):
                    p = self._p(seq)
                    x = int(torch.multinomial(p, 1, generator=self.rng))
                    row.append(x)
                    row_q.append(p)
                    seq.append(x)
                tokens.append(row)
                qs.append(torch.stack(row_q))
                parents.append(list(range(arm.depth)))
            else:
                top = self._p(seq).topk(arm.topk).indices.tolist()
                row, row_parents = list(top), [0] * len(top)
                best = self._p([*seq, top[0]]).topk(arm.topk).indices.tolist()
                row += best
                row_parents += [1] * len(best)
                tokens.append(row[: arm.verify])
                parents.append(row_parents[: arm.verify])
        tree = DraftTree(torch.tensor(tokens), torch.tensor(parents))
        return Proposal(tree, torch.stack(qs) if arm.topk == 1 else None)


def exact_joint(hf, prompt: list[int], length: int, temperature: float) -> dict[tuple[int, ...], float]:
    probs: dict[tuple[int, ...], float] = {}
    for seq in itertools.product(range(4), repeat=length):
        logits = hf(torch.tensor([prompt + list(seq)])).logits[0, len(prompt) - 1 : len(prompt) - 1 + length]
        logp = torch.log_softmax(logits / temperature, dim=-1).gather(1, torch.tensor(seq)[:, None]).sum()
        probs[seq] = float(logp.exp().detach())
    return probs


@pytest.mark.slow
@pytest.mark.parametrize(
    "mode",
    [
        "eagle-chain",
        "eagle-tree",
        "ngram",
        "self-chain",
        "self-tree",
        "group-good",
        "group-adversarial",
        "mixed",
        "either",
        "either-adversarial",
    ],
)
def test_sampled_speculative_output_follows_the_target_distribution(tiny, mode: str) -> None:
    hf, model = tiny
    prompt, length, temperature, n = [1, 2, 3, 1, 2], 3, 0.9, 6000
    expected = exact_joint(hf, prompt, length, temperature)
    if mode == "ngram":
        proposer, arm = NgramProposer(), Arm.drafter(3, 1, 3)
    elif mode.startswith("group"):  # the 6000 rows are one prompt's siblings: what they write is indexed
        proposer, arm = GroupProposer(), Arm.group_source(3, 4)
        if mode == "group-adversarial":  # history that always proposes the target's least likely tokens
            worst = min(expected, key=expected.__getitem__)
            for _ in range(50):
                proposer.remember(prompt, list(worst))
    elif mode == "mixed":
        torch.manual_seed(0)
        proposer = MixedProposer(EagleProposer(Drafter(model.spec).bind(model)), GroupProposer())
        arm = Arm.mixed(2, 2, 3, group_nodes=3)
    elif mode.startswith("either"):  # EAGLE's sampled chains (with q) and group chains (point masses) in a batch
        torch.manual_seed(0)
        group = GroupProposer(strong_match=2)
        if mode == "either-adversarial":
            worst = min(expected, key=expected.__getitem__)
            for _ in range(50):
                group.remember(prompt, list(worst))
        proposer = MixedProposer(EagleProposer(Drafter(model.spec).bind(model)), group)
        arm = Arm.either(3, 3)
    elif mode.startswith("self"):
        proposer = SelfProposer(hf, prompt[0], temperature)
        arm = Arm.drafter(1, 1, 1) if mode == "self-chain" else Arm.drafter(2, 3, 6)
        n = 3000
    else:
        torch.manual_seed(0)
        proposer = EagleProposer(Drafter(model.spec).bind(model))
        arm = Arm.drafter(3, 1, 3) if mode == "eagle-chain" else Arm.drafter(2, 3, 6)
    engine = GenerationEngine(model, 64, 16, proposer=proposer, arm=arm)
    results = engine.generate([prompt] * n, length, temperature, seed=1000)
    observed = Counter(tuple(r.token_ids) for r in results)
    assert engine.rounds > 0 and any(len(r.accept_lengths) for r in results)
    if mode == "self-chain":  # q = p: the draft is always accepted and the bonus token follows
        assert all(r.accept_lengths == [2] for r in results)
    if mode.startswith(("group", "mixed", "either")):
        assert engine.drafted_by["group"] > 0 and engine.accepted_by["group"] > 0, dict(engine.accepted_by)
    if mode.startswith("either"):
        assert engine.drafted_by["eagle"] > 0, "rows took EAGLE's chain where the group's match was weak"
    if mode.endswith("adversarial"):
        assert engine.accepted_by["group"] < 0.5 * engine.drafted_by["group"], "bad drafts are mostly refused"
    # Merge cells expected below 5 into one, then a chi-square test at a 1e-4 false-alarm rate.
    stat, df, rest_e, rest_o = 0.0, -1, 0.0, 0
    for key, p in expected.items():
        if p * n < 5:
            rest_e += p * n
            rest_o += observed.get(key, 0)
            continue
        stat += (observed.get(key, 0) - p * n) ** 2 / (p * n)
        df += 1
    if rest_e > 0:
        stat += (rest_o - rest_e) ** 2 / rest_e
        df += 1
    assert stat < chi2_threshold(df), (mode, stat, chi2_threshold(df))


class TwoLetters:
    """A stand-in tokenizer: token t decodes to one or two letters of x/y/z (EOS to nothing), so stop
    strings span tokens and end inside one."""

    @staticmethod
    def piece(t: int) -> str:
        if t == EOS:
            return ""
        return "xyz"[t % 3] + ("" if t % 2 else "xyz"[(t // 3) % 3])

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(self.piece(t) for t in ids)


@pytest.mark.parametrize("proposer_kind", ["plain", "eagle", "ngram", "scripted"])
def test_a_stop_string_ends_a_response_at_the_token_completing_it_with_and_without_sd(
    models, proposer_kind: str
) -> None:
    from tlt_stream.rollout.stops import StopStrings

    hf, model = models
    ps = prompts()
    reference = [hf_greedy(hf, p, 24) for p in ps]
    strings = ["zyx", "yy"]

    def cut(tokens: list[int]) -> tuple[list[int], bool]:  # the oracle: the whole text decoded at each length
        for n in range(1, len(tokens) + 1):
            text = "".join(TwoLetters.piece(t) for t in tokens[:n])
            if any(s in text for s in strings):
                return tokens[:n], tokens[n - 1] != EOS
        return tokens, False

    expected = [cut(r) for r in reference]
    stopped = [by_string for _, by_string in expected]
    assert any(stopped) and not all(stopped), "some rows stop at a string, some at EOS or the limit"
    if proposer_kind == "plain":
        engine = GenerationEngine(model, 3, 64)
    elif proposer_kind == "eagle":
        engine = GenerationEngine(model, 3, 64, proposer=eagle(model), arm=Arm.drafter(3, 3, 12))
    elif proposer_kind == "ngram":
        engine = GenerationEngine(model, 3, 64, proposer=NgramProposer(), arm=Arm.ngram(4))
    else:  # accepts whole chains: the stop lands inside an accepted chain, whose rest must be dropped
        oracle = OracleProposer({tuple(p[1:]): r for p, r in zip(ps, reference, strict=True)}, VOCAB)
        engine = GenerationEngine(model, 3, 64, proposer=oracle, arm=Arm.drafter(5, 3, 15))
    results = engine.generate(ps, 24, eos_ids=[EOS], stop=StopStrings(TwoLetters(), strings))
    for result, (tokens, by_string) in zip(results, expected, strict=True):
        assert result.token_ids == tokens
        assert (result.finish_reason == "stop") == by_string
        assert len(result.logprobs) == len(tokens)


@pytest.mark.parametrize("kind", ["group", "mixed", "either"])
def test_greedy_with_group_and_history_drafts_equals_transformers_even_when_they_disagree(models, kind: str) -> None:
    """Siblings (each prompt three times, mixed lengths), history that agrees for a while and then diverges,
    history of noise, and early EOS: greedy output is transformers' token for token, logprobs the target's."""
    hf, model = models
    ps = prompts()
    reference = {tuple(p): hf_greedy(hf, p, 24) for p in ps}
    assert any(len(r) < 24 for r in reference.values()), "some rows stop early on EOS"
    group = GroupProposer(max_match=6, strong_match=3)
    g = torch.Generator().manual_seed(5)
    for p, ref in reference.items():
        cut = len(ref) // 2
        group.remember(p, ref[:cut] + torch.randint(1, VOCAB, (12,), generator=g).tolist())  # diverges
        group.remember(p, torch.randint(0, VOCAB, (20,), generator=g).tolist())  # noise
    if kind == "group":
        engine = GenerationEngine(model, 8, 64, proposer=group, arm=Arm.group_source(6, 8))
    elif kind == "mixed":
        engine = GenerationEngine(model, 8, 64, proposer=MixedProposer(eagle(model), group), arm=Arm.mixed(3, 2, 4, 6))
    else:  # per row and round: the group's chain where the match is strong, else EAGLE's
        engine = GenerationEngine(model, 8, 64, proposer=MixedProposer(eagle(model), group), arm=Arm.either(3, 6))
    siblings = [p for p in ps for _ in range(3)]
    results = engine.generate(siblings, 24, eos_ids=[EOS])
    plain = GenerationEngine(model, 8, 64).generate(siblings, 24, eos_ids=[EOS])
    for p, spec, ref in zip(siblings, results, plain, strict=True):
        assert spec.token_ids == reference[tuple(p)] == ref.token_ids
        assert spec.finish_reason == ref.finish_reason
        assert max(abs(a - b) for a, b in zip(spec.logprobs, ref.logprobs, strict=True)) < 1e-4
    assert engine.accepted_by["group"] > 0, "history and siblings drafted accepted tokens"
    assert engine.drafted_by["group"] > engine.accepted_by["group"], "and some drafts were wrong"
    if kind in ("mixed", "either"):
        assert engine.drafted_by["eagle"] > 0


@pytest.mark.parametrize("arm", [Arm.either(1, 8), Arm.mixed(1, 1, 1, 8)], ids=lambda a: a.label)
def test_a_group_chain_deeper_than_the_drafter_emits_beyond_depth_plus_one(models, arm: Arm) -> None:
    """`mixed` and `either` arms verify the group source's chain of up to `group_nodes` tokens, deeper than the
    drafter's `depth`: a round then emits more than depth + 1 tokens, at most `Arm.most_tokens`. The planner
    read such a round as damaged (it bounded a round at depth + 1) and left the arm's measurement out."""
    from tlt_stream.plan.acceptance import from_reports

    hf, model = models
    ps = prompts()
    group = GroupProposer(max_match=6, strong_match=2)
    for p in ps:
        group.remember(p, hf_greedy(hf, p, 24))  # a sibling that wrote exactly what greedy decoding will
    engine = GenerationEngine(model, 8, 64, proposer=MixedProposer(eagle(model), group), arm=arm)
    rounds = [n for result in engine.generate(ps, 24, eos_ids=[EOS]) for n in result.accept_lengths]
    assert max(rounds) > arm.depth + 1 and max(rounds) <= arm.most_tokens == 9
    report = {"kind": "sd_arm", "bucket": 0, "depth": arm.depth, "topk": arm.topk, "verify": arm.verify}
    report |= {"proposer": arm.kind, "group": arm.group_nodes, "tokens": sum(rounds), "rows": len(rounds)}
    acceptance = from_reports([report], None, "engine")
    assert acceptance is not None and acceptance.mean(arm, 0) == pytest.approx(sum(rounds) / len(rounds))
    assert acceptance.mean(arm, 0) > arm.depth + 1


def test_merged_trees_keep_a_token_two_sources_propose_under_one_node_once() -> None:
    from tlt_stream.rollout.proposers import SOURCE_EAGLE, SOURCE_GROUP, merge_trees

    group = ([5, 6, 7], [0, 1, 2], SOURCE_GROUP)
    drafter = ([5, 9, 6, 8, 0], [0, 0, 1, 1, -1], SOURCE_EAGLE)  # 5 and 5->6 repeat the group's; one pad
    tokens, parents, bits = merge_trees([group, drafter])
    assert (tokens, parents) == ([5, 6, 7, 9, 8], [0, 1, 2, 0, 1])
    assert bits == [SOURCE_GROUP | SOURCE_EAGLE, SOURCE_GROUP | SOURCE_EAGLE, SOURCE_GROUP, SOURCE_EAGLE, SOURCE_EAGLE]
