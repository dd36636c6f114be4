"""The learner keeps its lease when two renewals of an expired grant run at once.

A partition longer than the lease ttl lets the lease expire inside Redis while the learner still holds its
grant. Two renewals can then be in flight together: `_keep_lease`'s periodic one and `_update`'s renewal
before a step. Both find the grant gone; unserialised, one re-acquired the lease (fence 2) and the other's
acquire was refused by that very re-acquisition, so it set `grant = None` and `_keep_lease` stopped the
learner as if another learner had taken over. Serialised by `_lease_lock`, the second renewal sees the
re-taken grant and renews it. Proven from Redis (who holds the lease, with which fence) and from the grant.

fakeredis, no timing: an Event holds both renewals inside the partition and releases them together.
"""

from __future__ import annotations

import asyncio

import fakeredis.aioredis

from tlt_stream.bus.lease import DrafterLease, LeaseGrant
from tlt_stream.bus.streams import Keys
from tlt_stream.roles.learner import LearnerService

ME = "learner@host:1"


def bare_service(lease: DrafterLease) -> LearnerService:
    """A LearnerService with only what `_renew_lease` uses (as `__init__` sets it up)."""
    service = LearnerService.__new__(LearnerService)
    service.lease = lease
    service.grant = None
    service._longest_update_s = 0.0
    service._lease_lock = asyncio.Lock()
    return service


async def test_concurrent_renewals_of_an_expired_lease_keep_it() -> None:
    redis = fakeredis.aioredis.FakeRedis()
    lease = DrafterLease(redis, Keys("r"), ttl_ms=10_000, name="learner_lease")
    service = bare_service(lease)
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
    keeper = asyncio.create_task(service._renew_lease())  # _keep_lease's periodic renewal
    update = asyncio.create_task(service._renew_lease())  # _update's renewal before core.step
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
