"""The embedded MQTT broker picks its own port when the caller names none. A port found free and taken by another
process before the broker bound it (the window between the two) makes it try another, and the broker answers
on the one it reports; a port the caller named is refused at once when it is taken."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator

import aiomqtt
import pytest

from tests.ports import free_port
from tlt_stream.bus import embedded
from tlt_stream.bus.embedded import BIND_TRIES, AddressInUse, EmbeddedServers


@pytest.fixture
def taken() -> Iterator[list[int]]:
    """Ports this test makes busy: a listener on each, as another process's server would be."""
    listeners: list[socket.socket] = []
    ports: list[int] = []

    def take() -> int:
        s = socket.socket()
        s.bind(("127.0.0.1", free_port()))
        s.listen()
        listeners.append(s)
        ports.append(s.getsockname()[1])
        return ports[-1]

    for _ in range(BIND_TRIES):
        take()
    yield ports
    for s in listeners:
        s.close()


def picks(monkeypatch: pytest.MonkeyPatch, ports: list[int]) -> list[int]:
    """Make the broker's free-port search return `ports` in order; returns the list of those it asked for."""
    given: list[int] = []
    queue = iter(ports)

    def pick(host: str = "127.0.0.1") -> int:
        given.append(next(queue))
        return given[-1]

    monkeypatch.setattr(embedded, "free_port", pick)
    return given


async def answers(url: str) -> None:
    host, port = url.removeprefix("mqtt://").split(":")
    async with aiomqtt.Client(host, int(port), identifier="ports-test") as client:
        await client.publish("ports/test", b"1", qos=1)


def test_a_port_taken_before_the_broker_bound_it_is_replaced(monkeypatch: pytest.MonkeyPatch, taken) -> None:
    spare = free_port()
    given = picks(monkeypatch, [taken[0], spare])
    servers = EmbeddedServers()
    try:
        url = servers.start_mqtt()
        assert given == [taken[0], spare] and url == f"mqtt://127.0.0.1:{spare}"
        asyncio.run(answers(url))
    finally:
        servers.close()


def test_a_named_port_that_is_taken_is_refused_at_once(monkeypatch: pytest.MonkeyPatch, taken) -> None:
    given = picks(monkeypatch, [])
    with pytest.raises(AddressInUse, match=str(taken[0])):
        EmbeddedServers().start_mqtt(port=taken[0])
    assert given == []


def test_the_search_gives_up_after_its_tries_naming_the_last_port(monkeypatch: pytest.MonkeyPatch, taken) -> None:
    given = picks(monkeypatch, [*taken, free_port()])
    with pytest.raises(AddressInUse, match=str(taken[-1])):
        EmbeddedServers().start_mqtt()
    assert given == taken
