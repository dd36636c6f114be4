"""amqtt's broker, guarded against two faults of its release 0.12.

- Iteration across an await. The broker walks its topic-filter dict (`_subscriptions`) in loops that await:
  when a client connects (`_handle_client_session`), when it disconnects and when it broadcasts. Another
  client's subscribe or unsubscribe changes the dict meanwhile, the loop raises "dictionary changed size
  during iteration", and the connecting client's session dies with its subscribe unanswered. Several services
  connecting at once (the demo, the tests) hit it.
- Retained messages at connect. That connect loop sends a new session the retained message of every topic
  filter any client holds, so a client receives versions it never subscribed to.

A subclass, not another broker: the embedded broker must stay pure Python and in-process (no server to
install for `make demo`), amqtt is the maintained one, and both faults sit in two small, stable places that a
subclass reaches without copying the broker's code: the dict's type and the retained-message hook.
"""

from __future__ import annotations

import logging
from typing import Any

from amqtt.broker import Broker


class Snapshots(dict):  # type: ignore[type-arg]
    """A dict whose loops walk a copy: a coroutine that awaits inside `for key in d` or `d.items()` sees the
    filters as they were when the loop began, and a change meanwhile no longer breaks it."""

    def __iter__(self) -> Any:
        return iter(list(super().keys()))

    def keys(self) -> Any:  # type: ignore[override]
        return list(super().keys())

    def values(self) -> Any:  # type: ignore[override]
        return list(super().values())

    def items(self) -> Any:  # type: ignore[override]
        return list(super().items())


class GuardedBroker(Broker):
    """amqtt's `Broker` with snapshot loops over its topic filters, and retained messages sent only for the
    filters the session itself holds (on subscribe, and for a resumed session's own filters on connect)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._subscriptions = Snapshots()

    async def _publish_retained_messages_for_subscription(self, subscription: tuple[str, int], session: Any) -> None:
        topic_filter = subscription[0]
        holders = self._subscriptions.get(topic_filter, ())
        if not any(held.client_id == session.client_id for held, _qos in holders):
            return  # another client's filter, walked by the connect loop: not this session's to receive
        await super()._publish_retained_messages_for_subscription(subscription, session)


class QuietAckTimeouts(logging.Filter):
    """Drops amqtt's reports of a QoS 1 PUBACK that came after its fixed 5 s wait. The message was written to
    the subscriber's socket; a service whose event loop runs a CPU-bound step (a learner update, a decode
    step) reads it and acks it once the step ends, and amqtt only stops waiting (nothing is resent or lost).
    amqtt logs each as a warning and then as an error with a traceback, which a user of the demo would take
    for a failure."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if "Timeout waiting for PUBACK" in text or "PUBACK for unknown pending message" in text:
            return False
        exc = record.exc_info[1] if record.exc_info else None
        return not (exc is not None and "Timeout waiting for PUBACK" in str(exc))


def quiet_ack_timeouts() -> None:
    """Install `QuietAckTimeouts` on the amqtt loggers that report them (idempotent)."""
    for name in ("amqtt.broker", "amqtt.mqtt.protocol.handler"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, QuietAckTimeouts) for f in logger.filters):
            logger.addFilter(QuietAckTimeouts())
