"""compose.yaml ships secured servers: it refuses to start without the passwords, every service logs in as its
own user, and the servers it starts (run here from the same deploy/ files and entry point, on loopback) refuse
the default Redis user and anonymous MQTT clients, give each role's user what it needs and keep the monitor
to reading, and deliver a control topic's messages from its one publisher only."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import socket
import stat
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiomqtt
import msgspec
import pytest
import redis
import redis.exceptions

from tests.compose_file import (
    COMPOSE_FILE,
    CPU_OVERRIDE,
    DEPLOY,
    ENV_EXAMPLE,
    ROLES,
    ROOT,
    SERVERS,
    compose_command,
    deployed_server,
    environment,
    interpolate,
    load,
    make_env,
    missing_binaries,
    read_env_file,
    services,
)
from tlt_stream.basics.config import BusConfig, Config
from tlt_stream.bus.connect import mqtt_params

SERVICE_ROLES = ("policy", "rollout", "learner")
PUBLISHER = {"policy": "learner", "drafter": "rollout", "sd_config": "policy"}
"""Who publishes each control kind: the `owns` of `serve(config, role, owns, ...)` in tlt_stream/roles/."""
RUN = "sec"


def password_variables() -> dict[str, str]:
    return {f"TLT_{server}_PASSWORD_{role.upper()}": role for server in ("REDIS", "MQTT") for role in ROLES}


# ------------------------------------------------------------------------------------------------- compose


def test_env_example_lists_every_variable_of_compose_with_placeholders_and_the_compose_defaults() -> None:
    used = {}
    for path in (COMPOSE_FILE, CPU_OVERRIDE):
        for name, op, arg in re.findall(r"\$\{([A-Z_][A-Z0-9_]*)(?::?([-?+]))?([^}]*)\}", path.read_text()):
            used[name] = (op, arg)
    required = {name for name, (op, _) in used.items() if op == "?"}
    assert required == set(password_variables()), "the passwords, and only they, have no default"
    example = ENV_EXAMPLE.read_text()
    assert read_env_file(ENV_EXAMPLE) == {name: f"change-me-{name.split('_')[1].lower()}-{role}"
                                          for name, role in password_variables().items()}  # fmt: skip
    for name, (op, default) in used.items():
        if op != "?":
            assert f"\n# {name}={default}\n" in example, f"{name} [{default}] is not in .env.example"
    assert "CHANGE EVERY PASSWORD" in example


def test_make_env_writes_fresh_url_safe_passwords_readable_by_the_owner_only(tmp_path: Path) -> None:
    first, second = make_env(tmp_path / "a.env"), make_env(tmp_path / "b.env")
    assert set(first) == set(password_variables())
    values = [*first.values(), *second.values()]
    assert len(set(values)) == len(values), "every password is drawn afresh"
    assert all(len(v) >= 32 and v.isalnum() for v in values)
    assert stat.S_IMODE((tmp_path / "a.env").stat().st_mode) == 0o600
    again = subprocess.run(
        ["sh", str(DEPLOY / "make-env.sh"), str(tmp_path / "a.env")], capture_output=True, text=True, timeout=30
    )
    assert again.returncode != 0 and "exists" in again.stderr
    assert read_env_file(tmp_path / "a.env") == first


def test_every_service_logs_in_as_its_own_user_and_each_server_holds_only_its_passwords(tmp_path: Path) -> None:
    env = make_env(tmp_path / ".env")
    spec = services(env)
    for role in ROLES:
        urls = environment(spec[role])
        redis_url, mqtt_url = urlsplit(urls["TLT_REDIS_URL"]), urlsplit(urls["TLT_MQTT_URL"])
        assert (redis_url.hostname, redis_url.username) == ("redis", role)
        assert redis_url.password == env[f"TLT_REDIS_PASSWORD_{role.upper()}"]
        mqtt = mqtt_params(urls["TLT_MQTT_URL"])  # as the services read it
        assert (mqtt.host, mqtt.port, mqtt.username) == ("mosquitto", 1883, role) and mqtt_url.scheme == "mqtt"
        assert mqtt.password == env[f"TLT_MQTT_PASSWORD_{role.upper()}"]
        assert not any("PASSWORD" in name for name in urls), f"{role} sees other roles' passwords"
    for name, server in (("redis", "REDIS"), ("mosquitto", "MQTT")):
        assert environment(spec[name]) == {k: v for k, v in env.items() if k.startswith(f"TLT_{server}_PASSWORD_")}
    assert "bootstrap" not in {n for n, s in spec.items() if "TLT_REDIS_URL" in environment(s)}


@pytest.mark.parametrize("value", [None, ""])
def test_compose_refuses_to_start_when_a_password_is_missing_or_empty(value: str | None, tmp_path: Path) -> None:
    env = make_env(tmp_path / ".env")
    name = "TLT_MQTT_PASSWORD_ROLLOUT"
    if value is None:
        del env[name]
    else:
        env[name] = value
    with pytest.raises(ValueError, match=name):
        interpolate(load()["services"], env)
    command = compose_command()
    if command is None:
        pytest.skip("no Compose v2 binary (the tests' interpolation refused it above)")
    dotenv = tmp_path / "partial.env"
    dotenv.write_text("".join(f"{k}={v}\n" for k, v in env.items()))
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("TLT_", "COMPOSE_", "DOCKER_"))}
    for files in ([COMPOSE_FILE], [COMPOSE_FILE, CPU_OVERRIDE]):
        result = subprocess.run(
            [*command, *(a for f in files for a in ("-f", str(f))), "--env-file", str(dotenv), "config", "--quiet"],
            capture_output=True, text=True, timeout=60, env=clean, check=False,
        )  # fmt: skip
        assert result.returncode != 0, result.stdout
        assert name in result.stderr and ".env.example" in result.stderr, result.stderr


def server_auth(server: str, env: dict[str, str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["sh", str(DEPLOY / "server-auth.sh"), server, "echo", "started"],
        env={"PATH": os.environ["PATH"], "TLT_AUTH_DIR": str(tmp_path / "auth"), **env},
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip


@pytest.mark.parametrize("server", SERVERS)
@pytest.mark.parametrize(
    ("value", "reason"),
    [(None, "unset or empty"), ("change-me-x", "placeholder"), ("p@ss/word", "only letters")],
)
def test_the_servers_refuse_a_missing_placeholder_or_unsafe_password(
    server: str, value: str | None, reason: str, tmp_path: Path
) -> None:
    if why := missing_binaries("sha256sum", "mosquitto_passwd"):
        pytest.skip(why)
    env = make_env(tmp_path / ".env")
    assert server_auth(server, env, tmp_path).stdout.startswith("started")
    name = f"TLT_{'REDIS' if server == 'redis' else 'MQTT'}_PASSWORD_LEARNER"
    if value is None:
        del env[name]
    else:
        env[name] = value
    result = server_auth(server, env, tmp_path)
    assert result.returncode == 1 and result.stdout == "", "the server must not start"
    assert name in result.stderr and reason in result.stderr, result.stderr
    assert value is None or value not in result.stderr


def test_the_generated_credentials_hold_no_password_and_only_the_server_reads_them(tmp_path: Path) -> None:
    if why := missing_binaries("sha256sum", "mosquitto_passwd"):
        pytest.skip(why)
    env = make_env(tmp_path / ".env")
    for server in SERVERS:
        assert server_auth(server, env, tmp_path).returncode == 0
    auth = tmp_path / "auth"
    assert {p.name for p in auth.iterdir()} == {"users.acl", "passwd", "acl"}
    for path in auth.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
        text = path.read_text()
        assert not any(secret in text for secret in env.values()), f"{path.name} holds a password"
    assert (auth / "acl").read_text() == (DEPLOY / "mosquitto.acl").read_text()
    assert "/run/tlt-auth/passwd" in (DEPLOY / "mosquitto.conf").read_text()
    assert "${TLT_AUTH_DIR:-/run/tlt-auth}" in (DEPLOY / "server-auth.sh").read_text()


# --------------------------------------------------------------------------------------------------- Redis


@pytest.fixture
def redis_server(tmp_path: Path) -> Any:
    if why := missing_binaries("redis-server", "redis-cli", "sha256sum"):
        pytest.skip(why)
    env = make_env(tmp_path / ".env")
    with deployed_server("redis", tmp_path / "redis", env) as port:
        yield port, env


def raw_reply(port: int, *lines: bytes) -> bytes:
    """What Redis answers inline commands on a fresh connection (one short reply each)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        replies = []
        for line in lines:
            s.sendall(line + b"\r\n")
            replies.append(s.recv(4096))
        return b"".join(replies)


