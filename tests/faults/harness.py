"""Fault injection on a whole run: private Redis and Mosquitto servers this harness may kill and restart, the
services as real processes (the command lines `tlt-stream run` and compose use), and the audit that says
whether every dispatched prompt group was trained on exactly once.

Used by `tests/faults/` (assertions) and `bench/faults.py` (the figures in docs/reliability.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import shutil
import signal
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.worlds import build_world

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def have_servers() -> str | None:
    """Why private servers cannot run here (None when they can)."""
    missing = [b for b in ("redis-server", "mosquitto", "mosquitto_passwd", "openssl") if shutil.which(b) is None]
    return f"needs {' and '.join(missing)} on PATH" if missing else None


class PrivateServers:
    """A redis-server (append-only, fsync always) and a Mosquitto broker (persistent) on free loopback ports,
    owned by one test: killing or restarting them disturbs nobody else."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.redis_port, self.mqtt_port = free_port(), free_port()
        self.redis: asyncio.subprocess.Process | None = None
        self.broker: asyncio.subprocess.Process | None = None
        (root / "redis").mkdir(parents=True, exist_ok=True)
        (root / "mqtt").mkdir(parents=True, exist_ok=True)

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.redis_port}/0"

    @property
    def mqtt_url(self) -> str:
        return f"mqtt://127.0.0.1:{self.mqtt_port}"

    async def start_redis(self) -> None:
        log = (self.root / "redis.log").open("ab")
        self.redis = await asyncio.create_subprocess_exec(
            "redis-server",
            *("--port", str(self.redis_port), "--bind", "127.0.0.1", "--dir", str(self.root / "redis")),
            *("--appendonly", "yes", "--appendfsync", "always", "--save", ""),
            *self.redis_security(),
            stdout=log,
            stderr=log,
        )
        log.close()
        await _wait_port(self.redis_port)

    async def start_broker(self) -> None:
        conf = self.root / "mosquitto.conf"
        conf.write_text(
            f"listener {self.mqtt_port} 127.0.0.1\npersistence true\n"
            f"persistence_location {self.root / 'mqtt'}/\nautosave_interval 1\n"
            + ("user root\n" if os.geteuid() == 0 else "")  # else it drops to `mosquitto`, locked out of tmp
            + self.broker_security()
        )
        log = (self.root / "mosquitto.log").open("ab")
        self.broker = await asyncio.create_subprocess_exec("mosquitto", "-c", str(conf), stdout=log, stderr=log)
        log.close()
        await _wait_port(self.mqtt_port)

    def redis_security(self) -> list[str]:
        return []

    def broker_security(self) -> str:
        return "allow_anonymous true\n"

    async def stop_redis(self, sig: int = signal.SIGKILL) -> None:
        await _stop(self.redis, sig)

    async def stop_broker(self, sig: int = signal.SIGKILL) -> None:
        await _stop(self.broker, sig)

    async def __aenter__(self) -> PrivateServers:
        await self.start_redis()
        await self.start_broker()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop_redis()
        await self.stop_broker()


class SecureServers(PrivateServers):
    """The same servers locked down: Redis with ACL users (the default user off) over TLS only, Mosquitto
    with a password file over TLS only, both with a certificate from a throwaway CA."""

    REDIS_USER, REDIS_PASSWORD = "tlt", "r3dis-s3cret-Pw"
    MQTT_USER, MQTT_PASSWORD = "tlt", "mqtt-s3cret-Pw"

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.tls = root / "tls"
        self.tls.mkdir(exist_ok=True)
        make_certificates(self.tls)
        (root / "users.acl").write_text(
            f"user default off\nuser {self.REDIS_USER} on >{self.REDIS_PASSWORD} ~* &* +@all\n"
        )
        import subprocess

        subprocess.run(
            ["mosquitto_passwd", "-b", "-c", str(root / "passwd"), self.MQTT_USER, self.MQTT_PASSWORD], check=True
        )

    @property
    def redis_url(self) -> str:
        return (
            f"rediss://{self.REDIS_USER}:{self.REDIS_PASSWORD}@127.0.0.1:{self.redis_port}/0"
            f"?ssl_ca_certs={self.tls / 'ca.crt'}"
        )

    @property
    def mqtt_url(self) -> str:
        return f"mqtts://{self.MQTT_USER}:{self.MQTT_PASSWORD}@127.0.0.1:{self.mqtt_port}?ca_file={self.tls / 'ca.crt'}"

    def redis_security(self) -> list[str]:
        t = self.tls
        return [
            *("--port", "0", "--tls-port", str(self.redis_port), "--tls-auth-clients", "no"),
            *("--tls-cert-file", str(t / "server.crt"), "--tls-key-file", str(t / "server.key")),
            *("--tls-ca-cert-file", str(t / "ca.crt"), "--aclfile", str(self.root / "users.acl")),
        ]

    def broker_security(self) -> str:
        t = self.tls
        return (
            f"allow_anonymous false\npassword_file {self.root / 'passwd'}\n"
            f"cafile {t / 'ca.crt'}\ncertfile {t / 'server.crt'}\nkeyfile {t / 'server.key'}\n"
        )


