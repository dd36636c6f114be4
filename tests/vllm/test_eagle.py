"""One vLLM engine with this project's exported EAGLE drafter and the batch-size schedule (SD at running batch
<= SWITCH): greedy identity, the sampled distribution (chi-square), log-probs, the schedule seen in each
request's accept lengths, and drafter swaps with requests in flight, against transformers."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.stats import chi2_threshold, chi_square
from tests.vllm.conftest import MAX_BATCH, SWITCH, Oracle, closing, prompt_ids, requires_vllm, settings

pytestmark = requires_vllm


@pytest.fixture(scope="module")
def engine(models: dict[str, Path], engine_dir: Path) -> Iterator:
    from tlt_stream.rollout.vllm.backend import VllmEngine

    s = settings(engine_dir, arm="d4k1v4", switch_threshold=SWITCH)
    yield from closing(VllmEngine(models["policy"], settings=s, drafter=models["drafter"]))


@pytest.fixture(scope="module")
def fitted(engine, drafter_fit: Path, models: dict[str, Path]) -> Iterator:
    """The engine drafting with the fitted drafter; the random one again afterwards."""
    assert engine.load_drafter(drafter_fit) > 0
    yield engine
    engine.load_drafter(models["drafter"])


def mean_accept(results: list) -> float:
    rounds = [n for r in results for n in r.accept_lengths]
    return sum(rounds) / len(rounds)


def waves(engine, prompts: list[list[int]], new_tokens: int, temperature: float, seed: int) -> list:
    """`prompts` in waves of SWITCH requests: the running batch never leaves SD's range."""
    results = []
    for start in range(0, len(prompts), SWITCH):
        chunk = prompts[start : start + SWITCH]
        results += engine.generate(chunk, new_tokens, temperature=temperature, seed=seed + start)
    return results


def test_greedy_output_with_eagle_is_transformers_greedy(fitted, oracle: Oracle) -> None:
    prompts = prompt_ids(8, seed=21)
    results = waves(fitted, prompts, 40, 0.0, 0)
    for prompt, result in zip(prompts, results, strict=True):
        assert result.token_ids == oracle.greedy(prompt, 40)
        assert sum(result.accept_lengths) <= len(result.token_ids)
    assert mean_accept(results) > 1.5  # the drafter's tokens were accepted: SD ran and paid


def test_eagle_sampling_at_t1_follows_the_targets_distribution(fitted, oracle: Oracle) -> None:
    """The first three tokens of 1,000 samples at T = 1 from one prompt: the joint of tokens 1-2 and the
    marginal of token 3 against transformers' exact distribution (chi-square, false alarm 1e-4 each).
    Tokens 2 and 3 come from vLLM's rejection sampler on this project's drafts."""
    from tlt_stream.rollout.switch import DEFAULT_EDGES

    (prompt,) = prompt_ids(1, seed=22)
    n = 1000
    fitted.set_schedule(dict.fromkeys(range(len(DEFAULT_EDGES) + 1), "d4k1v4"))  # SD at every batch size
    try:
        results = fitted.generate([prompt] * n, 3, temperature=1.0, seed=100)
    finally:
        fitted.set_schedule(dict.fromkeys(range(len(DEFAULT_EDGES) + 1), "d4k1v4"), switch_threshold=SWITCH)
    assert all(len(r.token_ids) == 3 for r in results)
    assert sum(len(r.accept_lengths) for r in results) >= n  # every sample went through a verify round
    first = oracle.next_probs([prompt], 1.0)[0]  # [V]
    second = oracle.next_probs([[*prompt, x] for x in range(first.numel())], 1.0)  # [V, V]
    joint = first[:, None] * second  # p(x1, x2)
    expected = {(a, b): float(joint[a, b]) for a in range(joint.shape[0]) for b in range(joint.shape[1])}
    pairs = [(a, b) for (a, b), p in expected.items() if p > 1e-7]
    third = oracle.next_probs([[*prompt, a, b] for a, b in pairs], 1.0)  # [pairs, V]
    weights = torch.tensor([expected[pair] for pair in pairs])
    marginal = (weights[:, None] * third).sum(0) / weights.sum()
    observed = Counter((r.token_ids[0], r.token_ids[1]) for r in results)
    stat, df = chi_square(observed, expected, n)
    assert stat < chi2_threshold(df), f"tokens 1-2: chi-square {stat:.1f} on {df} df"
    observed3 = Counter(r.token_ids[2] for r in results)
    stat3, df3 = chi_square(observed3, {x: float(p) for x, p in enumerate(marginal)}, n)
    assert stat3 < chi2_threshold(df3), f"token 3: chi-square {stat3:.1f} on {df3} df"
    assert math.isclose(float(weights.sum()), 1.0, abs_tol=1e-4)  # the pairs left out hold no mass


