"""The tiny world that ships with the package, so that a first run starts RL within a minute or two.

`tlt_stream/tasks/world/` holds what `tlt-stream bootstrap` builds on its defaults (the policy, the drafter and
the bootstrap record with its seed, size and settings) and `shipped.json`: the SHA-256 and size of every file
and the versions it was built with. `bootstrap` copies it in place of training when a request matches its
record; `--rebuild` trains anyway. The copy is checked against the manifest first, so a damaged install
trains instead of running on a corrupt world.

Refresh it after changing the bootstrap recipe (the unit test fails until then):
    tlt-stream bootstrap --out /tmp/world --rebuild --threads 2 && python -m tlt_stream.tasks.bootstrap /tmp/world 2
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

__all__ = ["MANIFEST", "PARTS", "SHIPPED", "check", "copy_into", "digests", "matches", "record"]

SHIPPED = Path(__file__).with_name("world")
MANIFEST = "shipped.json"
PARTS = ("policy", "drafter")
RECORD = "bootstrap.json"


def digests(world: Path) -> dict[str, dict[str, Any]]:
    """SHA-256 and size of every file of the world's parts, by path relative to the world."""
    found: dict[str, dict[str, Any]] = {}
    for part in PARTS:
        for path in sorted((world / part).rglob("*")):
            if path.is_file():
                found[path.relative_to(world).as_posix()] = {
                    "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
                    "bytes": path.stat().st_size,
                }
    return found


def record(world: Path = SHIPPED) -> dict[str, Any] | None:
    """The shipped world's bootstrap record (None when the package ships none)."""
    try:
        found = json.loads((world / RECORD).read_text())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) and (world / MANIFEST).is_file() else None


def check(world: Path = SHIPPED) -> list[str]:
    """What is wrong with a shipped world: files missing, extra or changed against its manifest (empty: sound)."""
    try:
        manifest = json.loads((world / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return [f"{world / MANIFEST}: missing or unreadable"]
    found = digests(world)
    problems = [f"{name}: missing" for name in manifest.keys() - found.keys()]
    problems += [f"{name}: not in the manifest" for name in found.keys() - manifest.keys()]
    problems += [f"{name}: changed" for name in manifest.keys() & found.keys() if manifest[name] != found[name]]
    return sorted(problems)


def matches(wanted: dict[str, Any], world: Path = SHIPPED) -> bool:
    """Whether the shipped world is what a bootstrap asked for `wanted` (version, seed, size, settings) builds."""
    shipped = record(world)
    return shipped is not None and all(shipped.get(k) == wanted[k] for k in ("version", "seed", "size", "settings"))


def copy_into(stage: Path, world: Path = SHIPPED) -> dict[str, Any]:
    """Copy the shipped parts into `stage` (checked against the manifest first); returns its record."""
    if problems := check(world):
        raise ValueError(f"the shipped world in {world} is damaged: {'; '.join(problems[:3])}")
    for part in PARTS:
        shutil.rmtree(stage / part, ignore_errors=True)
        shutil.copytree(world / part, stage / part)
    shipped = record(world)
    assert shipped is not None
    return shipped
