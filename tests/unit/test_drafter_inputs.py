"""Unusual input to the commands that make, export and use drafters (`drafter init`, `export-drafter`,
`generate`): one line on stderr naming what is wrong, exit code 2, no traceback, standard JSON, and nothing
half-written when a command fails."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tlt_stream.commands.cli import main
from tlt_stream.drafter.model import Drafter, read_drafter, save_drafter
from tlt_stream.model import load_model
from tlt_stream.model.spec import ModelSpec
from tlt_stream.rollout.arms import MAX_DRAFT_DEPTH


def _strict_json(text: str) -> Any:
    """JSON as the standard has it: `NaN`, `Infinity` and `-Infinity` are refused."""

    def refuse(token: str) -> None:
        raise ValueError(f"non-standard JSON token {token}")

    return json.loads(text, parse_constant=refuse)


def _refused(capsys: pytest.CaptureFixture[str], command: str, argv: list[str]) -> str:
    """Run `tlt-stream ARGV`, expect exit code 2 and one line on stderr; return that line."""
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"tlt-stream {command}: "), err
    assert "\n" not in err and "Traceback" not in err, err
    return err


@pytest.fixture
def drafter_dir(tmp_path: Path, init_policy: Path) -> Path:
    torch.manual_seed(1)
    return save_drafter(Drafter(load_model(init_policy).spec), tmp_path / "drafter")


def _edited(drafter_dir: Path, where: Path, **spec: Any) -> Path:
    """A copy of `drafter_dir` whose config's spec has `spec`'s fields set (NaN and Infinity written as
    Python's json module writes them)."""
    where.mkdir()
    (where / "model.safetensors").write_bytes((drafter_dir / "model.safetensors").read_bytes())
    config = json.loads((drafter_dir / "config.json").read_text())
    config["spec"].update(spec)
    (where / "config.json").write_text(json.dumps(config))
    return where


# ------------------------------------------------------------------------------------- the drafter's config


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("rms_norm_eps", math.inf, "spec.rms_norm_eps must be a finite positive number"),
        ("vocab_size", math.nan, "spec.vocab_size must be an integer"),
        ("vocab_size", 100.5, "spec.vocab_size must be an integer"),
        ("hidden_size", 16.0, "spec.hidden_size must be an integer"),
        ("rope_theta", 0, "spec.rope_theta must be a finite positive number"),
        ("max_position_embeddings", -1, "spec.max_position_embeddings must be >= 1"),
        ("qkv_bias", "no", "spec.qkv_bias must be true or false"),
    ],
)
def test_a_drafter_config_with_a_non_finite_or_mistyped_number_is_refused_and_nothing_is_exported(
    tmp_path: Path, drafter_dir: Path, capsys: pytest.CaptureFixture[str], field: str, value: Any, named: str
) -> None:
    bad = _edited(drafter_dir, tmp_path / "bad", **{field: value})
    out = tmp_path / "out"
    err = _refused(capsys, "export-drafter", ["export-drafter", str(bad), "--out", str(out)])
    assert named in err and "config.json" in err
    assert not out.exists()


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"num_layers": 3}, "num_layers 3 where a drafter has 1"),
        ({"qk_norm": True}, "qk_norm True where a drafter has False"),
        ({"sliding_window": 64}, "sliding_window 64 where a drafter has None"),
        ({"architecture": "qwen3"}, "architecture 'qwen3' where a drafter has 'llama'"),
    ],
)
def test_a_drafter_config_describing_more_than_its_tensors_hold_is_refused(
    tmp_path: Path, drafter_dir: Path, capsys: pytest.CaptureFixture[str], fields: dict[str, Any], named: str
) -> None:
    bad = _edited(drafter_dir, tmp_path / "bad", **fields)
    out = tmp_path / "out"
    err = _refused(capsys, "export-drafter", ["export-drafter", str(bad), "--out", str(out)])
    assert named in err and "drafter init" in err
    assert not out.exists()