def test_logprobs_with_eagle_are_the_targets_at_the_rollout_temperature(fitted, oracle: Oracle) -> None:
    results = waves(fitted, prompt_ids(4, seed=23), 32, 0.7, 7)
    assert any(r.accept_lengths for r in results)
    for result in results:
        expected = oracle.logprobs(result.prompt_ids, result.token_ids, 0.7)
        torch.testing.assert_close(torch.tensor(result.logprobs), torch.tensor(expected), atol=2e-4, rtol=0)


def test_the_schedule_drafts_only_at_small_batches(fitted, oracle: Oracle) -> None:
    """MAX_BATCH requests at once, request i asking for 6 + 3i tokens: the batch drains. The batch only
    shrinks, so a request that ends in a step of more than SWITCH running rows never ran at SWITCH or fewer
    and must never have drafted; the last SWITCH ran their tail with SD."""
    prompts = prompt_ids(MAX_BATCH, seed=24)
    for i, p in enumerate(prompts):
        fitted.add_request(p, 6 + 3 * i, 0.0, request_id=i)
    batch_at_end, results = {}, {}
    while fitted.has_unfinished:
        running = fitted.num_running
        for result in fitted.step():
            batch_at_end[result.request_id] = running
            results[result.request_id] = result
    assert len(results) == MAX_BATCH
    for rid, result in results.items():
        assert result.token_ids == oracle.greedy(prompts[rid], 6 + 3 * rid)
        if batch_at_end[rid] > SWITCH:
            assert result.accept_lengths == [], f"request {rid} drafted at batch {batch_at_end[rid]}"
    last = sorted(results, key=lambda rid: len(results[rid].token_ids))[-SWITCH:]
    assert all(results[rid].accept_lengths for rid in last)
    assert sum(batch_at_end[rid] > SWITCH for rid in results) >= MAX_BATCH - 2 * SWITCH


def test_a_new_table_takes_effect_without_a_new_engine(fitted, oracle: Oracle) -> None:
    """`set_schedule` with a published table: all plain, then EAGLE at every batch size (above SWITCH too),
    then the engine's own schedule again; the same vLLM engine throughout."""
    from tlt_stream.rollout.switch import DEFAULT_EDGES
    from tlt_stream.rollout.vllm.config import UnsupportedSetting

    buckets = range(len(DEFAULT_EDGES) + 1)
    llm, prompts = fitted.llm, prompt_ids(MAX_BATCH, seed=27)
    try:
        assert fitted.set_schedule(dict.fromkeys(buckets, "plain")) == [[1, MAX_BATCH, 0]]
        off = fitted.generate(prompts[:SWITCH], 32, temperature=0.0)
        assert all(r.accept_lengths == [] for r in off)
        fitted.set_schedule(dict.fromkeys(buckets, "d4k1v4"))
        on = fitted.generate(prompts, 32, temperature=0.0)  # MAX_BATCH rows: above the built-in switch
        assert all(r.accept_lengths for r in on)
        for prompt, result in zip(prompts, on, strict=True):
            assert result.token_ids == oracle.greedy(prompt, 32)
        assert [r.token_ids for r in off] == [r.token_ids for r in on[:SWITCH]]
        with pytest.raises(UnsupportedSetting, match="need a new engine"):
            fitted.set_schedule(dict.fromkeys(buckets, "d6k1v6"))
        with pytest.raises(UnsupportedSetting, match="need a new engine"):
            fitted.set_schedule(dict.fromkeys(buckets, "ngram-d4"))
    finally:
        fitted.set_schedule(dict.fromkeys(buckets, "d4k1v4"), switch_threshold=SWITCH)
    assert fitted.llm is llm


