"""Loopback ports for the tests' private servers, taken so that nothing else takes them before the server binds.

Asking the kernel for a free port (bind to port 0, read it, close) leaves a window: until the test's server binds
the port, the kernel may hand the same number to another process's bind to port 0 or to any outgoing
connection, as both draw from the ephemeral range. Under `make test`'s two xdist workers a server restarted on
its port (a fault scenario kills Redis and starts it again) leaves that window open for seconds, and a second
test's server that took the number would answer the first test's clients: a failure that names neither.

`free_port` takes its ports below the ephemeral range (`net.ipv4.ip_local_port_range`), where the kernel never
assigns one on its own, and holds an exclusive lock on a file per port for the life of the test process, so no
other test process (another xdist worker, another checkout's suite) takes it; a port some other program
listens on is skipped. The locks go with the process, however it ends.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import socket
import tempfile
from pathlib import Path

__all__ = ["free_port"]

SPAN = 8_000
"""How many ports below the ephemeral range the tests draw from."""
LOCKS = Path(tempfile.gettempdir()) / "tlt-test-ports"
_DEFAULT_EPHEMERAL = (32_768, 60_999)  # Linux's default, where /proc does not say

_held: dict[int, int] = {}
"""port -> the descriptor whose lock reserves it for this process."""


def ephemeral_range() -> tuple[int, int]:
    """The range the kernel draws ports from for a bind to port 0 and for outgoing connections."""
    with contextlib.suppress(OSError, ValueError):
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    return _DEFAULT_EPHEMERAL


def _bindable(port: int, host: str) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port on `host` that no one listens on, that the kernel will not hand out, and that no other process
    using this function holds; reserved for this process until it exits."""
    low = ephemeral_range()[0]
    ports = list(range(max(1_024, low - SPAN), low))
    start = random.randrange(len(ports))
    LOCKS.mkdir(exist_ok=True)
    for port in ports[start:] + ports[:start]:
        if port in _held:
            continue
        fd = os.open(LOCKS / str(port), os.O_CREAT | os.O_RDWR, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        if _bindable(port, host):
            _held[port] = fd
            return port
        os.close(fd)  # some other program has it: leave the lock to whoever comes next
    raise RuntimeError(f"no free port in {ports[0]}-{ports[-1]} (below the ephemeral range {low}-)")
