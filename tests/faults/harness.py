"""Fault injection on a whole run: private Redis and Mosquitto servers this harness may kill and restart, and
the services as real processes (the command lines `tlt-stream run` and compose use), each startable, killable
and restartable alone; `FaultRun.collect()` reads the evidence that `tests/faults/audit.py` judges.

Used by `tests/faults/` (assertions) and `bench/faults.py` (the figures in docs/reliability.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from tests.faults.audit import AuditResult, RunRecord, audit, read_checkpoints
from tests.ports import free_port
from tests.worlds import build_world

ROOT = Path(__file__).resolve().parents[2]


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

    redis_host = "127.0.0.1"
    """The address Redis binds and the services reach it at."""

    def redis_launcher(self) -> list[str]:
        """What `redis-server` runs under (nothing here; `ip netns exec NS` for a Redis behind a cuttable link)."""
        return []

    @property
    def redis_url(self) -> str:
        return f"redis://{self.redis_host}:{self.redis_port}/0"

    @property
    def mqtt_url(self) -> str:
        return f"mqtt://127.0.0.1:{self.mqtt_port}"

    async def start_redis(self) -> None:
        log = (self.root / "redis.log").open("ab")
        self.redis = await asyncio.create_subprocess_exec(
            *self.redis_launcher(),
            "redis-server",
            *("--port", str(self.redis_port), "--bind", self.redis_host, "--dir", str(self.root / "redis")),
            *self.redis_persistence(),
            *self.redis_security(),
            stdout=log,
            stderr=log,
        )
        log.close()
        await wait_listening(self.redis_port, self.redis, self.root / "redis.log", self.redis_host)

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
        await wait_listening(self.mqtt_port, self.broker, self.root / "mosquitto.log")

    def redis_persistence(self) -> list[str]:
        return ["--appendonly", "yes", "--appendfsync", "always", "--save", ""]

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


async def wait_listening(
    port: int, server: asyncio.subprocess.Process, log: Path, host: str = "127.0.0.1", timeout: float = 20.0
) -> None:
    """Until `server` listens on `host:port`; a server that exits first (it could not bind) fails here, naming
    its log, rather than leaving its clients to whatever else answers on that port."""
    deadline = time.monotonic() + timeout
    while server.returncode is None:
        try:
            _, writer = await asyncio.open_connection(host, port)
            writer.close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing listens on {host}:{port}; see {log}") from None
            await asyncio.sleep(0.05)
    raise RuntimeError(f"the server for {host}:{port} exited ({server.returncode}) before it listened; see {log}")


async def _stop(process: asyncio.subprocess.Process | None, sig: int) -> None:
    if process is not None and process.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(sig)
        await process.wait()


_MARK = "=== fault harness: start "


class FaultRun:
    """One run's services as processes against `servers`, each startable, killable and restartable alone."""

    def __init__(
        self,
        servers: PrivateServers,
        world: Path,
        run_dir: Path,
        *,
        run: str,
        env: dict[str, str] | None = None,
        **plan: Any,
    ) -> None:
        from tlt_stream.basics.config import BusConfig, Config, override
        from tlt_stream.commands.run.launch import RunPlan, service_commands, write_service_config

        self.servers = servers
        self.run = run
        bus = BusConfig(redis_url=servers.redis_url, mqtt_url=servers.mqtt_url)
        self.config = override(Config(run=run, bus=bus), plan)
        self.plan = RunPlan(world=world, run_dir=run_dir, config=self.config, cores=2)
        write_service_config(self.plan, self.config)  # what every service reads, as `tlt-stream run` writes it
        # -v: the services' INFO lines are the evidence that a recovery path ran; every checkpoint is kept, as
        # consecutive ledgers are what says which update trained which sample.
        self.commands = {c.name: [*c.argv, "-v"] for c in service_commands(self.plan, self.config)}
        self.commands["learner"] += ["--keep-checkpoints", "1000"]
        self.processes: dict[str, asyncio.subprocess.Process] = {}
        self.killed: set[str] = set()
        """Services this harness killed on purpose (and has not restarted)."""
        self.forced: set[str] = set()
        self.hung_after_stop: dict[str, str] = {}
        """Services that ignored SIGTERM in `stop_all` and were killed: never a clean stop."""
        self.exit_codes: dict[str, int] = {}
        """Services a scenario expects to exit by themselves with another code than 0."""
        self.starts: dict[str, int] = {}
        self.injected: dict[tuple[str, str], str] = {}
        """(stream, entry id) of poison written straight into a stream -> words its dead letter's reason has."""
        self.lost_samples: list[tuple[str, bytes]] = []
        """Raw `samples` entries (id, payload) a fault made Redis lose, read by the scenario beforehand."""
        self.notes: dict[str, Any] = {}
        """What a fault's injection saw (its victim, the entries held at a kill), for its evidence check."""
        self._version = 0
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("TLT_")},
            "TLT_REDIS_URL": servers.redis_url,
            "TLT_MQTT_URL": servers.mqtt_url,
            "TLT_BUS__RECLAIM_IDLE_MS": "3000",  # a dead consumer's entries move on after 3 s, not a minute
            "PYTHONUNBUFFERED": "1",
            "PYTHONFAULTHANDLER": "1",  # a service that hangs on SIGTERM gets SIGABRT first: its stacks in its log
            "PYTHONPATH": str(ROOT),
            **(env or {}),
        }
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)

    @property
    def keys(self) -> Any:
        from tlt_stream.bus.streams import Keys

        return Keys(self.run)

    @contextlib.asynccontextmanager
    async def redis(self) -> AsyncIterator[Any]:
        import redis.asyncio as aioredis

        client = aioredis.Redis.from_url(self.servers.redis_url)
        try:
            yield client
        finally:
            await client.aclose()

    async def start(self, name: str) -> None:
        self.killed.discard(name)
        self.starts[name] = self.starts.get(name, 0) + 1
        log = (self.plan.run_dir / "logs" / f"{name}.log").open("ab")
        try:
            log.write(f"\n{_MARK}{name} #{self.starts[name]} at {time.time():.3f} ===\n".encode())
            log.flush()
            self.processes[name] = await asyncio.create_subprocess_exec(
                *self.commands[name], env=self.env, stdout=log, stderr=log, cwd=ROOT, process_group=0
            )
        finally:
            log.close()

    async def start_all(self) -> None:
        """The audit's own consumer group on each durable stream first: services trim what every group acked,
        and the audit reads every entry at the end."""
        async with self.redis() as redis:
            for stream in ("prompts", "samples"):
                await redis.xgroup_create(self.keys.stream(stream), "audit", id="0", mkstream=True)
        for name in list(self.commands):
            await self.start(name)

    def signal(self, name: str, sig: int) -> None:
        self.processes[name].send_signal(sig)

    async def kill(self, name: str) -> None:
        self.killed.add(name)
        await _stop(self.processes[name], signal.SIGKILL)

    async def wait_exit(self, name: str, timeout: float) -> int:
        """The exit code of `name`, which must exit by itself within `timeout` seconds."""
        try:
            return await asyncio.wait_for(self.processes[name].wait(), timeout)
        except TimeoutError:
            raise AssertionError(f"{name} still running after {timeout:.0f} s:\n{self.log_tail(name)}") from None

    def log_text(self, name: str, start: int | None = None) -> str:
        """The log of `name`, or of its `start`-th start only (1 = the first)."""
        path = self.plan.run_dir / "logs" / f"{name}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        if start is None:
            return text
        parts = text.split(_MARK)
        return parts[start] if start < len(parts) else ""

    def log_tail(self, name: str, lines: int = 40) -> str:
        return "\n".join(self.log_text(name).splitlines()[-lines:])

    def expect_log(self, name: str, pattern: str, *, start: int | None = None, absent: bool = False) -> str:
        """The first line of `name`'s log (or of one start of it) matching `pattern`; with `absent`, assert no
        line does. The evidence that a recovery path ran (or that a wrong one did not)."""
        text = self.log_text(name, start)
        found = re.search(pattern, text)
        where = f"{name}'s log" + (f" (start #{start})" if start else "")
        if absent:
            assert found is None, f"{where} says {found and found.group(0)!r}:\n{self.log_tail(name, 60)}"
            return ""
        assert found is not None, f"no /{pattern}/ in {where}:\n{self.log_tail(name, 60)}"
        return text[text.rfind("\n", 0, found.start()) + 1 : text.find("\n", found.end())]

    def adopted(self, name: str, start: int) -> list[int]:
        """The policy versions one start of `name` adopted, in order (its control plane logs each one)."""
        return [int(v) for v in re.findall(r"\bpolicy version (\d+) \(from ", self.log_text(name, start))]

    def version(self) -> int:
        """The newest checkpoint's step (the learner's version), read from `LATEST` and its meta.json; while
        the checkpoint directory is away (a fault), the last one seen."""
        root = self.plan.run_dir / "checkpoints"
        with contextlib.suppress(OSError, ValueError, KeyError):
            name = (root / "LATEST").read_text().strip()
            self._version = int(json.loads((root / name / "meta.json").read_text())["step"])
        return self._version

    async def published(self) -> int:
        """The policy version in the Redis mirror (-1 before the first)."""
        async with self.redis() as redis:
            value = await redis.hget(self.keys.versions, "policy:version")
        return int(value) if value is not None else -1

    def _check_alive(self) -> None:
        for name, process in self.processes.items():
            if process.returncode not in (None, self.exit_codes.get(name, 0)) and name not in self.killed:
                raise AssertionError(f"{name} exited with {process.returncode}:\n{self.log_tail(name)}")

    async def wait_version(self, version: int, timeout: float) -> float:
        """Seconds until checkpoint `version` exists; fails with the logs when a service died or time ran out."""
        started = time.monotonic()
        while self.version() < version:
            self._check_alive()
            if time.monotonic() - started > timeout:
                logs = "\n".join(f"== {n}\n{self.log_tail(n, 15)}" for n in self.processes)
                raise AssertionError(f"version {version} not reached in {timeout:.0f} s (at {self.version()})\n{logs}")
            await asyncio.sleep(0.1)
        return time.monotonic() - started

    async def wait_published(self, version: int, timeout: float) -> None:
        """Until the mirror holds `version` (published after its samples were acked)."""
        deadline = time.monotonic() + timeout
        while await self.published() < version:
            self._check_alive()
            assert time.monotonic() < deadline, f"version {version} not published:\n{self.log_tail('learner')}"
            await asyncio.sleep(0.1)

    async def wait_any(self, state: str, timeout: float) -> str:
        """The first rollout worker seen in `state` (whichever it is: a worker that admits a whole step's
        tasks leaves the other idle, so a fault aimed at "rollout-0" could wait forever). Polls the registry
        on one connection, every few ms: a state can last only tens of ms on the tests' tiny model."""
        from tlt_stream.bus.registry import list_workers

        workers = [name for name in self.commands if name.startswith("rollout")]
        deadline = time.monotonic() + timeout
        async with self.redis() as redis:
            while True:
                states = {w["worker_id"]: w.get("state") for w in await list_workers(redis, self.keys, self.config.bus)}
                for worker in workers:
                    if worker not in self.killed and states.get(worker) == state:
                        return worker
                if time.monotonic() > deadline:
                    raise AssertionError(f"no worker {state} in {timeout:.0f} s:\n{self.log_tail(workers[0])}")
                await asyncio.sleep(0.005)

    async def held(self, group: str = "learner", stream: str = "samples") -> dict[str, tuple[str, int]]:
        """Entries `group` holds (delivered, not acked) -> (owner, ms since the entry was added, server clock)."""
        async with self.redis() as redis:
            seconds, micros = await redis.time()
            rows = await redis.xpending_range(self.keys.stream(stream), group, "-", "+", 10_000)
        now_ms = seconds * 1000 + micros // 1000
        return {
            _text(r["message_id"]): (_text(r["consumer"]), now_ms - int(_text(r["message_id"]).split("-")[0]))
            for r in rows
        }

    async def settle(self, timeout: float = 15.0) -> None:
        """Until the services' consumer groups hold nothing (an ack may trail the update it fed by a moment);
        what is still pending after `timeout` is the audit's to report."""
        deadline = time.monotonic() + timeout
        async with self.redis() as redis:
            while time.monotonic() < deadline:
                pending = [
                    (await redis.xpending(self.keys.stream(stream), group))["pending"]
                    for stream, group in (("samples", "learner"), ("prompts", "rollout"))
                ]
                if not any(pending):
                    return
                await asyncio.sleep(0.1)

    async def collect(self) -> RunRecord:
        """Read the evidence: Redis (through the audit group's untrimmed view), the broker, the checkpoints."""
        from tlt_stream.basics.messages import CONTROL_CODEC, codec_for

        def decode(stream: str, payload: bytes | None) -> Any:
            try:
                return codec_for(stream).decode(payload) if payload is not None else None
            except ValueError:  # msgspec's DecodeError and ValidationError
                return None

        keys = self.keys
        async with self.redis() as redis:
            streams = {s: await redis.xrange(keys.stream(s)) for s in ("prompts", "samples", "dead")}
            added = {}
            for stream in ("prompts", "samples"):
                added[stream] = int((await redis.xinfo_stream(keys.stream(stream)))["entries-added"])
            pending = {}
            for stream, group in (("samples", "learner"), ("prompts", "rollout")):
                groups = {_text(g["name"]): g for g in await redis.xinfo_groups(keys.stream(stream))}
                pending[f"{stream}/{group}"] = int(groups[group]["pending"]) if group in groups else 0
            counts = {_text(k): int(v) for k, v in (await redis.hgetall(keys.dead_counts)).items()}
            dropped = {_text(k) for k in await redis.hkeys(keys.dropped)}
            replaced = {_text(k): _text(v) for k, v in (await redis.hgetall(keys.replaced)).items()}
            mirrored = await redis.hget(keys.versions, "policy")
        entries = {s: [(_text(i), decode(s, f.get(b"m"))) for i, f in rows] for s, rows in streams.items()}
        checkpoints, set_aside = read_checkpoints(self.plan.run_dir / "checkpoints")
        return RunRecord(
            prompts=entries["prompts"],
            samples=entries["samples"],
            added=added,
            pending=pending,
            dead=[d for _, d in entries["dead"] if d is not None],
            dead_counts=counts,
            mirror=CONTROL_CODEC.decode(mirrored) if mirrored is not None else None,
            retained=await self.retained("policy"),
            checkpoints=checkpoints,
            set_aside=set_aside,
            lost_samples=[(i, decode("samples", payload)) for i, payload in self.lost_samples],
            dropped=dropped,
            replaced=replaced,
        )

    async def retained(self, kind: str, timeout: float = 5.0) -> Any:
        """The broker's retained message on `tlt/{run}/{kind}` (None when there is none)."""
        from tlt_stream.basics.messages import CONTROL_CODEC
        from tlt_stream.bus.connect import mqtt_params

        client = mqtt_params(self.servers.mqtt_url).client(identifier=f"audit-{os.getpid()}-{time.monotonic_ns()}")
        async with client:
            await client.subscribe(self.config.topic_prefix + kind, qos=1)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    async for message in client.messages:
                        return CONTROL_CODEC.decode(message.payload) if message.payload else None
        return None

    async def audit(self, scenario: str = "") -> AuditResult:
        return audit(
            await self.collect(),
            scenario=scenario or self.run,
            steps=self.plan.steps,
            prompts_per_step=self.config.policy.prompts_per_step,
            max_staleness=self.config.policy.max_staleness,
            injected=self.injected,
        )

    async def stop_all(self) -> dict[str, int | None]:
        """SIGTERM every live service and wait for it (20 s); one still running then is killed and recorded in
        `forced`: it did not stop cleanly, whatever its code."""
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
                self.forced.add(name)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGABRT)  # faulthandler writes every thread's stack
                    await asyncio.sleep(2.0)
                    os.killpg(process.pid, signal.SIGKILL)
                codes[name] = await process.wait()
        return codes

    def unclean_stops(self, codes: dict[str, int | None]) -> dict[str, str]:
        """Services that did not stop as they should: each exits by itself on SIGTERM with 0 (or the code a
        scenario expects); only one this harness killed on purpose may show -9."""
        bad = {}
        for name, code in codes.items():
            wanted = -signal.SIGKILL if name in self.killed else self.exit_codes.get(name, 0)
            if name in self.forced and _STOPPED_LINE.search(self.log_text(name)):
                # Known open bug, seen once in ~50 scenario runs: the service finished its shutdown (its last
                # line says so; nothing was in flight) but its process did not exit. Recorded, with the
                # stacks faulthandler wrote on SIGABRT, not failed on: see docs/reliability.md.
                self.hung_after_stop[name] = f"hung after its clean stop line (exit code {code})"
            elif name in self.forced:
                bad[name] = f"ignored SIGTERM for 20 s and was killed (exit code {code})"
            elif code != wanted:
                bad[name] = f"exit code {code}, expected {wanted}"
        return bad


_STOPPED_LINE = re.compile(r"^(rollout-\d+: stopped after|learner: stopped at policy version|policy: stopped)", re.M)
"""The last line each service prints once its shutdown is complete."""


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


__all__ = [
    "AuditResult",
    "FaultRun",
    "PrivateServers",
    "SecureServers",
    "audit",
    "build_world",
    "have_servers",
    "wait_listening",
]
