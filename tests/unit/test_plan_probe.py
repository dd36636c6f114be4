"""`tlt-stream plan` as an engineer planning a GPU run uses it: acceptance inputs a round cannot produce, runs cut
short or without a timeline, a plain run, and the output's labels, plot files and determinism."""

from __future__ import annotations

import json
import os

import pytest

from tests.unit.test_plan_inputs import FAST, _json, _refused, _write_rows
from tlt_stream.basics.config import DEFAULTS
from tlt_stream.commands.cli import main
from tlt_stream.plan.acceptance import from_run as acceptance_from_run
from tlt_stream.rollout.arms import Arm

LAW = ["--lengths", "const:5", "--acceptance", "2", "--gpu", "h100"]


def test_an_acceptance_table_a_round_cannot_produce_is_refused(capsys):
    """d4k1v4 drafts 4 tokens, so a round emits at most 5; it was capped there without a word."""
    assert "at most 5" in _refused(capsys, [*LAW, "--acceptance-table", '{"d4k1v4": {"*": 9}}', *FAST])
    assert "'plain'" in _refused(capsys, [*LAW, "--acceptance-table", '{"plain": {"*": 3}}', *FAST])
    outside = str(len(DEFAULTS.sd.edges) + 1)  # the buckets are 0 .. len(edges)
    for bucket in (outside, "-1", "x"):
        table = json.dumps({"d4k1v4": {bucket: 3}})
        assert f"bucket {bucket!r}" in _refused(capsys, [*LAW, "--acceptance-table", table, *FAST])
    for value in ("true", '"3"', "0.5", "1e400"):
        table = '{"d4k1v4": {"*": ' + value + "}}"
        assert "tokens per round are >= 1" in _refused(capsys, [*LAW, "--acceptance-table", table, *FAST])
    assert "not {arm: {bucket: tokens}}" in _refused(capsys, [*LAW, "--acceptance-table", "[1, 2]", *FAST])
    last = str(len(DEFAULTS.sd.edges))
    out = _json(capsys, [*LAW, "--acceptance-table", json.dumps({"d4k1v4": {last: 5, "*": 1}}), *FAST])
    assert out["inputs"]["acceptance"]["table"][f"d4k1v4@{last}"] == 5


def test_an_acceptance_figure_beyond_its_arms_depth_is_refused(capsys):
    err = _refused(capsys, ["--lengths", "const:5", "--acceptance", "9", "--acceptance-arm", "d4k1v4", "--gpu", "h100"])
    assert "at most 5 tokens" in err
    argv = ["--lengths", "const:5", "--acceptance", "5", "--acceptance-arm", "d4k1v4", "--gpu", "h100", *FAST]
    assert _json(capsys, argv)["inputs"]["acceptance"]["table"] == {"d4k1v4@*": 5}
    # a group chain of 8 tokens reaches past a depth-1 drafter: a round of d1k1v1|g8 emits up to 9
    argv = ["--lengths", "const:5", "--acceptance", "6", "--acceptance-arm", "d1k1v1|g8", "--gpu", "h100", *FAST]
    assert _json(capsys, argv)["inputs"]["acceptance"]["table"] == {"d1k1v1|g8@*": 6}
    assert "at most 9" in _refused(capsys, [*LAW, "--acceptance-table", '{"d1k1v1+g8": {"*": 10}}', *FAST])


def test_arms_that_name_no_sd_arm_are_refused_for_the_sd_modes(capsys):
    """The TLT modes then ran plain decoding and projected (b) exactly as (a), without saying why."""
    for arms in ("plain", ","):
        assert "names no SD arm" in _refused(capsys, [*LAW, "--arms", arms, *FAST])
    out = _json(capsys, [*LAW, "--arms", "plain", *FAST[:-1], "a_sync_plain"])
    assert list(out["modes"]) == ["a_sync_plain"]


def test_arm_reports_of_more_tokens_than_a_round_emits_are_left_out(tmp_path):
    """A d4k1v4 round emits at most 5 tokens per row; a report of 50 per row is damaged, the other one counts."""
    arm = {"kind": "sd_arm", "bucket": 0, "depth": 4, "topk": 1, "verify": 4}
    _write_rows(tmp_path / "timeline.jsonl", [{**arm, "tokens": 30, "rows": 10}, {**arm, "tokens": 500, "rows": 10}])
    acceptance = acceptance_from_run(tmp_path, fallback=2.0)
    assert acceptance.table["d4k1v4", 0] == pytest.approx(3.0)
    assert acceptance.mean(Arm.from_label("d4k1v4"), 0) == pytest.approx(3.0)


def _sd_run(path, *, torn: bool = False) -> None:
    rows = [
        {"version": v, "response_lens": [10, 30], "accept_lengths": [2.0, 2.0], "accept_length_mean": 2.0}
        for v in (1, 2, 3)
    ]
    _write_rows(path / "metrics.jsonl", [*rows, '{"version": 4, "response_lens": [10'] if torn else rows)


