"""The control plane: policy, drafter and SD-config versions as retained MQTT messages, mirrored in Redis.

Topics are `tlt/{run}/policy`, `tlt/{run}/drafter` and `tlt/{run}/sd_config`, each holding one retained
QoS 1 JSON message with the latest version (MQTT 3.1.1, so any broker works). A subscriber that joins
late receives the current state at once. Versions only move forward: an older or repeated version is
ignored everywhere. Publishing goes through a compare-and-set on the Redis hash `tlt:{run}:versions`
first, so two publishers can never move a version backwards, and the monitor or a restarted service can
read the state without a broker.

The mirror is the authority; an MQTT message is only a notification. Anyone who can publish on the broker
could otherwise announce version 2**62 (and every genuine version after it would be "older") or point
workers at another checkpoint, so a notification makes the receiver read the mirror, and only the
mirror's message is ever adopted: a notification the mirror does not confirm changes nothing and is
counted as forged. When the mirror cannot be read, what we know stands until a later notification or the
recheck that follows the failed read. The connection is kept up with capped, jittered reconnect backoff;
on every (re)connect the mirror is read (catching up while the broker was away) and the kinds this
process owns are re-published as the mirror holds them (a broker that lost its retained store gets them
back). Every second an owner also checks that the mirror still holds what it published, and writes back a
version a Redis restarted from a short append-only file lost.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Iterable
from typing import Any

import aiomqtt
import msgspec
import redis.asyncio as aioredis

from tlt_stream.basics.aio import Backoff, retry, sleep_or_stop
from tlt_stream.basics.config import Config, redact_url
from tlt_stream.basics.messages import (
    CONTROL_CODEC,
    CONTROL_KINDS,
    ControlMessage,
    DrafterVersion,
    PolicyVersion,
    SdConfigVersion,
)
from tlt_stream.bus.connect import REDIS_RETRYABLE, mqtt_params
from tlt_stream.bus.producer import OOM_BACKOFF_CAP_S
from tlt_stream.bus.streams import Keys

__all__ = ["ControlPlane", "read_mirror"]

log = logging.getLogger(__name__)

CONTROL_MAX_BYTES = 64 * 1024
"""A control message (a version: numbers, a path, a hash) is a few hundred bytes; anything larger on a
control topic is refused before it is decoded."""

MIRROR_READ_TIMEOUT_S = 2.0
"""Bound on one read of the Redis mirror made by the control plane (services' Redis clients retry through
outages for minutes): a slow or absent Redis holds up the MQTT receive loop for at most this long."""

OWNED_CHECK_S = 1.0
"""How often a publisher checks that the mirror still holds the versions it published."""

FORGED_LOG_LIMIT = 1024
"""How many distinct (kind, version) forged notifications are remembered so each is logged only once."""

_MIRROR_ERRORS: tuple[type[Exception], ...] = (TimeoutError, aioredis.RedisError, *REDIS_RETRYABLE)

_CAS_SCRIPT = """
local current = tonumber(redis.call('HGET', KEYS[1], ARGV[1] .. ':version') or '-1')
if tonumber(ARGV[2]) > current then
  redis.call('HSET', KEYS[1], ARGV[1] .. ':version', ARGV[2], ARGV[1], ARGV[3])
  return 1
end
if tonumber(ARGV[2]) == current and redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[3] then
  return 1