def test_a_published_drafter_is_swapped_in_with_requests_in_flight_by_the_worker(
    fitted, models: dict[str, Path], drafter_fit: Path, oracle: Oracle
) -> None:
    """The rollout worker's path (`DrafterSwaps.maybe_swap`): a drafter version announced on the control plane
    (location and sha256, as the drafter trainer publishes it) goes into the running engine between steps
    while requests are in flight. Outputs stay transformers' greedy; the engine's draft weights, read back
    from vLLM's worker, are the new drafter's; acceptance rises with it."""
    import asyncio

    from tlt_stream.basics.config import DEFAULTS, override
    from tlt_stream.basics.messages import DrafterVersion
    from tlt_stream.drafter.model import read_drafter
    from tlt_stream.roles.worker.drafters import DrafterSwaps
    from tlt_stream.store.digest import directory_sha256

    norm = "model.layers.0.post_attention_layernorm.weight"
    fit_norm = read_drafter(drafter_fit).state_dict()["layer.post_attention_layernorm.weight"]
    random_norm = read_drafter(models["drafter"]).state_dict()["layer.post_attention_layernorm.weight"]
    assert not torch.equal(fit_norm, random_norm)
    prompts = prompt_ids(SWITCH, seed=25)
    fitted.load_drafter(models["drafter"])  # the warm-up drafter the worker starts with
    config = override(DEFAULTS, {"sd.drafter": str(models["drafter"]), "sd.adaptive": False})
    plane, registry = _Plane(), _Registry()
    swaps = DrafterSwaps(config, plane, registry, "w")  # type: ignore[arg-type]
    try:
        torch.testing.assert_close(fitted.draft_tensor(norm), random_norm.float(), rtol=0, atol=0)
        before = fitted.generate(prompts, 48, temperature=0.0)
        ids = [fitted.add_request(p, 48, 0.0, request_id=i) for i, p in enumerate(prompts)]
        results = {}
        for _ in range(3):
            results.update({r.request_id: r for r in fitted.step()})
        assert fitted.has_unfinished
        plane.current["drafter"] = DrafterVersion(version=1, location=str(drafter_fit),
                                                  sha256=directory_sha256(drafter_fit))  # fmt: skip
        asyncio.run(swaps.maybe_swap(fitted, None))  # in flight
        assert (swaps.version, swaps.swaps, registry.info["drafter_version"]) == (1, 1, 1)
        torch.testing.assert_close(fitted.draft_tensor(norm), fit_norm.float(), rtol=0, atol=0)
        while fitted.has_unfinished:
            results.update({r.request_id: r for r in fitted.step()})
        for rid in ids:
            assert results[rid].token_ids == oracle.greedy(prompts[rid], 48)
        after = fitted.generate(prompts, 48, temperature=0.0)
        assert [r.token_ids for r in after] == [r.token_ids for r in before]
        assert mean_accept(after) > mean_accept(before) + 0.5
        plane.current["drafter"] = DrafterVersion(version=2, location=str(models["drafter"]), sha256="0" * 64)
        asyncio.run(swaps.maybe_swap(fitted, None))  # a damaged announcement: refused, the drafter in use stays
        assert str(registry.info["refused_drafter"]).startswith("2: ")
        torch.testing.assert_close(fitted.draft_tensor(norm), fit_norm.float(), rtol=0, atol=0)
    finally:
        fitted.load_drafter(drafter_fit)


def test_a_drafter_that_does_not_fit_the_engine_is_refused_in_one_line(
    engine, models: dict[str, Path], tmp_path: Path, oracle: Oracle
) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from tlt_stream.basics.errors import CheckpointError
    from tlt_stream.drafter.model import Drafter, save_drafter
    from tlt_stream.model import load_model

    narrow = tmp_path / "narrow"
    LlamaForCausalLM(
        LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    ).save_pretrained(narrow)
    save_drafter(Drafter(load_model(narrow).spec), tmp_path / "narrow-drafter")
    with pytest.raises(CheckpointError, match="shape differs") as caught:
        engine.load_drafter(tmp_path / "narrow-drafter")
    assert "\n" not in str(caught.value)
    damaged = tmp_path / "damaged"
    save_drafter(Drafter(load_model(models["policy"]).spec), damaged)
    for weights in damaged.glob("*.safetensors"):
        weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(CheckpointError) as caught:
        engine.load_drafter(damaged)
    assert "\n" not in str(caught.value)
    (prompt,) = prompt_ids(1, seed=26)
    (result,) = engine.generate([prompt], 24, temperature=0.0)  # the engine drafts on with its drafter
    assert result.token_ids == oracle.greedy(prompt, 24) and result.accept_lengths


