"""The vLLM backend's pure parts, on CPU without vLLM: finished vLLM outputs as `GenerationResult`s, the
recomputed hidden states, what a drafter swap loads, and the one-line refusal when vLLM is missing.

vLLM's output types are stood in for by the dataclasses below, shaped as in vLLM 0.33.0 (vllm/outputs.py
`RequestOutput`, `CompletionOutput`; vllm/logprobs.py `Logprob`, positions as `dict[int, Logprob]`;
vllm/v1/metrics/stats.py `RequestSpecDecodeMetrics`). Nothing else is faked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from tlt_stream.commands.cli import main
from tlt_stream.drafter.export import export_drafter
from tlt_stream.drafter.model import Drafter, save_drafter
from tlt_stream.model import load_model
from tlt_stream.rollout.engine import GenerationEngine
from tlt_stream.rollout.vllm.backend import (
    INSTALL_HINT,
    WORKER_EXTENSION,
    BackendUnavailable,
    TltWorkerExtension,
    VllmEngine,
    accept_lengths,
    drafter_swap_tensors,
    field_names,
    recompute_hidden,
    require_vllm,
    to_generation_result,
)

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class SpecMetrics:
    num_spec_tokens: int
    histogram: list[int] = field(default_factory=list)
    num_draft_tokens: int = 0
    per_step_accepted: list[int] = field(default_factory=list)
    per_step_drafted: list[int] = field(default_factory=list)


@dataclass
class Completion:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    spec_decode_metrics: SpecMetrics | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    prompt_logprobs: Any
    outputs: list[Completion]
    finished: bool


def finished(tokens: list[int], logps: list[float], reason: str, **completion: Any) -> RequestOutput:
    positions = [{t: Logprob(lp, rank=1)} for t, lp in zip(tokens, logps, strict=True)]
    done = Completion(0, "", tokens, sum(logps), positions, reason, **completion)
    return RequestOutput("tlt-0", None, [5, 6, 7], None, [done], True)


# ---------------------------------------------------------------------------------------- outputs -> ours


def test_a_finished_output_becomes_a_generation_result() -> None:
    out = finished([11, 12, 2], [-0.5, -1.25, -0.125], "stop", stop_reason=2)
    result = to_generation_result(out, request_id=("task", 3), prompt_ids=[5, 6, 7], eos_ids=[2])
    assert result.request_id == ("task", 3) and result.prompt_ids == [5, 6, 7]
    assert result.token_ids == [11, 12, 2] and result.finish_reason == "eos"  # EOS kept, as the torch engine does
    assert result.logprobs == [-0.5, -1.25, -0.125]
    assert result.accept_lengths == [] and result.hidden is None
    capped = to_generation_result(
        finished([11, 12], [-1.0, -2.0], "length"), request_id=0, prompt_ids=[5, 6, 7], eos_ids=[2]
    )
    assert capped.finish_reason == "length" and capped.token_ids == [11, 12]


class Letters:
    """Token t decodes to chr(ord('a') + t % 26): enough of a tokenizer for stop strings."""

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(ord("a") + t % 26) for t in ids)


def test_a_response_vllm_stopped_at_a_stop_string_is_cut_where_our_engine_would_stop() -> None:
    from tlt_stream.rollout.stops import StopStrings

    # With SD, vLLM checks stop strings after a whole step: tokens accepted past the stop come back too.
    out = finished([11, 3, 4, 20, 21], [-0.5, -1.0, -1.5, -2.0, -2.5], "stop", stop_reason="de")
    stop = StopStrings(Letters(), ["de"])  # 3 -> d, 4 -> e
    result = to_generation_result(out, request_id=0, prompt_ids=[5, 6, 7], eos_ids=[2], stop=stop)
    assert result.finish_reason == "stop"
    assert result.token_ids == [11, 3, 4] and result.logprobs == [-0.5, -1.0, -1.5]
    with pytest.raises(ValueError, match="stop string none was asked for"):
        to_generation_result(out, request_id=0, prompt_ids=[5, 6, 7], eos_ids=[2])


def test_the_sampled_tokens_logprob_is_picked_among_several() -> None:
    out = finished([11, 12], [-0.5, -1.5], "length")
    out.outputs[0].logprobs = [{4: Logprob(-0.1), 11: Logprob(-0.5)}, {12: Logprob(-1.5), 9: Logprob(-0.3)}]
    assert to_generation_result(out, request_id=0, prompt_ids=[5, 6, 7], eos_ids=[]).logprobs == [-0.5, -1.5]


@pytest.mark.parametrize(
    ("mutate", "needle"),
    [
        (lambda o: setattr(o, "finished", False), "not finished"),
        (lambda o: setattr(o.outputs[0], "finish_reason", "abort"), "'abort', which yields no sample"),
        (lambda o: setattr(o.outputs[0], "logprobs", None), "logprobs=0"),
        (lambda o: o.outputs[0].logprobs.__setitem__(1, {99: Logprob(-1.0)}), "no logprob for the sampled token 12"),
        (lambda o: setattr(o, "prompt_token_ids", [5, 6]), "different prompt"),
        (lambda o: o.outputs.append(o.outputs[0]), "expected one completion"),
        (lambda o: setattr(o.outputs[0], "token_ids", [11, 12, 3]), "not at an EOS id"),
    ],
)
def test_outputs_that_are_no_sample_are_refused(mutate: Any, needle: str) -> None:
    out = finished([11, 12, 2], [-0.5, -1.25, -0.125], "stop", stop_reason=2)
    mutate(out)
    with pytest.raises(ValueError, match=needle):
        to_generation_result(out, request_id=0, prompt_ids=[5, 6, 7], eos_ids=[2])


def test_accept_lengths_come_from_vllms_per_request_metrics() -> None:
    detailed = SpecMetrics(4, histogram=[1, 0, 1, 0, 1], per_step_accepted=[4, 0, 2], per_step_drafted=[4, 4, 4])
    assert accept_lengths(detailed, 20) == [5, 1, 3]  # accepted drafts + the bonus token, in order
    summary = SpecMetrics(4, histogram=[2, 0, 1, 0, 1])
    assert sorted(accept_lengths(summary, 20)) == [1, 1, 3, 5]  # grouped, counts and sums exact
    as_dict = {"acceptance_histogram": [0, 3], "num_spec_tokens": 1}  # RequestSpecDecodeMetrics.to_dict()
    assert accept_lengths(as_dict, 20) == [2, 2, 2]
    assert accept_lengths(detailed, 7) == [5, 1, 1]  # the last round cut by EOS: never more than emitted
    assert accept_lengths(None, 7) == []
    out = finished([11, 12, 13, 2], [-1.0] * 4, "stop", spec_decode_metrics=SpecMetrics(3, per_step_accepted=[2, 3]))
    result = to_generation_result(out, request_id=0, prompt_ids=[5, 6, 7], eos_ids=[2])
    assert result.accept_lengths == [3, 1]
    forwards = len(result.accept_lengths) + len(result.token_ids) - sum(result.accept_lengths)
    assert forwards == 2  # what rl/samples.py computes: two target forwards for four tokens


# ------------------------------------------------------------------------------------------- hidden states


def test_recomputed_hidden_states_are_what_the_torch_engine_streams(init_policy: Path) -> None:
    """The states `recompute_hidden` derives from (prompt, response) alone match the ones the torch engine
    collects while generating (`return_hidden=True`), in every packing of the recompute batches."""
    model = load_model(init_policy)
    prompts = [[5, 9, 12, 7], [8, 3], [30, 31, 32, 33, 34, 35, 36], [40]]
    engine = GenerationEngine(model, 4, 64)
    results = engine.generate(prompts, 12, temperature=1.0, seed=3, eos_ids=[2], return_hidden=True)
    sequences = [(r.prompt_ids, r.token_ids) for r in results]
    for budget in (16, 10_000):  # one sequence per batch, and all in one padded batch
        states = recompute_hidden(model, sequences, max_tokens=budget)
        for r, (prompt_hidden, hidden) in zip(results, states, strict=True):
            assert r.prompt_hidden is not None and r.hidden is not None
            assert prompt_hidden.shape == r.prompt_hidden.shape and hidden.shape == r.hidden.shape
            torch.testing.assert_close(prompt_hidden, r.prompt_hidden, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(hidden, r.hidden, atol=1e-5, rtol=1e-5)
    assert recompute_hidden(model, []) == []
    with pytest.raises(ValueError, match="at least one generated token"):
        recompute_hidden(model, [([5, 6], [])])


# ---------------------------------------------------------------------------------------------- drafter swap


def test_a_drafter_swap_never_loads_the_embedding_or_head(tmp_path: Path, init_policy: Path) -> None:
    torch.manual_seed(0)
    save_drafter(Drafter(load_model(init_policy).spec), tmp_path / "drafter")
    export = export_drafter(tmp_path / "drafter", tmp_path / "eagle", policy=init_policy)
    assert "embed_tokens.weight" in export.tensors
    names = [name for name, _ in drafter_swap_tensors(export.path)]
    assert sorted(names) == sorted(n for n in export.tensors if n != "embed_tokens.weight")
    assert "fc.weight" in names and "layers.0.self_attn.q_proj.weight" in names


def test_the_worker_extension_resolves_by_name_and_shadows_nothing() -> None:
    """vLLM imports `worker_extension_cls` by its qualified name in each worker and refuses an extension
    with a non-dunder attribute the worker class already has (vllm/v1/worker/worker_base.py)."""
    import importlib

    module, _, name = WORKER_EXTENSION.rpartition(".")
    assert getattr(importlib.import_module(module), name) is TltWorkerExtension
    own = [a for a in vars(TltWorkerExtension) if not a.startswith("__")]
    assert sorted(own) == ["tlt_reload_policy", "tlt_swap_drafter"]
    assert "__init__" not in vars(TltWorkerExtension)


def test_field_names_read_dataclasses_and_msgspec_structs() -> None:
    @dataclass
    class Args:
        model: str = ""
        seed: int = 0

    class Params(msgspec.Struct):
        temperature: float = 1.0
        logprobs: int | None = None

    assert field_names(Args) == {"model", "seed"}
    assert field_names(Params) == {"temperature", "logprobs"}


# --------------------------------------------------------------------------------------------- not installed


def test_without_vllm_the_backend_refuses_in_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError, installed or not
    with pytest.raises(BackendUnavailable) as exc:
        require_vllm()
    message = str(exc.value)
    assert INSTALL_HINT in message and "\n" not in message
    with pytest.raises(BackendUnavailable, match="tlt-stream\\[vllm\\]"):
        VllmEngine(tmp_path)


def test_generate_with_the_vllm_backend_is_refused_in_one_line_without_vllm(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, init_policy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)
    rows = tmp_path / "in.jsonl"
    rows.write_text(json.dumps({"prompt_ids": [5, 6, 7]}) + "\n")
    argv = ["generate", "--model", str(init_policy), "--input", str(rows), "--output", str(tmp_path / "o.jsonl")]
    assert main([*argv, "--backend", "vllm"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tlt-stream generate: the vllm rollout backend needs vLLM") and "\n" not in err
    assert "pip install 'tlt-stream[vllm]'" in err
    assert not (tmp_path / "o.jsonl").exists()


def test_generate_still_runs_the_torch_engine_by_default(
    tmp_path: Path, init_policy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--backend` is new; the default path (torch, plain and speculative) is unchanged: SD output equals
    plain output at temperature 0."""
    torch.manual_seed(1)
    save_drafter(Drafter(load_model(init_policy).spec), tmp_path / "drafter")
    rows = tmp_path / "in.jsonl"
    rows.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in ([5, 6, 7], [9, 10], [11])))
    outputs = {}
    for name, extra in {"plain": [], "sd": ["--drafter", str(tmp_path / "drafter"), "--backend", "torch"]}.items():
        out = tmp_path / f"{name}.jsonl"
        argv = ["generate", "--model", str(init_policy), "--input", str(rows), "--output", str(out)]
        assert main([*argv, "--max-new-tokens", "10", *extra]) == 0
        outputs[name] = [json.loads(line)["token_ids"] for line in out.read_text().splitlines()]
        summary = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
        assert summary["backend"] == "torch"
    assert outputs["sd"] == outputs["plain"] and len(outputs["plain"]) == 3


def test_importing_tlt_stream_never_imports_vllm(tmp_path: Path) -> None:
    """A `vllm` package that fails on import is first on the path: importing every module of the backend,
    the config translation, the export and the CLI must not touch it."""
    fake = tmp_path / "site" / "vllm"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise RuntimeError('vllm was imported')\n")
    code = (
        "import sys\n"
        "import tlt_stream, tlt_stream.commands.cli, tlt_stream.commands.generate, tlt_stream.drafter.export\n"
        "import tlt_stream.rollout.vllm.backend, tlt_stream.rollout.vllm.config\n"
        "tlt_stream.commands.cli.build_parser()\n"
        "assert 'vllm' not in sys.modules, 'vllm in sys.modules'\n"
        "print('ok')\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), str(ROOT)])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
