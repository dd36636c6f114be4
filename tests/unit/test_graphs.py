"""Captured forwards (`model.graphs`) keep the eager forward's semantics.

The "trace" backend replays the aten ops of one run with Python, shapes and scalars frozen, as a CUDA graph
does, so these tests hold what a graph would replay (not only the static-shape forward) to the eager
forward: on inputs, lengths and batch sizes that change between calls, with padded batches, with trees,
and end to end in the engine against transformers as the oracle. CUDA capture itself needs a GPU
(`bench/gpu_check.py`).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from tlt_stream.drafter.model import Drafter
from tlt_stream.model import load_model
from tlt_stream.model.graphs import ForwardGraphs, GraphCaptureError, record, resolve_backend
from tlt_stream.rollout.arms import Arm
from tlt_stream.rollout.engine import GenerationEngine
from tlt_stream.rollout.proposers import EagleProposer, GroupProposer, MixedProposer

VOCAB = 53
EOS = 2


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory):
    config = LlamaConfig(
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        initializer_range=0.3,
        tie_word_embeddings=True,
    )
    torch.manual_seed(7)
    hf = AutoModelForCausalLM.from_config(config).eval()
    path = tmp_path_factory.mktemp("llama")
    hf.save_pretrained(path, safe_serialization=True)
    return hf, load_model(path)


def random_tree_mask(b: int, t: int, g: torch.Generator) -> torch.Tensor:
    """Ancestor masks `[B, T, T]` of random trees (node i's parent is a random earlier node)."""
    mask = torch.zeros(b, t, t, dtype=torch.bool)
    for row in range(b):
        for i in range(t):
            mask[row, i, i] = True
            if i:
                parent = int(torch.randint(0, i, (1,), generator=g))
                mask[row, i] |= mask[row, parent]
    return mask


class CountingForward:
    """Counts the model's Python forward calls (a replay does not make one)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.inner, self.calls = model.forward, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.inner(*args, **kwargs)


@pytest.mark.parametrize("max_graphs", [96, 2])
def test_replayed_forward_equals_the_eager_one_as_lengths_batches_and_trees_change(
    models, monkeypatch: pytest.MonkeyPatch, max_graphs: int
) -> None:
    _, model = models
    g = torch.Generator().manual_seed(0)
    graphed_cache, eager_cache = model.new_cache(6, 96), model.new_cache(6, 96)
    graphed_cache.k.normal_(generator=g)
    graphed_cache.v.normal_(generator=g)
    graphs = ForwardGraphs(model, graphed_cache, "trace", len_step=16, max_graphs=max_graphs)
    counting = CountingForward(model)
    monkeypatch.setattr(model, "forward", counting)
    calls, shapes = 0, set()
    with torch.inference_mode():
        for _ in range(3):
            for b, t in [(3, 1), (5, 4), (1, 1), (6, 7), (3, 4), (2, 1), (5, 4), (3, 1)]:
                lengths = torch.randint(0, 96 - t, (b,), generator=g)
                graphed_cache.lengths[:] = torch.randint(0, 96, (6,), generator=g)  # idle slots: any length
                graphed_cache.lengths[:b] = lengths
                eager_cache.k.copy_(graphed_cache.k)
                eager_cache.v.copy_(graphed_cache.v)
                eager_cache.lengths.copy_(graphed_cache.lengths)
                before_k = graphed_cache.k.clone()
                ids = torch.randint(0, VOCAB, (b, t), generator=g)
                positions = lengths[:, None] + torch.arange(t)
                mask = None if t == 1 else random_tree_mask(b, t, g)
                out = graphs(ids, positions, mask)
                calls += 1
                shapes.add((b, t, -(-(int(lengths.max()) + t) // 16)))  # batch, tokens, span in len_steps
                expected = model(ids, positions, eager_cache, tree_mask=mask)
                assert out.shape == expected.shape
                torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
                # The real rows' new K/V are the eager forward's; idle slots keep every committed entry.
                torch.testing.assert_close(graphed_cache.k[:, :b], eager_cache.k[:, :b], rtol=1e-5, atol=1e-5)
                for slot in range(b, 6):
                    kept = int(graphed_cache.lengths[slot])
                    assert torch.equal(graphed_cache.k[:, slot, :, :kept], before_k[:, slot, :, :kept])
                assert torch.equal(graphed_cache.lengths, eager_cache.lengths), "lengths are never advanced"
    python_forwards = counting.calls - calls  # the loop made one eager call per graphed call
    assert len(graphs._graphs) <= max_graphs
    if max_graphs >= len(shapes):  # each shape ran the module's Python once (padding may merge shapes)
        assert python_forwards <= len(shapes) < calls
    else:  # shapes were dropped and captured again
        assert python_forwards > len(shapes)


def test_calls_beyond_the_capture_limits_run_eagerly_and_agree(models) -> None:
    _, model = models
    cache, eager_cache = model.new_cache(4, 40), model.new_cache(4, 40)
    graphs = ForwardGraphs(model, cache, "trace", batch_sizes=(1, 2), max_tokens=2)
    g = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for b, t in [(3, 1), (2, 3), (2, 2), (2, 2)]:  # batch above every size, tokens above max_tokens, captured
            lengths = torch.randint(0, 30, (b,), generator=g)
            cache.lengths[:b] = lengths
            eager_cache.lengths.copy_(cache.lengths)
            eager_cache.k.copy_(cache.k)
            eager_cache.v.copy_(cache.v)
            ids, positions = torch.randint(0, VOCAB, (b, t), generator=g), lengths[:, None] + torch.arange(t)
            mask = None if t == 1 else random_tree_mask(b, t, g)
            got = graphs(ids, positions, mask).clone()
            torch.testing.assert_close(got, model(ids, positions, eager_cache, tree_mask=mask), rtol=1e-5, atol=1e-5)
    assert (graphs.eager, graphs.captures, graphs.replays) == (2, 1, 1)


def test_a_shape_that_fails_to_capture_or_to_agree_runs_eagerly(
    models, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Capture errors and (with `check`, CUDA's default) a first replay that disagrees with one eager
    forward both leave the shape to the eager forward, logged; what the caller gets is right either way."""
    _, model = models
    g = torch.Generator().manual_seed(2)

    def calls(graphs: ForwardGraphs, cache, times: int) -> None:
        eager_cache = model.new_cache(2, 40)
        with torch.inference_mode():
            for _ in range(times):
                cache.lengths[:2] = torch.randint(0, 30, (2,), generator=g)
                eager_cache.lengths.copy_(cache.lengths)
                eager_cache.k.copy_(cache.k)
                eager_cache.v.copy_(cache.v)
                ids, positions = torch.randint(0, VOCAB, (2, 1), generator=g), cache.lengths[:2, None].clone()
                torch.testing.assert_close(graphs(ids, positions).clone(), model(ids, positions, eager_cache))

    def broken(self, graph, span):  # a capture that raises, as a CUDA capture of an uncapturable op would
        raise RuntimeError("operation not permitted when stream is capturing")

    failing = ForwardGraphs(model, model.new_cache(2, 40), "trace", len_step=64)
    with monkeypatch.context() as patch, caplog.at_level("WARNING", logger="tlt_stream.model.graphs"):
        patch.setattr(ForwardGraphs, "_capture", broken)
        calls(failing, failing.cache, 3)
    assert (failing.failed, failing.captures, failing.eager) == (1, 0, 3)
    assert "capture failed: RuntimeError: operation not permitted" in caplog.text

    real_run = ForwardGraphs._run

    def wrong(self, graph, span):  # a graph that replays wrong values (e.g. a stale pointer)
        return real_run(self, graph, span).add_(1.0)

    checked = ForwardGraphs(model, model.new_cache(2, 40), "trace", len_step=64, check=True)
    caplog.clear()
    with monkeypatch.context() as patch, caplog.at_level("WARNING", logger="tlt_stream.model.graphs"):
        patch.setattr(ForwardGraphs, "_run", wrong)
        calls(checked, checked.cache, 3)
    assert (checked.failed, checked.captures, checked.eager) == (1, 0, 3)
    assert "differs from the eager forward" in caplog.text
    fine = ForwardGraphs(model, model.new_cache(2, 40), "trace", len_step=64, check=True)
    calls(fine, fine.cache, 3)
    assert (fine.failed, fine.captures, fine.replays) == (0, 1, 2), "a right capture passes the check"


def test_a_replay_whose_shapes_depend_on_data_is_refused() -> None:
    x = torch.tensor([1.0, -2.0, 3.0])
    trace = record(lambda: x[x > 0] * 2)  # boolean indexing: the output's length is data
    torch.testing.assert_close(trace.replay(), torch.tensor([2.0, 6.0]))
    x.copy_(torch.tensor([1.0, 2.0, 3.0]))
    with pytest.raises(GraphCaptureError, match="on replay"):
        trace.replay()


def test_capture_refuses_a_host_read_and_a_static_capture_follows_its_inputs(models) -> None:
    _, model = models
    cache, eager_cache = model.new_cache(2, 32), model.new_cache(2, 32)
    cache.k.normal_()
    cache.v.normal_()
    cache.lengths[:2] = torch.tensor([5, 9])
    ids, positions = torch.tensor([[3], [4]]), torch.tensor([[5], [9]])
    with torch.inference_mode():
        with pytest.raises(GraphCaptureError, match="host"):
            record(lambda: model(ids, positions, cache))  # the eager forward reads max(lengths) on the host
        trace = record(lambda: model(ids, positions, cache, static_len=32))
        for lengths, tokens in [([11, 2], [7, 8]), ([0, 30], [1, 1])]:  # inputs change in place, as buffers do
            cache.lengths[:2] = torch.tensor(lengths)
            positions.copy_(torch.tensor(lengths)[:, None])
            ids.copy_(torch.tensor(tokens)[:, None])
            eager_cache.k.copy_(cache.k)
            eager_cache.v.copy_(cache.v)
            eager_cache.lengths.copy_(cache.lengths)
            expected = model(ids, positions, eager_cache)
            torch.testing.assert_close(trace.replay(), expected, rtol=1e-5, atol=1e-5)


def engines(model, kind: str, graphs: str | None):
    if kind == "plain":
        return GenerationEngine(model, 4, 64, graphs=graphs)
    torch.manual_seed(1)
    drafter = EagleProposer(Drafter(model.spec).bind(model))
    if kind == "chain":
        return GenerationEngine(model, 4, 64, proposer=drafter, arm=Arm.drafter(4, 1, 4), graphs=graphs)
    if kind == "tree":
        return GenerationEngine(model, 4, 64, proposer=drafter, arm=Arm.drafter(3, 3, 9), graphs=graphs)
    group = GroupProposer(max_match=6, strong_match=3)
    return GenerationEngine(
        model, 4, 64, proposer=MixedProposer(drafter, group), arm=Arm.mixed(3, 2, 4, 6), graphs=graphs
    )


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(4)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (7, 1, 12, 4, 9, 2)]


