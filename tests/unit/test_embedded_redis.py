"""The embedded Redis-protocol server's connections send small replies at once (TCP_NODELAY).

fakeredis writes a transaction's replies one by one; with Nagle's algorithm on (socketserver's default) every
reply after the first waited for the client's delayed ACK, ~40 ms per transaction. The evidence is the
kernel's own socket option on the server's side of each connection (the fd fakeredis records per client).
"""

from __future__ import annotations

import asyncio
import socket

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