def test_a_drafter_config_that_is_not_utf8_is_refused_in_one_line(
    tmp_path: Path, drafter_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = _edited(drafter_dir, tmp_path / "bad")
    (bad / "config.json").write_bytes(b"\xff\xfe{")
    err = _refused(capsys, "export-drafter", ["export-drafter", str(bad), "--out", str(tmp_path / "out")])
    assert "not UTF-8" in err


def test_a_saved_drafter_still_reads_back_and_exports_standard_json(
    tmp_path: Path, drafter_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert read_drafter(drafter_dir).spec.num_layers == 1
    qwen = ModelSpec("qwen2", 29, 32, 64, 4, 4, 2, 8, rope_type="yarn", rope_factor=4.0,
                     rope_original_max_positions=64, sliding_window=128, qk_norm=True)  # fmt: skip
    assert read_drafter(save_drafter(Drafter(qwen), tmp_path / "qwen")).spec.qkv_bias is False
    assert main(["export-drafter", str(drafter_dir), "--out", str(tmp_path / "out")]) == 0
    _strict_json(capsys.readouterr().out)
    for name in ("config.json", "tlt_export.json"):
        _strict_json((tmp_path / "out" / name).read_text())


# ------------------------------------------------------------------------------------------ export output


def test_a_failed_forced_export_leaves_the_earlier_export_as_it_was(
    tmp_path: Path, drafter_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import tlt_stream.drafter.export as export

    out = tmp_path / "out"
    assert main(["export-drafter", str(drafter_dir), "--out", str(out)]) == 0
    capsys.readouterr()
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def full_disk(*args: Any, **kwargs: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(export, "save_file", full_disk)
    err = _refused(capsys, "export-drafter", ["export-drafter", str(drafter_dir), "--out", str(out), "--force"])
    assert "No space left on device" in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []


def test_an_export_under_a_file_names_the_file(
    tmp_path: Path, drafter_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "a-file").write_text("")
    out = tmp_path / "a-file" / "sub" / "out"
    err = _refused(capsys, "export-drafter", ["export-drafter", str(drafter_dir), "--out", str(out)])
    assert f"{tmp_path / 'a-file'} is a file, not a folder" in err


# ------------------------------------------------------------------------------------------------ generate


@pytest.fixture
def prompts(tmp_path: Path) -> Path:
    path = tmp_path / "in.jsonl"
    path.write_text('{"prompt": "1+2="}\n{"prompt_ids": [1, 5, 6]}\n')
    return path


@pytest.fixture
def no_model_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bad input must be refused before the policy loads."""
    import tlt_stream.model

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(tlt_stream.model, "load_model", refuse)


def _generate(init_policy: Path, prompts: Path, out: Path, *extra: str) -> list[str]:
    return ["generate", "--model", str(init_policy), "--input", str(prompts), "--output", str(out),
            "--max-new-tokens", "3", *extra]  # fmt: skip


@pytest.mark.parametrize("temperature", ["nan", "-1", "inf", "-inf"])
def test_generate_refuses_a_temperature_it_cannot_sample_with_before_loading(
    tmp_path: Path, init_policy: Path, prompts: Path, capsys: pytest.CaptureFixture[str], no_model_load: None,
    temperature: str,
) -> None:  # fmt: skip
    out = tmp_path / "out.jsonl"
    err = _refused(capsys, "generate", _generate(init_policy, prompts, out, f"--temperature={temperature}"))
    assert "--temperature must be a finite number >= 0" in err
    assert not out.exists()


def test_generate_refuses_a_seed_past_64_bits(
    tmp_path: Path, init_policy: Path, prompts: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out.jsonl"
    with pytest.raises(SystemExit) as exc:
        main(_generate(init_policy, prompts, out, "--seed", str(2**64), "--temperature", "1"))
    assert exc.value.code == 2
    assert "--seed: must be a 64-bit integer" in capsys.readouterr().err
    argv = _generate(init_policy, prompts, out, "--seed", str(2**63 - 1), "--temperature", "1")
    assert "row i samples with seed + i" in _refused(capsys, "generate", argv)  # two rows: seed + 1 overflows
    assert not out.exists()
    assert main(_generate(init_policy, prompts, out, "--seed", str(-(2**63)), "--temperature", "1")) == 0


def test_generate_refuses_a_draft_topk_past_the_vocabulary(
    tmp_path: Path, init_policy: Path, drafter_dir: Path, prompts: Path, capsys: pytest.CaptureFixture[str],
    no_model_load: None,
) -> None:  # fmt: skip
    topk = json.loads((init_policy / "config.json").read_text())["vocab_size"] + 1
    argv = _generate(init_policy, prompts, tmp_path / "out.jsonl", "--drafter", str(drafter_dir), "--topk", str(topk))
    assert f"--topk {topk} is more than the model's" in _refused(capsys, "generate", argv)


def test_generate_refuses_a_drafter_made_for_another_policy_before_loading(
    tmp_path: Path, init_policy: Path, prompts: Path, capsys: pytest.CaptureFixture[str], no_model_load: None
) -> None:
    other = ModelSpec("llama", 100, 24, 48, 1, 2, 1, 12)
    drafter = save_drafter(Drafter(other), tmp_path / "other-drafter")
    argv = _generate(init_policy, prompts, tmp_path / "out.jsonl", "--drafter", str(drafter))
    err = _refused(capsys, "generate", argv)
    assert "made for a policy of hidden size 24" in err and "drafter init" in err


def test_generate_refuses_a_drafter_with_an_invalid_config(
    tmp_path: Path, init_policy: Path, drafter_dir: Path, prompts: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = _edited(drafter_dir, tmp_path / "bad", hidden_size=16.0)
    argv = _generate(init_policy, prompts, tmp_path / "out.jsonl", "--drafter", str(bad))
    assert "spec.hidden_size must be an integer" in _refused(capsys, "generate", argv)


@pytest.mark.parametrize(
    ("row", "named"),
    [
        ('{"prompt": "  \\t "}', "not only whitespace"),
        ('{"prompt": "a\\ud800b"}', "unpaired surrogate"),
    ],
)
def test_generate_refuses_a_prompt_of_whitespace_or_a_lone_surrogate(
    tmp_path: Path, init_policy: Path, capsys: pytest.CaptureFixture[str], row: str, named: str
) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text('{"prompt": "1+2="}\n' + row + "\n")
    err = _refused(capsys, "generate", _generate(init_policy, path, tmp_path / "out.jsonl"))
    assert f"{path}:2:" in err and named in err


def test_generate_output_under_a_file_is_refused_naming_the_file(
    tmp_path: Path, init_policy: Path, prompts: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "a-file").write_text("")
    err = _refused(capsys, "generate", _generate(init_policy, prompts, tmp_path / "a-file" / "out.jsonl"))
    assert f"{tmp_path / 'a-file'} is a file, not a folder" in err


def test_a_failed_write_leaves_an_earlier_output_as_it_was(
    tmp_path: Path, init_policy: Path, prompts: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    import tlt_stream.commands.generate as generate

    out = tmp_path / "out.jsonl"
    out.write_text("earlier\n")
    real = json.dumps
    rows = 0

    class FailingJson:
        """The second row's write fails (a full disk, as it would halfway through the file)."""

        loads = staticmethod(json.loads)
        JSONDecodeError = json.JSONDecodeError

        @staticmethod
        def dumps(value: Any, **kwargs: Any) -> str:
            nonlocal rows
            if isinstance(value, dict) and "token_ids" in value:
                rows += 1
                if rows == 2:
                    raise OSError(28, "No space left on device")
            return real(value, **kwargs)

    monkeypatch.setattr(generate, "json", FailingJson)
    assert "No space left on device" in _refused(capsys, "generate", _generate(init_policy, prompts, out))
    assert out.read_text() == "earlier\n"
    monkeypatch.undo()
    link = tmp_path / "link.jsonl"
    link.symlink_to(out)
    assert main(_generate(init_policy, prompts, link)) == 0
    assert link.is_symlink() and len(out.read_text().splitlines()) == 2
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


# ---------------------------------------------------------------------------------------------- drafter init


def _init(init_policy: Path, tmp_path: Path, out: Path, *extra: str) -> list[str]:
    train = tmp_path / "train.jsonl"
    if not train.exists():
        train.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i)}) + "\n" for i in range(3)))
    return ["drafter", "init", "--policy", str(init_policy), "--dataset", str(train), "--out", str(out),
            "--samples", "2", "--steps", "2", "--max-len", "32", "--threads", "1", *extra]  # fmt: skip


