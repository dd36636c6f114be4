"""The code says what and why, never its history: no docstring, comment or configuration doc (which feeds
`config describe` and every flag's help) cites an issue number, docs/benchmarks.md or a past measurement of a
benchmark. Git and docs/benchmarks.md keep the history."""

from __future__ import annotations

import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "tlt_stream"

HISTORY = [
    (re.compile(r"\bissues? ?#?\d+", re.I), "an issue number"),
    (re.compile(r"benchmarks\.md"), "docs/benchmarks.md"),
    (re.compile(r"bench/\w+\.py (measured|gave|found)", re.I), "a past benchmark figure"),
]


def citations(text: str, where: str) -> list[str]:
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for pattern, what in HISTORY:
            if pattern.search(line):
                found.append(f"{where}:{number}: {what}: {line.strip()[:100]}")
    return found


def test_no_module_cites_its_history() -> None:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        found += citations(path.read_text(), str(path.relative_to(PACKAGE.parent)))
    assert not found, "history in the code (say what and why; git and docs/benchmarks.md keep the rest):\n" + "\n".join(
        found
    )


def test_the_check_sees_each_kind_of_citation() -> None:
    assert citations("x = 1  # fixed in issue 25\n", "a.py")
    assert citations('"""See docs/benchmarks.md."""\n', "a.py")
    assert citations("# bench/e2e.py measured 1.22x at 64\n", "a.py")
    assert not citations('"""Speculative decoding at batch 1 (the paper\'s 1.7x claim)."""\n', "a.py")
