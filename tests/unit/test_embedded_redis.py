"""The embedded Redis-protocol server's connections send small replies at once (TCP_NODELAY).

fakeredis writes a transaction's replies one by one; with Nagle's algorithm on (socketserver's default) every
reply after the first waited for the client's delayed ACK, ~40 ms per transaction. The evidence is the
kernel's own socket option on the server's side of each connection (the fd fakeredis records per client).
"""

from __future__ import annotations

import asyncio
import socket
import threading

import pytest
import redis.asyncio as aioredis

from tlt_stream.bus.embedded import EmbeddedServers


def test_the_embedded_redis_turns_nagle_off_on_every_connection() -> None:
    servers = EmbeddedServers()
    url = servers.start_redis()

    async def use() -> None:
        client = aioredis.Redis.from_url(url)
        other = aioredis.Redis.from_url(url)
        async with client.pipeline(transaction=True) as pipe:
            pipe.xadd("s", {"p": b"x"})
            pipe.hset("h", "a", 1)
            assert len(await pipe.execute()) == 2
        await other.ping()
        server = servers._redis_server
        fds = [conn._client_info["fd"] for conn in server.clients.values()]  # type: ignore[attr-defined]
        assert len(fds) == 2, "one server-side socket per client connection"
        for fd in fds:
            with socket.fromfd(fd, socket.AF_INET, socket.SOCK_STREAM) as sock:  # a dup of the server's socket
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
        await client.aclose()
        await other.aclose()

    try:
        asyncio.run(use())
    finally:
        servers.close()


def _handler_wakeups(server: object, connections: int) -> int:
    """Voluntary context switches, as the kernel counts them, of this server's connection threads (there must be
    one per connection; other servers in the process are not counted)."""
    from pathlib import Path

    handlers = list(server.quiet_handlers)  # type: ignore[attr-defined]
    assert len(handlers) == connections
    total = 0
    for handler in handlers:
        status = Path(f"/proc/self/task/{handler.thread_id}/status").read_text()
        total += int(status.split("\nvoluntary_ctxt_switches:")[1].split()[0])
    return total


def test_idle_embedded_redis_connections_sleep_instead_of_polling() -> None:
    """fakeredis' own handler wakes every 10 ms per connection (~100 times a second each); an idle connection
    here sleeps until its client sends or a reply is queued for it (one look at the shutdown flag a second)."""

    servers = EmbeddedServers()
    url = servers.start_redis()

    async def use() -> None:
        clients = [aioredis.Redis.from_url(url) for _ in range(4)]
        for client in clients:
            await client.ping()
        await asyncio.sleep(0.2)  # the handlers reach their wait
        before = _handler_wakeups(servers._redis_server, len(clients))
        await asyncio.sleep(2.0)  # nothing is sent
        woke = _handler_wakeups(servers._redis_server, len(clients)) - before
        # 4 connections over 2 s: polling would be ~800; sleeping, ~8 (WAKE_CHECK_S) plus stray signals
        assert woke < 60, f"idle connections woke {woke} times in 2 s"
        for client in clients:
            await client.aclose()

    try:
        asyncio.run(use())
    finally:
        servers.close()


def test_replies_pushed_by_other_connections_wake_the_connection(monkeypatch) -> None:
    """A reply queued on a connection by another one (a pub/sub message, as a producer's ack is) is delivered with
    the idle wait made an hour long: only the wake-up the reply writes can have delivered it. A blocking read that
    another connection's write completes is delivered too (it waits on its own handler's thread, as in fakeredis);
    and closing the server wakes the idle handlers at once rather than after the hour."""
    from tlt_stream.bus import embedded

    monkeypatch.setattr(embedded, "WAKE_CHECK_S", 3600.0)
    servers = EmbeddedServers()
    url = servers.start_redis()

    async def use() -> None:
        subscriber = aioredis.Redis.from_url(url)
        publisher = aioredis.Redis.from_url(url)
        reader = aioredis.Redis.from_url(url)
        pubsub = subscriber.pubsub()
        await pubsub.subscribe("acked")
        assert (await pubsub.get_message(timeout=10))["type"] == "subscribe"
        await asyncio.sleep(0.3)  # the subscriber's handler is asleep in its wait
        await publisher.publish("acked", b"7")
        message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=10)
        assert message is not None and message["data"] == b"7"

        await reader.xgroup_create("s", "g", id="0", mkstream=True)
        read = asyncio.create_task(reader.xreadgroup("g", "c", {"s": ">"}, count=1, block=20_000))
        await asyncio.sleep(0.3)  # blocked on the server
        entry = await publisher.xadd("s", {"k": b"v"})
        got = await asyncio.wait_for(read, timeout=10)
        assert got[0][1][0][0] == entry
        await pubsub.aclose()
        for client in (subscriber, publisher, reader):
            await client.aclose()

    try:
        asyncio.run(use())
    finally:
        servers.close()
    idle = EmbeddedServers()  # a server whose connection is idle when it closes
    url = idle.start_redis()

    async def connect() -> aioredis.Redis:
        client = aioredis.Redis.from_url(url)
        await client.ping()
        return client

    loop = asyncio.new_event_loop()
    client = loop.run_until_complete(connect())
    (handler,) = idle._redis_server.quiet_handlers  # type: ignore[attr-defined]
    threads = [t for t in threading.enumerate() if t.native_id == handler.thread_id]
    idle.close()
    threads[0].join(timeout=10)
    assert not threads[0].is_alive(), "the idle handler slept through the server's close"
    loop.run_until_complete(client.aclose())
    loop.close()