def test_a_hand_made_export_of_another_layout_is_refused_before_vllm_loads_it(
    engine, models: dict[str, Path], tmp_path: Path, oracle: Oracle
) -> None:
    """An EAGLE export edited by hand, its config still the engine's: q/k/v fused under one name (vLLM loaded
    the rest and kept the old attention without a word), or an MLP tensor cut short (vLLM's in-place reload
    raised a traceback half-way and the engine died at its next step). Each is refused in one line, from the
    files' headers, and a worker that was announced one logs it and drafts on with the drafter it had."""
    import asyncio

    from safetensors.torch import load_file, save_file

    from tlt_stream.basics.config import DEFAULTS, override
    from tlt_stream.basics.errors import CheckpointError
    from tlt_stream.basics.messages import DrafterVersion
    from tlt_stream.drafter.export import export_drafter
    from tlt_stream.roles.worker.drafters import DrafterSwaps
    from tlt_stream.store.digest import directory_sha256

    norm = "model.layers.0.post_attention_layernorm.weight"
    export = export_drafter(models["drafter"], tmp_path / "export").path

    def edited(name: str, edit) -> Path:
        out = tmp_path / name
        out.mkdir()
        for file in export.iterdir():
            (out / file.name).write_bytes(file.read_bytes())
        tensors = load_file(str(out / "model.safetensors"))
        edit(tensors)
        save_file(tensors, str(out / "model.safetensors"))
        return out

    def fuse(t: dict) -> None:
        parts = [t.pop(f"layers.0.self_attn.{x}_proj.weight") for x in "qkv"]
        t["layers.0.self_attn.qkv_proj.weight"] = torch.cat(parts)

    def cut(t: dict) -> None:
        t["layers.0.mlp.gate_proj.weight"] = t["layers.0.mlp.gate_proj.weight"][:64].contiguous()

    fused, short = edited("fused", fuse), edited("short", cut)
    held = engine.draft_tensor(norm)
    for bad, words in (
        (fused, r"missing \['layers.0.self_attn.k_proj.weight'"),
        (short, r"gate_proj.weight has shape"),
    ):
        with pytest.raises(CheckpointError, match=f"not the layout of the engine's drafter: .*{words}") as caught:
            engine.load_drafter(bad)
        assert "\n" not in str(caught.value)
    config = override(DEFAULTS, {"sd.drafter": str(models["drafter"]), "sd.adaptive": False})
    plane, registry = _Plane(), _Registry()
    swaps = DrafterSwaps(config, plane, registry, "w")  # type: ignore[arg-type]
    plane.current["drafter"] = DrafterVersion(version=7, location=str(short), sha256=directory_sha256(short))
    asyncio.run(swaps.maybe_swap(engine, None))
    refused = str(registry.info["refused_drafter"])
    assert refused.startswith("7: ") and "gate_proj.weight has shape" in refused
    assert swaps.swaps == 0 and "drafter_version" not in registry.info
    torch.testing.assert_close(engine.draft_tensor(norm), held, rtol=0, atol=0)
    prompts = prompt_ids(2, seed=27)
    for prompt, result in zip(prompts, engine.generate(prompts, 24, temperature=0.0), strict=True):
        assert result.token_ids == oracle.greedy(prompt, 24) and result.accept_lengths


