"""Connections: Redis clients and MQTT parameters from URLs, and the embedded fallback when none is given."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import copy
import inspect
import logging
import ssl
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import msgspec
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import AbstractBackoff

from tlt_stream.basics.aio import sleep_or_stop
from tlt_stream.basics.config import Config, redact_text, redact_url
from tlt_stream.bus.embedded import EmbeddedServers

__all__ = [
    "REDIS_RETRYABLE",
    "MqttParams",
    "connect_redis",
    "connections_opened",
    "endpoints",
    "mqtt_params",
    "purge_run",
    "redis_socket_timeout",
]

log = logging.getLogger(__name__)

REDIS_RETRYABLE: tuple[type[Exception], ...] = (
    aioredis.ConnectionError,
    aioredis.TimeoutError,
    ConnectionError,
    OSError,
)
"""Errors that mean "the server is (momentarily) unreachable": worth a retry with backoff."""


class OutageBackoff(AbstractBackoff):
    """Capped exponential backoff with jitter that says what it is doing: a Redis restart or a network
    blip shows in every service's log as "unreachable, retrying", never as a busy loop or a silent hang.
    (One instance serves every command of a client at once, so it keeps no state: `failures` is the
    calling command's own count.)"""

    def __init__(self, url: str, *, base: float = 0.05, cap: float = 5.0) -> None:
        self.where = redact_url(url)
        self.base, self.cap = base, cap

    def compute(self, failures: int) -> float:
        from tlt_stream.basics.aio import Backoff

        delay = Backoff(base=self.base, cap=self.cap, attempt=failures - 1).next_delay()
        if failures == 2 or failures % 10 == 0:  # the first retry is routine (a dropped idle connection)
            error = _last_error.get()
            why = f" ({error})" if error is not None else ""
            log.warning("Redis %s unreachable (attempt %d); retrying in %.1fs%s", self.where, failures, delay, why)
        return delay


def _permanent(exc: BaseException) -> bool:
    """A connection error that waiting will not fix: wrong credentials, a refused or unverifiable
    certificate. Retrying those for minutes would only hide the one line the user needs."""
    if isinstance(exc, aioredis.AuthenticationError | aioredis.ResponseError):
        return True
    chain = [exc, exc.__cause__, exc.__context__]
    return any(isinstance(e, ssl.SSLCertVerificationError) for e in chain) or "CERTIFICATE_VERIFY_FAILED" in str(exc)


STOPPING_RETRIES = 2
"""Failures a connection of a stopping service gets past: enough to reconnect a dropped idle connection, far
from riding out an outage."""
STOPPING_DELAY_S = 0.1


class OutageRetry(Retry):
    """redis-py's retry loop, except for errors that are not outages (`_permanent`), which fail at once, and
    for a client whose service is stopping (`stop` set): a stopping service does not ride out an outage (its
    drain would wait minutes on a server that is gone). A backoff in progress ends when `stop` is set, and once a
    connection has failed `STOPPING_RETRIES` + 1 times with the stop set, its commands fail at once (at most a
    few more attempts, `STOPPING_DELAY_S` apart). A cancellation of the calling task is never lost in it: a
    command that returns, or fails as in an outage, after its task was cancelled raises CancelledError (at
    worst one command late, where the library dropped the cancellation and ran the command to its end)."""

    def __init__(self, backoff: AbstractBackoff, retries: int, stop: asyncio.Event | None = None) -> None:
        super().__init__(backoff, retries)
        self.stop = stop
        self.failed_stopping = 0
        """Failures since `stop` was set, over every command of this copy (one connection's): redis-py nests
        a connection's retries (a reconnect's handshake retries inside the command's), so a count per call
        would not bound them."""

    def __deepcopy__(self, memo: dict[int, Any]) -> OutageRetry:
        """redis-py deep-copies the retry into each connection: the copies share the one stop event."""
        if self.stop is not None:
            memo[id(self.stop)] = self.stop
        clone = type(self).__new__(type(self))
        memo[id(self)] = clone
        for key, value in self.__dict__.items():
            setattr(clone, key, copy.deepcopy(value, memo))
        return clone

    async def call_with_retry(self, do, fail, is_retryable=None, with_failure_count=False):  # type: ignore[override]
        self._backoff.reset()
        failures = 0
        task = asyncio.current_task()
        cancels = task.cancelling() if task is not None else 0
        while True:
            try:
                result = await do()
            except self._supported_errors as error:
                if task is not None and task.cancelling() > cancels:  # the error took a cancellation's place
                    raise asyncio.CancelledError from error
                _last_error.set(f"{type(error).__name__}: {redact_text(str(error))[:120]}")  # for the backoff's log
                own = getattr(self, "_is_retryable", None)  # a checker set on the Retry itself (newer redis-py)
                if own is not None and not own(error):
                    await _failed(fail, error, failures + 1, with_failure_count)  # connection-scoped cleanup
                    raise
                if _permanent(error) or (is_retryable is not None and not is_retryable(error)):
                    raise
                failures += 1
                await _failed(fail, error, failures, with_failure_count)
                stopping = self.stop is not None and self.stop.is_set()
                self.failed_stopping += stopping
                if 0 <= self._retries < failures or self.failed_stopping > STOPPING_RETRIES:
                    raise
                if stopping:  # a dropped idle connection, say: reconnect at once, a few times at most
                    await asyncio.sleep(STOPPING_DELAY_S)
                    continue
                delay = self._backoff.compute(failures)
                if self.stop is None:
                    await asyncio.sleep(delay)
                else:  # a stop in the middle ends the wait: the next failure is then one of the last few
                    await sleep_or_stop(self.stop, delay)
            else:
                if task is not None and task.cancelling() > cancels:
                    # Cancelled while the command ran, and it returned anyway: Python 3.11's asyncio.wait_for
                    # (redis-py's send) drops a cancellation that lands as the send completes, and the command
                    # then runs to its end (a blocking read: its whole block). The cancellation goes on here.
                    raise asyncio.CancelledError
                return result


async def _failed(fail: Any, error: Exception, failures: int, with_failure_count: bool) -> None:
    """redis-py's failure handler (it disconnects the connection, and may raise)."""
    result = fail(error, failures) if with_failure_count else fail(error)
    if inspect.isawaitable(result):
        await result


_last_error: contextvars.ContextVar[str | None] = contextvars.ContextVar("redis_last_error", default=None)
"""The error that made the calling command retry (each asyncio task has its own context)."""


REDIS_OUTAGE_RETRIES = 40
"""Retries of one command before its error reaches the service: with the 5 s cap, about three minutes of
outage (a Redis restart, a failover) are ridden out in place; a longer one stops the service, whose
supervisor (compose's restart policy) restarts it."""


def redis_socket_timeout(block_ms: int) -> float:
    """Seconds a Redis reply may take before the connection is presumed dead: longer than any blocking
    read this project makes (`bus.block_ms`), so only a silent peer (a partition that drops packets instead
    of refusing them) trips it, and then the command is retried like any outage instead of hanging."""
    return max(10.0, 2 * block_ms / 1000 + 5.0)


class _ConnectionsOpened:
    """Counts the connections a client opens: its first ones, and each reconnection after an outage."""

    def __init__(self) -> None:
        self.count = 0

    async def on_connect(self, connection: Any) -> None:
        await connection.on_connect()  # what redis-py does when no connect function is given
        self.count += 1


def connections_opened(redis: aioredis.Redis) -> int:
    """How many connections `redis` (from `connect_redis`) has opened so far; 0 for any other client. A count
    that grows after the first commands means a reconnection: perhaps to a restarted Redis, which may have
    replayed an append-only file that lost its last writes (the readers then look for lost acks at once)."""
    hook = redis.connection_pool.connection_kwargs.get("redis_connect_func")
    owner = getattr(hook, "__self__", None)
    return owner.count if isinstance(owner, _ConnectionsOpened) else 0


def connect_redis(
    url: str,
    *,
    cap_s: float = 5.0,
    name: str | None = None,
    retries: int = REDIS_OUTAGE_RETRIES,
    block_ms: int = 1000,
    stop: asyncio.Event | None = None,
) -> aioredis.Redis:
    """An asyncio Redis client (bytes replies) that rides out outages: a failed command is retried with
    capped backoff (logged) for about three minutes before its error reaches the caller; tools that must
    answer at once (`doctor`, `monitor --once`) pass a small `retries`.

    Connecting is lazy; the first command opens the connection. Credentials and TLS (`rediss://`) come
    from the URL. Timeouts are explicit whatever the installed redis-py's defaults: connecting 5 s, a reply
    `redis_socket_timeout(block_ms)`; with TLS the certificate and its hostname are always checked. Once
    `stop` (a service's stop event) is set, a failed command is no longer retried (`OutageRetry`).
    """
    scheme = urlsplit(url).scheme
    tls = {"ssl_cert_reqs": "required", "ssl_check_hostname": True} if scheme == "rediss" else {}
    tcp = {} if scheme == "unix" else {"socket_keepalive": True}  # a Unix socket's connection takes no keepalive
    return aioredis.Redis.from_url(
        url,
        decode_responses=False,
        health_check_interval=30,
        socket_connect_timeout=5,
        socket_timeout=redis_socket_timeout(block_ms),
        retry=OutageRetry(OutageBackoff(url, cap=cap_s), retries=retries, stop=stop),
        retry_on_error=[aioredis.ConnectionError, aioredis.TimeoutError],
        client_name=name,
        redis_connect_func=_ConnectionsOpened().on_connect,
        **tls,
        **tcp,
    )


@dataclass(frozen=True)
class MqttParams:
    """What aiomqtt.Client needs, parsed from an `mqtt://` or `mqtts://` URL."""

    host: str
    port: int
    username: str | None
    password: str | None
    tls: bool
    ca_file: str | None = None

    def tls_context(self) -> ssl.SSLContext | None:
        if not self.tls:
            return None
        return ssl.create_default_context(cafile=self.ca_file)

    def client(self, **options: Any) -> Any:
        """An aiomqtt client for this broker (MQTT 3.1.1, credentials and TLS from the URL); `options` go to
        `aiomqtt.Client` as they are (identifier, keepalive, timeout, ...)."""
        import aiomqtt

        return aiomqtt.Client(
            self.host,
            self.port,
            username=self.username,
            password=self.password,
            protocol=aiomqtt.ProtocolVersion.V311,
            tls_context=self.tls_context(),
            **options,
        )

    def __repr__(self) -> str:  # never print the password
        return f"MqttParams(host={self.host!r}, port={self.port}, username={self.username!r}, tls={self.tls})"


def mqtt_params(url: str) -> MqttParams:
    parts = urlsplit(url)
    if parts.scheme not in ("mqtt", "mqtts"):
        raise ValueError(f"not an MQTT URL: {redact_url(url)!r}")
    tls = parts.scheme == "mqtts"
    query = parse_qs(parts.query)
    return MqttParams(
        host=parts.hostname or "127.0.0.1",
        port=parts.port or (8883 if tls else 1883),
        username=unquote(parts.username) if parts.username else None,
        password=unquote(parts.password) if parts.password else None,
        tls=tls,
        ca_file=query.get("ca_file", [None])[0],
    )


@contextlib.contextmanager
def endpoints(config: Config) -> Iterator[Config]:
    """The configuration with Redis and MQTT URLs filled in, starting embedded servers for missing ones.

    Embedded servers live as long as the block; a real URL is always used as given.
    """
    need_redis = config.bus.redis_url is None
    need_mqtt = config.bus.mqtt_url is None
    if not (need_redis or need_mqtt):
        yield config
        return
    servers = EmbeddedServers()
    try:
        redis_url = servers.start_redis() if need_redis else config.bus.redis_url
        mqtt_url = servers.start_mqtt() if need_mqtt else config.bus.mqtt_url
        if need_redis or need_mqtt:
            log.info(
                "no %s configured: using embedded %s (set TLT_REDIS_URL / TLT_MQTT_URL for real servers)",
                " and ".join(n for n, need in (("Redis URL", need_redis), ("MQTT URL", need_mqtt)) if need),
                " and ".join(n for n, need in (("Redis", need_redis), ("MQTT", need_mqtt)) if need),
            )
        bus = msgspec.structs.replace(config.bus, redis_url=redis_url, mqtt_url=mqtt_url)
        yield msgspec.structs.replace(config, bus=bus)
    finally:
        servers.close()


async def purge_run(config: Config) -> int:
    """Delete everything run `config.run` left on the servers: its Redis keys (streams, mirror, registry,
    lease, dispatch cursor) and its retained MQTT control messages. Returns the number of keys deleted. Only
    the run's own keys: the scan's pattern escapes the glob characters a name may hold (`run_glob`).

    For benchmarks and tests on shared servers: a run's `hidden` stream alone holds ~100 MB at the default
    bound, and keys outlive the processes that wrote them. Never call it on a run that is still going.
    """
    from tlt_stream.basics.messages import CONTROL_KINDS
    from tlt_stream.bus.streams import run_glob

    if config.bus.redis_url is None or config.bus.mqtt_url is None:
        raise ValueError("purge_run needs the Redis and MQTT URLs of the run (embedded servers vanish with it)")
    pattern = run_glob(config.run)  # refuses a name whose keys or topics another run's could be
    redis = connect_redis(config.bus.redis_url, retries=3)
    deleted = 0
    try:
        batch: list[bytes] = []
        async for key in redis.scan_iter(match=pattern, count=1000):
            batch.append(key)
            if len(batch) >= 500:
                deleted += await redis.unlink(*batch)
                batch = []
        if batch:
            deleted += await redis.unlink(*batch)
    finally:
        await redis.aclose()
    async with mqtt_params(config.bus.mqtt_url).client() as client:
        for kind in CONTROL_KINDS:  # an empty retained message clears the retained state
            await client.publish(f"{config.topic_prefix}{kind}", b"", qos=1, retain=True)
    return deleted
