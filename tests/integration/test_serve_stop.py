"""A stopped service exits even when a teardown step never completes, and its log says which.

A rollout worker in the TLS security test once printed its clean stop line and then did not exit within the
harness's 20 s grace (faulthandler's stacks on SIGABRT: the main thread still inside the event loop, running
`serve`'s teardown after the body had returned, nothing else at work). A close that never completes (a TLS
peer that never answers the closing handshake) is the likely kind. Whatever the step, `serve` now bounds each
one and logs every pending task's stack. Here the control plane's task ignores the stop event and never
ends: the service process must still exit 0 after its body returns, and its log must name the coroutine that
hung. The servers are the real ones (the `bus_config` fixture's); the process is a real `serve`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import msgspec

from tlt_stream.basics.config import Config

ROOT = Path(__file__).resolve().parents[2]

CHILD = """
import asyncio, logging, sys
import msgspec
from tlt_stream.bus.control import ControlPlane
from tlt_stream.basics.config import Config
from tlt_stream.roles.serve import serve

logging.basicConfig(level=logging.INFO)

async def a_plane_that_never_ends(self, stop):
    await asyncio.Event().wait()  # ignores `stop`: the teardown's first step never completes

ControlPlane.run = a_plane_that_never_ends

async def body(config, redis, control, stop):
    await redis.ping()
    print("body: done", file=sys.stderr)

config = msgspec.json.decode(sys.argv[1].encode(), type=Config)
sys.exit(serve(config, "teardown-test", [], body))
"""


def test_a_service_whose_control_plane_never_ends_still_exits_and_logs_what_hung(bus_config: Config) -> None:
    spec = msgspec.json.encode(bus_config).decode()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(  # a hang here would be the bug; the limit only keeps CI from waiting forever
        [sys.executable, "-c", CHILD, spec], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "body: done" in done.stderr
    assert "the control plane (MQTT) did not finish" in done.stderr, done.stderr[-3000:]
    assert "a_plane_that_never_ends" in done.stderr, "the log names the coroutine that hung"


CHILD_STUCK_SHUTDOWN = """
import asyncio, logging, sys, threading
import msgspec
from tlt_stream.basics.config import Config
from tlt_stream.roles.serve import serve

logging.basicConfig(level=logging.INFO)

async def stubborn():
    while True:  # swallows every cancellation: the loop's shutdown waits on it for ever
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            pass

async def body(config, redis, control, stop):
    await redis.ping()
    asyncio.get_running_loop().run_in_executor(None, threading.Event().wait)  # an executor job that never returns
    asyncio.ensure_future(stubborn())
    await asyncio.sleep(0)
    print("body: done", file=sys.stderr)

config = msgspec.json.decode(sys.argv[1].encode(), type=Config)
sys.exit(serve(config, "shutdown-test", [], body))
"""


def test_a_service_whose_loop_cannot_close_still_exits_and_logs_every_threads_stack(bus_config: Config) -> None:
    """After the teardown, the loop's own shutdown waits for every cancelled task and joins the default
    executor's threads: a task that swallows its cancellation, or an executor job that never returns, held a
    stopped service alive for good. Past `EXIT_GRACE_S` it exits 0 (its body ended well) and its log holds the
    stacks of what it waited on."""
    spec = msgspec.json.encode(bus_config).decode()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(  # a hang here would be the bug; the limit only keeps CI from waiting forever
        [sys.executable, "-c", CHILD_STUCK_SHUTDOWN, spec], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "body: done" in done.stderr
    assert "shutdown-test: still alive 5 s after its teardown; exiting with code 0" in done.stderr, done.stderr[-3000:]
    stacks = done.stderr.split("exiting with code 0", 1)[1]
    assert "Thread 0x" in stacks and " in wait" in stacks, "every thread's stack, the executor's stuck job's too"
