"""Connections: Redis clients and MQTT parameters from URLs, and the embedded fallback when none is given."""

from __future__ import annotations

import contextlib
import logging
import ssl
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import parse_qs, unquote, urlsplit

import msgspec
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff

from tlt_stream.bus.embedded import EmbeddedServers
from tlt_stream.config import Config, redact_url

__all__ = ["REDIS_RETRYABLE", "MqttParams", "connect_redis", "endpoints", "mqtt_params"]

log = logging.getLogger(__name__)

REDIS_RETRYABLE: tuple[type[Exception], ...] = (
    aioredis.ConnectionError,
    aioredis.TimeoutError,
    ConnectionError,
    OSError,
)
"""Errors that mean "the server is (momentarily) unreachable": worth a retry with backoff."""


def connect_redis(url: str, *, cap_s: float = 30.0, name: str | None = None) -> aioredis.Redis:
    """An asyncio Redis client (bytes replies) that retries dropped connections with capped backoff.

    Connecting is lazy; the first command opens the connection. Credentials and TLS (`rediss://`) come
    from the URL.
    """
    return aioredis.Redis.from_url(
        url,
        decode_responses=False,
        health_check_interval=30,
        socket_keepalive=True,
        socket_connect_timeout=5,
        retry=Retry(ExponentialBackoff(cap=min(cap_s, 10.0), base=0.05), retries=3),
        retry_on_error=[aioredis.ConnectionError, aioredis.TimeoutError],
        client_name=name,
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
