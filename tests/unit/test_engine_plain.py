"""Plain generation with continuous batching against transformers' `generate`, plus sampling properties."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from tlt_stream.model import Transformer, load_model
from tlt_stream.rollout.engine import GenerationEngine
from tlt_stream.rollout.sampling import sample, sample_with_uniforms, target_logprobs

# One xdist worker runs this module, so its module-scoped fixtures are built once.
pytestmark = pytest.mark.xdist_group("test_engine_plain")

VOCAB = 97


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def models(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    config_cls = Qwen2Config if request.param == "qwen2" else LlamaConfig
    config = config_cls(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        initializer_range=0.3,
    )
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config).eval()
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path, safe_serialization=True)
    return hf, load_model(path)


def make_prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def hf_greedy(hf: torch.nn.Module, prompt: list[int], max_new: int, eos: int | None = None) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=eos if eos is not None else 0,
    )[0, len(prompt) :].tolist()
    if eos is not None and eos in out:
        out = out[: out.index(eos) + 1]
    return out


def test_greedy_matches_transformers_with_mixed_lengths_and_early_eos(models) -> None:
    hf, model = models
    prompts = make_prompts([5, 1, 9, 3, 12, 7])
    reference = [hf_greedy(hf, p, 16) for p in prompts]
    eos = reference[2][3]  # prompt 2 must stop at its 4th token
    reference = [hf_greedy(hf, p, 16, eos) for p in prompts]
    engine = GenerationEngine(model, max_batch=4, max_len=32)
    results = engine.generate(prompts, 16, eos_ids=[eos])
    for ref, res in zip(reference, results, strict=True):
        assert res.token_ids == ref
        assert res.finish_reason == ("eos" if ref[-1] == eos else "length")
    assert results[2].finish_reason == "eos" and len(results[2].token_ids) <= 4
    assert not engine.has_unfinished


def test_continuous_batching_equals_one_by_one(models) -> None:
    _, model = models
    prompts = make_prompts([4, 8, 2, 6, 3, 5, 7], seed=1)
    budgets = [3, 10, 1, 7, 12, 2, 5]
    batched = GenerationEngine(model, max_batch=3, max_len=32, max_prefill_tokens=12)
    ids = [
        batched.add_request(p, n, temperature=0.0 if i % 2 else 0.9, seed=100 + i)
        for i, (p, n) in enumerate(zip(prompts, budgets, strict=True))
    ]
    done = {}
    while batched.has_unfinished:
        for r in batched.step():
            done[r.request_id] = r
    for i, (p, n) in enumerate(zip(prompts, budgets, strict=True)):
        single = GenerationEngine(model, max_batch=1, max_len=32)
        alone = single.generate([p], n, temperature=0.0 if i % 2 else 0.9, seed=100 + i)[0]
        assert done[ids[i]].token_ids == alone.token_ids
        assert len(alone.token_ids) == n
        torch.testing.assert_close(torch.tensor(done[ids[i]].logprobs), torch.tensor(alone.logprobs), atol=1e-5, rtol=0)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_logprobs_are_log_softmax_of_transformers_logits(models, temperature: float) -> None:
    hf, model = models
    prompts = make_prompts([6, 2, 9], seed=2)
    results = GenerationEngine(model, max_batch=3, max_len=32).generate(prompts, 8, temperature, seed=7)
    for p, r in zip(prompts, results, strict=True):
        with torch.no_grad():
            logits = hf(torch.tensor([p + r.token_ids])).logits[0, len(p) - 1 : -1]  # [n, V]
        expected = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
        expected = expected.gather(1, torch.tensor(r.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(r.logprobs), expected, atol=1e-4, rtol=0)


def test_sampling_is_reproducible_for_a_seed(models) -> None:
    _, model = models
    prompts = make_prompts([4, 4], seed=3)
    engine = GenerationEngine(model, max_batch=2, max_len=40)
    first = engine.generate(prompts, 24, temperature=1.0, seed=11)
    again = engine.generate(prompts, 24, temperature=1.0, seed=11)
    other = engine.generate(prompts, 24, temperature=1.0, seed=12)
    assert [r.token_ids for r in first] == [r.token_ids for r in again]
    assert [r.token_ids for r in first] != [r.token_ids for r in other]


def test_return_hidden_gives_the_states_that_produced_each_token(models) -> None:
    _, model = models
    prompts = make_prompts([5, 3], seed=4)
    results = GenerationEngine(model, max_batch=2, max_len=32).generate(prompts, 6, return_hidden=True)
    for p, r in zip(prompts, results, strict=True):
        assert r.hidden is not None and r.hidden.shape == (6, model.spec.hidden_size)
        assert not r.hidden.is_inference()  # usable as autograd input by a drafter trainer
        seq = torch.tensor([p + r.token_ids[:-1]])
        with torch.no_grad():
            full = model(seq, torch.arange(seq.shape[1])[None], model.new_cache(1, 32))[0]
        torch.testing.assert_close(r.hidden, full[len(p) - 1 :], atol=1e-5, rtol=0)
        assert model.logits(r.hidden).argmax(-1).tolist() == r.token_ids


def test_hidden_states_follow_their_rows_through_slot_moves_and_refilled_slots(models) -> None:
    """Rows finish at different steps (slots are compacted), queued requests refill the freed slots, and
    requests that did not ask for hidden states share the batch: each result still holds exactly the states
    of its own tokens, from a full forward over its own sequence."""
    _, model = models
    prompts = make_prompts([5, 3, 7, 4, 6, 2, 5], seed=8)
    budgets = [9, 3, 12, 5, 2, 8, 6]
    wants = [True, True, False, True, True, False, True]
    engine = GenerationEngine(model, max_batch=3, max_len=32)
    for i, (p, n, want) in enumerate(zip(prompts, budgets, wants, strict=True)):
        engine.add_request(p, n, 1.0, seed=i, request_id=i, return_hidden=want)
    done = {}
    while engine.has_unfinished:
        for r in engine.step():
            done[r.request_id] = r
    for i, (p, want) in enumerate(zip(prompts, wants, strict=True)):
        r = done[i]
        assert len(r.token_ids) == budgets[i]
        if not want:
            assert r.hidden is None and r.prompt_hidden is None
            continue
        seq = torch.tensor([p + r.token_ids[:-1]])
        with torch.no_grad():
            full = model(seq, torch.arange(seq.shape[1])[None], model.new_cache(1, 32))[0]
        torch.testing.assert_close(r.hidden, full[len(p) - 1 :], atol=1e-5, rtol=0)
        torch.testing.assert_close(r.prompt_hidden, full[: len(p) - 1], atol=1e-5, rtol=0)


def test_sampler_follows_the_target_distribution() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]])
    n = 4000
    u = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    tokens, logp = sample_with_uniforms(logits.expand(n, 4), torch.full((n,), 0.5), u)
    p = target_logprobs(logits, torch.tensor([0.5])).exp()[0]
    freq = torch.bincount(tokens, minlength=4).double() / n
    torch.testing.assert_close(freq, p.double(), atol=1e-3, rtol=0)
    torch.testing.assert_close(logp, p.log()[tokens], atol=1e-6, rtol=0)
    gens = [torch.Generator().manual_seed(0), None]
    tok, lp = sample(torch.tensor([[0.0, 5.0], [3.0, 1.0]]), torch.tensor([1.0, 0.0]), gens)
    assert tok[1] == 0 and lp[1] == pytest.approx(float(torch.log_softmax(torch.tensor([3.0, 1.0]), 0)[0]))
    with pytest.raises(ValueError, match="no generator"):
        sample(torch.zeros(1, 3), torch.tensor([1.0]), [None])


def test_engine_validates_requests() -> None:
    from tlt_stream.model import ModelSpec

    engine = GenerationEngine(Transformer(ModelSpec("llama", 11, 16, 24, 1, 2, 1, 8)).eval(), 2, 8)
    with pytest.raises(ValueError, match="exceeds max_len"):
        engine.add_request([1, 2, 3], 6)
    with pytest.raises(ValueError, match=r"lie in \[0, 11\)"):
        engine.add_request([1, 11], 2)
    with pytest.raises(ValueError, match="temperature"):
        engine.add_request([1], 2, temperature=-1.0)
    with pytest.raises(ValueError, match="empty prompt"):
        engine.add_request([], 2)
    engine.add_request([1], 2, request_id="a")
    with pytest.raises(ValueError, match="already queued"):
        engine.add_request([1], 2, request_id="a")
    with pytest.raises(RuntimeError, match="idle engine"):
        engine.generate([[1]], 2)
    assert [r.request_id for r in engine.step()] == ["a"]
    assert not engine.has_unfinished
    assert engine.step() == []