end
return 0
"""
"""Move `kind` to a newer version. The very message already there counts as set: a call that redis-py
retried after a lost reply (its first attempt applied) must not turn a published version into a refused one."""


def _decode_mirrored(kind: str, payload: bytes) -> ControlMessage | None:
    try:
        message = CONTROL_CODEC.decode(payload)
    except (msgspec.DecodeError, TypeError) as exc:
        log.error("the Redis mirror holds an undecodable %s message (%s); ignoring it", kind, exc)
        return None
    if message.kind != kind:
        log.error("the Redis mirror holds a %s message in its %s field; ignoring it", message.kind, kind)
        return None
    return message


async def read_mirror(redis: aioredis.Redis, keys: Keys) -> dict[str, ControlMessage]:
    """The control state as mirrored in Redis (kinds never published, garbage, or a message filed under
    another kind's field are absent)."""
    raw = await redis.hgetall(keys.versions)
    found: dict[str, ControlMessage] = {}
    for kind in CONTROL_KINDS:
        payload = raw.get(kind.encode())
        if payload is not None and (message := _decode_mirrored(kind, payload)) is not None:
            found[kind] = message
    return found


class ControlPlane:
    """A process's view of the control plane, and its way to publish versions.

    `owns` names the kinds this process publishes (re-published after reconnects). Use `run(stop)` as a
    task; `current` holds the latest known message per kind; `updates()` yields each accepted newer one.
    `ignored` counts older or repeated versions (replays), `forged` the MQTT notifications the Redis
    mirror did not confirm; `counters()` gives both for registry info and the monitor.
    """

    def __init__(
        self,
        config: Config,
        redis: aioredis.Redis,
        *,
        role: str,
        owns: Iterable[str] = (),
        mirror_timeout_s: float = MIRROR_READ_TIMEOUT_S,
    ) -> None:
        if config.bus.mqtt_url is None:
            raise ValueError("ControlPlane needs an MQTT URL (resolve embedded servers first)")
        self.config = config
        self.redis = redis
        self.keys = Keys(config.run)
        self.owns = frozenset(owns)
        unknown = self.owns - set(CONTROL_KINDS)
        if unknown:
            raise ValueError(f"unknown control kinds {sorted(unknown)}; known: {', '.join(CONTROL_KINDS)}")
        self.params = mqtt_params(config.bus.mqtt_url)
        self.client_id = f"tlt-{config.run}-{role}-{uuid.uuid4().hex[:8]}"
        self.current: dict[str, ControlMessage] = {}
        self.mirror_timeout_s = mirror_timeout_s
        self.ignored = 0
        self.forged = 0
        self.connected = asyncio.Event()
        self._recheck = asyncio.Event()
        self._unconfirmed: dict[str, ControlMessage] = {}
        """Per kind, the newest announcement the mirror could not be read to judge: judged at the recheck."""
        self._reported: dict[tuple[str, int], None] = {}
        self._client: aiomqtt.Client | None = None
        self._subscribers: list[asyncio.Queue[ControlMessage]] = []

    def topic(self, kind: str) -> str:
        return f"{self.config.topic_prefix}{kind}"

    def version(self, kind: str) -> int:
        """The latest known version of `kind`, or -1."""
        message = self.current.get(kind)
        return message.version if message is not None else -1

    def counters(self) -> dict[str, int]:
        """Refused control messages: `ignored` (older or repeated versions), `forged` (unconfirmed)."""
        return {"ignored": self.ignored, "forged": self.forged}

    # ------------------------------------------------------------------------------------------ receiving

    def offer(self, message: ControlMessage, source: str) -> bool:
        """Adopt `message` if it is newer than what we know; returns whether it was adopted."""
        kind = message.kind
        if message.version <= self.version(kind):
            self.ignored += 1
            log.debug("ignored %s version %d from %s (have %d)", kind, message.version, source, self.version(kind))
            return False
        self.current[kind] = message
        log.info("%s version %d (from %s)", kind, message.version, source)
        for queue in self._subscribers:
            queue.put_nowait(message)
        return True

    async def updates(self) -> AsyncIterator[ControlMessage]:
        """Every adopted message from now on (start iterating before the updates you need happen)."""
        queue: asyncio.Queue[ControlMessage] = asyncio.Queue()
        self._subscribers.append(queue)
        try:
            while True:
                yield await queue.get()
        finally:
            self._subscribers.remove(queue)

    async def wait_for(self, kind: str, min_version: int = 0) -> ControlMessage:
        """The current message of `kind` once its version is at least `min_version` (bound it with
        `asyncio.timeout`)."""
        queue: asyncio.Queue[ControlMessage] = asyncio.Queue()
        self._subscribers.append(queue)
        try:
            while self.version(kind) < min_version:
                await queue.get()
        finally:
            self._subscribers.remove(queue)
        return self.current[kind]

    async def _read_mirror(self, purpose: str) -> dict[str, ControlMessage] | None:
        """The mirror, read within `mirror_timeout_s`; None (logged) when Redis cannot answer."""
        try:
            async with asyncio.timeout(self.mirror_timeout_s):
                return await read_mirror(self.redis, self.keys)
        except _MIRROR_ERRORS as exc:
            log.warning("cannot read the version mirror from Redis to %s (%r); keeping what we know", purpose, exc)
            return None

    async def refresh_from_mirror(self) -> bool:
        """Adopt whatever the mirror holds that is newer; False when the mirror could not be read."""
        mirrored = await self._read_mirror("catch up")
        if mirrored is None:
            return False
        for message in mirrored.values():
            self.offer(message, "redis mirror")
        return True

    def _parse(self, message: aiomqtt.Message) -> ControlMessage | None:
        """The control message an MQTT delivery announces; None for an empty (a cleared topic), oversized,
        undecodable or misfiled one. Parsing adopts nothing: see `_on_mqtt`."""
        if not message.payload:
            return None
        size = len(message.payload)  # type: ignore[arg-type]
        if size > CONTROL_MAX_BYTES:
            log.error(
                "control message of %d bytes on %s exceeds %d; ignoring it", size, message.topic, CONTROL_MAX_BYTES
            )
            return None
        try:
            decoded = CONTROL_CODEC.decode(message.payload)  # type: ignore[arg-type]
        except (msgspec.DecodeError, TypeError) as exc:
            log.error("undecodable control message on %s: %s", message.topic, exc)
            return None
        expected = self.topic(decoded.kind)
        if str(message.topic) != expected:
            log.error("control message of kind %s arrived on %s; ignoring it", decoded.kind, message.topic)
            return None
        return decoded

    async def _on_mqtt(self, message: aiomqtt.Message) -> None:
        """A notification: adopt the mirror's message for its kind, never the notification itself."""
        announced = self._parse(message)
        if announced is None:
            return
        kind = announced.kind
        held = self.current.get(kind)
        if held is not None and announced.version <= held.version:
            # What we hold came from the mirror or our own compare-and-set: no read needed to judge this.
            if announced.version == held.version and announced != held:
                self._refuse_forged(announced, held)
            else:
                self._ignore(announced, held)
            return
        mirrored = await self._read_mirror(f"confirm {kind} version {announced.version}")
        if mirrored is None:  # judged once the mirror answers (`_recheck_mirror`): adopted, ignored or refused
            pending = self._unconfirmed.get(kind)
            if pending is None or announced.version >= pending.version:
                self._unconfirmed[kind] = announced
            self._recheck.set()
            return
        self._judge(announced, mirrored.get(kind))

    def _judge(self, announced: ControlMessage, truth: ControlMessage | None) -> None:
        """An announcement against the mirror's message of its kind (`truth`): adopt the mirror's where it is
        newer than what is held; the announcement is then confirmed, older (a replay: ignored) or forged."""
        if truth is not None and truth.version > self.version(announced.kind):
            self.offer(truth, "mqtt, confirmed by the redis mirror" if truth == announced else "redis mirror")
        if truth == announced:
            return
        if truth is not None and announced.version < truth.version:
            self._ignore(announced, truth)
        else:
            self._refuse_forged(announced, truth)

    def _ignore(self, announced: ControlMessage, newer: ControlMessage) -> None:
        self.ignored += 1
        log.debug("ignored %s version %d from mqtt (have %d)", announced.kind, announced.version, newer.version)

    def _refuse_forged(self, announced: ControlMessage, truth: ControlMessage | None) -> None:
        self.forged += 1
        key = (announced.kind, announced.version)
        if key in self._reported:
            return
        if len(self._reported) >= FORGED_LOG_LIMIT:
            del self._reported[next(iter(self._reported))]
        self._reported[key] = None
        log.warning(
            "ignoring an unconfirmed (forged?) %s version %d from MQTT (%s): the Redis mirror holds %s",
            announced.kind,
            announced.version,
            _describe(announced),
            f"version {truth.version} ({_describe(truth)})" if truth is not None else "no such version",
        )

    # ------------------------------------------------------------------------------------------ publishing

    async def publish(self, message: ControlMessage) -> bool:
        """Announce a new version: compare-and-set in the Redis mirror, then a retained MQTT publish.

        Returns False (and publishes nothing) when the mirror already holds this or a newer version; then the
        mirror's version is adopted, so the caller's next version number follows it. (A publisher that stopped
        between its compare-and-set and its MQTT publish left a version that only the mirror knows: without
        this, every other publisher of the kind numbered from its MQTT-fed view and was refused again.)
        """
        kind = message.kind
        payload = CONTROL_CODEC.encode(message)
        if not await self._compare_and_set(message, payload):
            log.warning("not publishing %s version %d: the mirror holds a newer or equal one", kind, message.version)
            mirrored = await self._read_mirror(f"catch up with {kind} after a refused publish")
            truth = (mirrored or {}).get(kind)
            if truth is not None:
                self.offer(truth, "redis mirror, after a refused publish")
            return False
        self.offer(message, "self")
        client = self._client
        if client is not None:
            try:
                await client.publish(self.topic(kind), payload, qos=1, retain=True)
            except aiomqtt.MqttError as exc:
                log.warning("MQTT publish of %s v%d failed (%s); it goes out on reconnect", kind, message.version, exc)
        else:
            log.warning("MQTT is down: %s v%d is in the Redis mirror and goes out on reconnect", kind, message.version)
        return True

    async def _compare_and_set(self, message: ControlMessage, payload: bytes) -> bool:
        """The mirror's compare-and-set. A Redis at `maxmemory` refuses it (the script's HSET): waited out
        with capped backoff, as every durable write is, never raised (a publisher must not die of it)."""

        async def cas() -> Any:
            return await self.redis.eval(_CAS_SCRIPT, 1, self.keys.versions, message.kind, message.version, payload)

        accepted = await retry(
            cas,
            retry_on=(aioredis.OutOfMemoryError,),
            what=f"{message.kind} version {message.version} into the mirror (Redis out of memory)",
            max_attempts=None,
            cap=OOM_BACKOFF_CAP_S,
        )
        return bool(int(accepted))

    async def _republish_owned(self, client: aiomqtt.Client) -> None:
        """Re-announce each owned kind as the mirror holds it; an owned version the mirror lost (a Redis that
        restarted empty) goes back through the compare-and-set first, or receivers would refuse it."""
        if not self.owns:
            return
        mirrored = await self._read_mirror("re-publish owned versions")
        for kind in sorted(self.owns):
            truth = (mirrored or {}).get(kind)
            held = self.current.get(kind)
            message = held if truth is None or (held is not None and held.version > truth.version) else truth
            if message is None:
                continue
            payload = CONTROL_CODEC.encode(message)
            if mirrored is not None and message != truth and not await self._restore(message, payload):
                continue
            await client.publish(self.topic(kind), payload, qos=1, retain=True)

    async def guard_owned(self) -> None:
        """Write back every owned version the mirror no longer holds (a Redis restarted from an append-only
        file that lost its last second of writes): receivers adopt only what the mirror confirms, so a version
        missing there would stall them. Cheap (one HGETALL); called every `OWNED_CHECK_S`."""
        if not self.owns or not any(kind in self.current for kind in self.owns):
            return
        mirrored = await self._read_mirror("check the owned versions")
        if mirrored is None:
            return
        for kind in sorted(self.owns):
            held, truth = self.current.get(kind), mirrored.get(kind)
            if held is None or (truth is not None and truth.version >= held.version):
                continue
            log.warning(
                "the Redis mirror holds %s version %s, older than ours (%d): Redis lost its newest writes; "
                "writing ours back",
                kind,
                truth.version if truth is not None else "none",
                held.version,
            )
            payload = CONTROL_CODEC.encode(held)
            if await self._restore(held, payload) and self._client is not None:
                try:
                    await self._client.publish(self.topic(kind), payload, qos=1, retain=True)
                except aiomqtt.MqttError as exc:
                    log.warning("MQTT publish of %s v%d failed (%s); it goes out on reconnect", kind, held.version, exc)

    async def _guard_owned_loop(self, stop: asyncio.Event) -> None:
        while not await sleep_or_stop(stop, OWNED_CHECK_S):
            await self.guard_owned()

    async def _restore(self, message: ControlMessage, payload: bytes) -> bool:
        try:
            async with asyncio.timeout(self.mirror_timeout_s):
                restored = await self._compare_and_set(message, payload)
        except _MIRROR_ERRORS as exc:
            log.warning("cannot restore %s version %d in the mirror (%r)", message.kind, message.version, exc)
            return False
        if restored:
            log.warning("restored %s version %d in the Redis mirror, which had lost it", message.kind, message.version)
        return restored

    # ------------------------------------------------------------------------------------------ connection

    async def run(self, stop: asyncio.Event) -> None:
        """Keep a subscription up until `stop`, reconnecting with capped backoff."""
        backoff = Backoff(base=0.2, cap=self.config.bus.reconnect_max_s)
        while not stop.is_set():
            await self.refresh_from_mirror()
            try:
                await self._session(stop)
                backoff.reset()
            except aiomqtt.MqttError as exc:
                delay = backoff.next_delay()
                log.warning(
                    "MQTT %s unreachable or lost (%s); retrying in %.1fs",
                    redact_url(self.config.bus.mqtt_url),
                    exc,
                    delay,
                )
                if await self._follow_mirror(stop, delay):
                    break

    async def _follow_mirror(self, stop: asyncio.Event, seconds: float, *, every_s: float = 1.0) -> bool:
        """Wait `seconds` before the next reconnect while following the Redis mirror every `every_s`: with
        the broker down, versions published meanwhile still reach this process. True when `stop` was set."""
        deadline = asyncio.get_running_loop().time() + seconds
        while (remaining := deadline - asyncio.get_running_loop().time()) > 0:
            if await sleep_or_stop(stop, min(every_s, remaining)):
                return True
            await self.refresh_from_mirror()
            await self.guard_owned()
        return stop.is_set()

    async def _session(self, stop: asyncio.Event) -> None:
        p = self.params
        client = p.client(
            identifier=self.client_id, keepalive=self.config.bus.mqtt_keepalive_s, clean_session=True, timeout=10
        )
        async with client:
            await client.subscribe(f"{self.config.topic_prefix}+", qos=1)
            self._client = client
            self.connected.set()
            try:
                await self._republish_owned(client)
                tasks = [
                    asyncio.create_task(self._receive(client), name="mqtt-receive"),
                    asyncio.create_task(self._recheck_mirror(stop), name="mqtt-mirror-recheck"),
                    asyncio.create_task(self._guard_owned_loop(stop), name="mqtt-guard-owned"),
                    asyncio.create_task(stop.wait(), name="mqtt-stop"),
                ]
                try:
                    await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for task in tasks:
                        task.cancel()
                    outcomes = await asyncio.gather(*tasks, return_exceptions=True)
                for outcome in outcomes:
                    if isinstance(outcome, Exception):
                        raise outcome
            finally:
                self._client = None
                self.connected.clear()

    async def _receive(self, client: aiomqtt.Client) -> None:
        async for message in client.messages:
            await self._on_mqtt(message)

    async def _recheck_mirror(self, stop: asyncio.Event) -> None:
        """After a notification could not be confirmed (Redis unreadable), re-read the mirror with backoff
        until it answers: the version announced then is adopted without waiting for another notification, and
        each kind's newest unconfirmed announcement is judged against it (a forgery refused and logged, as when
        the mirror answered at once)."""
        backoff = Backoff(base=0.2, cap=self.config.bus.reconnect_max_s)
        while True:
            await self._recheck.wait()
            if await sleep_or_stop(stop, backoff.next_delay()):
                return
            self._recheck.clear()
            mirrored = await self._read_mirror("catch up")
            if mirrored is None:
                self._recheck.set()
                continue
            backoff.reset()
            for message in mirrored.values():
                self.offer(message, "redis mirror")
            pending, self._unconfirmed = self._unconfirmed, {}
            for announced in pending.values():
                held = self.current.get(announced.kind)
                if held is not None and announced.version < held.version:
                    self._ignore(announced, held)
                else:
                    self._judge(announced, mirrored.get(announced.kind))


def _describe(message: ControlMessage) -> str:
    match message:
        case PolicyVersion() | DrafterVersion():
            return f"{message.location}, sha256 {message.sha256}"
        case SdConfigVersion():
            return f"a table of {len(message.table)} arms"
