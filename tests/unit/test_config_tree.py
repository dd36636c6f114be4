"""The configuration tree holds every setting once: one default, one docstring, reached by every layer.

The defaults are read from the source itself (AST): a settings class or a role command that writes a literal
default for a key the tree owns is a second default, which drifts; a class that restates the tree's fields
with docstrings of its own is a shadow of the tree, which drifts too.
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

import pytest

from tlt_stream.basics.config import DEFAULTS, PRESETS, Config, ConfigError, describe, dump_toml, load_config, override

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "tlt_stream"
ROLE_COMMANDS = ("run", "learner", "policy", "rollout_worker")
"""Subcommands whose options are role settings: every one goes through `commands.args.setting`."""
NOT_SETTINGS = {
    "tlt_stream/basics/messages": "wire formats: a field's default is what an old producer's message means",
    "GenerateOptions": "`tlt-stream generate`'s own options (an offline tool, greedy by default), not a role's",
    "Sequence.temperature": "one request's state in the scheduler",
    "ArmMeasurement.steps": "a counter",
    "Mode": "the planner's mode names a bench/e2e.py configuration, not a role's settings",
}
"""What shares a configuration key's name without being that setting, and why."""


def leaf_names() -> set[str]:
    return {key.rsplit(".", 1)[-1] for key, _, _ in describe()}


def literal(node: ast.expr | None) -> bool:
    """A value written out in the source (a number, a string, a tuple of them, 256 * 2**20, -1)."""
    if node is None:
        return False
    if isinstance(node, ast.Constant):
        return node.value is not None
    if isinstance(node, ast.Tuple | ast.List):
        return bool(node.elts) and all(literal(e) for e in node.elts)
    if isinstance(node, ast.UnaryOp):
        return literal(node.operand)
    if isinstance(node, ast.BinOp):
        return literal(node.left) and literal(node.right)
    return False


def second_defaults(source: str, where: str, names: set[str]) -> list[str]:
    """`where:line name = literal` for every class field named like a configuration key that writes its own
    literal default."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ClassDef):
            continue
        for item in node.body:
            if not (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)):
                continue
            name = item.target.id
            if name in names and literal(item.value) and not {node.name, f"{node.name}.{name}"} & NOT_SETTINGS.keys():
                found.append(f"{where}:{item.lineno} {node.name}.{item.target.id} = {ast.unparse(item.value)}")
    return found


def none(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and node.value is None


def argparse_defaults(source: str, where: str) -> list[str]:
    """`add_argument(..., default=...)` in a role command: a setting's default outside the tree."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "add_argument"
            and any(
                k.arg == "default" and not (isinstance(k.value, ast.Constant) and k.value.value is None)
                for k in node.keywords
            )
        ):
            found.append(f"{where}:{node.lineno} {ast.unparse(node)}")
    return found


def test_no_default_is_written_twice() -> None:
    names = leaf_names()
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = str(path.relative_to(ROOT))
        if (
            path.is_relative_to(PACKAGE / "basics" / "config")
            or where in NOT_SETTINGS
            or any(where.startswith(f"{place}/") for place in NOT_SETTINGS)
        ):
            continue
        found += second_defaults(path.read_text(), where, names)
    for name in ROLE_COMMANDS:
        path = PACKAGE / "commands" / (f"{name}/__init__.py" if name == "run" else f"{name}.py")
        found += argparse_defaults(path.read_text(), str(path.relative_to(ROOT)))
    assert not found, "defaults written outside the configuration tree (read them from config.DEFAULTS):\n" + "\n".join(
        found
    )


