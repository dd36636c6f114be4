"""A real network partition between the services and Redis: packets dropped, not refused.

Killing Redis (`restart_redis`) is the friendly outage: the kernel answers every packet with a reset, and every
client learns at once that its connection is gone. A partition answers nothing. A client without an explicit
socket timeout then waits forever on a reply that never comes, so the only proof that `connect_redis`'s timeouts
work for a whole run is a link that really drops packets for longer than the socket timeout. Here the private
redis-server runs in a network namespace of its own, joined to the root namespace by a veth pair; cutting the
link is taking the namespace's end down. A permanent neighbour entry on the root end keeps the kernel from
answering new connections with "No route to host" (a refusal, which is not what a partition does): their SYNs
are dropped like everything else. The MQTT broker stays on loopback: only the data plane is cut.

Needs root and `ip` (iproute2); elsewhere the scenario is skipped, saying why (`partition_unavailable`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

from tests.faults.audit import AuditResult
from tests.faults.harness import FaultRun, PrivateServers
from tests.faults.scenario import Scenario

__all__ = ["PARTITION_SCENARIOS", "PartitionedServers", "partition_unavailable"]

_PREFIX = "tltf"
_SUBNETS = 1 << 14
"""The /30 networks in 10.213.0.0/16."""

_counter = itertools.count()


def _ip(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *argv], capture_output=True, text=True, check=check, timeout=30)


@functools.cache
def partition_unavailable() -> str | None:
    """Why this machine cannot cut a link to a private Redis (None when it can): it takes root, iproute2, and a
    kernel that lets this process make a network namespace with a veth pair in it."""
    if os.geteuid() != 0:
        return "needs root (a network namespace and a veth pair per run)"
    if shutil.which("ip") is None:
        return "needs `ip` (iproute2) on PATH"
    probe = f"{_PREFIX}probe{os.getpid()}"
    try:
        for argv in (
            ("netns", "add", probe),
            ("-n", probe, "link", "add", "tp0", "type", "veth", "peer", "name", "tp1"),
            ("netns", "exec", probe, "true"),
        ):
            done = _ip(*argv, check=False)
            if done.returncode != 0:
                said = done.stderr.strip()
                return f"cannot make a network namespace with a veth pair here: ip {' '.join(argv)}: {said}"
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot run ip: {exc}"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


def _sweep_stale() -> None:
    """Namespaces this module made in processes that are gone (a test run killed before its clean-up): their
    Redis killed, the namespace and its veth pair deleted."""
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        found = re.match(rf"({_PREFIX}(\d+)-\d+)\b", line)
        if found is None or Path(f"/proc/{found.group(2)}").exists():
            continue
        name = found.group(1)
        for pid in _ip("netns", "pids", name, check=False).stdout.split():  # its orphaned redis-server
            with contextlib.suppress(OSError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        _ip("netns", "del", name, check=False)


def _subnet() -> int:
    """A /30 of 10.213.0.0/16 that no address of the root namespace is in: the first free one from an index
    that differs between processes (pid) and between the instances of one process (a counter)."""
    used = set()
    for entry in json.loads(_ip("-j", "-4", "addr", "show").stdout or "[]"):
        for address in entry.get("addr_info", []):
            parts = address.get("local", "").split(".")
            if parts[:2] == ["10", "213"]:
                used.add((int(parts[2]) * 256 + int(parts[3])) // 4)
    start = (os.getpid() * 97 + next(_counter) * 7919) % _SUBNETS
    for offset in range(_SUBNETS):
        index = (start + offset) % _SUBNETS
        if index not in used:
            return index
    raise RuntimeError("no free /30 left in 10.213.0.0/16")


class PartitionedServers(PrivateServers):
    """`PrivateServers` with the redis-server in a network namespace of its own, behind a veth pair that
    `cut()` takes down (every packet dropped, both ways) and `heal()` brings back."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        tag = next(_counter)
        self.namespace = f"{_PREFIX}{os.getpid()}-{tag}"
        short = f"{os.getpid():x}{tag:x}"[-11:]
        self.outer, self.inner = f"tfo{short}", f"tfi{short}"
        _sweep_stale()
        self.subnet = _subnet()
        self.redis_host = self._address(2)

    def _address(self, host: int) -> str:
        first = self.subnet * 4
        return f"10.213.{first // 256}.{first % 256 + host}"

    def redis_launcher(self) -> list[str]:
        return ["ip", "netns", "exec", self.namespace]

    def redis_security(self) -> list[str]:
        return ["--protected-mode", "no"]  # bound to a non-loopback address, without a password

    def _make_link(self) -> None:
        ns, outer, inner = self.namespace, self.outer, self.inner
        _ip("netns", "add", ns)
        _ip("link", "add", outer, "type", "veth", "peer", "name", inner, "netns", ns)
        _ip("addr", "add", f"{self._address(1)}/30", "dev", outer)
        _ip("link", "set", outer, "up")
        _ip("-n", ns, "addr", "add", f"{self._address(2)}/30", "dev", inner)
        _ip("-n", ns, "link", "set", inner, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        mac = json.loads(_ip("-j", "-n", ns, "link", "show", inner).stdout)[0]["address"]
        _ip("neigh", "replace", self._address(2), "lladdr", mac, "dev", outer, "nud", "permanent")

    def _remove_link(self) -> None:
        _ip("link", "del", self.outer, check=False)
        _ip("netns", "del", self.namespace, check=False)

    async def cut(self) -> None:
        """Every packet between the services and Redis dropped from now on, on open and new connections."""
        await asyncio.to_thread(_ip, "-n", self.namespace, "link", "set", self.inner, "down")

    async def heal(self) -> None:
        await asyncio.to_thread(_ip, "-n", self.namespace, "link", "set", self.inner, "up")

    async def __aenter__(self) -> PartitionedServers:
        await asyncio.to_thread(self._make_link)
        try:
            await super().__aenter__()
        except BaseException:
            await self.__aexit__()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        try:
            await super().__aexit__(*exc)
        finally:
            await asyncio.to_thread(self._remove_link)


def _socket_timeout(run: FaultRun) -> float:
    from tlt_stream.bus.connect import redis_socket_timeout

    return redis_socket_timeout(int(run.env.get("TLT_BUS__BLOCK_MS", run.config.bus.block_ms)))


CONNECT_TIMEOUT_S = 5.0
"""`connect_redis`'s connect timeout: a reconnect into the partition fails after this long."""

_TIMED_OUT = re.compile(r"Redis \S+ unreachable \(attempt \d+\); retrying in [\d.]+s \(TimeoutError: ")
"""A service's retry line naming a timeout. `OutageBackoff` logs a command's second failure: through a silent
link that is its first reconnect's connect timeout, which only comes once the command in flight at the cut has
given up, on its socket timeout (nothing else can end it: no reset or refusal crosses the link)."""


async def partition_redis(run: FaultRun, servers: PrivateServers) -> float:
    """The link to Redis cut for longer than the socket timeout (3 s more at least) and until every service has
    logged a retry that names a timeout (one command's socket timeout, then its reconnect's connect timeout),
    then healed; returns the seconds from the heal to the next policy version. While it is cut nothing here may
    talk to Redis (a client would wait like the services): only the services' logs are read."""
    assert isinstance(servers, PartitionedServers), servers
    shortest = _socket_timeout(run) + 3.0
    longest = _socket_timeout(run) + CONNECT_TIMEOUT_S + 30.0
    before = {name: len(run.log_text(name)) for name in run.commands}
    await servers.cut()
    cut = time.monotonic()
    timed_out: list[str] = []
    try:
        while time.monotonic() - cut < shortest or (len(timed_out) < len(before) and time.monotonic() - cut < longest):
            await asyncio.sleep(0.25)
            timed_out = [name for name, at in before.items() if _TIMED_OUT.search(run.log_text(name)[at:])]
    finally:
        run.notes["cut_s"] = round(time.monotonic() - cut, 1)
        run.notes["timed_out"] = sorted(timed_out)
        run.notes["alive_at_heal"] = sorted(name for name, p in run.processes.items() if p.returncode is None)
        await servers.heal()
    healed = time.monotonic()
    await run.wait_version(min(run.version() + 1, run.plan.steps), 120)
    return time.monotonic() - healed


def _timeouts_fired(run: FaultRun, result: AuditResult) -> None:
    """Every service's Redis client gave up on the silent link by its timeouts during the cut instead of hanging
    (a retry naming a TimeoutError, `_TIMED_OUT`), and every service was still running at the heal."""
    names = sorted(run.commands)
    assert run.notes["alive_at_heal"] == names, f"not every service outlived the partition: {run.notes}"
    missing = [name for name in names if name not in run.notes["timed_out"]]
    assert not missing, f"no timeout retry in {run.notes['cut_s']} s of partition from {missing}:\n" + "\n".join(
        f"== {name}\n{run.log_tail(name, 30)}" for name in missing
    )


PARTITION_SCENARIOS: list[Scenario] = [
    Scenario(
        "partition_redis",
        "the link to Redis cut (every packet dropped) past the socket timeout until every service timed out, healed",
        partition_redis,
        evidence=_timeouts_fired,
        servers=PartitionedServers,
        unavailable=partition_unavailable,
        extended=True,  # CI time: tests/integration/test_partition.py and the regression tests of what it found
    )
]
