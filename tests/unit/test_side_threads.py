"""Torch work off a service's compute thread makes no second OpenMP team that outlives it (`model/threads.py`).

Each case runs in a fresh interpreter (a team, once made, lives as long as its thread) and reads the process's
threads from /proc: an OpenMP team of n threads adds n - 1 of them to the thread that leads it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    "OpenMP" not in torch.__config__.parallel_info() or not Path("/proc/self/task").is_dir(),
    reason="the team this guards against is OpenMP's, counted in /proc",
)

PRELUDE = """
import asyncio, json, os, sys, threading, time
from concurrent.futures import ThreadPoolExecutor
import torch
from tlt_stream.model.threads import in_own_thread, off_compute_thread, one_torch_thread

torch.set_num_threads(2)

def tasks():
    return len(os.listdir("/proc/self/task"))

def matmul():
    a = torch.randn(256, 256)
    (a @ a).sum()
    return torch.get_num_threads(), tasks()

matmul()  # the compute thread's own team exists
base = tasks()
"""


def run(body: str) -> dict:
    code = PRELUDE + textwrap.dedent(body)
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_an_executor_thread_that_ran_torch_keeps_a_second_team_unless_it_runs_on_one_torch_thread():
    out = run("""
        counts = {}
        for name, fn in (("plain", matmul), ("one", off_compute_thread(matmul))):
            pool = ThreadPoolExecutor(1)
            pool.submit(lambda: None).result()
            before = tasks()
            threads, _ = pool.submit(fn).result()
            counts[name] = {"threads": threads, "added": tasks() - before}
            pool.shutdown()
            deadline = time.monotonic() + 30  # its thread and team end (later on a busy machine)
            while tasks() != base and time.monotonic() < deadline:
                time.sleep(0.05)
        print(json.dumps({**counts, "main": torch.get_num_threads()}))
    """)
    # the detector works: a plain executor thread's torch op leaves its team's extra thread behind
    assert out["plain"] == {"threads": 2, "added": 1}
    # on one torch thread: no team, nothing added; the compute thread keeps its count
    assert out["one"] == {"threads": 1, "added": 0}
    assert out["main"] == 2


def test_in_own_thread_runs_at_the_callers_threads_and_its_team_ends_with_it():
    out = run("""
        one = ThreadPoolExecutor(1, initializer=one_torch_thread)  # a side thread set to 1 first
        one.submit(matmul).result()
        with_side = tasks()

        async def settled():
            deadline = time.monotonic() + 30  # the thread settles the await, then ends (later on a busy machine)
            while tasks() != with_side and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            return tasks() - with_side

        async def main():
            threads, count = await in_own_thread(matmul)
            after = await settled()
            try:
                await in_own_thread(lambda: 1 / 0)
            except ZeroDivisionError:
                raised = True
            else:
                raised = False
            after_raise = await settled()
            return {"threads": threads, "added": count - with_side, "after": [after, after_raise], "raised": raised}

        print(json.dumps({**asyncio.run(main()), "main": torch.get_num_threads()}))
    """)
    assert out["threads"] == 2, "the work runs at the compute thread's torch threads, not at a side thread's 1"
    assert out["added"] == 2, "while it ran: its thread and its team's other thread"
    assert out["after"] == [0, 0], "the thread and its team are gone once the work has returned (or raised)"
    assert out["raised"] and out["main"] == 2
