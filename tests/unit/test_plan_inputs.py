"""`tlt-stream plan` on inputs unlike the repo's own: spellings, damaged run directories, odd laws and files."""

from __future__ import annotations

import json

import pytest

from tlt_stream.commands.cli import main
from tlt_stream.plan import lengths
from tlt_stream.plan.acceptance import from_run as acceptance_from_run
from tlt_stream.plan.costs import CpuCosts
from tlt_stream.plan.lengths import LengthError, from_lengths, from_run, named, trained_share
from tlt_stream.rollout.arms import Arm

FAST = ["--steps", "1", "--seeds", "1", "-q", "--no-recommend", "--modes", "a_sync_plain,b_sync_tlt"]
LAW = ["--lengths", "const:5", "--acceptance", "2"]


def _refused(capsys, argv: list[str]) -> str:
    """The one line `plan` refuses `argv` with (exit code 2, nothing on stdout, no traceback)."""
    assert main(["plan", *argv]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert captured.out == "" and err.startswith("tlt-stream plan:") and "\n" not in err, err
    return err


def _json(capsys, argv: list[str]) -> dict:
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _write_rows(path, rows) -> None:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))


def test_gpu_and_model_size_are_read_in_any_case(capsys):
    out = _json(capsys, [*LAW, "--gpu", " H100 ", "--model-size", "14b", "--rollout-gpus", "4", *FAST])
    assert out["inputs"]["costs"]["gpu"].startswith("H100") and out["inputs"]["costs"]["checkpoint"] == "Qwen2.5-14B"
    assert "choose from 7B, 14B, 32B" in _refused(capsys, [*LAW, "--gpu", "h100", "--model-size", "70B", *FAST])


def test_paper_with_an_unknown_gpu_is_refused_in_one_line(capsys):
    assert "unknown --gpu 'v100'" in _refused(capsys, ["--paper", "--gpu", "v100", "--seeds", "1", "-q"])


def test_json_output_is_standard_json(capsys):
    """A GPU's unbounded `cores` was printed as the non-standard token Infinity, which strict parsers refuse."""
    assert main(["plan", *LAW, "--gpu", "h100", *FAST, "--json"]) == 0
    text = capsys.readouterr().out

    def refuse(token):
        raise ValueError(token)

    out = json.loads(text, parse_constant=refuse)
    assert out["inputs"]["costs"]["cores"] is None
    assert main(["plan", *LAW, "--gpu", "h100", *FAST]) == 0
    table = capsys.readouterr().out
    assert "Infinity" not in table and "NaN" not in table and "b_sync_tlt" in table


def test_plot_path_is_checked_before_simulating_and_a_folder_gets_plan_png(capsys, tmp_path):
    err = _refused(capsys, [*LAW, "--gpu", "h100", *FAST, "--plot", str(tmp_path / "missing" / "p.png")])
    assert "no folder" in err
    assert ".png" in _refused(capsys, [*LAW, "--gpu", "h100", *FAST, "--plot", str(tmp_path / "p.txt")])
    assert main(["plan", *LAW, "--gpu", "h100", *FAST, "--plot", str(tmp_path)]) == 0
    assert (tmp_path / "plan.png").stat().st_size > 0
    assert str(tmp_path / "plan.png") in capsys.readouterr().err


def test_no_modes_is_refused(capsys):
    assert "--modes names no mode" in _refused(capsys, [*LAW, "--gpu", "h100", "--modes", " , ", "-q"])


def test_acceptance_that_is_not_a_finite_number_is_refused_naming_the_flag(capsys):
    for value in ("nan", "inf"):
        assert "--acceptance is tokens per round" in _refused(
            capsys, [*LAW[:2], "--acceptance", value, "--gpu", "h100"]
        )


def test_a_run_with_damaged_metrics_keeps_its_usable_steps(capsys, tmp_path):
    """Rows without a version, lines that are JSON but not an object, a NaN length and a torn last line."""
    rows = [
        {"response_lens": [7, 7]},
        [1, 2, 3],
        {"version": 2, "response_lens": [10, 20], "accept_lengths": ["x", 3.0], "degenerate_groups": "x"},
        {"version": 3, "response_lens": [float("nan"), 40]},
        {"version": 4, "response_lens": [30, 40], "accept_lengths": [3.0, 3.0], "trained_groups": ["a"]},
        '{"version": 5, "respo',
    ]
    _write_rows(tmp_path / "metrics.jsonl", rows)
    assert [r.get("version") for r in lengths.run_rows(tmp_path)] == [2, 3, 4, None]
    assert sorted(from_run(tmp_path).lengths) == [7, 7, 30, 40]  # the first usable step left out
    out = _json(capsys, ["--from-run", str(tmp_path), "--gpu", "h100", *FAST])
    assert out["inputs"]["acceptance"]["tokens_per_round"] == pytest.approx(3.0) and out["inputs"]["trained_share"] == 1


def test_a_run_whose_lengths_are_not_numbers_is_refused_with_what_to_do(capsys, tmp_path):
    rows = [{"version": v, "response_lens": ["a", 3], "response_len_p50": None} for v in (1, 2)]
    _write_rows(tmp_path / "metrics.jsonl", rows)
    err = _refused(capsys, ["--from-run", str(tmp_path), "--gpu", "h100", "--acceptance", "2", *FAST])
    assert "metrics.jsonl: no step records response lengths" in err and "--lengths" in err
    (tmp_path / "metrics.jsonl").write_text('{"version": 1, "response_len_p50": 100}\n')  # p90 and max missing
    with pytest.raises(LengthError):
        from_run(tmp_path)


