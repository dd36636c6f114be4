"""In-process Redis-protocol server and MQTT broker for a laptop run with nothing installed.

fakeredis' TCP server speaks RESP (streams, consumer groups, BLOCK, Lua) and amqtt is an MQTT 3.1.1 broker.
Each runs on its own background thread (the broker with its own event loop), bound to a free loopback
port, so any process can connect to them by URL exactly as it would to real servers. They keep nothing on
disk: an embedded run does not survive the process that hosts the servers.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import select
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

__all__ = ["AddressInUse", "EmbeddedServers", "embedded_servers"]

log = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


BIND_TRIES = 3
"""Ports the embedded broker tries when it picks its own and finds each taken before it bound it."""


class AddressInUse(RuntimeError):
    """The embedded broker's port was taken by another process."""


def _address_in_use(exc: BaseException | None) -> bool:
    """Whether `exc`, or an error it was raised from (amqtt wraps the bind's OSError), is EADDRINUSE."""
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno == errno.EADDRINUSE:
            return True
        exc = exc.__cause__ or exc.__context__
    return False


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
        server.RequestHandlerClass = _quiet_handler(server.RequestHandlerClass)
        server.quiet_handlers = set()  # the live connections' handlers: close() wakes them
        thread = threading.Thread(target=server.serve_forever, name="embedded-redis", daemon=True)
        thread.start()
        self._redis_server = server
        self._threads.append(thread)
        port = server.server_address[1]
        self.redis_url = f"redis://{host}:{port}/0"
        log.info("started embedded Redis-protocol server (fakeredis) on %s:%d", host, port)
        return self.redis_url

    def start_mqtt(self, host: str = "127.0.0.1", port: int | None = None, timeout: float = 15.0) -> str:
        """Start the broker on `port`, or on a free one: a port found free can be taken by another process
        before the broker binds it, and then another is tried (`BIND_TRIES` in all), as the caller cannot."""
        if port:
            return self._start_mqtt_on(host, port, timeout)
        for _ in range(BIND_TRIES - 1):
            try:
                return self._start_mqtt_on(host, free_port(host), timeout)
            except AddressInUse:
                log.info("the free port found for the embedded MQTT broker was taken before it bound; trying another")
        return self._start_mqtt_on(host, free_port(host), timeout)

    def _start_mqtt_on(self, host: str, port: int, timeout: float) -> str:
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
            thread.join(timeout)
            error = AddressInUse if _address_in_use(failure[0]) else RuntimeError
            raise error(f"embedded MQTT broker failed to start on {host}:{port}: {failure[0]}") from failure[0]
        self._threads.append(thread)
        self.mqtt_url = f"mqtt://{host}:{port}"
        log.info("started embedded MQTT broker (amqtt) on %s:%d", host, port)
        return self.mqtt_url

    def close(self) -> None:
        if self._redis_server is not None:
            self._redis_server.shutdown()  # type: ignore[attr-defined]
            for handler in list(self._redis_server.quiet_handlers):  # type: ignore[attr-defined]
                handler.wake.ring()  # each sees the shutdown now, not after its idle wait
            self._redis_server.server_close()  # type: ignore[attr-defined]
            self._redis_server = None
        if self._broker_loop is not None and self._broker is not None:
            self._broker_loop.call_soon_threadsafe(self._broker_loop.stop)
            self._broker_loop = None
        for thread in self._threads:
            thread.join(timeout=5)
        self._threads.clear()


WAKE_CHECK_S = 1.0
"""How long an idle embedded-Redis connection sleeps before it looks at the server's shutdown flag again."""


