"""The drafter-training lease: one idle worker at a time trains the drafter, and a stale one cannot publish.

A lease alone is not enough. A holder can stall (GC pause, swapped-out host, a long step) past its expiry,
another worker takes the lease and publishes a newer drafter, and then the stalled one wakes and writes
over it. So every grant also carries a *fencing token*: `INCR` on a counter that never goes back, issued
in the same Lua script that takes the lease. A fenced write (the record that names the newest drafter
checkpoint) is accepted only from the newest grant, and the highest fence that ever wrote is kept in the
record, so an older holder's write is refused by Redis itself, whatever the holder believes.

Keys (all under the run's `tlt:{run}:` prefix):
- `drafter_lease`: hash {owner, worker, fence} with a PX expiry; exists while someone holds the lease;
- `drafter_lease:fence`: the fencing counter (never expires, never decreases);
- `drafter_lease:record`: hash written only through `fenced_write`, with the writer's `fence` in it.

The owner token is random per grant, so renew and release compare-and-act on exactly one grant: a worker
that re-acquires after losing the lease holds a new token and a new fence.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass

import redis.asyncio as aioredis

from tlt_stream.basics.aio import sleep_or_stop
from tlt_stream.basics.common import as_text
from tlt_stream.bus.connect import REDIS_RETRYABLE
from tlt_stream.bus.streams import Keys

__all__ = ["DrafterLease", "FencedRecord", "LeaseGrant", "LeaseHolder"]

log = logging.getLogger(__name__)

LEASE = "drafter_lease"
FENCE = "drafter_lease:fence"
RECORD = "drafter_lease:record"

_ACQUIRE = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  return 0
end
local fence = redis.call('INCR', KEYS[2])
redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'worker', ARGV[2], 'fence', fence)
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return fence
"""

_RENEW = """
if redis.call('HGET', KEYS[1], 'owner') == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""

_RELEASE = """
if redis.call('HGET', KEYS[1], 'owner') == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

_HOLDER = """
local fields = redis.call('HMGET', KEYS[1], 'worker', 'fence')
if not fields[1] then return {} end
return {fields[1], fields[2], redis.call('PTTL', KEYS[1])}
"""

# A fence may write only while it is the newest one granted (so no newer holder exists) and not below the
# fence of the record it replaces. Returns 1 when it wrote (check only: ARGV has no fields), else 0.
_FENCED_WRITE = """
local fence = tonumber(ARGV[1])
local granted = tonumber(redis.call('GET', KEYS[1]) or '0')
local committed = tonumber(redis.call('HGET', KEYS[2], 'fence') or '0')
if fence ~= granted or fence < committed then
  return 0
end
if #ARGV > 1 then
  redis.call('DEL', KEYS[2])
  redis.call('HSET', KEYS[2], 'fence', fence, unpack(ARGV, 2))
end
return 1
"""


@dataclass(frozen=True)
class LeaseGrant:
    """One acquisition of the lease: what renew, release and fenced writes need."""

    owner: str
    """Random token identifying this grant (compared by renew and release)."""
    worker_id: str
    fence: int
    """Fencing token: strictly greater than every earlier grant's."""
    ttl_ms: int
    expires_at: float
    """Local `time.monotonic()` by which the lease has surely expired unless renewed (counted from when the
    request was sent, so it errs early)."""

    def remaining_s(self, now: float | None = None) -> float:
        return self.expires_at - (time.monotonic() if now is None else now)


@dataclass(frozen=True)
class LeaseHolder:
    """Who holds the lease now, as Redis sees it."""

    worker_id: str
    fence: int
    ttl_ms: int


@dataclass(frozen=True)
class FencedRecord:
    """The last record accepted by `fenced_write` and the fence that wrote it."""

    fence: int
    fields: dict[str, bytes]