def test_a_connection_numbered_past_1023_is_served() -> None:
    """A process that hosts the servers may hold descriptors numbered past 1023, which `select` refuses: such a
    connection broke at its first wait, and a `connect_redis` client then retries as in an outage, for minutes.
    Its server-side socket is numbered past 1023 here, as the kernel says, and it is served: a command, a wait,
    and a reply another connection pushes to it."""
    import os
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"this process may open only {hard} descriptors")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200) if soft != resource.RLIM_INFINITY else soft, hard))
    filler = [os.open(os.devnull, os.O_RDONLY) for _ in range(max(0, 1100 - len(os.listdir("/proc/self/fd"))))]
    servers = EmbeddedServers()
    url = servers.start_redis()

    async def use() -> None:
        subscriber = aioredis.Redis.from_url(url, socket_timeout=10)
        publisher = aioredis.Redis.from_url(url, socket_timeout=10)
        pubsub = subscriber.pubsub()
        await pubsub.subscribe("acked")
        assert (await pubsub.get_message(timeout=10))["type"] == "subscribe"
        await publisher.ping()
        fds = [conn._client_info["fd"] for conn in servers._redis_server.clients.values()]  # type: ignore[attr-defined]
        assert min(fds) > 1023, fds
        await asyncio.sleep(0.3)  # the subscriber's handler waits
        await publisher.publish("acked", b"7")
        message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=10)
        assert message is not None and message["data"] == b"7"
        await pubsub.aclose()
        for client in (subscriber, publisher):
            await client.aclose()

    try:
        asyncio.run(use())
    finally:
        servers.close()
        for fd in filler:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_fakeredis_without_the_internals_the_quiet_loop_uses_still_serves(monkeypatch, caplog) -> None:
    """The quiet loop reaches into fakeredis' connection handler (not its public API). A release that moved one
    of those internals is stood in for by one more required attribute that no handler has: every connection is
    then served by fakeredis' own loop (each handler says so), with one warning naming what is missing, and the
    server still answers commands, a blocking read another connection completes, and a pushed pub/sub reply."""
    import logging

    from tlt_stream.bus import embedded

    monkeypatch.setattr(embedded, "QUIET_NEEDS", (*embedded.QUIET_NEEDS, ("writer", "no_such_internal")))
    monkeypatch.setattr(embedded, "_warned", threading.Event())
    servers = EmbeddedServers()
    url = servers.start_redis()

    async def use() -> None:
        subscriber = aioredis.Redis.from_url(url, socket_timeout=10)
        publisher = aioredis.Redis.from_url(url, socket_timeout=10)
        reader = aioredis.Redis.from_url(url, socket_timeout=30)
        pubsub = subscriber.pubsub()
        await pubsub.subscribe("acked")
        assert (await pubsub.get_message(timeout=10))["type"] == "subscribe"
        await publisher.publish("acked", b"7")
        message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=10)
        assert message is not None and message["data"] == b"7"
        await reader.xgroup_create("s", "g", id="0", mkstream=True)
        read = asyncio.create_task(reader.xreadgroup("g", "c", {"s": ">"}, count=1, block=20_000))
        await asyncio.sleep(0.3)
        entry = await publisher.xadd("s", {"k": b"v"})
        got = await asyncio.wait_for(read, timeout=10)
        assert got[0][1][0][0] == entry
        handlers = list(servers._redis_server.quiet_handlers)  # type: ignore[attr-defined]
        assert len(handlers) == 3 and not any(h.quiet for h in handlers)
        await pubsub.aclose()
        for client in (subscriber, publisher, reader):
            await client.aclose()

    with caplog.at_level(logging.WARNING, logger=embedded.__name__):
        try:
            asyncio.run(use())
        finally:
            servers.close()
    warnings = [r.getMessage() for r in caplog.records if "no_such_internal" in r.getMessage()]
    assert len(warnings) == 1, warnings


def test_the_installed_fakeredis_has_every_internal_the_quiet_loop_uses() -> None:
    """Against the fakeredis installed: every connection runs the quiet loop (a fakeredis that moved an internal
    fails here, in the tests, rather than only slowing a run)."""
    servers = EmbeddedServers()
    url = servers.start_redis()

    async def use() -> None:
        client = aioredis.Redis.from_url(url)
        await client.ping()
        handlers = list(servers._redis_server.quiet_handlers)  # type: ignore[attr-defined]
        assert handlers and all(h.quiet for h in handlers)
        await client.aclose()

    try:
        asyncio.run(use())
    finally:
        servers.close()
