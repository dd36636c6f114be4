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
