"""What the in-process RL-loop tests share: control planes for the roles, driving services until the learner
is done, and reading `stats`."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import redis.asyncio as aioredis

from tlt_stream.basics.config import Config
from tlt_stream.basics.messages import codec_for
from tlt_stream.bus.connect import connect_redis
from tlt_stream.bus.control import ControlPlane
from tlt_stream.bus.streams import Keys


@contextlib.asynccontextmanager
async def planes(config: Config, roles: dict[str, list[str]]) -> AsyncIterator[dict[str, ControlPlane]]:
    """One connected `ControlPlane` per role (owning the listed kinds), stopped on the way out."""
    redis = connect_redis(config.bus.redis_url)
    made = {role: ControlPlane(config, redis, role=role, owns=owns) for role, owns in roles.items()}
    stop = asyncio.Event()
    tasks = [asyncio.create_task(p.run(stop)) for p in made.values()]
    try:
        async with asyncio.timeout(20):
            await asyncio.gather(*(p.connected.wait() for p in made.values()))
        yield made
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        await redis.aclose()


async def until_first_done(services: list[asyncio.Task[None]], seconds: float) -> None:
    """Wait for `services[0]` (the learner) to finish; a service that fails first fails with its own error."""
    async with asyncio.timeout(seconds):
        while not services[0].done():
            running = [task for task in services if not task.done()]
            done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()


async def prompt_tasks(redis: aioredis.Redis, keys: Keys) -> list:
    """The `PromptGroup` tasks `prompts` holds, in order."""
    codec = codec_for("prompts")
    return [codec.decode(fields[b"m"]) for _, fields in await redis.xrange(keys.stream("prompts"))]


async def stats_of(redis: aioredis.Redis, keys: Keys, kind: type) -> list:
    entries = [codec_for("stats").decode(f[b"m"]) for _, f in await redis.xrange(keys.stream("stats"))]
    return [e for e in entries if isinstance(e, kind)]


async def keep_for_audit(redis: aioredis.Redis, keys: Keys, stream: str = "samples") -> None:
    """Give `stream` an `audit` consumer group that never acks, so the learner's trimming (only entries every
    group acked) keeps every entry for the test to read at the end, as an auditor's own group would."""
    with contextlib.suppress(aioredis.ResponseError):  # BUSYGROUP: already there
        await redis.xgroup_create(keys.stream(stream), "audit", id="0", mkstream=True)


async def until_redis(condition: Callable[[], Awaitable[bool]], what: str, seconds: float = 60.0) -> None:
    """Wait (at most `seconds`) for a state read from Redis; the server has no event to wait on."""
    try:
        async with asyncio.timeout(seconds):
            while not await condition():  # noqa: ASYNC110 - Redis state, not an event
                await asyncio.sleep(0.05)
    except TimeoutError:
        raise AssertionError(f"gave up after {seconds}s waiting for {what}") from None
