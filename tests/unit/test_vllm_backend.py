"""The vLLM backend where no vLLM is installed (CI's main environment): the one-line refusals, that importing
the project never imports vllm, what a drafter swap loads, and the defensive checks on vLLM outputs that the
running engine never produces (an aborted request, missing log-probs, a summary-only metric). Everything a
running engine does is tested against it in tests/vllm (`make test-vllm`).

The few output shapes below follow vLLM's (vllm/outputs.py `RequestOutput`, `CompletionOutput`;
vllm/logprobs.py `Logprob`; vllm/v1/metrics/stats.py `RequestSpecDecodeMetrics`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from tlt_stream.commands.cli import main
from tlt_stream.drafter.export import export_drafter
from tlt_stream.drafter.model import Drafter, save_drafter
from tlt_stream.model import load_model
from tlt_stream.rollout.vllm.backend import VllmEngine
from tlt_stream.rollout.vllm.extension import drafter_swap_tensors
from tlt_stream.rollout.vllm.install import INSTALL_HINT, BackendUnavailable, require_vllm
from tlt_stream.rollout.vllm.outputs import accept_lengths, to_generation_result

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


# ---------------------------------------------------------------------------------------------- drafter swap


def test_a_drafter_swap_never_loads_the_embedding_or_head(tmp_path: Path, init_policy: Path) -> None:
    torch.manual_seed(0)
    save_drafter(Drafter(load_model(init_policy).spec), tmp_path / "drafter")
    export = export_drafter(tmp_path / "drafter", tmp_path / "eagle", policy=init_policy)
    assert "embed_tokens.weight" in export.tensors
    names = [name for name, _ in drafter_swap_tensors(export.path)]
    assert sorted(names) == sorted(n for n in export.tensors if n != "embed_tokens.weight")
    assert "fc.weight" in names and "layers.0.self_attn.q_proj.weight" in names


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


class _ScheduledEngine:
    """`VllmEngine`'s schedule state without vLLM: an engine built to draft with d4k1v4, up to 16 rows, with
    the buckets the worker's configuration gives it (`rollout.build.vllm_settings`)."""

    def __init__(self, work_dir: Path) -> None:
        from tlt_stream.rollout.arms import Arm
        from tlt_stream.rollout.vllm.backend import VllmSettings

        self.arm, self.settings, self._schedule, self.work_dir = (
            Arm.from_label("d4k1v4"),
            VllmSettings(max_batch=16, edges=(4, 8)),
            None,
            work_dir,
        )

    set_schedule = VllmEngine.set_schedule


def test_a_published_sd_config_becomes_a_vllm_engines_schedule_or_is_refused_once(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from tlt_stream.basics.config import DEFAULTS, override
    from tlt_stream.basics.messages import SdArmChoice, SdConfigVersion
    from tlt_stream.roles.worker.drafters import DrafterSwaps

    config = override(DEFAULTS, {"sd.drafter": "d", "sd.adaptive": False, "sd.edges": [4, 8]})
    plane, info = SimpleNamespace(current={}), {}
    swaps = DrafterSwaps(config, plane, SimpleNamespace(update_info=info.update), "w")  # type: ignore[arg-type]
    engine = _ScheduledEngine(tmp_path)

    def announce(version: int, drafter: int, *rows: tuple[int, int]) -> None:  # (max_batch, depth; 0: plain)
        table = [SdArmChoice(max_batch=b, depth=d, topk=1, verify=d, enabled=d > 0) for b, d in rows]
        plane.current["sd_config"] = SdConfigVersion(version=version, drafter_version=drafter, table=table)
        swaps.adopt_sd_config(engine, None)

    announce(1, 0, (4, 4), (8, 2), (9, 0))  # buckets: <= 4, 5-8, above 8
    assert engine._schedule == [[1, 4, 4], [5, 8, 2], [9, 16, 0]] and info["sd_config_version"] == 1
    assert json.loads((tmp_path / "tlt-sd-schedule.json").read_text()) == engine._schedule  # vLLM's scheduler reads it
    announce(1, 0, (4, 0))  # the same version again: nothing changes
    assert engine._schedule == [[1, 4, 4], [5, 8, 2], [9, 16, 0]]
    announce(2, 0, (4, 6))  # deeper than the engine's chains: refused in one line, the schedule stays
    assert (
        swaps.sd_config == 2 and info["refused_sd_config"].startswith("2: ") and "\n" not in info["refused_sd_config"]
    )
    assert engine._schedule == [[1, 4, 4], [5, 8, 2], [9, 16, 0]]
    swaps.drafter = SimpleNamespace(version=3)  # a newer drafter is in use: a table measured on v0 is stale
    announce(3, 0, (4, 1))
    assert swaps.sd_config == 3 and engine._schedule == [[1, 4, 4], [5, 8, 2], [9, 16, 0]]
    announce(4, 3, (9, 1))
    assert engine._schedule == [[1, 8, 0], [9, 16, 1]]
    swaps.adopt_sd_config(object(), None)  # the torch engine without adaptive SD has no schedule to take


def test_the_follower_feeds_a_vllm_engines_group_history() -> None:
    """A vLLM engine drafting group arms has no torch proposer; the rollout worker's follower finds its
    `group_history` (which forwards to vLLM's worker), and nothing on an engine without one."""
    from types import SimpleNamespace

    from tlt_stream.roles.worker.follow import SampleFollower

    history = SimpleNamespace(remember=lambda prompt, response: None)
    group = SimpleNamespace(engine=SimpleNamespace(proposer=None, group_history=history))
    eagle = SimpleNamespace(engine=SimpleNamespace(proposer=SimpleNamespace(drafter=object()), group_history=None))
    assert SampleFollower(None, None, "w", group)._group_source() is history  # type: ignore[arg-type]
    assert SampleFollower(None, None, "w", eagle)._group_source() is None  # type: ignore[arg-type]
