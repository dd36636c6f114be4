"""The package's layers, read from the imports themselves (AST), so the architecture holds after every change.

The arrows run one way: basics <- cores <- bus <- roles <- commands, and among the cores in the order of
`CORES`. The cores (the model runtime, the drafter, the rollout engine, the tiny world, the GRPO math, the
planner) are plain code a newcomer can test as functions: they import neither Redis nor MQTT, neither the
bus nor the role loops. Every import counts as an arrow: one inside a function, and one under
`if TYPE_CHECKING:` (a circle of types is still a circle of concepts). A module outside the known places is
refused, so a new folder must be given its place here. No two modules import each other, directly or round
a longer circle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "tlt_stream"

CORES = ("store", "model", "drafter", "rollout", "tasks", "rl", "plan")
"""The cores, lowest first: each may import the ones before it, never one after it."""
ORDER = {"basics": (0, 0), **{core: (1, rank) for rank, core in enumerate(CORES)}}
ORDER |= {"bus": (2, 0), "roles": (3, 0), "commands": (4, 0)}
TRANSPORTS = ("redis", "aiomqtt", "fakeredis", "amqtt", "paho")
"""Third-party packages only the bus (and the layers above it) may import."""


def place_of(module: str) -> str | None:
    """The place (a key of ORDER) of a `tlt_stream.x.y` module name; None for a module in no known place."""
    parts = module.split(".")
    if len(parts) == 1:
        return "basics"  # the package's own __init__: its version, nothing else
    return parts[1] if parts[1] in ORDER else None


def module_name(path: Path) -> str:
    relative = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(relative.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in `path`, relative ones resolved, wherever it stands."""
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
            if node.module is None or name.startswith("tlt_stream"):  # the names may be modules
                found += [(node.lineno, f"{name}.{alias.name}") for alias in node.names]
            else:
                found.append((node.lineno, name))
    return found


def _modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def violations() -> list[str]:
    bad = []
    for source, path in _modules().items():
        mine = place_of(source)
        if mine is None:
            bad.append(f"{path.relative_to(PACKAGE.parent)}: module {source} is in no known place (test_layers)")
            continue
        for line, target in imports(path):
            where = f"{path.relative_to(PACKAGE.parent)}:{line}"
            if target.split(".")[0] in TRANSPORTS and ORDER[mine] < ORDER["bus"]:
                bad.append(f"{where}: {mine} module {source} imports {target}")
            elif target.startswith("tlt_stream."):
                theirs = place_of(target)
                if theirs is not None and ORDER[theirs] > ORDER[mine]:
                    bad.append(f"{where}: {mine} module {source} imports {theirs} module {target}")
    return bad


def circles() -> list[list[str]]:
    """Every set of modules that import one another round a circle (strongly connected, more than one)."""
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for source, path in modules.items():
        for _, target in imports(path):
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != source and not source.startswith(f"{target}."):  # a package's own parents
                graph[source].add(target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_no_import_runs_against_the_layers() -> None:
    assert violations() == []


def test_no_modules_import_each_other_round_a_circle() -> None:
    assert circles() == []


def _scratch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, files: dict[str, str]) -> None:
    root = tmp_path / "tlt_stream"
    root.mkdir()
    (root / "__init__.py").write_text("")
    for name, text in files.items():
        target = tmp_path / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    monkeypatch.setattr(__import__(__name__, fromlist=["PACKAGE"]), "PACKAGE", root)


@pytest.mark.parametrize(
    ("source", "statement", "wanted"),
    [
        (
            "tlt_stream/rollout/bad.py",
            "import redis.asyncio as aioredis\n",
            "rollout module tlt_stream.rollout.bad imports redis",
        ),
        ("tlt_stream/model/bad.py", "from tlt_stream.bus.streams import Keys\n", "imports bus module"),
        ("tlt_stream/drafter/bad.py", "def f():\n    from ..roles import learner\n", "imports roles module"),
        ("tlt_stream/bus/bad.py", "from tlt_stream.roles.learner import LearnerService\n", "bus module"),
        ("tlt_stream/roles/bad.py", "from tlt_stream.commands import cli\n", "imports commands module"),
        ("tlt_stream/basics/bad.py", "from tlt_stream.model.spec import ModelSpec\n", "basics module"),
        ("tlt_stream/drafter/bad.py", "from tlt_stream.rollout.engine import GenerationEngine\n", "imports rollout"),
        ("tlt_stream/model/bad.py", "from ..drafter import model\n", "imports drafter module"),
        ("tlt_stream/rl/bad.py", "from tlt_stream.plan import simulate\n", "imports plan module"),
        (
            "tlt_stream/store/bad.py",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from tlt_stream.model.spec import ModelSpec\n",
            "imports model module",
        ),
        ("tlt_stream/loose.py", "x = 1\n", "in no known place"),
        ("tlt_stream/newfolder/mod.py", "x = 1\n", "in no known place"),
    ],
)
def test_the_checker_catches_a_wrong_arrow(
    source: str, statement: str, wanted: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each kind of forbidden arrow (and a module in no known place), written into a scratch copy of the
    layout, is reported once."""
    _scratch(tmp_path, monkeypatch, {source: statement})
    found = violations()
    assert len(found) == 1 and wanted in found[0], found


def test_the_checker_allows_a_right_arrow(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _scratch(
        tmp_path,
        monkeypatch,
        {
            "tlt_stream/rollout/fine.py": "from tlt_stream.drafter.model import Drafter\nimport torch\n",
            "tlt_stream/roles/fine.py": "import redis\nfrom tlt_stream.bus import streams\n",
        },
    )
    assert violations() == []


@pytest.mark.parametrize("late", ["def f():\n    from . import b\n", "if TYPE_CHECKING:\n    from . import b\n"])
def test_the_checker_catches_a_circle(late: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two modules that import each other (one of the arrows late or type-only) and a circle of three."""
    _scratch(
        tmp_path,
        monkeypatch,
        {
            "tlt_stream/roles/a.py": "from tlt_stream.roles import b\n",
            "tlt_stream/roles/b.py": "from typing import TYPE_CHECKING\n" + late.replace("b", "a"),
            "tlt_stream/rl/x.py": "from . import y\n",
            "tlt_stream/rl/y.py": "from . import z\n",
            "tlt_stream/rl/z.py": "from .x import thing\n",
        },
    )
    assert sorted(circles()) == [
        ["tlt_stream.rl.x", "tlt_stream.rl.y", "tlt_stream.rl.z"],
        ["tlt_stream.roles.a", "tlt_stream.roles.b"],
    ]
