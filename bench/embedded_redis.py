"""A worker's Redis transaction against the embedded Redis-protocol server, with Nagle's algorithm on (as
socketserver leaves it) and off (as `EmbeddedServers.start_redis` sets it), interleaved in one run.

The transaction is the shape a rollout worker sends for each completed group (an XADD of the samples, a
registry HSET, an EXPIRE). fakeredis writes a transaction's replies one by one, so with Nagle on each reply
after the first waits for the client's delayed ACK.

    python bench/embedded_redis.py [--rounds 5] [--transactions 30]

Prints one JSON object: median and p90 milliseconds per transaction for each setting, and their ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--transactions", type=int, default=30)
    args = parser.parse_args()
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
