"""The package's layers, read from the imports themselves (AST), so the architecture holds after every change.

The arrows run one way: shared basics <- cores <- bus <- roles <- commands. The cores (the model runtime,
the rollout engine, the drafter, the GRPO math and the tiny world) are plain code a newcomer can test as
functions: they import neither Redis nor MQTT, neither the bus nor the role loops. Imports inside functions
count as much as those at the top (a late import is still an arrow).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "tlt_stream"

LAYERS = {
    "basics": 0,  # config, messages, errors, aio, progress: what every layer shares
    "cores": 1,
    "bus": 2,
    "roles": 3,
    "commands": 4,
}
CORES = {"model", "rollout", "drafter", "rl", "tasks", "store"}
BASICS = {"__init__", "common", "config", "messages", "errors", "aio", "progress", "failpoints"}
TRANSPORTS = ("redis", "aiomqtt", "fakeredis", "amqtt", "paho")
"""Third-party packages only the bus (and the layers above it) may import."""


def layer_of(module: str) -> str:
    """The layer of a `tlt_stream.x.y` module name (its first component below the package)."""
    parts = module.split(".")
    head = parts[1] if len(parts) > 1 else "__init__"
    if head in BASICS:
        return "basics"
    if head in CORES:
        return "cores"
    if head in ("bus", "roles"):
        return head
    return "commands"  # cli, the commands package, doctor, monitor, launch, report, generate


def module_name(path: Path) -> str:
    relative = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(relative.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in `path`, relative ones resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    here = module_name(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                name = ".".join([*base, node.module] if node.module else base)
            else:
                name = node.module or ""
            if node.module is None or name == "tlt_stream":  # `from tlt_stream import cli`: the names are modules
                found += [(node.lineno, f"{name}.{alias.name}") for alias in node.names]
            else:
                found.append((node.lineno, name))
    return found


def violations() -> list[str]:
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = module_name(path)
        mine = layer_of(source)
        for line, target in imports(path):
            where = f"{path.relative_to(PACKAGE.parent)}:{line}"
            if target.split(".")[0] in TRANSPORTS and LAYERS[mine] < LAYERS["bus"]:
                bad.append(f"{where}: {mine} module {source} imports {target}")
            elif target.startswith("tlt_stream.") or target == "tlt_stream":
                theirs = layer_of(target)
                if LAYERS[theirs] > LAYERS[mine]:
                    bad.append(f"{where}: {mine} module {source} imports {theirs} module {target}")
    return bad


def test_no_import_runs_against_the_layers() -> None:
    assert violations() == []


@pytest.mark.parametrize(
    ("source", "statement", "wanted"),
    [
        ("tlt_stream/rollout/bad.py", "import redis.asyncio as aioredis\n", "cores module tlt_stream.rollout.bad"),
        ("tlt_stream/model/bad.py", "from tlt_stream.bus.streams import Keys\n", "imports bus module"),
        ("tlt_stream/drafter/bad.py", "def f():\n    from ..roles import learner\n", "imports roles module"),
        ("tlt_stream/bus/bad.py", "from tlt_stream.roles.learner import LearnerService\n", "bus module"),
        ("tlt_stream/roles/bad.py", "from tlt_stream import cli\n", "imports commands module"),
    ],
)
def test_the_checker_catches_a_wrong_arrow(
    source: str, statement: str, wanted: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each kind of forbidden arrow, written into a scratch copy of the layout, is reported."""
    root = tmp_path / "tlt_stream"
    target = tmp_path / source
    target.parent.mkdir(parents=True)
    (root / "__init__.py").write_text("")
    target.write_text(statement)
    monkeypatch.setattr(__import__(__name__, fromlist=["PACKAGE"]), "PACKAGE", root)
    found = violations()
    assert len(found) == 1 and wanted in found[0], found