def test_a_run_without_speculative_decoding_asks_for_the_acceptance(capsys, tmp_path):
    rows = [{"version": v, "response_lens": [10, 20], "accept_length_mean": 1.0} for v in (1, 2)]
    _write_rows(tmp_path / "metrics.jsonl", rows)
    err = _refused(capsys, ["--from-run", str(tmp_path), "--gpu", "h100", *FAST])
    assert "recorded no speculative decoding" in err and "without --from-run" not in err


def test_a_timeline_with_malformed_arm_reports_keeps_the_others(tmp_path):
    arm = {"kind": "sd_arm", "bucket": 0, "depth": 4, "topk": 1, "verify": 4}
    lines = [
        {**arm, "tokens": "x", "rows": 5},
        {**arm, "tokens": 10, "rows": 0.5},
        {**arm, "depth": "4", "tokens": 10, "rows": 5},
        {"kind": "sd_arm", "tokens": 10, "rows": 5},
        {**arm, "tokens": 30, "rows": 10},
    ]
    _write_rows(tmp_path / "timeline.jsonl", lines)
    assert acceptance_from_run(tmp_path, fallback=2.0).mean(Arm.from_label("d4k1v4"), 0) == pytest.approx(3.0)


def test_a_lengths_file_of_the_wrong_shape_is_refused_naming_it(capsys, tmp_path):
    path = tmp_path / "lens.json"
    for text, said in (("5", "a JSON list"), ("[3, 1e400]", "got inf"), ('[3, "x"]', "got 'x'"), ("[3,", "not JSON")):
        path.write_text(text)
        err = _refused(capsys, ["--lengths-file", str(path), "--acceptance", "2", "--gpu", "h100", *FAST])
        assert str(path) in err and said in err
    assert from_lengths([3, 4.6]).lengths == (3, 5)


def test_length_laws_need_finite_arguments_and_a_cap_on_endless_tails():
    for spec in ("lognormal:inf:1", "const:1e400", "lognormal:3000:nan", "pareto:100:0.01", "lognormal:3000:50"):
        with pytest.raises(LengthError):
            named(spec)
    assert max(named("pareto:100:0.01:32768").lengths) == 32768
    assert named("LogNormal:100:1.0:500").lengths == named("lognormal:100:1.0:500").lengths
    with pytest.raises(LengthError, match="LOW <= HIGH"):
        named("uniform:200:20")


def test_a_cpu_model_file_of_the_wrong_shape_is_refused_in_one_line(capsys, tmp_path):
    path = tmp_path / "cpu.json"
    CpuCosts(step_s=0.01, row_s=0.001).save(path)
    assert CpuCosts.load(path).step_s == 0.01
    good = json.loads(path.read_text())
    for text in ("[]", "not json", json.dumps({**good, "row_s": "fast"}), json.dumps({"model": "cpu"})):
        path.write_text(text)
        assert "fit one with bench/plan_fit.py" in _refused(capsys, [*LAW, "--cpu-model", str(path), *FAST])
    assert "cannot read it" in _refused(capsys, [*LAW, "--cpu-model", str(tmp_path / "none.json"), *FAST])


def test_an_acceptance_table_given_inline_as_its_help_shows(capsys):
    table = json.dumps({"d4k1v4": {"0": 3.4, "*": 3.0}, "*": {"*": 2.5}})
    out = _json(capsys, [*LAW, "--gpu", "h100", "--acceptance-table", table, *FAST])
    assert out["inputs"]["acceptance"]["table"]["d4k1v4@0"] == 3.4
    assert "not JSON" in _refused(capsys, [*LAW, "--gpu", "h100", "--acceptance-table", '{"d4k1v4": ', *FAST])


def test_more_rollout_gpus_than_groups_leaves_engines_idle(capsys):
    out = _json(capsys, [*LAW, "--gpu", "h100", "--rollout-gpus", "32", *FAST])
    assert out["inputs"]["setup"]["workers"] == 32 and out["inputs"]["setup"]["max_batch"] == 8


def test_a_model_or_prompt_that_does_not_fit_the_gpus_is_refused(capsys):
    err = _refused(capsys, [*LAW, "--gpu", "a100", "--model-size", "32B", "--tp", "1", "--rollout-gpus", "1", *FAST])
    assert "give a larger --tp" in err
    assert "KV cache" in _refused(capsys, [*LAW, "--gpu", "h100", "--prompt-len", "1000000000", *FAST])
    err = _refused(capsys, [*LAW, "--gpu", "h100", "--model-size", "7B", "--tp", "3", "--rollout-gpus", "3", *FAST])
    assert "28 attention heads do not split over --tp 3" in err


def test_trained_share_skips_rows_whose_counts_are_not_numbers():
    rows = [
        {"degenerate_groups": "x", "trained_groups": ["a", "b"]},
        {"degenerate_groups": 1, "trained_groups": ["c", "d"]},
    ]
    assert trained_share(rows) == 0.5
