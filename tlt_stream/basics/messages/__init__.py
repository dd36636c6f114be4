"""Every wire schema: one tagged union of msgspec Structs per stream, msgpack-encoded.

Each entry carries a `kind` tag and a `schema` version; a decoder accepts exactly the versions it knows and
anything else fails to decode (and is dead-lettered by the reader). Tensors travel as (dtype, shape, bytes)
and are checked for consistency while decoding, so a tensor whose bytes do not match its shape never
reaches a handler. Timestamps come from a default factory, evaluated per message. Importing this module
does not import torch; `Tensor.to_torch`/`from_torch` import it on first use.
"""

from __future__ import annotations

from typing import Generic, TypeVar

import msgspec

from tlt_stream.basics.messages.control import (
    CONTROL_KINDS,
    ControlMessage,
    DrafterVersion,
    PolicyVersion,
    SdArmChoice,
    SdConfigVersion,
)
from tlt_stream.basics.messages.data import (
    MAX_GROUP_SIZE,
    DeadEntry,
    DeadLetter,
    HiddenEntry,
    HiddenWindow,
    PromptGroup,
    PromptsEntry,
    Sample,
    SamplesEntry,
)
from tlt_stream.basics.messages.stats import (
    DrafterStats,
    LearnerDiskTrouble,
    LearnerStats,
    RolloutStats,
    SdArmReport,
    StatsEntry,
    WorkerState,
    WorkerStatus,
)
from tlt_stream.basics.messages.wire import DTYPE_SIZES, SCHEMA, Tensor

__all__ = [
    "CONTROL_CODEC",
    "CONTROL_KINDS",
    "DTYPE_SIZES",
    "MAX_GROUP_SIZE",
    "SCHEMA",
    "Codec",
    "ControlMessage",
    "DeadLetter",
    "DrafterStats",
    "DrafterVersion",
    "HiddenWindow",
    "LearnerDiskTrouble",
    "LearnerStats",
    "PolicyVersion",
    "PromptGroup",
    "RolloutStats",
    "Sample",
    "SdArmChoice",
    "SdArmReport",
    "SdConfigVersion",
    "StatsEntry",
    "Tensor",
    "WorkerState",
    "WorkerStatus",
    "codec_for",
]


# ---------------------------------------------------------------------------------------------------- codecs

T = TypeVar("T")


class Codec(Generic[T]):
    """One reused msgpack encoder and typed decoder for one stream's union."""

    def __init__(self, kind: type[T] | object) -> None:
        self.type = kind
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder: msgspec.msgpack.Decoder[T] = msgspec.msgpack.Decoder(kind)  # type: ignore[arg-type]

    def encode(self, message: T) -> bytes:
        return self._encoder.encode(message)

    def encode_into(self, message: T, buffer: bytearray) -> None:
        """Encode into a reused buffer (resized to fit): no fresh allocation for large entries."""
        self._encoder.encode_into(message, buffer)

    def decode(self, data: bytes | memoryview) -> T:
        """Raises `msgspec.DecodeError` (malformed) or `msgspec.ValidationError` (well-formed but invalid)."""
        return self._decoder.decode(data)


_CODECS: dict[str, Codec] = {
    "prompts": Codec(PromptsEntry),
    "samples": Codec(SamplesEntry),
    "hidden": Codec(HiddenEntry),
    "stats": Codec(StatsEntry),
    "dead": Codec(DeadEntry),
}


class JsonCodec(Generic[T]):
    """One reused JSON encoder and typed decoder (the control plane's wire format)."""

    def __init__(self, kind: type[T] | object) -> None:
        self.type = kind
        self._encoder = msgspec.json.Encoder()
        self._decoder: msgspec.json.Decoder[T] = msgspec.json.Decoder(kind)  # type: ignore[arg-type]

    def encode(self, message: T) -> bytes:
        return self._encoder.encode(message)

    def decode(self, data: bytes | str) -> T:
        return self._decoder.decode(data)


CONTROL_CODEC: JsonCodec[ControlMessage] = JsonCodec(ControlMessage)


def codec_for(stream: str) -> Codec:
    """The codec of a stream by its short name (`prompts`, `samples`, `hidden`, `stats`, `dead`)."""
    try:
        return _CODECS[stream]
    except KeyError:
        raise KeyError(f"no codec for stream {stream!r}; known: {', '.join(_CODECS)}") from None