def as_user(port: int, env: dict[str, str], role: str) -> redis.Redis:
    password = env[f"TLT_REDIS_PASSWORD_{role.upper()}"]
    return redis.Redis(port=port, username=role, password=password, socket_timeout=5, client_name=role)


def allowed(call: Any) -> bool:
    """Whether Redis runs the command (a reply, or an error that is not about permissions)."""
    try:
        call()
    except redis.exceptions.NoPermissionError:
        return False
    except redis.exceptions.ResponseError as exc:
        return "can't run this command" not in str(exc)  # a script's command its user may not run
    return True


K = f"tlt:{RUN}:"
WRITE_SCRIPT = "return redis.call('XADD', KEYS[1], '*', 'm', 'x')"
READ_SCRIPT = "return #redis.call('XRANGE', KEYS[1], '-', '+')"
ACK_SCRIPT = "local n = redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]); redis.call('PUBLISH', KEYS[2], n); return n"


def data_plane(r: redis.Redis) -> dict[str, Any]:
    """The commands of the bus layer and the roles (tlt_stream/bus and tlt_stream/roles)."""
    stream, channel = f"{K}stream:samples", f"{K}acked:samples"

    def transaction() -> None:
        with r.pipeline(transaction=True) as pipe:
            pipe.watch(f"{K}dispatch")
            pipe.hmget(f"{K}dispatch", ["next_step"])
            pipe.multi()
            pipe.xadd(f"{K}stream:prompts", {"m": b"x"})
            pipe.hset(f"{K}dispatch", mapping={"next_step": 1})
            pipe.execute()

    def subscribe() -> None:
        pubsub = r.pubsub()
        pubsub.subscribe(channel)
        assert pubsub.get_message(timeout=5)["type"] == "subscribe"
        pubsub.close()

    return {
        "xgroup create": lambda: r.xgroup_create(stream, "learner", id="0", mkstream=True),
        "xadd": lambda: r.xadd(stream, {"m": b"x"}, maxlen=100, approximate=True),
        "xreadgroup": lambda: r.xreadgroup("learner", "c1", {stream: ">"}, count=1),
        "xpending": lambda: (r.xpending(stream, "learner"), r.xpending_range(stream, "learner", "-", "+", 10)),
        "xclaim": lambda: r.xclaim(stream, "learner", "c2", 0, ["0-1"], justid=True),
        "xautoclaim": lambda: r.xautoclaim(stream, "learner", "c2", 0),
        "xack": lambda: r.xack(stream, "learner", "0-1"),
        "xinfo groups, xlen, xrange, xrevrange, xread": lambda: (
            r.xinfo_groups(stream), r.xlen(stream), r.xrange(stream), r.xrevrange(stream), r.xread({stream: "0"})
        ),
        "xtrim": lambda: r.xtrim(stream, minid="0-1", approximate=False),
        "hashes": lambda: (r.hset(f"{K}versions", "policy:version", 1), r.hget(f"{K}versions", "x"),
                           r.hgetall(f"{K}versions"), r.hincrby(f"{K}dead_counts", "samples", 1)),
        "registry": lambda: (r.hset(f"{K}worker:w1", "state", "busy"), r.pexpire(f"{K}worker:w1", 10000),
                             r.zadd(f"{K}workers", {"w1": 1.0}), r.zrange(f"{K}workers", 0, -1),
                             r.exists(f"{K}worker:w1")),
        "prune workers": lambda: r.zremrangebyscore(f"{K}workers", "-inf", 0),
        "lease": lambda: (r.incr(f"{K}lease_fence"), r.get(f"{K}lease_fence"), r.pttl(f"{K}lease"),
                          r.delete(f"{K}lease")),
        "eval (ack and notify)": lambda: r.eval(ACK_SCRIPT, 2, stream, channel, "learner", "0-1"),
        "evalsha (registered script)": lambda: r.register_script(READ_SCRIPT)(keys=[stream]),
        "watch, multi, exec": transaction,
        "publish": lambda: r.publish(channel, 1),
        "subscribe": subscribe,
        "info, time, ping": lambda: (r.info("server"), r.time(), r.ping()),
    }  # fmt: skip