def hf_greedy(hf, prompt: list[int], max_new: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False, eos_token_id=EOS
    )[0, len(prompt) :].tolist()
    return out[: out.index(EOS) + 1] if EOS in out else out


@pytest.mark.parametrize("kind", ["plain", "chain", "tree", "mixed"])
def test_greedy_generation_with_replayed_forwards_equals_transformers(models, kind: str) -> None:
    hf, model = models
    ps = [p for p in prompts() for _ in range(2)]  # siblings: the group source drafts from them
    reference = [hf_greedy(hf, p, 30) for p in ps]
    engine = engines(model, kind, "trace")
    results = engine.generate(ps, 30, eos_ids=[EOS])
    assert [r.token_ids for r in results] == reference
    eager = engines(model, kind, None).generate(ps, 30, eos_ids=[EOS])
    for got, want in zip(results, eager, strict=True):
        assert got.finish_reason == want.finish_reason
        assert max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs, strict=True)) < 1e-4
    assert engine.graphs is not None and engine.graphs.replays > engine.graphs.captures > 0


@pytest.mark.parametrize("kind", ["plain", "chain", "tree", "mixed"])
def test_sampling_with_replayed_forwards_draws_what_the_eager_engine_draws(models, kind: str) -> None:
    """Same seeds, same draws: the replayed forward's distributions are the eager one's (to float rounding),
    so the lossless rules take the same decisions; the eager engine's exactness is test_speculative's."""
    _, model = models
    ps = prompts() * 3
    got = engines(model, kind, "trace").generate(ps, 24, temperature=1.0, seed=11, eos_ids=[EOS])
    want = engines(model, kind, None).generate(ps, 24, temperature=1.0, seed=11, eos_ids=[EOS])
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert len({tuple(r.token_ids) for r in got}) > len(prompts()), "the draws differ between a prompt's copies"
    for a, b in zip(got, want, strict=True):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-4