def test_a_run_without_a_timeline_says_every_arm_is_alike(capsys, tmp_path):
    """The source read `RUN (accept_length_mean)`: neither the figure it used nor that no arm was measured."""
    _sd_run(tmp_path)
    source = _json(capsys, ["--from-run", str(tmp_path), "--gpu", "h100", *FAST])["inputs"]["acceptance"]["source"]
    assert "metrics.jsonl (tokens per target forward" in source and "timeline.jsonl is missing" in source


def test_a_run_cut_short_names_the_line_it_left_out(capsys, tmp_path):
    _sd_run(tmp_path, torn=True)
    out = _json(capsys, ["--from-run", str(tmp_path), "--gpu", "h100", *FAST])
    assert out["inputs"]["lengths"]["source"] == f"{tmp_path} (2 steps, per-sample lengths; 1 line not a JSON " + (
        "record (cut short?) left out)"
    )
    (tmp_path / "metrics.jsonl").write_text('{"version": 1, "response_lens": [1')
    assert "1 line not a JSON record" in _refused(capsys, ["--from-run", str(tmp_path), "--gpu", "h100", *FAST])


def test_a_run_directory_that_is_a_file_is_named_as_such(capsys, tmp_path):
    path = tmp_path / "run"
    path.write_text("{}")
    assert "not a directory" in _refused(capsys, ["--from-run", str(path), "--gpu", "h100", *FAST])


def test_a_plain_run_projects_plain_decoding_and_asks_for_the_acceptance_of_the_rest(capsys, tmp_path):
    """A run with SD off has no acceptance to read: the TLT modes need one given, plain decoding needs none."""
    rows = [{"version": v, "response_lens": [10, 30], "accept_lengths": [], "accept_length_mean": 1.0} for v in (1, 2)]
    _write_rows(tmp_path / "metrics.jsonl", rows)
    err = _refused(capsys, ["--from-run", str(tmp_path), "--gpu", "h100", "--steps", "1", "--seeds", "1", "-q"])
    assert "give --acceptance TOKENS" in err and "--modes a_sync_plain" in err
    argv = ["--from-run", str(tmp_path), "--gpu", "h100", "--steps", "1", "--seeds", "1", "-q"]
    out = _json(capsys, [*argv, "--modes", "a_sync_plain", "--plot", str(tmp_path / "p.png")])
    assert list(out["modes"]) == ["a_sync_plain"] and out["recommended"] is None
    assert out["inputs"]["acceptance"]["source"].startswith("not used")


def test_every_section_of_the_table_says_it_is_a_projection(capsys):
    assert main(["plan", *LAW, "--steps", "1", "--seeds", "1", "-q", "--modes", "a_sync_plain,b_sync_tlt"]) == 0
    text = capsys.readouterr().out
    heads = [line for line in text.splitlines() if line.startswith("  ") and not line.startswith("   ")]
    sections = [line for line in heads if line.split(" (")[0].strip() in ("recommended", "device_split")]
    assert len(sections) == 2 and all("PROJECTED" in line for line in sections), sections
    assert "PROJECTED per mode" in text


