"""The tests' private servers take their ports from `tests.ports.free_port`: below the kernel's ephemeral range
(no bind to port 0 and no outgoing connection is ever given one), never one another process holds, never one a
program listens on."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests import ports
from tests.ports import SPAN, ephemeral_range, free_port

ROOT = Path(__file__).resolve().parents[2]


def test_ports_are_below_the_ephemeral_range_and_never_repeat_in_a_process() -> None:
    low, _ = ephemeral_range()
    ports = [free_port() for _ in range(20)]
    assert len(set(ports)) == len(ports)
    assert all(1_024 <= p < low for p in ports)


def test_another_process_never_gets_a_port_this_one_holds() -> None:
    mine = {free_port() for _ in range(200)}
    script = "from tests.ports import free_port; print(*(free_port() for _ in range(400)))"
    theirs = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout.split()
    assert len(theirs) == 400 and not mine & {int(p) for p in theirs}


def test_a_port_someone_listens_on_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    low, _ = ephemeral_range()
    first = max(1_024, low - SPAN)
    monkeypatch.setattr(ports.random, "randrange", lambda n: 0)  # every search starts at the listeners below
    listeners = []
    try:
        for port in range(first, first + 16):  # listeners this test opens itself, not through free_port
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                s.close()
                continue
            s.listen()
            listeners.append(s)
        taken = {s.getsockname()[1] for s in listeners}
        assert taken
        got = free_port()
        assert got not in taken and got > min(taken)
    finally:
        for s in listeners:
            s.close()
