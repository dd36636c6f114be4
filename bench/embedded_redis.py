"""What the embedded Redis-protocol server costs a run, each setting interleaved with the others in one run.

1. A worker's Redis transaction with Nagle's algorithm on (as socketserver leaves it) and off (as
   `EmbeddedServers.start_redis` sets it). The transaction is the shape a rollout worker sends for each
   completed group (an XADD of the samples, a registry HSET, an EXPIRE). fakeredis writes a transaction's
   replies one by one, so with Nagle on each reply after the first waits for the client's delayed ACK.
2. `--beside-decode`: the rollout engine's decode step (the world's policy, on all the cores, in a process of
   its own, as a run's worker) while this process hosts the server with a run's idle connections (7, one of
   them blocked in XREADGROUP as a learner waiting for groups): no server, fakeredis' own connection handler
   (it polls every 10 ms per connection), and the embedded server's (it sleeps until its socket or a reply
   wakes it).

    python bench/embedded_redis.py [--rounds 5] [--transactions 30]
    python bench/embedded_redis.py --beside-decode [--rounds 3] [--world artifacts/world]

Prints one JSON object: (1) median and p90 milliseconds per transaction for each setting, and their ratio;
(2) median milliseconds per decode step at 1 and 16 rows for each setting, the server's own CPU, and the
ratios to no server.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import redis.asyncio as aioredis

from tlt_stream.bus.embedded import EmbeddedServers


async def transactions(url: str, count: int) -> list[float]:
    client = aioredis.Redis.from_url(url)
    await client.ping()
    seconds = []
    for i in range(count):
        start = time.perf_counter()
        async with client.pipeline(transaction=True) as pipe:
            pipe.xadd("samples", {"payload": b"x" * 2000})
            pipe.hset("worker", "rows_in_flight", i)
            pipe.expire("worker", 100)
            await pipe.execute()
        seconds.append(time.perf_counter() - start)
    await client.aclose()
    return seconds


def server(nagle: bool) -> tuple[EmbeddedServers, str]:
    servers = EmbeddedServers()
    url = servers.start_redis()
    if nagle:  # socketserver's default, before the embedded server turned it off
        handler = servers._redis_server.RequestHandlerClass  # type: ignore[attr-defined]
        handler.disable_nagle_algorithm = False
    return servers, url


ROOT = Path(__file__).resolve().parents[1]
IDLE_CONNECTIONS = 7
"""A run's connections to the embedded server that wait most of the time (the services' clients)."""
DECODE = """
import json, statistics, sys, time, torch
sys.path.insert(0, {bench!r})
import plan_fit
from tlt_stream.model import load_model
torch.set_num_threads({threads})
policy = load_model({policy!r})
out = {{}}
for rows in (1, 16):
    out[rows] = statistics.median(plan_fit.engine_steps(policy, rows, skip=4, steps=40)[0] for _ in range(3))
print(json.dumps(out))
"""


def decode_ms(world: Path, threads: int) -> dict[str, float]:
    code = DECODE.format(bench=str(ROOT / "bench"), threads=threads, policy=str(world / "policy"))
    done = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=ROOT)
    return {rows: seconds * 1e3 for rows, seconds in json.loads(done.stdout.strip().splitlines()[-1]).items()}


def idle_server(handler: str) -> tuple[EmbeddedServers, list]:
    """The embedded server with a run's idle connections; `polling`: fakeredis' own handler (Nagle off)."""
    import redis
    from fakeredis._clients._tcp_server import TCPFakeRequestHandler

    servers = EmbeddedServers()
    url = servers.start_redis()
    if handler == "polling":
        server = servers._redis_server  # type: ignore[attr-defined]
        server.RequestHandlerClass = type("Polling", (TCPFakeRequestHandler,), {"disable_nagle_algorithm": True})
    clients = [redis.Redis.from_url(url) for _ in range(IDLE_CONNECTIONS)]
    for client in clients:
        client.ping()
    clients[0].xgroup_create("samples", "learner", id="0", mkstream=True)

    def wait_for_groups() -> None:
        with contextlib.suppress(redis.RedisError):  # the server's shutdown ends it
            clients[0].xreadgroup("learner", "l0", {"samples": ">"}, block=600_000)

    threading.Thread(target=wait_for_groups, daemon=True).start()
    return servers, clients


def beside_decode(args: argparse.Namespace) -> dict:
    settings = ("none", "polling", "quiet")
    ms: dict[str, dict[str, list[float]]] = {s: {"1": [], "16": []} for s in settings}
    server_cpu: dict[str, list[float]] = {s: [] for s in settings}
    for r in range(args.rounds):
        for setting in settings[r % 3 :] + settings[: r % 3]:  # each setting first in turn
            print(f"[embedded_redis] round {r + 1}/{args.rounds}: {setting}", file=sys.stderr, flush=True)
            servers, clients = idle_server(setting) if setting != "none" else (None, [])
            cpu, wall = time.process_time(), time.perf_counter()
            try:
                for rows, value in decode_ms(Path(args.world), args.threads).items():
                    ms[setting][rows].append(value)
            finally:
                server_cpu[setting].append((time.process_time() - cpu) / (time.perf_counter() - wall))
                if servers is not None:
                    servers.close()
                for client in clients:
                    client.close()
    out: dict = {"rounds": args.rounds, "threads": args.threads, "idle_connections": IDLE_CONNECTIONS}
    for setting in settings:
        out[setting] = {
            **{f"rows_{rows}_ms": round(statistics.median(v), 3) for rows, v in ms[setting].items()},
            "server_process_cores": round(statistics.median(server_cpu[setting]), 4),
        }
    for setting in ("polling", "quiet"):
        for rows in ("1", "16"):
            out[f"{setting}_over_none_rows_{rows}"] = round(
                statistics.median(ms[setting][rows]) / statistics.median(ms["none"][rows]), 3
            )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--transactions", type=int, default=30)
    parser.add_argument("--beside-decode", action="store_true", help="decode steps beside idle connections")
    parser.add_argument("--world", default=str(ROOT / "artifacts" / "world"))
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="the decode's torch threads")
    args = parser.parse_args()
    if args.beside_decode:
        print(json.dumps(beside_decode(args)))
        return
    ms: dict[str, list[float]] = {"nagle_on": [], "nagle_off": []}
    for _ in range(args.rounds):
        for name, nagle in (("nagle_on", True), ("nagle_off", False)):
            servers, url = server(nagle)
            try:
                ms[name] += [s * 1e3 for s in asyncio.run(transactions(url, args.transactions))]
            finally:
                servers.close()
    out = {
        name: {
            "median_ms": round(statistics.median(v), 3),
            "p90_ms": round(statistics.quantiles(v, n=10)[-1], 3),
            "n": len(v),
        }
        for name, v in ms.items()
    }
    out["on_over_off"] = round(out["nagle_on"]["median_ms"] / out["nagle_off"]["median_ms"], 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
