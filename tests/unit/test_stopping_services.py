"""A service that is told to stop does not ride out an outage, and a service `tlt-stream run` started stops
when its launcher is gone.

The Redis side: a server that accepts every connection and closes it at once, so every command fails as in an
outage and every attempt is counted from outside the client. The launcher side: a real process that dies.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Self
from urllib.parse import urlsplit

import pytest
import redis.asyncio as aioredis

from tlt_stream.basics.config import Config
from tlt_stream.bus.connect import STOPPING_RETRIES, OutageBackoff, OutageRetry, connect_redis
from tlt_stream.roles.serve import LAUNCHER_PID_ENV, watch_launcher


class Listening:
    """A TCP server on a free local port that counts the connections it accepts (`handle` serves each)."""

    def __init__(self) -> None:
        self.accepts = 0
        self.server: asyncio.Server | None = None

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError

    async def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepts += 1
        await self.handle(reader, writer)

    async def __aenter__(self) -> Self:
        self.server = await asyncio.start_server(self._accepted, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()

    @property
    def port(self) -> int:
        assert self.server is not None
        return self.server.sockets[0].getsockname()[1]


class Refusing(Listening):
    """Closes every connection it accepts: each command attempt is one accept."""

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.close()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    async def until_accepts(self, n: int) -> None:
        async with asyncio.timeout(60):
            while self.accepts < n:  # noqa: ASYNC110 (a count kept by the server's callback)
                await asyncio.sleep(0.01)


async def test_a_stop_ends_the_backoff_in_progress_and_the_command_fails_with_the_outage_error() -> None:
    stop = asyncio.Event()
    async with Refusing() as server:
        # The first retry waits 300-600 s: only the stop can end it within the test's bound.
        retry = OutageRetry(OutageBackoff(server.url, base=600.0, cap=600.0), retries=1000, stop=stop)
        client = aioredis.Redis(
            host="127.0.0.1",
            port=server.port,
            retry=retry,
            retry_on_error=[aioredis.ConnectionError, aioredis.TimeoutError],
        )
        ping = asyncio.create_task(client.ping())
        await server.until_accepts(1)
        await asyncio.sleep(0.2)
        assert not ping.done(), "the outage is being ridden out"
        stop.set()
        async with asyncio.timeout(30):  # a bound against a hang, not a timing: unstopped, the wait is minutes
            with pytest.raises(aioredis.ConnectionError):
                await ping
        assert server.accepts - 1 <= STOPPING_RETRIES + 1, "a few attempts after the stop at most"
        await client.aclose()


async def test_every_connection_of_a_client_shares_its_stop_event() -> None:
    """redis-py deep-copies a client's retry into each connection; a copied event would never be set."""
    stop = asyncio.Event()
    async with Refusing() as server:
        client = connect_redis(server.url, retries=10_000, stop=stop)
        ping = asyncio.create_task(client.ping())
        await server.until_accepts(3)
        assert not ping.done()
        stop.set()
        async with asyncio.timeout(30):  # unstopped: 10,000 retries at up to 5 s each
            with pytest.raises(aioredis.ConnectionError):
                await ping
        attempts = server.accepts
        await asyncio.sleep(0.5)
        assert server.accepts == attempts
        await client.aclose()


async def test_without_a_stop_a_client_keeps_retrying_an_outage() -> None:
    async with Refusing() as server:
        client = connect_redis(server.url, retries=10_000, stop=asyncio.Event())
        ping = asyncio.create_task(client.ping())
        await server.until_accepts(4)
        assert not ping.done()
        ping.cancel()
        await asyncio.gather(ping, return_exceptions=True)
        await client.aclose()


class Proxy(Listening):
    """A TCP relay to a real Redis whose connections the test can cut, as a server's idle `timeout` or a
    load balancer does."""

    def __init__(self, url: str) -> None:
        super().__init__()
        parts = urlsplit(url)
        self.target = (parts.hostname or "127.0.0.1", parts.port or 6379)
        self.rest = url.split(f":{parts.port}", 1)[1] if parts.port else "/0"
        self.links: list[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = []

    async def __aexit__(self, *exc: object) -> None:
        self.cut()
        await super().__aexit__(*exc)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}{self.rest}"

    def cut(self) -> None:
        for a, b in self.links:
            a.transport.abort()
            b.transport.abort()
        self.links.clear()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self.target)
        self.links.append((writer, up_writer))

        async def pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            try:
                while data := await source.read(65536):
                    sink.write(data)
                    await sink.drain()
            except OSError:
                pass
            finally:
                sink.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))


