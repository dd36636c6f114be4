"""The run's one learner: a fenced lease in Redis, taken at start and renewed while the learner lives.

The learner owns the policy version, so two learners on one run would publish versions over each other. A
learner starting finds the lease held: it waits for a holder killed a moment ago to let it expire, and is
refused (`RunTaken`) when the holder still renews it. An update blocks the event loop, so the renewed ttl
covers the longest update seen; a lease that expired during one longer than any before is taken again
unless another learner took it, and losing it stops the service. Renewals are serialised: two of them
finding the same expired grant must not refuse each other.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import socket
import time

import redis.asyncio as aioredis

from tlt_stream.basics.aio import sleep_or_stop
from tlt_stream.basics.config import Config
from tlt_stream.bus.lease import DrafterLease, LeaseGrant
from tlt_stream.bus.streams import Keys

__all__ = ["RunLease", "RunTaken"]

log = logging.getLogger("tlt_stream.roles.learner")


class RunTaken(ValueError):
    """Another learner, alive, already serves this run (there is exactly one learner per run)."""


class RunLease:
    """The learner's lease on its run: taken, renewed for as long as the longest update, released."""

    def __init__(self, config: Config, redis: aioredis.Redis, keys: Keys) -> None:
        self.run = config.run
        self.lease = DrafterLease(redis, keys, ttl_ms=int(config.bus.heartbeat_ttl_s * 1000), name="learner_lease")
        self.grant: LeaseGrant | None = None
        self.longest_update_s = 0.0
        """The longest update so far (the updates say): the renewed ttl covers it."""
        self._lock = asyncio.Lock()

    async def take(self) -> None:
        """One learner per run: a second one waits for the holder's lease to expire (a learner killed a
        moment ago) and is refused when it is still being renewed (a live learner)."""
        me = f"learner@{socket.gethostname()}:{os.getpid()}"
        deadline = time.monotonic() + 2 * self.lease.ttl_ms / 1000 + 1
        announced = False
        while (grant := await self.lease.acquire(me)) is None:
            holder = await self.lease.holder()
            if time.monotonic() > deadline:
                who = holder.worker_id if holder is not None else "another learner"
                raise RunTaken(
                    f"run {self.run!r} already has a learner ({who}, lease renewed); stop it first or use another --run"
                )
            if not announced and holder is not None:
                log.warning("%s holds the learner lease; waiting for it to expire", holder.worker_id)
                announced = True
            await asyncio.sleep(0.25)
        self.grant = grant

    async def keep(self, stop: asyncio.Event) -> None:
        """Renew the learner lease; its ttl covers the longest update seen (updates block the loop). Losing it
        (this process stalled past the ttl and another learner took over) stops the service."""
        assert self.grant is not None
        while not await sleep_or_stop(stop, self.lease.ttl_ms / 3000):
            await self.renew()
            if self.grant is None:
                log.error("lost the learner lease of run %r to another learner; stopping", self.run)
                stop.set()
                return

    async def renew(self) -> None:
        async with self._lock:
            await self._renew_locked()

    async def _renew_locked(self) -> None:
        if self.grant is None:
            return
        ttl_ms = int(self.lease.ttl_ms + 2000 * self.longest_update_s)
        try:
            renewed = await self.lease.renew(dataclasses.replace(self.grant, ttl_ms=ttl_ms))
            if renewed is None:  # expired during an update longer than any before: ours again unless taken
                renewed = await self.lease.acquire(self.grant.worker_id)
                if renewed is not None:
                    log.warning("the learner lease expired during a long update; taken again")
            self.grant = renewed
        except aioredis.RedisError as exc:  # Redis away: the loop's own calls retry; try again next time
            log.warning("renewing the learner lease failed (%s)", exc)

    async def release(self) -> None:
        """Let the next learner of the run take over at once (a Redis away: it waits for the ttl instead)."""
        if self.grant is not None:
            with contextlib.suppress(aioredis.RedisError):
                await self.lease.release(self.grant)
            self.grant = None