def test_the_drafter_sees_the_features_it_would_see_eagerly_when_sd_switches_on_and_off(
    models, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Plain steps hand the drafter each step's hidden states, which it keeps until its next catch-up; a
    replay's output lives in a buffer the next call overwrites. What the drafter's forward receives is
    recorded (cloned at the call) and compared with the eager engine's."""
    _, model = models
    seen: list[list[torch.Tensor]] = []
    outcomes = []
    for graphs in (None, "trace"):
        torch.manual_seed(1)
        drafter = Drafter(model.spec).bind(model)
        inner, calls = drafter.forward, []

        def recording(tokens, features, *args, inner=inner, calls=calls, **kwargs):
            calls.append(features.clone())
            return inner(tokens, features, *args, **kwargs)

        monkeypatch.setattr(drafter, "forward", recording)
        engine = GenerationEngine(model, 4, 64, proposer=EagleProposer(drafter), graphs=graphs)
        ids = [engine.add_request(p, 30, eos_ids=[EOS]) for p in prompts()[:4]]
        arms = itertools.cycle([None, None, None, Arm.drafter(4, 1, 4), None, Arm.drafter(3, 2, 6)])
        done = {}
        while engine.has_unfinished:
            engine.arm = next(arms)
            done |= {r.request_id: r for r in engine.step()}
        outcomes.append([(done[i].token_ids, done[i].accept_lengths) for i in ids])
        seen.append(calls)
    assert outcomes[0] == outcomes[1]
    eager, replayed = seen
    assert len(eager) == len(replayed) > 0
    for a, b in zip(eager, replayed, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


def test_backend_settings() -> None:
    cpu = torch.device("cpu")
    assert resolve_backend("off", cpu) is None
    assert resolve_backend("auto", cpu) is None
    assert resolve_backend("auto", torch.device("cuda", 0)) == "cuda"
    assert resolve_backend("trace", cpu) == "trace"
    with pytest.raises(ValueError, match="CUDA device"):
        resolve_backend("cuda", cpu)
    with pytest.raises(ValueError, match="off, auto"):
        resolve_backend("always", cpu)


def test_span_buckets_stay_few_at_long_contexts() -> None:
    """At a 40,960-token context (Qwen3's) the captured forwards use 11 spans per batch shape, each at
    least what is needed and under twice it past the first few steps."""
    from tlt_stream.model.graphs import attention_span

    max_len = 40_960
    spans = {attention_span(n, 128, max_len) for n in range(1, max_len + 1)}
    assert len(spans) == 11, sorted(spans)  # 128..512 by steps, 1024..32768 doubling, the cache
    for n in range(1, max_len + 1, 97):
        span = attention_span(n, 128, max_len)
        assert n <= span and (span < 2 * n or span <= 4 * 128)
