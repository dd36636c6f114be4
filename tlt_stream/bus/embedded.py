"""In-process Redis-protocol server and MQTT broker for a laptop run with nothing installed.

fakeredis' TCP server speaks RESP (streams, consumer groups, BLOCK, Lua) and amqtt is an MQTT 3.1.1 broker.
Each runs on its own background thread (the broker with its own event loop), bound to a free loopback
port, so any process can connect to them by URL exactly as it would to real servers. They keep nothing on
disk: an embedded run does not survive the process that hosts the servers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

__all__ = ["EmbeddedServers", "embedded_servers", "free_port"]

log = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class EmbeddedServers:
    """Handles to the running embedded servers; `close()` stops them."""

    redis_url: str | None = None
    mqtt_url: str | None = None
    _redis_server: object | None = None
    _threads: list[threading.Thread] = field(default_factory=list)
    _broker_loop: asyncio.AbstractEventLoop | None = None
    _broker: object | None = None

    def start_redis(self, host: str = "127.0.0.1") -> str:
        from fakeredis import TcpFakeServer

        server = TcpFakeServer((host, 0), server_type="redis")
        server.daemon_threads = True
        # socketserver leaves Nagle's algorithm on, and fakeredis writes a transaction's or pipeline's replies
        # one by one: each reply after the first then waited for the client's delayed ACK, ~40 ms a round trip
        # (every group a worker completes; `bench/embedded_redis.py` compares the two).
        server.RequestHandlerClass = type(
            "NoDelayHandler", (server.RequestHandlerClass,), {"disable_nagle_algorithm": True}
        )
        thread = threading.Thread(target=server.serve_forever, name="embedded-redis", daemon=True)
        thread.start()
        self._redis_server = server
        self._threads.append(thread)
        port = server.server_address[1]
        self.redis_url = f"redis://{host}:{port}/0"
        log.info("started embedded Redis-protocol server (fakeredis) on %s:%d", host, port)
        return self.redis_url

    def start_mqtt(self, host: str = "127.0.0.1", port: int | None = None, timeout: float = 15.0) -> str:
        port = port or free_port(host)
        ready = threading.Event()
        failure: list[BaseException] = []

        def serve() -> None:
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            self._broker_loop = loop
            try:
                self._broker = loop.run_until_complete(_start_broker(host, port))
            except BaseException as exc:  # reported to the caller below
                failure.append(exc)
                ready.set()
                loop.close()
                return
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self._broker.shutdown())  # type: ignore[attr-defined]
            loop.close()

        thread = threading.Thread(target=serve, name="embedded-mqtt", daemon=True)
        thread.start()
        if not ready.wait(timeout):
            raise RuntimeError(f"embedded MQTT broker did not start within {timeout:.0f}s")
        if failure:
            raise RuntimeError(f"embedded MQTT broker failed to start: {failure[0]}") from failure[0]
        self._threads.append(thread)
        self.mqtt_url = f"mqtt://{host}:{port}"
        log.info("started embedded MQTT broker (amqtt) on %s:%d", host, port)
        return self.mqtt_url

    def close(self) -> None:
        if self._redis_server is not None:
            self._redis_server.shutdown()  # type: ignore[attr-defined]
            self._redis_server.server_close()  # type: ignore[attr-defined]
            self._redis_server = None
        if self._broker_loop is not None and self._broker is not None:
            self._broker_loop.call_soon_threadsafe(self._broker_loop.stop)
            self._broker_loop = None
        for thread in self._threads:
            thread.join(timeout=5)
        self._threads.clear()


async def _start_broker(host: str, port: int) -> object:
    from tlt_stream.bus.amqtt_broker import GuardedBroker, quiet_ack_timeouts

    for name in ("amqtt", "transitions"):
        logging.getLogger(name).setLevel(logging.WARNING)
    quiet_ack_timeouts()
    config = {
        "listeners": {"default": {"type": "tcp", "bind": f"{host}:{port}"}},
        "plugins": {"amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True}},
    }
    broker = GuardedBroker(config)
    await broker.start()
    return broker


@contextlib.contextmanager
def embedded_servers(*, redis: bool = True, mqtt: bool = True) -> Iterator[EmbeddedServers]:
    """Start the requested embedded servers for the duration of the block."""
    servers = EmbeddedServers()
    try:
        if redis:
            servers.start_redis()
        if mqtt:
            servers.start_mqtt()
        yield servers
    finally:
        servers.close()