class DrafterLease:
    """The lease and its fence for one run; every method is one round trip (one Lua script)."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, *, ttl_ms: int = 15_000, name: str = LEASE) -> None:
        """`name` picks the lease: `drafter_lease` by default; the learner's single-instance lease reuses the
        same machinery under its own name."""
        if ttl_ms < 10:
            raise ValueError(f"ttl_ms must be >= 10, got {ttl_ms}")
        self.redis = redis
        self.ttl_ms = ttl_ms
        self.name = name
        self.lease_key = keys.prefix + name
        self.fence_key = keys.prefix + (FENCE if name == LEASE else f"{name}:fence")
        self.record_key = keys.prefix + (RECORD if name == LEASE else f"{name}:record")
        self._acquire = redis.register_script(_ACQUIRE)
        self._renew = redis.register_script(_RENEW)
        self._release = redis.register_script(_RELEASE)
        self._holder = redis.register_script(_HOLDER)
        self._fenced_write = redis.register_script(_FENCED_WRITE)

    async def acquire(self, worker_id: str) -> LeaseGrant | None:
        """Take the lease if nobody holds it: a new grant with the next fencing token, else None."""
        owner = f"{worker_id}:{secrets.token_hex(12)}"
        sent = time.monotonic()
        fence = int(await self._acquire(keys=[self.lease_key, self.fence_key], args=[owner, worker_id, self.ttl_ms]))
        if not fence:
            return None
        log.info("%s took the %s (fence %d, ttl %d ms)", worker_id, self.name, fence, self.ttl_ms)
        return LeaseGrant(owner, worker_id, fence, self.ttl_ms, sent + self.ttl_ms / 1000)

    async def renew(self, grant: LeaseGrant) -> LeaseGrant | None:
        """Extend the lease by its ttl if `grant` still holds it: the grant with its new expiry, else None."""
        sent = time.monotonic()
        if not int(await self._renew(keys=[self.lease_key], args=[grant.owner, grant.ttl_ms])):
            log.warning("%s lost the %s (fence %d)", grant.worker_id, self.name, grant.fence)
            return None
        return LeaseGrant(grant.owner, grant.worker_id, grant.fence, grant.ttl_ms, sent + grant.ttl_ms / 1000)

    async def release(self, grant: LeaseGrant) -> bool:
        """Free the lease at once if `grant` still holds it; False when it had already expired or moved on."""
        released = bool(int(await self._release(keys=[self.lease_key], args=[grant.owner])))
        if released:
            log.info("%s released the %s (fence %d)", grant.worker_id, self.name, grant.fence)
        return released

    async def holder(self) -> LeaseHolder | None:
        reply = await self._holder(keys=[self.lease_key])
        if not reply:
            return None
        worker, fence, pttl = reply
        return LeaseHolder(as_text(worker), int(fence), int(pttl))

    async def check_fence(self, fence: int) -> bool:
        """Whether a write with `fence` would be accepted now (it is the newest grant's fence)."""
        return bool(int(await self._fenced_write(keys=[self.fence_key, self.record_key], args=[fence])))

    async def fenced_write(self, fence: int, fields: Mapping[str, str | bytes | int | float]) -> bool:
        """Replace the record with `fields` (plus `fence`) unless a newer grant exists: True when written.

        Refused writes change nothing. The check and the write are one script, so no grant can slip in
        between them.
        """
        if not fields:
            raise ValueError("fenced_write needs at least one field")
        if "fence" in fields:
            raise ValueError("'fence' is set by fenced_write itself")
        args: list[str | bytes | int | float] = [fence]
        for name, value in fields.items():
            args += [name, value]
        written = bool(int(await self._fenced_write(keys=[self.fence_key, self.record_key], args=args)))
        if not written:
            log.warning("refused a fenced write from fence %d: a newer lease grant exists", fence)
        return written

    async def record(self) -> FencedRecord | None:
        """The last record accepted by `fenced_write`, or None before the first one."""
        raw = await self.redis.hgetall(self.record_key)
        if not raw:
            return None
        fields = {as_text(k): v if isinstance(v, bytes) else v.encode() for k, v in raw.items()}
        return FencedRecord(int(fields.pop("fence")), fields)

    async def keep_alive(self, grant: LeaseGrant, stop: asyncio.Event, *, every_s: float | None = None) -> bool:
        """Renew `grant` every `every_s` (a third of the ttl by default) until `stop` is set (returns True)
        or the lease is lost (returns False). Connection errors are retried until the grant's local expiry
        has passed, which counts as lost. Run it as a named task beside the training slice and let a False
        return stop the slice."""
        every_s = grant.ttl_ms / 3000 if every_s is None else every_s
        current = grant
        while not await sleep_or_stop(stop, every_s):
            try:
                renewed = await self.renew(current)
            except REDIS_RETRYABLE as exc:
                if current.remaining_s() <= 0:
                    log.warning("%s (fence %d) expired while Redis was unreachable", self.name, grant.fence)
                    return False
                log.warning("renewing the %s failed (%s); retrying", self.name, exc)
                continue
            if renewed is None:
                return False
            current = renewed
        return True
