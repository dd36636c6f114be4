"""The control plane: policy, drafter and SD-config versions as retained MQTT messages, mirrored in Redis.

Topics are `tlt/{run}/policy`, `tlt/{run}/drafter` and `tlt/{run}/sd_config`, each holding one retained
QoS 1 JSON message with the latest version (MQTT 3.1.1, so any broker works). A subscriber that joins
late receives the current state at once. Versions only move forward: an older or repeated version is
ignored everywhere. Publishing goes through a compare-and-set on the Redis hash `tlt:{run}:versions`
first, so two publishers can never move a version backwards, and the monitor or a restarted service can
read the state without a broker. The connection is kept up with capped, jittered reconnect backoff; on
every (re)connect the mirror is read (catching up while the broker was away) and the kinds this process
owns are re-published (a broker that lost its retained store gets them back).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Iterable

import aiomqtt
import msgspec
import redis.asyncio as aioredis

from tlt_stream.aio import Backoff, sleep_or_stop
from tlt_stream.bus.connect import REDIS_RETRYABLE, mqtt_params
from tlt_stream.bus.streams import Keys
from tlt_stream.config import Config, redact_url
from tlt_stream.messages import CONTROL_CODEC, CONTROL_KINDS, ControlMessage

__all__ = ["ControlPlane", "read_mirror"]

log = logging.getLogger(__name__)

CONTROL_MAX_BYTES = 64 * 1024
"""A control message (a version: numbers, a path, a hash) is a few hundred bytes; anything larger on a
control topic is refused before it is decoded."""

_CAS_SCRIPT = """
local current = tonumber(redis.call('HGET', KEYS[1], ARGV[1] .. ':version') or '-1')
if tonumber(ARGV[2]) > current then
  redis.call('HSET', KEYS[1], ARGV[1] .. ':version', ARGV[2], ARGV[1], ARGV[3])
  return 1
end
return 0
"""


async def read_mirror(redis: aioredis.Redis, keys: Keys) -> dict[str, ControlMessage]:
    """The control state as mirrored in Redis (kinds never published are absent)."""
    raw = await redis.hgetall(keys.versions)
    found: dict[str, ControlMessage] = {}
    for kind in CONTROL_KINDS:
        payload = raw.get(kind.encode())
        if payload is None:
            continue
        try:
            found[kind] = CONTROL_CODEC.decode(payload)
        except msgspec.DecodeError as exc:
            log.error("the Redis mirror holds an undecodable %s message (%s); ignoring it", kind, exc)
    return found


class ControlPlane:
    """A process's view of the control plane, and its way to publish versions.

    `owns` names the kinds this process publishes (re-published after reconnects). Use `run(stop)` as a
    task; `current` holds the latest known message per kind; `updates()` yields each accepted newer one.
    """

    def __init__(
        self,
        config: Config,
        redis: aioredis.Redis,
        *,
        role: str,
        owns: Iterable[str] = (),
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
        self.ignored = 0
        self.connected = asyncio.Event()
        self._client: aiomqtt.Client | None = None
        self._subscribers: list[asyncio.Queue[ControlMessage]] = []

    def topic(self, kind: str) -> str:
        return f"{self.config.topic_prefix}{kind}"

    def version(self, kind: str) -> int:
        """The latest known version of `kind`, or -1."""
        message = self.current.get(kind)
        return message.version if message is not None else -1

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

    async def refresh_from_mirror(self) -> None:
        try:
            mirrored = await read_mirror(self.redis, self.keys)
        except REDIS_RETRYABLE as exc:
            log.warning("cannot read the version mirror from Redis (%s); keeping what we know", exc)
            return
        for message in mirrored.values():
            self.offer(message, "redis mirror")

    def _on_mqtt(self, message: aiomqtt.Message) -> None:
        if not message.payload:  # an empty retained message clears a topic; nothing to adopt
            return
        size = len(message.payload)  # type: ignore[arg-type]
        if size > CONTROL_MAX_BYTES:
            log.error(
                "control message of %d bytes on %s exceeds %d; ignoring it", size, message.topic, CONTROL_MAX_BYTES
            )
            return
        try:
            decoded = CONTROL_CODEC.decode(message.payload)  # type: ignore[arg-type]
        except (msgspec.DecodeError, TypeError) as exc:
            log.error("undecodable control message on %s: %s", message.topic, exc)
            return
        expected = self.topic(decoded.kind)
        if str(message.topic) != expected:
            log.error("control message of kind %s arrived on %s; ignoring it", decoded.kind, message.topic)
            return
        self.offer(decoded, "mqtt")

    # ------------------------------------------------------------------------------------------ publishing

    async def publish(self, message: ControlMessage) -> bool:
        """Announce a new version: compare-and-set in the Redis mirror, then a retained MQTT publish.

        Returns False (and publishes nothing) when the mirror already holds this or a newer version.
        """
        kind = message.kind
        payload = CONTROL_CODEC.encode(message)
        accepted = await self.redis.eval(_CAS_SCRIPT, 1, self.keys.versions, kind, message.version, payload)
        if not int(accepted):
            log.warning("not publishing %s version %d: the mirror holds a newer or equal one", kind, message.version)
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

    async def _republish_owned(self, client: aiomqtt.Client) -> None:
        for kind in sorted(self.owns):
            message = self.current.get(kind)
            if message is not None:
                await client.publish(self.topic(kind), CONTROL_CODEC.encode(message), qos=1, retain=True)

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
                receiver = asyncio.create_task(self._receive(client), name="mqtt-receive")
                stopper = asyncio.create_task(stop.wait(), name="mqtt-stop")
                try:
                    await asyncio.wait({receiver, stopper}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    receiver.cancel()
                    stopper.cancel()
                    outcome = await asyncio.gather(receiver, stopper, return_exceptions=True)
                if isinstance(outcome[0], aiomqtt.MqttError):
                    raise outcome[0]
            finally:
                self._client = None
                self.connected.clear()

    async def _receive(self, client: aiomqtt.Client) -> None:
        async for message in client.messages:
            self._on_mqtt(message)
