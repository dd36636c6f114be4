"""The control plane's messages: the retained policy, drafter and SD-config versions (JSON over MQTT, mirrored
in Redis)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Literal

from msgspec import Meta, Struct

if TYPE_CHECKING:
    pass

from tlt_stream.basics.messages.wire import Entry, NonNegInt, Version

__all__ = ["CONTROL_KINDS", "ControlMessage", "DrafterVersion", "PolicyVersion", "SdArmChoice", "SdConfigVersion"]


# ---------------------------------------------------------------------------------------------------- control
# Retained MQTT messages (JSON, so `mosquitto_sub -v -t 'tlt/#'` is readable), mirrored in a Redis hash.

Sha256 = Annotated[str, Meta(pattern=r"^[0-9a-f]{64}$")]


class PolicyVersion(Entry, tag="policy"):
    """A new policy checkpoint: where it is and its sha256 (workers verify before loading)."""

    version: NonNegInt
    location: str
    sha256: Sha256
    step: NonNegInt = 0
    digest: Literal["v1", "v2"] = "v1"
    """The scheme `sha256` was computed with (`store/digest.py`); absent in announcements from before v2."""
    published_at: Annotated[float, Meta(ge=0)] = 0.0
    """Wall-clock seconds (the publisher's `time.time()`) when it was announced: workers report the time from
    it to having the version loaded. 0: unknown (an announcement from before the field)."""


class DrafterVersion(Entry, tag="drafter"):
    """A new drafter checkpoint and the policy version it was trained against."""

    version: NonNegInt
    location: str
    sha256: Sha256
    policy_version: Version = -1


class SdArmChoice(Struct, frozen=True, forbid_unknown_fields=True):
    """The arm to use for running batches of at most `max_batch` rows (`enabled=False`: plain decoding)."""

    max_batch: Annotated[int, Meta(ge=1)]
    depth: NonNegInt
    topk: NonNegInt
    verify: NonNegInt
    enabled: bool = True
    proposer: Literal["plain", "ngram", "drafter", "group", "mixed", "either"] = "drafter"
    group: NonNegInt = 0


class SdConfigVersion(Entry, tag="sd_config"):
    """The speculative-decoding table aggregated across workers."""

    version: NonNegInt
    drafter_version: Version = -1
    table: list[SdArmChoice] = []


ControlMessage = PolicyVersion | DrafterVersion | SdConfigVersion
CONTROL_KINDS = ("policy", "drafter", "sd_config")
