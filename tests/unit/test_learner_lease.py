"""The learner keeps its lease when two renewals of an expired grant run at once.

A partition longer than the lease ttl lets the lease expire inside Redis while the learner still holds its
grant. Two renewals can then be in flight together: `RunLease.keep`'s periodic one and the update's renewal
before a step. Both find the grant gone; unserialised, one re-acquired the lease (fence 2) and the other's
acquire was refused by that very re-acquisition, so it set `grant = None` and `keep` stopped the learner
as if another learner had taken over. Serialised by the lease's lock, the second renewal sees the
re-taken grant and renews it. Proven from Redis (who holds the lease, with which fence) and from the grant.

fakeredis, no timing: an Event holds both renewals inside the partition and releases them together.
"""

from __future__ import annotations

import asyncio

import fakeredis.aioredis

from tlt_stream.basics.config import Config
from tlt_stream.bus.lease import LeaseGrant
from tlt_stream.bus.streams import Keys
from tlt_stream.roles.learner_parts.lease import RunLease

ME = "learner@host:1"


async def test_concurrent_renewals_of_an_expired_lease_keep_it() -> None:
    redis = fakeredis.aioredis.FakeRedis()
    service = RunLease(Config(run="r"), redis, Keys("r"))
    lease = service.lease
    service.grant = await lease.acquire(ME)
    assert service.grant is not None and service.grant.fence == 1
    await redis.delete(lease.lease_key)  # the ttl ran out inside Redis during the partition

    healed = asyncio.Event()
    entered = asyncio.Event()
    real_renew = lease.renew

    async def renew_after_the_heal(grant: LeaseGrant) -> LeaseGrant | None:
        entered.set()
        await healed.wait()  # the request is stuck in the partition; answered once it heals
        return await real_renew(grant)

    lease.renew = renew_after_the_heal  # type: ignore[method-assign]
    keeper = asyncio.create_task(service.renew())  # `keep`'s periodic renewal
    update = asyncio.create_task(service.renew())  # the update's renewal before core.step
    await entered.wait()
    for _ in range(5):  # let the other renewal run up to where it waits (the partition, or the lock)
        await asyncio.sleep(0)
    healed.set()
    await asyncio.gather(keeper, update)

    holder = await lease.holder()
    assert holder is not None and holder.worker_id == ME, f"nobody else took it, yet Redis says {holder}"
    assert service.grant is not None, "the learner dropped the lease it had just taken again"
    assert service.grant.fence == holder.fence == 2, (service.grant, holder)
    assert await real_renew(service.grant) is not None, "the grant kept is the one Redis has"
    await redis.aclose()