def test_the_plot_is_a_png_or_svg_where_it_says_and_the_json_repeats(capsys, tmp_path):
    argv = [*LAW, *FAST, "--json"]
    assert main(["plan", *argv, "--plot", str(tmp_path / "a.png")]) == 0
    first = capsys.readouterr()
    assert f"plot: {tmp_path / 'a.png'}" in first.err
    assert (tmp_path / "a.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["plan", *argv, "--plot", str(tmp_path / "a.svg")]) == 0
    assert capsys.readouterr().out == first.out  # the same seed, the same projection
    assert "<svg" in (tmp_path / "a.svg").read_text()


def test_a_cpu_model_whose_steps_take_no_time_or_less_is_refused(capsys, tmp_path):
    """Such a model simulated steps of negative length, or divided by zero in a traceback."""
    path = tmp_path / "cpu.json"
    cases = {
        '"step_s": -0.01, "row_s": 0.001': "takes -0.009 s",  # -0.01 + 0.001 x 1 row
        '"step_s": 0.01, "row_s": 0.001, "learn_tokens_per_s": 0': "learn_tokens_per_s is 0",
        '"step_s": 0.01, "row_s": 0.001, "cores": 0': "cores is 0",
        '"step_s": 1e400, "row_s": 0.001': "step_s is inf",
        '"step_s": 0.01, "row_s": 0.001, "publish_s": -1': "publish_s is -1",
        '"step_s": 0.01, "row_s": 0.001, "engine_k": [-1]': "engine_k is [-1]",
    }
    law = ["--lengths", "const:5", "--acceptance", "2"]
    for body, said in cases.items():
        path.write_text('{"model": "cpu", ' + body + "}")
        err = _refused(capsys, [*law, "--cpu-model", str(path), *FAST])
        assert said in err and "fit one with bench/plan_fit.py" in err, err
    path.write_text('{"model": "cpu", "step_s": 0.01, "row_s": 0.001}')
    out = _json(capsys, [*law, "--cpu-model", str(path), *FAST])
    assert all(row["step_time_s"] > 0 for row in out["modes"].values())


def test_a_step_time_too_short_to_report_is_refused_not_divided_by():
    """Steps of nanoseconds rounded to 0 s and the speedup over (a) divided by it."""
    from tlt_stream.plan.acceptance import Acceptance
    from tlt_stream.plan.costs import CpuCosts
    from tlt_stream.plan.lengths import named
    from tlt_stream.plan.project import project
    from tlt_stream.plan.simulate import Setup

    costs = CpuCosts(step_s=1e-9, row_s=0.0, learn_tokens_per_s=1e12)
    setup = Setup(prompts=2, group_size=2, steps=1)
    with pytest.raises(ValueError, match=r"at least 0\.0001 s"):
        project(setup, named("const:5"), Acceptance.uniform(2.0), costs, ["a_sync_plain"], seeds=1)


def test_gpu_only_flags_beside_a_cpu_model_are_refused_naming_them(capsys, tmp_path):
    """--cpu-model prices steps by this machine's fit and read none of them, so the projection looked shaped by
    GPUs, a model size or a split it never saw. A flag given at its default value counts as given."""
    path = tmp_path / "cpu.json"
    path.write_text('{"model": "cpu", "step_s": 0.01, "row_s": 0.001}')
    cpu = ["--lengths", "const:5", "--acceptance", "2", "--cpu-model", str(path), *FAST]
    for flags, named in (
        (["--rollout-gpus", "8"], "--rollout-gpus"),
        (["--model-size", "7B"], "--model-size"),
        (["--learner-gpus", "2"], "--learner-gpus"),
        (["--tp", "1"], "--tp"),
        (["--vary"], "--vary"),
        (["--tp", "2", "--model-size", "14B", "--rollout-gpus", "4"], "--model-size, --rollout-gpus, --tp"),
    ):
        err = _refused(capsys, [*cpu, *flags])
        assert f"--cpu-model ignores {named} (" in err and "give --gpu" in err, err
    assert "choose --gpu or --cpu-model" in _refused(capsys, [*cpu, "--gpu", "h100", "--tp", "2"])
    assert set(_json(capsys, cpu)["modes"]) == {"a_sync_plain", "b_sync_tlt"}


def test_a_default_plot_that_cannot_be_written_is_said_and_the_projection_still_printed(capsys, tmp_path):
    """The plot beside the run was skipped without a word; the projection is what was asked for, so it is
    printed and the exit status is 0, with one line saying where the plot was not written and why."""
    _sd_run(tmp_path)
    (tmp_path / "plan.png").mkdir()  # a folder in the plot's place
    argv = ["plan", "--from-run", str(tmp_path), "--gpu", "h100", *FAST]
    for extra in (["--json"], []):
        assert main([*argv, *extra]) == 0
        captured = capsys.readouterr()
        err = captured.err.strip()
        assert err.startswith("tlt-stream plan: plot not written") and "\n" not in err, err
        assert f"{tmp_path / 'plan.png'}: Is a directory" in err and "--plot" in err
        if extra:
            assert set(json.loads(captured.out)["modes"]) == {"a_sync_plain", "b_sync_tlt"}
        else:
            assert "PROJECTED per mode" in captured.out
    assert list((tmp_path / "plan.png").iterdir()) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only folder")
def test_a_default_plot_in_a_read_only_run_is_said(capsys, tmp_path):
    _sd_run(tmp_path)
    tmp_path.chmod(0o555)
    try:
        assert main(["plan", "--from-run", str(tmp_path), "--gpu", "h100", *FAST, "--json"]) == 0
        captured = capsys.readouterr()
    finally:
        tmp_path.chmod(0o755)
    assert json.loads(captured.out)["modes"] and not (tmp_path / "plan.png").exists()
    err = captured.err.strip()
    assert err.startswith("tlt-stream plan: plot not written") and "Permission denied" in err and "\n" not in err


def test_a_plot_path_asked_for_that_cannot_be_written_is_refused_before_simulating(capsys, tmp_path):
    """A folder given to --plot gets plan.png in it; a folder named so in there was found only when drawing, after
    the projection, and reported as a failure to draw."""
    (tmp_path / "plan.png").mkdir()
    err = _refused(capsys, [*LAW, *FAST, "--plot", str(tmp_path)])
    assert f"--plot {tmp_path / 'plan.png'}: a folder is in its place" in err
    if os.geteuid() != 0:  # root writes into a read-only folder
        (tmp_path / "ro").mkdir(mode=0o555)
        assert "not writable" in _refused(capsys, [*LAW, *FAST, "--plot", str(tmp_path / "ro" / "p.png")])


def test_the_papers_projection_refuses_a_users_own_workload_and_hardware_flags(capsys, tmp_path):
    """--paper projects TLT's published setup; --from-run, --cpu-model or --model-size beside it were ignored
    without a word, and the user read the paper's figures as their own."""
    for extra in (["--from-run", str(tmp_path)], ["--cpu-model", "x.json"], ["--model-size", "32B", "--tp", "8"]):
        err = _refused(capsys, ["--paper", "--seeds", "1", "-q", *extra])
        assert "--paper projects TLT's published" in err and all(f in err for f in extra if f.startswith("--"))
