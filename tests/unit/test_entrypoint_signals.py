"""A service stopped while it is still starting (importing torch, loading a checkpoint) exits at once with
the conventional code 143 and no traceback, instead of dying by the signal with its `finally` blocks
skipped. (Stopping a running service, which drains and exits 0, is tested with the services themselves.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def catches_sigterm(pid: int) -> bool:
    """Whether process `pid` has a handler installed for SIGTERM (Linux: the SigCgt mask in /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signal.SIGTERM - 1) & 1)
    return False


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize(
    "module,args",
    [
        ("services.learner", ["--run-dir", "{tmp}/run", "--policy", "{tmp}/policy"]),
        ("services.rollout_worker", ["--worker-id", "w0"]),
    ],
)
def test_sigterm_during_startup_exits_143_without_traceback(module: str, args: list[str], tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TLT_REDIS_URL": "redis://127.0.0.1:1/0"}
    env["TLT_MQTT_URL"] = "mqtt://127.0.0.1:1"  # never reached: the signal comes first
    argv = [sys.executable, "-m", module, *(a.format(tmp=tmp_path) for a in args)]
    process = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    try:
        deadline = time.monotonic() + 30
        while not catches_sigterm(process.pid):  # main() has started: the start-up handler is in place
            assert process.poll() is None, process.communicate()
            assert time.monotonic() < deadline, "the service never installed a SIGTERM handler"
            time.sleep(0.002)
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=20)
    finally:
        process.kill()
    assert process.returncode == 143, err.decode()
    assert b"Traceback" not in err, err.decode()