def forbidden(r: redis.Redis) -> dict[str, Any]:
    """What no role needs: administration, other key spaces, commands that scan or wipe the server."""
    return {
        "flushall": lambda: r.flushall(),
        "flushdb": lambda: r.flushdb(),
        "config get": lambda: r.config_get("maxmemory"),
        "config set": lambda: r.config_set("maxmemory-policy", "allkeys-lru"),
        "keys": lambda: r.keys("*"),
        "acl list": lambda: r.acl_list(),
        "acl setuser": lambda: r.acl_setuser("intruder", enabled=True, nopass=True),
        "client list": lambda: r.client_list(),
        "client kill": lambda: r.client_kill_filter(skipme=True, laddr="127.0.0.1:1"),
        "save": lambda: r.save(),
        "replicaof": lambda: r.execute_command("REPLICAOF", "NO", "ONE"),
        "function": lambda: r.execute_command("FUNCTION", "FLUSH"),
        "sort": lambda: r.sort(f"{K}workers"),
        "bgrewriteaof": lambda: r.bgrewriteaof(),
        "a key outside tlt:": lambda: r.set("other", 1),
        "read outside tlt:": lambda: r.get("other"),
        "a channel outside tlt:": lambda: r.publish("other", 1),
        "a script that wipes": lambda: r.eval("return redis.call('FLUSHALL')", 0),
    }


