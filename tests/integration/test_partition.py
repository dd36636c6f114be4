"""A partition that drops packets instead of refusing connections: the peer accepts and then says nothing.
Without an explicit socket timeout a Redis command waits on such a peer forever; with it, the command fails
(and is retried like any outage) once the timeout passes."""

from __future__ import annotations

import asyncio
import socket

import pytest
import redis.asyncio as aioredis

from tlt_stream.bus.connect import connect_redis, redis_socket_timeout
from tlt_stream.roles.serve import _outage


def test_the_reply_timeout_outlasts_every_blocking_read() -> None:
    for block_ms in (1, 1000, 5000, 60_000):
        assert redis_socket_timeout(block_ms) > block_ms / 1000 + 1


async def test_a_silent_peer_times_out_instead_of_hanging() -> None:
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(8)  # the kernel completes the handshake; nobody ever reads or answers
    port = hole.getsockname()[1]
    client = connect_redis(f"redis://127.0.0.1:{port}/0", retries=0, block_ms=1)
    try:
        with pytest.raises((aioredis.TimeoutError, aioredis.ConnectionError)):
            async with asyncio.timeout(4 * redis_socket_timeout(1)):  # the test's own bound, far above
                await client.ping()
    finally:
        await client.aclose()
        hole.close()


def test_an_outage_is_found_inside_an_exception_group() -> None:
    error = aioredis.ConnectionError("Error 111 connecting")
    assert _outage(ExceptionGroup("tasks", [ValueError("x"), ExceptionGroup("inner", [error])])) is error
    assert _outage(ExceptionGroup("tasks", [ValueError("x")])) is None
