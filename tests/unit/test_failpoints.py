"""Failpoints: a process dies exactly where the environment says; with `once`, only the first one, and only once
the harness armed it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tlt_stream.basics.failpoints import parse_failpoints

SCRIPT = "from tlt_stream.basics.failpoints import failpoint\nfailpoint('a.b')\nprint('went on', flush=True)\n"


def _run(tmp_path: Path, spec: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TLT_FAILPOINTS": spec}
    return subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=60)


def test_parse_reads_actions_and_once_and_names_what_is_wrong() -> None:
    assert parse_failpoints("") == {}
    assert parse_failpoints("a=kill, b.c=stop:once=/tmp/t") == {"a": ("kill", None), "b.c": ("stop", "/tmp/t")}
    for bad in ("a", "a=explode", "=kill", "a=kill:twice=/x", "a=kill:once="):
        with pytest.raises(ValueError, match="TLT_FAILPOINTS"):
            parse_failpoints(bad)


def test_a_process_dies_at_its_failpoint_and_once_lets_the_next_one_through(tmp_path: Path) -> None:
    assert _run(tmp_path, "other=kill").stdout == "went on\n"  # another point: nothing happens

    token = tmp_path / "armed" / "token"
    assert _run(tmp_path, f"a.b=kill:once={token}").stdout == "went on\n"  # not armed: no directory yet
    token.parent.mkdir()
    first = _run(tmp_path, f"a.b=kill:once={token}")
    assert first.returncode == -signal.SIGKILL and "went on" not in first.stdout
    assert "failpoint a.b: kill" in first.stderr and token.exists()
    second = _run(tmp_path, f"a.b=kill:once={token}")
    assert second.returncode == 0 and second.stdout == "went on\n"
