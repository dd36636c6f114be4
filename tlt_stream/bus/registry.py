"""The worker registry: who is alive, in what state, since when.

Each worker keeps a hash `tlt:{run}:worker:{id}` (state, role, pid, host, versions, ...) that expires when
its heartbeats stop, plus an entry in the sorted set `tlt:{run}:workers` scored by its last heartbeat, so
the monitor can list workers without SCAN. A worker that dies simply stops refreshing: its hash expires
after `bus.heartbeat_ttl_s` and `list_workers` prunes it from the index. Every state change is also
written to the `stats` stream as a `WorkerState` entry: the state timeline.

A Redis that refuses writes for memory (`maxmemory`) does not stop the heartbeat: it is logged once, the
hash is kept from expiring (PEXPIRE, which Redis allows when full, so readers do not take a live worker's
entries for a dead one's) and the full beat is tried again each period until Redis has room.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import OutOfMemoryError

from tlt_stream.basics.aio import sleep_or_stop
from tlt_stream.basics.common import as_text
from tlt_stream.basics.config import BusConfig
from tlt_stream.basics.messages import WorkerState, WorkerStatus
from tlt_stream.bus.connect import REDIS_RETRYABLE
from tlt_stream.bus.producer import StreamProducer
from tlt_stream.bus.streams import Keys

__all__ = ["WorkerRegistry", "list_workers", "rollout_rows"]

log = logging.getLogger(__name__)


class WorkerRegistry:
    """One worker's presence: its state, refreshed by `heartbeat(stop)` running as a task."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        bus: BusConfig,
        producer: StreamProducer,
        worker_id: str,
        *,
        role: str,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.bus = bus
        self.producer = producer
        self.worker_id = worker_id
        self.role = role
        self.state: WorkerStatus | None = None
        self.since = time.time()
        self.info: dict[str, str] = {"pid": str(os.getpid()), "host": socket.gethostname(), "role": role}

    def update_info(self, **fields: Any) -> None:
        """Extra fields shown by the monitor (versions, batch size, ...); written with the next heartbeat."""
        self.info.update({k: str(v) for k, v in fields.items()})

    async def publish(self, **fields: Any) -> None:
        """Extra fields written now, not with the next heartbeat (what a reader acts on, such as the rows in
        flight the learner reads); a write that fails is left to the next heartbeat."""
        self.update_info(**fields)
        key = self.keys.worker(self.worker_id)
        try:
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.hset(key, mapping={k: self.info[k] for k in fields})
                pipe.pexpire(key, int(self.bus.heartbeat_ttl_s * 1000))
                await pipe.execute()
        except (*REDIS_RETRYABLE, OutOfMemoryError) as exc:
            log.debug("%s: could not write %s now (%s); the next heartbeat will", self.worker_id, sorted(fields), exc)

    async def set_state(self, state: WorkerStatus, reason: str = "") -> None:
        """Change state: written to the registry at once and to the `stats` timeline."""
        if state == self.state:
            return
        previous, self.state, self.since = self.state, state, time.time()
        log.info("%s: %s -> %s%s", self.worker_id, previous, state, f" ({reason})" if reason else "")
        try:
            await self.producer.send_one(
                "stats", WorkerState(worker_id=self.worker_id, state=state, previous=previous, reason=reason)
            )
            await self.beat()
        except (*REDIS_RETRYABLE, OutOfMemoryError) as exc:
            log.warning("%s: could not record state %s (%s); the next heartbeat will", self.worker_id, state, exc)

    async def beat(self) -> None:
        now = time.time()
        key = self.keys.worker(self.worker_id)
        state = self.state or WorkerStatus.LOADING
        mapping = {**self.info, "state": str(state), "since": f"{self.since:.3f}", "heartbeat": f"{now:.3f}"}
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(key, mapping=mapping)
            pipe.pexpire(key, int(self.bus.heartbeat_ttl_s * 1000))
            pipe.zadd(self.keys.workers, {self.worker_id: now})
            await pipe.execute()

    async def _keep_alive(self) -> None:
        """Extend the hash's TTL only: what a full Redis still accepts."""
        try:
            await self.redis.pexpire(self.keys.worker(self.worker_id), int(self.bus.heartbeat_ttl_s * 1000))
        except REDIS_RETRYABLE as exc:
            log.warning("%s: heartbeat failed (%s); retrying", self.worker_id, exc)

    async def heartbeat(self, stop: asyncio.Event) -> None:
        """Refresh the registry every `bus.heartbeat_s` until `stop`; then record STOPPED."""
        refused = False
        while True:
            try:
                await self.beat()
                if refused:
                    log.info("%s: heartbeat written again (Redis has memory)", self.worker_id)
                refused = False
            except OutOfMemoryError as exc:
                if not refused:
                    log.warning(
                        "%s: Redis refuses the heartbeat for memory (%s); keeping the entry alive, retrying each beat",
                        self.worker_id,
                        exc,
                    )
                refused = True
                await self._keep_alive()
            except REDIS_RETRYABLE as exc:
                log.warning("%s: heartbeat failed (%s); retrying", self.worker_id, exc)
            if await sleep_or_stop(stop, self.bus.heartbeat_s):
                break
        await self.set_state(WorkerStatus.STOPPED, "shutdown")


async def list_workers(redis: aioredis.Redis, keys: Keys, bus: BusConfig) -> list[dict[str, str]]:
    """Live workers (heartbeat within the TTL), each as its registry hash plus `worker_id`."""
    cutoff = time.time() - bus.heartbeat_ttl_s
    await redis.zremrangebyscore(keys.workers, "-inf", cutoff)
    ids = [as_text(i) for i in await redis.zrange(keys.workers, 0, -1)]
    if not ids:
        return []
    async with redis.pipeline(transaction=False) as pipe:
        for worker_id in ids:
            pipe.hgetall(keys.worker(worker_id))
        hashes = await pipe.execute()
    workers = []
    for worker_id, raw in zip(ids, hashes, strict=True):
        if not raw:  # expired between the two reads
            continue
        entry = {as_text(k): as_text(v) for k, v in raw.items()}
        entry["worker_id"] = worker_id
        workers.append(entry)
    return workers


async def rollout_rows(redis: aioredis.Redis, keys: Keys, bus: BusConfig) -> int | None:
    """The rows the run's live rollout workers have in flight: the sum of the `rows_in_flight` their registry
    records report (`Generation.report_rows`; a stopped worker's count as 0), or None when no live worker
    reports one. Reads only: one ZRANGEBYSCORE and one pipelined HMGET per worker."""
    cutoff = time.time() - bus.heartbeat_ttl_s
    ids = [as_text(i) for i in await redis.zrangebyscore(keys.workers, cutoff, "+inf")]
    if not ids:
        return None
    async with redis.pipeline(transaction=False) as pipe:
        for worker_id in ids:
            pipe.hmget(keys.worker(worker_id), ["role", "state", "rows_in_flight"])
        records = await pipe.execute()
    reported = [
        0 if as_text(state) == str(WorkerStatus.STOPPED) else int(as_text(rows))
        for role, state, rows in records
        if rows is not None and as_text(role) == "rollout"
    ]
    return sum(reported) if reported else None