def make_certificates(where: Path) -> None:
    """A throwaway CA and a server certificate for 127.0.0.1 / localhost (openssl)."""
    import subprocess

    def ssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=where, check=True, capture_output=True)

    ssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
        "-subj", "/CN=tlt-test-ca")  # fmt: skip
    ssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=localhost")
    (where / "san.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    ssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "server.crt", "-days", "2", "-extfile", "san.cnf")  # fmt: skip


async def _wait_port(port: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing listens on 127.0.0.1:{port}") from None
            await asyncio.sleep(0.05)


async def _stop(process: asyncio.subprocess.Process | None, sig: int) -> None:
    if process is not None and process.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(sig)
        await process.wait()


@dataclass
class AuditResult:
    dispatched: int
    trained: int
    lost: list[str]
    duplicated: list[str]
    versions: list[int]
    regressions: list[str] = field(default_factory=list)
    """Places where a version went backwards (learner rows, or one worker's samples)."""

    @property
    def clean(self) -> bool:
        return not self.lost and not self.duplicated and not self.regressions

    def row(self) -> dict[str, Any]:
        return {
            "dispatched": self.dispatched,
            "trained": self.trained,
            "lost": len(self.lost),
            "duplicated": len(self.duplicated),
            "versions": f"{self.versions[0]}..{self.versions[-1]}" if self.versions else "none",
            "regressions": len(self.regressions),
        }


def audit(run_dir: Path, expected_groups: set[str], samples: list[Any] = ()) -> AuditResult:
    """Every dispatched group trained exactly once? From the learner's `metrics.jsonl` (each update's groups;
    an update whose line a crash cut short is rewritten from its checkpoint on restart) and, for the
    workers' side, the `samples` stream (per worker, policy versions never go back)."""
    from tlt_stream.report import read_jsonl

    rows = read_jsonl(run_dir / "metrics.jsonl")  # every line, repeats included (load_metrics would merge them)
    versions = [int(r["version"]) for r in rows]
    regressions = [f"learner row {a} then {b}" for a, b in itertools.pairwise(versions) if b != a + 1]
    counts: dict[str, int] = {}
    for r in rows:
        for group in r.get("trained_groups", []):
            counts[group] = counts.get(group, 0) + 1
    seen: dict[str, int] = {}
    for s in samples:
        if s.policy_version < seen.get(s.worker_id, -1):
            regressions.append(f"{s.worker_id}: sample {s.sample_id} of version {s.policy_version} after a newer one")
        seen[s.worker_id] = max(seen.get(s.worker_id, -1), s.policy_version)
    return AuditResult(
        dispatched=len(expected_groups),
        trained=sum(1 for g in counts if g in expected_groups),
        lost=sorted(expected_groups - set(counts)),
        duplicated=sorted(g for g, n in counts.items() if n > 1),
        versions=versions,
        regressions=regressions,
    )


class FaultRun:
    """One run's services as processes against `servers`, each startable, killable and restartable alone."""

    def __init__(self, servers: PrivateServers, world: Path, run_dir: Path, *, run: str, **plan: Any) -> None:
        from tlt_stream.config import BusConfig, Config
        from tlt_stream.launch import RunPlan, service_commands

        self.servers = servers
        self.run = run
        self.plan = RunPlan(world=world, run_dir=run_dir, **{"cores": 2, **plan})
        bus = BusConfig(redis_url=servers.redis_url, mqtt_url=servers.mqtt_url)
        self.config = Config(run=run, bus=bus)
        self.commands = {c.name: c.argv for c in service_commands(self.plan, self.config)}
        self.processes: dict[str, asyncio.subprocess.Process] = {}
        self.killed: set[str] = set()
        """Services this harness killed on purpose (and has not restarted)."""
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("TLT_")},
            "TLT_REDIS_URL": servers.redis_url,
            "TLT_MQTT_URL": servers.mqtt_url,
            "TLT_BUS__RECLAIM_IDLE_MS": "3000",  # a dead consumer's entries move on after 3 s, not a minute
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": str(ROOT),
        }
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)

    @property
    def expected_groups(self) -> set[str]:
        return {f"s{s:06d}-{i:04d}" for s in range(self.plan.steps) for i in range(self.plan.prompts_per_step)}

    async def start(self, name: str) -> None:
        self.killed.discard(name)
        log = (self.plan.run_dir / "logs" / f"{name}.log").open("ab")
        try:
            self.processes[name] = await asyncio.create_subprocess_exec(
                *self.commands[name], env=self.env, stdout=log, stderr=log, cwd=ROOT, process_group=0
            )
        finally:
            log.close()

    async def start_all(self) -> None:
        for name in self.commands:
            await self.start(name)

    def signal(self, name: str, sig: int) -> None:
        self.processes[name].send_signal(sig)

    async def kill(self, name: str) -> None:
        self.killed.add(name)
        await _stop(self.processes[name], signal.SIGKILL)

    def log_tail(self, name: str, lines: int = 40) -> str:
        path = self.plan.run_dir / "logs" / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def version(self) -> int:
        """The newest version the learner wrote a metrics line for (0 before the first update)."""
        from tlt_stream.report import load_metrics

        rows = load_metrics(self.plan.run_dir)
        return rows[-1]["version"] if rows else 0

    async def wait_version(self, version: int, timeout: float) -> float:
        """Seconds until the learner reaches `version`; fails with the logs when a service died or time ran out."""
        started = time.monotonic()
        while self.version() < version:
            for name, process in self.processes.items():
                if process.returncode not in (None, 0) and name not in self.killed:
                    raise AssertionError(f"{name} exited with {process.returncode}:\n{self.log_tail(name)}")
            if time.monotonic() - started > timeout:
                logs = "\n".join(f"== {n}\n{self.log_tail(n, 15)}" for n in self.processes)
                raise AssertionError(f"version {version} not reached in {timeout:.0f} s (at {self.version()})\n{logs}")
            await asyncio.sleep(0.1)
        return time.monotonic() - started

    async def wait_any(self, state: str, timeout: float) -> str:
        """The first rollout worker seen in `state` (whichever it is: a worker that admits a whole step's
        tasks leaves the other idle, so a fault aimed at "rollout-0" could wait forever). Polls the registry
        on one connection, every few ms: a state can last only tens of ms on the tests' tiny model."""
        import redis.asyncio as aioredis

        from tlt_stream.bus.registry import list_workers
        from tlt_stream.bus.streams import Keys

        workers = [name for name in self.commands if name.startswith("rollout")]
        deadline = time.monotonic() + timeout
        redis = aioredis.Redis.from_url(self.servers.redis_url)
        try:
            while True:
                states = {
                    w["worker_id"]: w.get("state") for w in await list_workers(redis, Keys(self.run), self.config.bus)
                }
                for worker in workers:
                    if worker not in self.killed and states.get(worker) == state:
                        return worker
                if time.monotonic() > deadline:
                    raise AssertionError(f"no worker {state} in {timeout:.0f} s:\n{self.log_tail(workers[0])}")
                await asyncio.sleep(0.005)
        finally:
            await redis.aclose()

    async def samples(self) -> list[Any]:
        import redis.asyncio as aioredis

        from tlt_stream.bus.streams import Keys
        from tlt_stream.messages import codec_for

        redis = aioredis.Redis.from_url(self.servers.redis_url)
        try:
            entries = await redis.xrange(Keys(self.run).stream("samples"))
        finally:
            await redis.aclose()
        return [codec_for("samples").decode(f[b"m"]) for _, f in entries]

    async def audit(self) -> AuditResult:
        return audit(self.plan.run_dir, self.expected_groups, await self.samples())

    async def stop_all(self) -> dict[str, int | None]:
        for process in self.processes.values():
            if process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    process.send_signal(signal.SIGCONT)  # a frozen service must be able to hear SIGTERM
                    process.terminate()
        codes = {}
        for name, process in self.processes.items():
            try:
                codes[name] = await asyncio.wait_for(process.wait(), timeout=20)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                codes[name] = await process.wait()
        return codes


__all__ = [
    "AuditResult",
    "FaultRun",
    "PrivateServers",
    "SecureServers",
    "audit",
    "build_world",
    "free_port",
    "have_servers",
]