def test_the_default_user_is_refused(redis_server: tuple[int, dict[str, str]]) -> None:
    port, env = redis_server
    assert raw_reply(port, b"PING").startswith(b"-NOAUTH")
    assert raw_reply(port, b"SET tlt:x 1").startswith(b"-NOAUTH")
    assert raw_reply(port, b"AUTH default anything").startswith(b"-WRONGPASS")
    assert raw_reply(port, b"AUTH anything").startswith(b"-WRONGPASS")  # AUTH with a password alone is the default
    password = env["TLT_REDIS_PASSWORD_LEARNER"].encode()
    assert raw_reply(port, b"AUTH learner " + password, b"PING") == b"+OK\r\n+PONG\r\n"
    assert raw_reply(port, b"AUTH learner wrong").startswith(b"-WRONGPASS")
    assert raw_reply(port, b"AUTH policy " + password).startswith(b"-WRONGPASS"), "each role has its own password"


def test_a_restart_replays_every_write_of_the_append_only_file_transactions_included(tmp_path: Path) -> None:
    """Redis replays its append-only file as the default user, and EXEC re-checks each queued command's ACL:
    with the default user off, every MULTI/EXEC in the file was refused on load (`-NOPERM ACLs rules changed
    ...`), silently: the policy service's dispatch transactions and, since Redis 7 wraps what it propagates
    for a command in MULTI/EXEC, every XREADGROUP's delivery state (the group's last id and pending entries).
    A restarted stack then delivered every task still in `prompts` again. The default user is now on with a
    password no one has (a random hash): no client can use it, the replay can."""
    if why := missing_binaries("redis-server", "redis-cli", "sha256sum"):
        pytest.skip(why)
    env = make_env(tmp_path / ".env")
    prompts = f"{K}stream:prompts"
    with deployed_server("redis", tmp_path / "redis", env) as port:
        policy, rollout = as_user(port, env, "policy"), as_user(port, env, "rollout")
        rollout.xgroup_create(prompts, "rollout", id="0", mkstream=True)
        with policy.pipeline(transaction=True) as pipe:  # a dispatch: the step's tasks and the cursor at once
            pipe.xadd(prompts, {"m": b"task-0"})
            pipe.xadd(prompts, {"m": b"task-1"})
            pipe.hset(f"{K}dispatch", mapping={"next_step": 1})
            pipe.execute()
        delivered = rollout.xreadgroup("rollout", "w1", {prompts: ">"}, count=1)[0][1]
        rollout.xack(prompts, "rollout", delivered[0][0])
        before = (rollout.xinfo_groups(prompts)[0]["last-delivered-id"], rollout.xlen(prompts))
    with deployed_server("redis", tmp_path / "redis", env) as port:  # the same data directory
        rollout = as_user(port, env, "rollout")
        assert "NOPERM" not in (tmp_path / "redis" / "redis.log").read_text(), "the replay refused writes"
        assert (rollout.xinfo_groups(prompts)[0]["last-delivered-id"], rollout.xlen(prompts)) == before
        assert rollout.hget(f"{K}dispatch", "next_step") == b"1"
        again = rollout.xreadgroup("rollout", "w1", {prompts: ">"}, count=10)[0][1]
        assert [m[b"m"] for _, m in again] == [b"task-1"], "a delivered task was delivered again"
        assert raw_reply(port, b"PING").startswith(b"-NOAUTH")
        assert raw_reply(port, b"AUTH default anything").startswith(b"-WRONGPASS")


