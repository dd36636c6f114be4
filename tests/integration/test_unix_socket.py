"""Redis over a Unix socket (`unix:///path/to/redis.sock`), as a user on one host configures it: the services'
client connects and the bus works (its TCP keepalive option used to be passed to the socket's connection,
which refuses it, so every command failed)."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from tlt_stream.basics.config import load_config, override
from tlt_stream.basics.messages import PromptGroup
from tlt_stream.bus.connect import connect_redis
from tlt_stream.bus.consumer import StreamReader
from tlt_stream.bus.producer import StreamProducer
from tlt_stream.bus.streams import Keys
from tlt_stream.commands.cli import main


@pytest.fixture
def unix_socket():
    if shutil.which("redis-server") is None:
        pytest.skip("no redis-server binary")
    folder = Path(tempfile.mkdtemp(prefix="tlt-sock-"))  # short: a socket path has ~100 characters at most
    sock = folder / "redis.sock"
    server = subprocess.Popen(
        ["redis-server", "--port", "0", "--unixsocket", str(sock), "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(100):
            if sock.exists():
                break
            server.poll()
            assert server.returncode is None, "redis-server exited"
            time.sleep(0.05)
        yield f"unix://{sock}"
    finally:
        server.terminate()
        server.wait(timeout=10)
        shutil.rmtree(folder, ignore_errors=True)


async def test_the_bus_runs_over_a_unix_socket(unix_socket: str) -> None:
    config = override(load_config(), {"bus.redis_url": unix_socket, "run": "unix-socket"})
    keys = Keys(config.run)
    redis = connect_redis(config.bus.redis_url)
    try:
        assert await redis.ping()
        task = PromptGroup(task_id="t0", prompt_id="p0", prompt_ids=[1, 2], answer="3", group_size=2)
        reader: StreamReader[PromptGroup] = StreamReader(redis, keys, config.bus, "prompts", "w0")
        await reader.ensure_group()
        await StreamProducer(redis, keys, config.bus).send("prompts", [task])
        async with asyncio.timeout(10):
            (delivery,) = await reader.read(block_ms=100)
        assert delivery.message == task and await reader.ack([delivery.entry_id]) == 1
    finally:
        await redis.aclose()


def test_the_monitor_reads_a_run_over_a_unix_socket(unix_socket: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["monitor", "--once", "--json", "--redis-url", unix_socket, "--run", "unix-socket"]) == 0
    assert '"reachable":true' in capsys.readouterr().out.replace(" ", "")