def _quiet_handler(base: type) -> type:
    """fakeredis' TCP connection handler, woken by its socket or by a reply, never by a clock.

    fakeredis serves each connection on a thread that polls every 10 ms for replies other connections push to
    it (pub/sub messages, a producer's acks). With a run's ~7 idle connections that is ~800 wake-ups a second
    in the process hosting the servers, and on a small machine each one can preempt a thread of the rollout
    worker's OpenMP team while its partner waits at a barrier (what that costs a run is not established). Here
    a connection sleeps in `poll` on its socket and on a wake-up socket that every reply queued for it writes
    to, so it runs only when there is something to do.

    Also, socketserver leaves Nagle's algorithm on, and fakeredis writes a transaction's or pipeline's replies
    one by one: each reply after the first then waited for the client's delayed ACK, ~40 ms a round trip
    (every group a worker completes; `bench/embedded_redis.py` compares the two).
    """
    try:
        from fakeredis._typing import RaiseErrorTypes
    except ImportError:  # another fakeredis layout: the error replies redis-py raises
        import redis

        RaiseErrorTypes = (redis.ResponseError, redis.AuthenticationError)

    class QuietHandler(base):  # type: ignore[misc, valid-type]
        disable_nagle_algorithm = True

        def setup(self) -> None:
            super().setup()
            self.quiet = _quiet_fits(self)
            self.wake = _Wake()
            # poll, not select: select refuses a descriptor numbered past 1023, which a process that hosts the
            # servers may hold (the connection then broke at its first wait and its client retried on)
            self._poll = select.poll()
            self._poll.register(self.connection, select.POLLIN)
            self._poll.register(self.wake, select.POLLIN)
            self.thread_id = threading.get_native_id()
            self._hooked: object | None = None
            self.server.quiet_handlers.add(self)

        def _hook(self) -> None:
            """Make every reply queued on the connection's fake socket also write to the wake-up socket (checked
            on every turn: a reconnected client gets a new fake socket)."""
            sock = self.current_client.get_socket()
            if sock is self._hooked:
                return
            sock.put_response = _waking(sock.put_response, self.wake)
            self._hooked = sock

        def _wait(self) -> bool:
            """Sleep until the client sends or a reply is queued; whether the client's socket is readable."""
            ready = {fd for fd, _ in self._poll.poll(WAKE_CHECK_S * 1000)}  # readable, hung up or failed
            if self.wake.fileno() in ready:
                self.wake.drain()
            return self.connection.fileno() in ready

        def handle(self) -> None:
            if not self.quiet:  # fakeredis' own loop: it polls, but it serves
                super().handle()
                return
            while not self.server._shutdown_event.is_set():
                try:
                    self._hook()
                    if self.current_client.can_read():  # a reply: to this client's command, or pushed to it
                        try:
                            response = self.current_client.read_response()
                        except RaiseErrorTypes as e:  # an error reply, raised as redis-py raises it: send it
                            response = e
                        self.writer.dump(response)
                        continue
                    # A non-blocking read; it may find commands a previous read left in the buffer, so it is tried
                    # before sleeping. Empty means nothing yet, or, once the socket says readable, the peer left.
                    data = self.rfile.readline()
                    if data == b"":
                        if not self._wait():
                            continue
                        data = self.rfile.readline()
                        if data == b"":
                            break
                    self.current_client.get_socket().sendall(data)
                except ConnectionError:
                    break
                except Exception as e:  # reported to the client, as fakeredis' own handler does
                    self.writer.dump(e)
                    break

        def finish(self) -> None:
            try:
                super().finish()
            finally:
                self.server.quiet_handlers.discard(self)
                self.wake.close()

    return QuietHandler


QUIET_NEEDS = (
    ("server", "_shutdown_event", "is_set"),
    ("writer", "dump"),
    ("current_client", "can_read"),
    ("current_client", "read_response"),
    ("current_client", "get_socket"),
    ("rfile", "readline"),
)
"""What the quiet handler uses of a fakeredis connection handler (attribute paths from the handler), beside
the fake socket's `put_response` and `sendall`."""

_warned = threading.Event()


def _quiet_fits(handler: object) -> bool:
    """Whether `handler` (a fakeredis connection handler, set up) has every internal the quiet loop uses. They are
    not fakeredis' public API: where a release moved one, the connection is served by fakeredis' own loop (with
    its 10 ms polls) and one warning says so, rather than the embedded server failing every command."""
    missing = []
    for path in QUIET_NEEDS:
        obj = handler
        for name in path:
            obj = getattr(obj, name, None)
            if obj is None:
                break
        if obj is None or not callable(obj):
            missing.append(".".join(path))
    if not missing:
        sock = handler.current_client.get_socket()  # type: ignore[attr-defined]
        missing += [n for n in ("put_response", "sendall") if not callable(getattr(sock, n, None))]
    if missing and not _warned.is_set():
        _warned.set()
        log.warning(
            "this fakeredis (%s) lacks %s: the embedded Redis serves with its own polling loop",
            _fakeredis_version(),
            ", ".join(missing),
        )
    return not missing


def _fakeredis_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("fakeredis")
    except PackageNotFoundError:
        return "unknown version"


class _Wake:
    """A connection handler's wake-up: `ring` from any thread makes its poll on this object return. Rings
    and the close are serialized, so a ring never writes to a closed (and perhaps reused) descriptor."""

    def __init__(self) -> None:
        self._read, self._write = socket.socketpair()
        self._read.setblocking(False)
        self._write.setblocking(False)
        self._lock = threading.Lock()
        self._closed = False

    def fileno(self) -> int:
        return self._read.fileno()

    def ring(self) -> None:
        with self._lock:
            if not self._closed:
                with contextlib.suppress(BlockingIOError):  # a full buffer wakes the reader anyway
                    self._write.send(b"\0")

    def drain(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while self._read.recv(4096):
                pass

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._write.close()
            self._read.close()


def _waking(put: Callable[[object], None], wake: _Wake) -> Callable[[object], None]:
    def put_response(msg: object) -> None:
        put(msg)
        wake.ring()

    return put_response


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