async def test_a_stopping_client_still_reconnects_a_dropped_idle_connection(bus_config: Config) -> None:
    """A clean stop's drain must not fail on the routine: a pooled connection the server side closed."""
    assert bus_config.bus.redis_url is not None
    key = f"{bus_config.run}:stopping-probe"
    stop = asyncio.Event()
    async with Proxy(bus_config.bus.redis_url) as proxy:
        client = connect_redis(proxy.url, stop=stop)
        assert await client.ping()
        assert proxy.accepts == 1
        proxy.cut()
        stop.set()
        assert await client.set(key, b"written while stopping")
        assert proxy.accepts == 2, "the command reconnected"
        await client.aclose()
    direct = connect_redis(bus_config.bus.redis_url)
    try:
        assert await direct.get(key) == b"written while stopping"
    finally:
        await direct.delete(key)
        await direct.aclose()


async def test_a_service_stops_once_its_launcher_is_gone(monkeypatch: pytest.MonkeyPatch) -> None:
    launcher = await asyncio.create_subprocess_exec(sys.executable, "-c", "import time; time.sleep(600)")
    try:
        monkeypatch.setenv(LAUNCHER_PID_ENV, str(launcher.pid))
        stop = asyncio.Event()
        watch = asyncio.create_task(watch_launcher(stop, poll_s=0.02))
        await asyncio.sleep(0.3)
        assert not stop.is_set() and not watch.done(), "the launcher is alive: nothing to do"
        launcher.kill()
        await launcher.wait()  # reaped: its pid no longer names a process
        async with asyncio.timeout(30):
            await watch
        assert stop.is_set()
    finally:
        if launcher.returncode is None:
            launcher.kill()
            await launcher.wait()


async def test_a_service_no_launcher_started_watches_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(LAUNCHER_PID_ENV, raising=False)
    stop = asyncio.Event()
    async with asyncio.timeout(5):
        await watch_launcher(stop, poll_s=0.02)
    assert not stop.is_set()


async def test_a_cancellation_the_command_drops_still_cancels_its_caller() -> None:
    """Python 3.11's `asyncio.wait_for` (redis-py sends every command through it) returns its result, dropping
    the cancellation, when the cancel lands as the awaited send completes; the command then runs its read to
    the end, and on a blocking read the caller never learns it was cancelled (a worker cancelled in a
    one-minute XREADGROUP went on reading). The retry loop around every command gives the cancellation back."""
    loop = asyncio.get_running_loop()
    send = loop.create_future()
    read_started = asyncio.Event()

    async def command() -> str:
        await asyncio.wait_for(send, timeout=60)  # the send, as redis-py awaits it
        read_started.set()
        await asyncio.sleep(0.2)  # the read (a short block)
        return "the reply"

    retry = OutageRetry(OutageBackoff("redis://127.0.0.1:1/0"), retries=3)
    caller = asyncio.create_task(retry.call_with_retry(command, lambda error: None))
    await asyncio.sleep(0)  # the caller waits in the send
    send.set_result(None)
    caller.cancel()  # in the same turn: wait_for wakes to a done send and a cancelled wait
    await asyncio.wait([caller], timeout=30)
    assert caller.done() and caller.cancelled(), "the caller went on as if not cancelled"
    if sys.version_info < (3, 12):
        assert read_started.is_set(), "the library dropped the cancellation (the case this guards)"


async def test_an_outage_error_in_place_of_a_cancellation_is_not_retried() -> None:
    attempts = 0

    async def command() -> str:
        nonlocal attempts
        attempts += 1
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            if attempts == 1:  # a library closing up replaces it with an outage error
                raise aioredis.ConnectionError("closed while cancelled") from None
            raise
        return "the reply"

    retry = OutageRetry(OutageBackoff("redis://127.0.0.1:1/0"), retries=1000)
    caller = asyncio.create_task(retry.call_with_retry(command, lambda error: None))
    await asyncio.sleep(0.05)
    caller.cancel()
    await asyncio.wait([caller], timeout=30)
    try:
        assert caller.done() and caller.cancelled(), f"retried {attempts} times after the cancel"
        assert attempts == 1
    finally:
        caller.cancel()  # a caller that retried is in its second attempt: this one it does not lose
        await asyncio.wait([caller], timeout=30)