def test_an_export_whose_tensors_are_not_its_configs_is_refused_before_vllm_starts(
    models: dict[str, Path], tmp_path: Path
) -> None:
    """The export an engine starts with, a `.bias` its config does not imply added by hand: vLLM would skip it
    without a word. The engine refuses it in one line before vLLM starts (`drafter.export.check_eagle_export`)."""
    from safetensors.torch import load_file, save_file

    from tlt_stream.basics.errors import CheckpointError
    from tlt_stream.drafter.export import export_drafter
    from tlt_stream.rollout.vllm.backend import VllmEngine

    export = export_drafter(models["drafter"], tmp_path / "export").path
    tensors = load_file(str(export / "model.safetensors"))
    tensors["layers.0.self_attn.o_proj.bias"] = torch.zeros(tensors["fc.weight"].shape[0])
    save_file(tensors, str(export / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"implies: .*unexpected \['layers.0.self_attn.o_proj.bias'\]") as caught:
        VllmEngine(models["policy"], settings=settings(tmp_path, arm="d4k1v4"), drafter=export)
    assert "\n" not in str(caught.value) and str(export) in str(caught.value)


class _Plane:
    """The control plane as the worker reads it: the retained version of each kind."""

    def __init__(self) -> None:
        self.current: dict[str, object] = {}


class _Registry:
    def __init__(self) -> None:
        self.info: dict[str, object] = {}

    def update_info(self, **fields: object) -> None:
        self.info.update(fields)


def test_the_worker_applies_a_published_sd_config_to_its_engine_in_place(
    fitted, models: dict[str, Path], oracle: Oracle
) -> None:
    """The rollout worker's `DrafterSwaps.adopt_sd_config` on the running engine: each newly announced
    `sd_config` (built as the publisher builds it) becomes the schedule of the next requests, seen in their
    accept lengths at MAX_BATCH rows (the engine's own schedule is plain there); a table the engine cannot run
    is refused once and the schedule in use stays; the same vLLM engine throughout."""
    from tlt_stream.basics.config import DEFAULTS, override
    from tlt_stream.basics.messages import SdArmChoice, SdConfigVersion
    from tlt_stream.roles.worker.drafters import DrafterSwaps
    from tlt_stream.rollout.arms import Arm

    config = override(DEFAULTS, {"sd.drafter": str(models["drafter"]), "sd.adaptive": False})
    edges = config.sd.edges

    def table(version: int, label: str) -> SdConfigVersion:
        arm = Arm.from_label(label)
        choices = [
            SdArmChoice(
                max_batch=edges[b] if b < len(edges) else edges[-1] + 1,
                depth=arm.depth,
                topk=arm.topk,
                verify=arm.verify,
                enabled=arm.kind != "plain",
                proposer=arm.kind,
            )
            for b in range(len(edges) + 1)
        ]
        return SdConfigVersion(version=version, drafter_version=0, table=choices)

    plane, registry = _Plane(), _Registry()
    swaps = DrafterSwaps(config, plane, registry, "w")  # type: ignore[arg-type]
    llm, prompts = fitted.llm, prompt_ids(MAX_BATCH, seed=28)
    try:
        plane.current["sd_config"] = table(1, "d4k1v4")
        swaps.adopt_sd_config(fitted, None)
        assert (swaps.sd_config, registry.info["sd_config_version"]) == (1, 1)
        on = fitted.generate(prompts, 32, temperature=0.0)  # MAX_BATCH rows: above the built-in switch
        assert all(r.accept_lengths for r in on)
        assert [r.token_ids for r in on] == [oracle.greedy(p, 32) for p in prompts]

        plane.current["sd_config"] = table(2, "plain")
        swaps.adopt_sd_config(fitted, None)
        off = fitted.generate(prompts[:SWITCH], 32, temperature=0.0)  # within the built-in switch
        assert all(r.accept_lengths == [] for r in off)

        plane.current["sd_config"] = table(3, "d6k1v6")  # deeper than the engine's chains
        swaps.adopt_sd_config(fitted, None)
        assert swaps.sd_config == 3 and str(registry.info["refused_sd_config"]).startswith("3: ")
        assert "\n" not in str(registry.info["refused_sd_config"])
        kept = fitted.generate(prompts[:SWITCH], 32, temperature=0.0)
        assert all(r.accept_lengths == [] for r in kept), "a refused table left the schedule in use"
        assert [r.token_ids for r in kept] == [r.token_ids for r in on[:SWITCH]]
    finally:
        fitted.set_schedule(dict.fromkeys(range(len(edges) + 1), "d4k1v4"), switch_threshold=SWITCH)
    assert fitted.llm is llm


def test_the_tuner_measures_vllms_steps_and_a_table_published_from_them_is_applied(fitted, oracle: Oracle) -> None:
    """The per-bucket tuner inside vLLM (`VllmTuning`): waves of SWITCH requests, each run under the schedule
    the tuner chose from the steps vLLM measured so far (untried arms first: plain, d2, d4), so every arm is
    measured in the wave's bucket; each wave's accept lengths show the arm it ran. The measurements become
    `SdArmReport`s as a worker sends them, the SD-config publisher's aggregation makes a table of them, and
    the worker's `adopt_sd_config` applies it to the same engine: the next wave runs the table's arm. (Which
    arm wins depends on the machine's timing; the test checks that the engine follows what was measured.)"""
    from msgspec.structs import replace

    from tlt_stream.basics.config import DEFAULTS, override
    from tlt_stream.basics.messages import SdArmReport, SdConfigVersion
    from tlt_stream.roles.sd_config import table_choices
    from tlt_stream.roles.worker.drafters import DrafterSwaps
    from tlt_stream.rollout.switch import DEFAULT_EDGES, aggregate_reports, bucket_of
    from tlt_stream.rollout.vllm.tuning import VllmTuning

    sd = replace(DEFAULTS.sd, arms=("plain", "d2k1v2", "d4k1v4"), edges=DEFAULT_EDGES, epsilon=0.0)
    llm, bucket = fitted.llm, bucket_of(SWITCH, DEFAULT_EDGES)
    tuning = VllmTuning(fitted, sd, drafter_version=0, every=1 << 30)  # read between waves (`refresh`)
    longest = {"plain": 0, "d2k1v2": 3, "d4k1v4": 5}  # tokens one round may emit

    def wave(seed: int) -> str:
        """SWITCH requests at once, run to the end; the arm the schedule gave the wave's bucket."""
        schedule = dict(tuning.schedule)
        prompts = prompt_ids(SWITCH, seed=seed)
        ids = [fitted.add_request(p, 32, 0.0, request_id=i) for i, p in enumerate(prompts)]
        results = {}
        while fitted.has_unfinished:
            results.update({r.request_id: r for r in tuning.step()})
        tuning.refresh()  # the wave's steps measured, each bucket's arm chosen again
        out = [results[i] for i in ids]
        assert [r.token_ids for r in out] == [oracle.greedy(p, 32) for p in prompts]
        rounds = [n for r in out for n in r.accept_lengths]  # the batch drains: smaller buckets' arms run too
        assert max(rounds, default=0) <= max(longest[schedule[b]] for b in range(bucket + 1))
        if schedule[bucket] != "plain":
            assert rounds
        if all(schedule[b] == "plain" for b in range(bucket + 1)):
            assert not rounds
        return schedule[bucket]

    try:
        ran = [wave(60 + i) for i in range(3)]
        assert ran == ["plain", "d2k1v2", "d4k1v4"]  # the tuner tried each arm, in order, in the wave's bucket
        measured = tuning.drain_reports()
        arms = {m.arm.label for m in measured if m.bucket == bucket and m.steps > 0 and m.tokens > 0}
        assert arms == set(ran)
        reports = [
            SdArmReport(worker_id="w", drafter_version=0, bucket=m.bucket, depth=m.arm.depth, topk=m.arm.topk,
                        verify=m.arm.verify, tokens=m.tokens, seconds=m.seconds, proposer=m.arm.kind, steps=m.steps)
            for m in measured
        ]  # fmt: skip
        best = aggregate_reports(reports).best
        published = SdConfigVersion(version=1, drafter_version=0, table=table_choices(best, DEFAULT_EDGES))
        plane, registry = _Plane(), _Registry()
        config = override(DEFAULTS, {"sd.drafter": "x", "sd.edges": list(DEFAULT_EDGES)})
        swaps = DrafterSwaps(config, plane, registry, "w")  # type: ignore[arg-type]
        plane.current["sd_config"] = published
        swaps.adopt_sd_config(fitted, tuning)  # type: ignore[arg-type]
        assert registry.info["sd_config_version"] == 1
        assert tuning.schedule[bucket] == best[bucket].label
        assert wave(70) == best[bucket].label
    finally:
        fitted.set_schedule(dict.fromkeys(range(len(DEFAULT_EDGES) + 1), "d4k1v4"), switch_threshold=SWITCH)
    assert fitted.llm is llm