@pytest.mark.parametrize(("flag", "value"), [("--lr", "nan"), ("--lr", "-1"), ("--lr", "0"), ("--seed", str(2**64))])
def test_drafter_init_refuses_a_learning_rate_or_seed_it_cannot_use(
    tmp_path: Path, init_policy: Path, capsys: pytest.CaptureFixture[str], flag: str, value: str
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(_init(init_policy, tmp_path, tmp_path / "out", flag, value))
    assert exc.value.code == 2
    assert f"argument {flag}: must be" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_drafter_init_refuses_an_out_it_cannot_write_before_any_work(
    tmp_path: Path, init_policy: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import tlt_stream.rollout.warmup as warmup

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the policy sampled before --out was checked")

    monkeypatch.setattr(warmup, "policy_windows", refuse)
    (tmp_path / "a-file").write_text("x")
    err = _refused(capsys, "drafter init", _init(init_policy, tmp_path, tmp_path / "a-file"))
    assert "exists and is not a directory" in err
    err = _refused(capsys, "drafter init", _init(init_policy, tmp_path, tmp_path / "a-file" / "sub"))
    assert "is a file, not a folder" in err
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    err = _refused(capsys, "drafter init", _init(init_policy, tmp_path, tmp_path / "full"))
    assert "not empty (pass --force" in err
    assert (tmp_path / "a-file").read_text() == "x" and (tmp_path / "full" / "notes.txt").read_text() == "mine"


def test_drafter_init_that_diverges_writes_nothing_and_prints_standard_json_when_it_holds(
    tmp_path: Path, init_policy: Path, drafter_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = {p.name: p.read_bytes() for p in drafter_dir.iterdir()}
    assert main(_init(init_policy, tmp_path, drafter_dir, "--force", "--lr", "1e30")) == 2
    err = capsys.readouterr().err  # the progress lines, then the one line that says why
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("tlt-stream drafter init: training diverged") and "lower --lr" in last
    assert {p.name: p.read_bytes() for p in drafter_dir.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []

    assert main(_init(init_policy, tmp_path, drafter_dir, "--force")) == 0
    report = _strict_json(capsys.readouterr().out)
    assert all(math.isfinite(v) for k, v in report.items() if k.startswith(("loss", "top1")))
    assert (drafter_dir / "model.safetensors").read_bytes() != before["model.safetensors"]
    assert all(torch.isfinite(t).all() for t in load_file(str(drafter_dir / "model.safetensors")).values())


def _truncated_policy(init_policy: Path, where: Path) -> Path:
    """A copy of the policy whose weights file is cut short (its header no longer covers the file)."""
    import shutil

    shutil.copytree(init_policy, where)
    weights = where / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    return where


def test_a_truncated_policy_is_refused_in_one_line_by_generate_and_export(
    tmp_path: Path, init_policy: Path, drafter_dir: Path, prompts: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    policy = _truncated_policy(init_policy, tmp_path / "cut")
    out = tmp_path / "out.jsonl"
    assert "unreadable safetensors" in _refused(capsys, "generate", _generate(policy, prompts, out))
    assert not out.exists()
    argv = ["export-drafter", str(drafter_dir), "--out", str(tmp_path / "eagle"), "--policy", str(policy)]
    assert "--policy" in (err := _refused(capsys, "export-drafter", argv)) and "unreadable safetensors" in err
    assert not (tmp_path / "eagle").exists()


def test_generate_names_the_verify_bound_of_the_draft_tree(
    tmp_path: Path, init_policy: Path, drafter_dir: Path, prompts: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = _generate(init_policy, prompts, tmp_path / "out.jsonl", "--drafter", str(drafter_dir), "--verify", "9")
    err = _refused(capsys, "generate", argv)
    assert "--verify 9: a tree of --depth 4 and --topk 1 offers at most 4 nodes" in err


@pytest.mark.parametrize("drafter", ["ngram", "checkpoint"])
def test_generate_refuses_a_draft_deeper_than_any_arm(
    drafter: str,
    tmp_path: Path,
    init_policy: Path,
    drafter_dir: Path,
    prompts: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A huge --depth stalled every round (a drafter forward per level) or tried to allocate a KV cache of
    terabytes and died in a traceback; it is now one line before any load: even with no model at --model, the
    refusal names --depth (with --verify past the tree as well, --depth is what is named)."""
    source = "ngram" if drafter == "ngram" else str(drafter_dir)
    out = tmp_path / "out.jsonl"
    for model in (init_policy, tmp_path / "no-such-model"):
        for depth in (MAX_DRAFT_DEPTH + 1, 10**11):
            argv = _generate(model, prompts, out, "--drafter", source, "--depth", str(depth))
            assert f"--depth {depth}: a draft is at most {MAX_DRAFT_DEPTH} levels deep" in _refused(
                capsys, "generate", argv
            )
    argv = _generate(init_policy, prompts, out, "--drafter", source, "--depth", "300", "--verify", str(10**6))
    assert f"--depth 300: a draft is at most {MAX_DRAFT_DEPTH} levels deep" in _refused(capsys, "generate", argv)
    assert not out.exists()


def test_generate_decodes_the_rows_memory_holds_and_names_a_row_that_does_not_fit(
    tmp_path: Path,
    init_policy: Path,
    drafter_dir: Path,
    prompts: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """--batch-size is an upper bound: rows past what half the free memory holds are decoded later, not
    allocated at once (2**40 rows was a traceback). A host too small for one row with its draft tree is told
    so in one line, with the numbers."""
    out = tmp_path / "out.jsonl"
    argv = _generate(init_policy, prompts, out, "--drafter", str(drafter_dir), "--batch-size", str(2**40))
    assert main(argv) == 0
    capsys.readouterr()
    assert out.exists()
    out.unlink()
    import tlt_stream.model.sizing as sizing

    monkeypatch.setattr(sizing, "free_memory", lambda device: 2**13)  # a host with 8 KiB free
    wide = ("--depth", "8", "--topk", "4", "--verify", "128")
    err = _refused(capsys, "generate", _generate(init_policy, prompts, out, "--drafter", str(drafter_dir), *wide))
    assert "and 128 draft nodes (--depth/--topk/--verify) needs" in err and "lower --max-new-tokens" in err
    assert not out.exists()