def test_redis_is_append_only_bounded_and_never_evicts(redis_server: tuple[int, dict[str, str]]) -> None:
    port, env = redis_server
    r = as_user(port, env, "monitor")
    memory, persistence = r.info("memory"), r.info("persistence")
    assert memory["maxmemory"] == 2 * 2**30 and memory["maxmemory_policy"] == "noeviction"
    assert persistence["aof_enabled"] == 1


@pytest.mark.parametrize("role", SERVICE_ROLES)
def test_each_service_user_runs_the_data_plane_on_its_keys_and_nothing_else(
    role: str, redis_server: tuple[int, dict[str, str]]
) -> None:
    port, env = redis_server
    r = as_user(port, env, role)
    refused = [name for name, call in data_plane(r).items() if not allowed(call)]
    assert refused == [], f"{role} may not run what it needs"
    ran = [name for name, call in forbidden(r).items() if allowed(call)]
    assert ran == [], f"{role} may run what no role needs"


def test_the_monitor_reads_everything_and_writes_nothing(redis_server: tuple[int, dict[str, str]]) -> None:
    port, env = redis_server
    writer = as_user(port, env, "rollout")
    for call in data_plane(writer).values():  # a populated run: streams with groups, registry, versions
        call()
    monitor = as_user(port, env, "monitor")
    reads = {
        "xlen, xrange, xrevrange, xinfo groups, xpending": lambda: (
            monitor.xlen(f"{K}stream:samples"), monitor.xrange(f"{K}stream:samples"),
            monitor.xrevrange(f"{K}stream:stats", count=5), monitor.xinfo_groups(f"{K}stream:samples"),
            monitor.xpending(f"{K}stream:samples", "learner"),
            monitor.xpending_range(f"{K}stream:samples", "learner", "-", "+", 1),
        ),
        "hashes, sorted sets": lambda: (monitor.hgetall(f"{K}versions"), monitor.zrange(f"{K}workers", 0, -1)),
        "prune the worker index": lambda: monitor.zremrangebyscore(f"{K}workers", "-inf", 0),
        "a read-only script over a stream": lambda: monitor.eval(READ_SCRIPT, 1, f"{K}stream:samples"),
        "info, time, ping": lambda: (monitor.info("server"), monitor.time(), monitor.ping()),
    }  # fmt: skip
    assert [name for name, call in reads.items() if not allowed(call)] == []
    writes = {
        "xadd": lambda: monitor.xadd(f"{K}stream:samples", {"m": b"x"}),
        "xreadgroup": lambda: monitor.xreadgroup("learner", "m", {f"{K}stream:samples": ">"}),
        "xack": lambda: monitor.xack(f"{K}stream:samples", "learner", "0-1"),
        "xgroup create": lambda: monitor.xgroup_create(f"{K}stream:samples", "g2", id="0"),
        "xtrim": lambda: monitor.xtrim(f"{K}stream:samples", maxlen=0),
        "hset": lambda: monitor.hset(f"{K}versions", "policy:version", 99),
        "zadd": lambda: monitor.zadd(f"{K}workers", {"ghost": 1.0}),
        "del": lambda: monitor.delete(f"{K}versions"),
        "prune a set that is not the worker index": lambda: monitor.zremrangebyscore(f"{K}versions", "-inf", 0),
        "publish": lambda: monitor.publish(f"{K}acked:samples", 1),
        "a script that writes": lambda: monitor.eval(WRITE_SCRIPT, 1, f"{K}stream:samples"),
        **forbidden(monitor),
    }
    assert [name for name, call in writes.items() if allowed(call)] == []


