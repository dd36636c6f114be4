"""The drafter-training lease: one holder at a time, expiry hands it on with a higher fence, stale writes fail."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from tlt_stream.basics.config import Config
from tlt_stream.bus.lease import DrafterLease, LeaseGrant
from tlt_stream.bus.streams import Keys

pytestmark = [pytest.mark.redis]

SHORT_TTL_MS = 300


@contextlib.asynccontextmanager
async def contenders(config: Config, n: int, *, ttl_ms: int) -> AsyncIterator[list[DrafterLease]]:
    """`n` leases on `n` separate connections, as `n` worker processes would have."""
    clients = [aioredis.Redis.from_url(config.bus.redis_url) for _ in range(n)]
    try:
        yield [DrafterLease(c, Keys(config.run), ttl_ms=ttl_ms) for c in clients]
    finally:
        for c in clients:
            await c.aclose()


async def test_simultaneous_contenders_get_exactly_one_grant(bus_config: Config) -> None:
    async with contenders(bus_config, 8, ttl_ms=60_000) as leases:
        grants = await asyncio.gather(*(lease.acquire(f"w{i}") for i, lease in enumerate(leases)))
        won = [g for g in grants if g is not None]
        assert len(won) == 1
        holder = await leases[0].holder()
        assert holder is not None and holder.worker_id == won[0].worker_id and holder.fence == won[0].fence
        assert 0 < holder.ttl_ms <= 60_000


async def test_two_contenders_never_hold_it_at_once(bus_config: Config) -> None:
    inside: set[str] = set()
    overlaps: list[set[str]] = []
    fences: list[int] = []

    async def worker(lease: DrafterLease, name: str) -> int:
        held = 0
        for _ in range(40):
            grant = await lease.acquire(name)
            if grant is None:
                await asyncio.sleep(0.002)
                continue
            inside.add(name)
            if len(inside) > 1:
                overlaps.append(set(inside))
            fences.append(grant.fence)
            holder = await lease.holder()
            assert holder is not None and holder.worker_id == name
            await asyncio.sleep(0.005)
            inside.discard(name)
            assert await lease.release(grant)
            held += 1
            await asyncio.sleep(0)
        return held

    async with contenders(bus_config, 2, ttl_ms=60_000) as (a, b):
        held = await asyncio.gather(worker(a, "a"), worker(b, "b"))
    assert not overlaps
    assert sum(held) == len(fences) >= 10, "the lease changed hands many times"
    assert fences == sorted(fences) and len(set(fences)) == len(fences), "each grant has a new, higher fence"


async def test_expiry_lets_another_take_it_with_a_higher_fence(bus_config: Config) -> None:
    async with contenders(bus_config, 2, ttl_ms=SHORT_TTL_MS) as (a, b):
        first = await a.acquire("a")
        assert first is not None
        assert await b.acquire("b") is None, "held and not yet expired"
        await asyncio.sleep(SHORT_TTL_MS / 1000 * 1.5)
        assert await a.holder() is None, "expired"
        second = await b.acquire("b")
        assert second is not None and second.fence > first.fence
        holder = await a.holder()
        assert holder is not None and holder.worker_id == "b" and holder.fence == second.fence


async def test_a_stale_holder_cannot_renew_release_or_publish(bus_config: Config) -> None:
    async with contenders(bus_config, 2, ttl_ms=SHORT_TTL_MS) as (a, b):
        stale = await a.acquire("a")
        assert stale is not None
        assert await a.fenced_write(stale.fence, {"location": "/ckpt/a-1", "step": 10})
        await asyncio.sleep(SHORT_TTL_MS / 1000 * 1.5)  # "a" pauses past its expiry
        newer = await b.acquire("b")
        assert newer is not None and newer.fence > stale.fence

        assert await a.renew(stale) is None
        assert not await a.release(stale)
        holder = await b.holder()
        assert holder is not None and holder.worker_id == "b", "the stale release did not free b's lease"
        assert not await a.check_fence(stale.fence)
        assert not await a.fenced_write(stale.fence, {"location": "/ckpt/a-2", "step": 20})
        record = await a.record()
        assert record is not None and record.fence == stale.fence and record.fields["location"] == b"/ckpt/a-1"

        assert await b.check_fence(newer.fence)
        assert await b.fenced_write(newer.fence, {"location": "/ckpt/b-1"})
        assert not await a.fenced_write(stale.fence, {"location": "/ckpt/a-3", "step": 30})
        record = await b.record()
        assert record is not None and record.fence == newer.fence
        assert record.fields == {"location": b"/ckpt/b-1"}, "a fenced write replaces the whole record"

        renewed = await b.renew(newer)
        assert isinstance(renewed, LeaseGrant) and renewed.fence == newer.fence
        assert renewed.expires_at >= newer.expires_at


async def test_an_expired_holder_may_still_publish_while_no_newer_grant_exists(bus_config: Config) -> None:
    async with contenders(bus_config, 1, ttl_ms=SHORT_TTL_MS) as (a,):
        grant = await a.acquire("a")
        assert grant is not None
        await asyncio.sleep(SHORT_TTL_MS / 1000 * 1.5)
        assert await a.holder() is None
        # Fencing orders writers; with no newer grant nothing newer can exist, so the write is safe.
        assert await a.fenced_write(grant.fence, {"location": "/ckpt/a-1"})
        again = await a.acquire("a")
        assert again is not None and again.fence == grant.fence + 1
        assert not await a.fenced_write(grant.fence, {"location": "/ckpt/a-old"})


async def test_release_by_the_owner_frees_it_at_once(bus_config: Config) -> None:
    async with contenders(bus_config, 2, ttl_ms=60_000) as (a, b):
        grant = await a.acquire("a")
        assert grant is not None
        assert await b.acquire("b") is None
        assert await a.release(grant)
        taken = await b.acquire("b")
        assert taken is not None and taken.fence == grant.fence + 1
        assert not await a.release(grant), "a released grant cannot release the next holder's"
        holder = await b.holder()
        assert holder is not None and holder.worker_id == "b"


async def test_keep_alive_holds_past_the_ttl_and_notices_a_loss(bus_config: Config) -> None:
    async with contenders(bus_config, 2, ttl_ms=SHORT_TTL_MS) as (a, b):
        grant = await a.acquire("a")
        assert grant is not None
        stop = asyncio.Event()
        async with asyncio.TaskGroup() as tg:
            kept = tg.create_task(a.keep_alive(grant, stop), name="keep-alive")
            await asyncio.sleep(SHORT_TTL_MS / 1000 * 3)
            assert await b.acquire("b") is None, "renewed past three ttls"
            stop.set()
        assert kept.result() is True
        assert await a.release(grant)

        grant = await a.acquire("a")
        assert grant is not None
        async with asyncio.TaskGroup() as tg:
            kept = tg.create_task(a.keep_alive(grant, asyncio.Event()), name="keep-alive")
            await b.redis.delete(b.lease_key)  # the lease is lost (as after a Redis failover)
            assert await b.acquire("b") is not None
            async with asyncio.timeout(SHORT_TTL_MS / 1000 * 2):
                assert await kept is False