def test_the_check_sees_a_second_default_when_there_is_one() -> None:
    names = leaf_names()
    assert second_defaults("class S:\n    max_len: int = 1408\n", "x.py", names) == ["x.py:2 S.max_len = 1408"]
    assert second_defaults("class S:\n    betas: tuple = (0.9, 0.95)\n", "x.py", names)
    assert second_defaults("class S:\n    hidden_max_bytes: int = 256 * 2**20\n", "x.py", names)
    assert not second_defaults("class S:\n    max_len: int = DEFAULTS.rollout.max_len\n", "x.py", names)
    assert argparse_defaults("p.add_argument('--lr', type=float, default=2e-4)\n", "x.py")
    assert not argparse_defaults("p.add_argument('--out', default=None)\n", "x.py")


def test_the_cores_take_their_defaults_from_the_tree() -> None:
    from tlt_stream.rl.learner import LearnerSettings

    learner = LearnerSettings()
    assert (learner.lr, learner.warmup_steps, learner.clip_high) == (
        DEFAULTS.learner.lr,
        DEFAULTS.learner.warmup_steps,
        DEFAULTS.learner.clip_high,
    )
    assert LearnerSettings.from_config(DEFAULTS) == learner


def shadow_classes(source: str, names: set[str]) -> list[str]:
    """Classes with three or more fields named like tree settings that each carry a docstring of their own: a
    settings class restating the tree (a small parameter class of a core takes its defaults from the tree
    and no second docstring)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ClassDef):
            continue
        body = node.body
        documented = [
            item.target.id
            for item, after in zip(body, [*body[1:], None], strict=True)
            if isinstance(item, ast.AnnAssign)
            and isinstance(item.target, ast.Name)
            and item.target.id in names
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ]
        if len(documented) >= 3:
            found.append(f"{node.name} ({', '.join(documented)})")
    return found


def test_no_settings_class_restates_the_tree() -> None:
    names = leaf_names()
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.is_relative_to(PACKAGE / "basics"):
            continue
        found += shadow_classes(path.read_text(), names)
    assert not found, "settings classes that restate the configuration tree (take its sections instead):\n" + "\n".join(
        found
    )
    fields = ("max_len: int = 4", "lr: float = 1.0", "seed: int = 0")
    shadow = "class S:\n" + "".join(f'    {f}\n    """What it is."""\n' for f in fields)
    assert shadow_classes(shadow, names) == ["S (max_len, lr, seed)"]
    assert shadow_classes("class P:\n    max_len: int = DEFAULTS.rollout.max_len\n    lr: float = 1.0\n", names) == []


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "tlt.toml"
    path.write_text(text)
    return path


def parse(*argv: str) -> argparse.Namespace:
    from tlt_stream.commands.cli import build_parser

    return build_parser().parse_args(list(argv))


def test_file_environment_set_and_flags_all_reach_the_learner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tlt_stream.commands.args import load
    from tlt_stream.rl.learner import LearnerSettings

    for name in [n for n in __import__("os").environ if n.startswith("TLT_")]:
        monkeypatch.delenv(name)
    path = write(tmp_path, "[learner]\nlr = 5e-6\nclip_high = 0.3\nkl_coef = 0.5\n[rollout]\ntemperature = 0.7\n")
    monkeypatch.setenv("TLT_LEARNER__KL_COEF", "0.1")
    monkeypatch.setenv("TLT_POLICY__PROMPTS_PER_STEP", "3")
    args = parse("learner", "--config", str(path), "--run-dir", "r", "--policy", "p", "--lr", "3e-6")
    args.overrides.append("learner.warmup_steps=7")
    config = load(args)
    settings = LearnerSettings.from_config(config)
    assert settings.lr == 3e-6, "the flag is above the file"
    assert settings.clip_high == 0.3, "the file is above the default"
    assert settings.kl_coef == 0.1, "the environment is above the file"
    assert settings.warmup_steps == 7, "--set reaches a role setting"
    assert settings.temperature == 0.7, "the learner's logprobs are at the rollout temperature"
    assert config.groups_per_step == 3, "groups per update follow the prompts per step unless set"
    assert (config.learner.run_dir, config.learner.policy) == ("r", "p")


def test_an_unknown_role_key_is_one_clear_error() -> None:
    with pytest.raises(ConfigError, match=r"unknown key 'learner.lr_max'; allowed keys here: run_dir, policy"):
        load_config(environ={"TLT_LEARNER__LR_MAX": "1"})
    with pytest.raises(ConfigError, match=r"learner.lr: expected `float` > 0"):
        load_config(environ={}, overrides=["learner.lr=0.0"])
    with pytest.raises(ConfigError, match=r"rollout.device must be auto, cpu, cuda or cuda:N \(got 'gpu0'\)"):
        load_config(environ={"TLT_DEVICE": "gpu0"})


def test_a_preset_sits_under_every_explicit_value(tmp_path: Path) -> None:
    tiny = PRESETS["tiny-world"]["learner"]
    assert load_config(environ={}) == Config(), "no preset unless asked"
    config = load_config(environ={}, default_preset="tiny-world")  # what `tlt-stream run` does on the tiny world
    assert (config.preset, config.learner.lr, config.learner.final_norm_lr_scale) == (
        "tiny-world",
        tiny["lr"],
        tiny["final_norm_lr_scale"],
    )
    mine = load_config(write(tmp_path, "[learner]\nlr = 1e-5\n"), environ={}, default_preset="tiny-world")
    assert mine.learner.lr == 1e-5 and mine.learner.final_norm_lr_scale == tiny["final_norm_lr_scale"]
    off = load_config(environ={"TLT_PRESET": "none"}, default_preset="tiny-world")
    assert off.preset is None and off.learner == DEFAULTS.learner, "preset none: the field's defaults"
    with pytest.raises(
        ConfigError, match=r"^--set preset=tiny: preset: unknown preset 'tiny'; choose tiny-world or none"
    ):
        load_config(environ={}, overrides=["preset=tiny"])
    with pytest.raises(ConfigError, match=r"^environment variable TLT_PRESET: preset: unknown preset 'x'"):
        load_config(environ={"TLT_PRESET": "x", "TLT_LEARNER__LR": "1e-5"})  # the layer that named it, not another
    with pytest.raises(ConfigError, match=r"^config file .*tlt\.toml: preset: unknown preset 'x'"):
        load_config(write(tmp_path, 'preset = "x"\n'), environ={"TLT_LEARNER__LR": "1e-5"})
    assert override(Config(), {"preset": "tiny-world", "learner.lr": 1e-5}).learner.warmup_steps == tiny["warmup_steps"]


def test_run_and_the_service_commands_share_one_default(monkeypatch: pytest.MonkeyPatch) -> None:
    from tlt_stream.commands.args import load

    for name in [n for n in __import__("os").environ if n.startswith("TLT_")]:
        monkeypatch.delenv(name)
    run = load(parse("run"), default_preset=None)
    learner = load(parse("learner"))
    worker = load(parse("rollout-worker"))
    assert run == learner == worker == Config(), "no command has a default of its own"


def test_dump_toml_reads_back_to_the_same_configuration(tmp_path: Path) -> None:
    config = override(
        Config(run="r-1"),
        {
            "preset": "tiny-world",
            "sd.drafter": "/w/drafter",
            "sd.arms": ["plain", "d2k1v2"],
            "learner.until_version": 9,
        },
    )
    path = write(tmp_path, dump_toml(config))
    assert load_config(path, environ={}) == config
    secret = override(config, {"bus.redis_url": "redis://u:hunter2@h:1/0"})
    assert "hunter2" not in dump_toml(secret, leave_out=("bus.redis_url",))


def test_config_describe_lists_every_key_and_the_presets(capsys: pytest.CaptureFixture[str]) -> None:
    from tlt_stream.commands.cli import main

    assert main(["config", "describe"]) == 0
    out = capsys.readouterr().out
    for key, _, text in describe():
        assert f"{key} = " in out and text
    assert "preset 'tiny-world'" in out and "learner.lr = 2.5e-05" in out