async def test_doctor_and_monitor_see_the_run_through_the_monitor_user(
    redis_server: tuple[int, dict[str, str]],
) -> None:
    from tlt_stream.commands.doctor_checks import inspect_redis
    from tlt_stream.roles.monitor import snapshot

    port, env = redis_server
    for call in data_plane(as_user(port, env, "rollout")).values():
        call()
    url = f"redis://monitor:{env['TLT_REDIS_PASSWORD_MONITOR']}@127.0.0.1:{port}/0"
    config = Config(run=RUN, bus=msgspec.convert({"redis_url": url, "mqtt_url": "mqtt://127.0.0.1:1"}, BusConfig))
    report = await inspect_redis(config, timeout=10)
    assert report["reachable"] and "error" not in report, report
    assert report["server"].startswith("redis "), "INFO is allowed"
    assert report["streams"]["samples"]["groups"]["learner"]["consumers"] >= 1, "XINFO GROUPS is allowed"
    snap = await snapshot(config, timeout=10)
    assert snap["reachable"] and "error" not in snap, snap


def test_the_healthcheck_logs_in_as_the_monitor(redis_server: tuple[int, dict[str, str]]) -> None:
    port, env = redis_server
    kind, script = services(env)["redis"]["healthcheck"]["test"]
    assert kind == "CMD-SHELL" and "redis-cli --user monitor" in script
    local = script.replace("redis-cli ", f"redis-cli -p {port} ")
    environ = {"PATH": os.environ["PATH"], **environment(services(env)["redis"])}
    assert subprocess.run(["sh", "-c", local], env=environ, timeout=30, check=False).returncode == 0
    wrong = {**environ, "TLT_REDIS_PASSWORD_MONITOR": "wrong"}
    assert subprocess.run(["sh", "-c", local], env=wrong, capture_output=True, timeout=30).returncode != 0


# ----------------------------------------------------------------------------------------------- Mosquitto


@pytest.fixture
def broker(tmp_path: Path) -> Any:
    if why := missing_binaries("mosquitto", "mosquitto_passwd", "mosquitto_sub"):
        pytest.skip(why)
    env = make_env(tmp_path / ".env")
    with deployed_server("mosquitto", tmp_path / "mosquitto", env) as port:
        yield port, env


def mqtt_client(port: int, username: str | None, password: str | None, **options: Any) -> aiomqtt.Client:
    return aiomqtt.Client(
        "127.0.0.1", port, username=username, password=password, protocol=aiomqtt.ProtocolVersion.V311, timeout=5,
        **options,
    )  # fmt: skip


def client(port: int, env: dict[str, str], role: str, **options: Any) -> aiomqtt.Client:
    return mqtt_client(port, role, env[f"TLT_MQTT_PASSWORD_{role.upper()}"], **options)


def test_the_broker_acl_grants_each_kind_to_the_role_that_owns_it_in_the_code() -> None:
    owns: dict[str, str] = {}
    for path in sorted((ROOT / "tlt_stream" / "roles").glob("*.py")):
        for role, kinds in re.findall(r'serve\(config, "(\w+)", (.*?), body\)', path.read_text()):
            for kind in re.findall(r'"(\w+)"', kinds):
                # one role may serve in several places (the learner: one process, or rank 0 of several)
                assert owns.get(kind, role) == role, f"{kind} has two publishers: {owns[kind]} and {role}"
                owns[kind] = role
    assert owns == PUBLISHER, "serve(config, role, owns, ...) changed: update deploy/mosquitto.acl and this test"
    grants, user = {}, None
    for line in (DEPLOY / "mosquitto.acl").read_text().splitlines():
        words = line.split()
        if words[:1] == ["user"]:
            user = words[1]
        elif words[:2] == ["topic", "write"] or words[:2] == ["pattern", "write"] or "readwrite" in words:
            assert words[0] == "topic" and user is not None, f"a write for everyone: {line!r}"
            grants[words[2]] = user
    assert grants == {f"tlt/+/{kind}": role for kind, role in PUBLISHER.items()}


async def test_anonymous_and_wrong_credentials_are_refused(broker: tuple[int, dict[str, str]]) -> None:
    port, env = broker
    for username, password in ((None, None), ("learner", "wrong"), ("learner", env["TLT_MQTT_PASSWORD_POLICY"])):
        with pytest.raises(aiomqtt.MqttError):
            async with asyncio.timeout(15), mqtt_client(port, username, password):
                pass
    async with asyncio.timeout(15), client(port, env, "monitor"):
        pass


async def received(subscriber: aiomqtt.Client, topic: str, until: bytes) -> list[tuple[str, bytes]]:
    """Messages on `topic` up to and including the payload `until` (bounded by the caller's timeout)."""
    got: list[tuple[str, bytes]] = []
    async for message in subscriber.messages:
        if str(message.topic) == topic:
            got.append((str(message.topic), bytes(message.payload)))  # type: ignore[arg-type]
            if got[-1][1] == until:
                return got
    raise AssertionError("the subscription ended")


@pytest.mark.parametrize("kind", list(PUBLISHER))
async def test_only_the_owner_of_a_control_kind_publishes_it_and_everyone_reads_it(
    kind: str, broker: tuple[int, dict[str, str]]
) -> None:
    port, env = broker
    topic, owner = f"tlt/{RUN}/{kind}", PUBLISHER[kind]
    async with asyncio.timeout(60):
        async with contextlib.AsyncExitStack() as stack:
            readers = [await stack.enter_async_context(client(port, env, role)) for role in ROLES]
            for reader in readers:
                await reader.subscribe(f"tlt/{RUN}/+", qos=1)
            for role in ROLES:  # each publish is acknowledged (or dropped) before the next goes out
                async with client(port, env, role) as publisher:
                    await publisher.publish(topic, f"from {role}".encode(), qos=1, retain=True)
            async with client(port, env, owner) as publisher:
                await publisher.publish(topic, b"end", qos=1)
            expected = [(topic, f"from {owner}".encode()), (topic, b"end")]
            for reader in readers:
                assert await received(reader, topic, b"end") == expected
        async with client(port, env, "monitor") as late:  # the retained state is the owner's
            await late.subscribe(topic, qos=1)
            message = await anext(aiter(late.messages))
            assert bytes(message.payload) == f"from {owner}".encode() and message.retain  # type: ignore[arg-type]


async def test_the_policy_topic_takes_the_learner_only_and_the_doctor_reads_the_broker(
    broker: tuple[int, dict[str, str]],
) -> None:
    from tlt_stream.commands.doctor_checks import inspect_mqtt

    port, env = broker
    async with client(port, env, "learner") as learner:
        await learner.publish(f"tlt/{RUN}/policy", b'{"kind":"policy"}', qos=1, retain=True)
    for role in ROLES:
        url = f"mqtt://{role}:{env[f'TLT_MQTT_PASSWORD_{role.upper()}']}@127.0.0.1:{port}"
        config = Config(run=RUN, bus=msgspec.convert({"redis_url": "redis://x", "mqtt_url": url}, BusConfig))
        report = await inspect_mqtt(config, timeout=10)
        assert report["reachable"] and "error" not in report, report
        assert report["server"].startswith("mosquitto"), f"{role} reads $SYS/broker/version"
        assert f"tlt/{RUN}/policy" in report["retained"], f"{role} reads the control topics"


def test_the_broker_healthcheck_logs_in_as_the_monitor(broker: tuple[int, dict[str, str]]) -> None:
    port, env = broker
    kind, script = services(env)["mosquitto"]["healthcheck"]["test"]
    assert kind == "CMD-SHELL" and "-u monitor" in script
    local = script.replace("mosquitto_sub ", f"mosquitto_sub -p {port} ")
    environ = {"PATH": os.environ["PATH"], **environment(services(env)["mosquitto"])}
    assert subprocess.run(["sh", "-c", local], env=environ, capture_output=True, timeout=30).returncode == 0
    wrong = {**environ, "TLT_MQTT_PASSWORD_MONITOR": "wrong"}
    assert subprocess.run(["sh", "-c", local], env=wrong, capture_output=True, timeout=30).returncode != 0
