"""Every wire schema: one tagged union of msgspec Structs per stream, msgpack-encoded.

Each entry carries a `kind` tag and a `schema` version; a decoder accepts exactly the versions it knows and
anything else fails to decode (and is dead-lettered by the reader). Tensors travel as (dtype, shape, bytes)
and are checked for consistency while decoding, so a tensor whose bytes do not match its shape never
reaches a handler. Timestamps come from a default factory, evaluated per message. Importing this module
does not import torch; `Tensor.to_torch`/`from_torch` import it on first use.
"""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Annotated, Any, Generic, Literal, TypeVar

import msgspec
import numpy as np
from msgspec import Meta, Struct, field

if TYPE_CHECKING:
    import torch

__all__ = [
    "CONTROL_CODEC",
    "CONTROL_KINDS",
    "DTYPE_SIZES",
    "Codec",
    "ControlMessage",
    "DeadLetter",
    "DrafterStats",
    "DrafterVersion",
    "HiddenWindow",
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

SCHEMA = 1
"""The schema version every entry written by this code carries."""

DTYPE_SIZES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float64": 8,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}

MAX_TENSOR_DIMS = 8

NonNegInt = Annotated[int, Meta(ge=0)]
Version = Annotated[int, Meta(ge=-1)]
"""A policy or drafter version; -1 means none yet."""


def _now() -> float:
    return time.time()


class _Entry(Struct, frozen=True, kw_only=True, tag_field="kind", forbid_unknown_fields=True):
    schema: Literal[1] = SCHEMA
    created_at: float = field(default_factory=_now)

    @property
    def kind(self) -> str:
        """The entry's tag (`sample`, `policy`, ...), as written in its `kind` field on the wire."""
        return type(self).__struct_config__.tag  # type: ignore[return-value]


class Tensor(Struct, frozen=True, forbid_unknown_fields=True):
    """A tensor on the wire: dtype name, shape and the raw little-endian bytes (C order).

    Decoding is zero-copy: `data` is a read-only view into the received entry. `to_torch` makes the one
    private copy a consumer needs.
    """

    dtype: str
    shape: list[NonNegInt]
    data: memoryview

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"unsupported tensor dtype {self.dtype!r}; allowed: {', '.join(DTYPE_SIZES)}")
        if len(self.shape) > MAX_TENSOR_DIMS:
            raise ValueError(f"tensor has {len(self.shape)} dimensions; at most {MAX_TENSOR_DIMS} allowed")
        expected = math.prod(self.shape) * DTYPE_SIZES[self.dtype]
        if expected != len(self.data):
            raise ValueError(
                f"tensor bytes do not match dtype and shape: {self.dtype}{self.shape} needs {expected} "
                f"bytes, got {len(self.data)}"
            )

    @property
    def nbytes(self) -> int:
        return len(self.data)

    @classmethod
    def from_torch(cls, tensor: torch.Tensor) -> Tensor:
        import torch

        t = tensor.detach().to("cpu").contiguous()
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype not in DTYPE_SIZES:
            raise ValueError(f"cannot send a {t.dtype} tensor; allowed: {', '.join(DTYPE_SIZES)}")
        raw = t.reshape(-1).view(torch.uint8)
        return cls(dtype=dtype, shape=list(t.shape), data=memoryview(raw.numpy().tobytes()))

    @classmethod
    def from_values(cls, values: Sequence[float] | np.ndarray, dtype: str) -> Tensor:
        """A 1-D (or n-D, from an array) tensor of `dtype` from Python numbers or a numpy array."""
        if dtype not in DTYPE_SIZES or dtype == "bfloat16":
            raise ValueError(f"from_values does not support dtype {dtype!r}")
        array = np.ascontiguousarray(values, dtype=np.dtype(dtype).newbyteorder("<"))
        return cls(dtype=dtype, shape=list(array.shape), data=memoryview(array.tobytes()))

    def to_numpy(self) -> np.ndarray:
        """A read-only numpy view of the bytes (bfloat16 is not representable in numpy)."""
        if self.dtype == "bfloat16":
            raise ValueError("bfloat16 tensors have no numpy form; use to_torch()")
        return np.frombuffer(self.data, dtype=np.dtype(self.dtype).newbyteorder("<")).reshape(self.shape)

    def tolist(self) -> list:
        return self.to_numpy().tolist()

    def to_torch(self) -> torch.Tensor:
        """A CPU tensor viewing a private copy of the bytes (writable, independent of the message)."""
        import torch

        dtype = getattr(torch, self.dtype)
        if not self.data:
            return torch.empty(self.shape, dtype=dtype)
        return torch.frombuffer(bytearray(self.data), dtype=dtype).reshape(self.shape)


# ---------------------------------------------------------------------------------------------------- prompts


class PromptGroup(_Entry, tag="prompt_group"):
    """One prompt to be answered G times by one rollout worker (the unit of the `prompts` stream)."""

    task_id: str
    prompt_id: str
    prompt_ids: list[NonNegInt]
    answer: str
    group_size: Annotated[int, Meta(ge=1, le=4096)]
    min_policy_version: NonNegInt = 0
    step: NonNegInt = 0
    prompt_text: str = ""
    fields: dict[str, Any] = {}
    """The dataset row's other fields (JSON values), for a reward that asks for them by name."""
    draft_version: NonNegInt | None = None
    """Partial rollouts: a worker may start the group under this (older) policy version as a draft; its rows
    are re-verified under `min_policy_version` before any sample is sent. None: not a draft."""

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("prompt_ids is empty")
        if self.draft_version is not None and self.draft_version >= self.min_policy_version:
            raise ValueError(
                f"draft_version {self.draft_version} must be older than min_policy_version {self.min_policy_version}"
            )

    @property
    def startable_version(self) -> int:
        """The oldest policy version a worker may start this group under (as a draft when it is older than
        `min_policy_version`)."""
        return self.min_policy_version if self.draft_version is None else self.draft_version


PromptsEntry = PromptGroup


# ---------------------------------------------------------------------------------------------------- samples


class Sample(_Entry, tag="sample"):
    """One finished response with everything the learner needs (the unit of the `samples` stream).

    `sample_id` is deterministic (`{task_id}/{index}`), so a sample regenerated after a worker died is
    recognised as the same sample and applied at most once.
    """

    sample_id: str
    task_id: str
    prompt_id: str
    index: NonNegInt
    group_size: Annotated[int, Meta(ge=1, le=4096)]
    prompt_ids: list[NonNegInt]
    token_ids: Tensor
    """int32 [n]: the response."""
    logprobs: Tensor
    """float32 [n]: behaviour log-probabilities of `token_ids` under the policy that generated them."""
    policy_version: NonNegInt
    drafter_version: Version
    reward: float
    finish_reason: Literal["eos", "stop", "length"]
    """eos: ended at an EOS id; stop: at a stop string; length: cut at the token limit (truncated)."""
    worker_id: str
    step: NonNegInt = 0
    gen_seconds: Annotated[float, Meta(ge=0)] = 0.0
    accept_length: Annotated[float, Meta(ge=0)] = 0.0
    """Mean tokens emitted per target forward while generating this sample (1.0 without SD)."""

    def __post_init__(self) -> None:
        if self.token_ids.dtype != "int32" or len(self.token_ids.shape) != 1:
            raise ValueError(f"token_ids must be int32 [n], got {self.token_ids.dtype}{self.token_ids.shape}")
        if self.logprobs.dtype != "float32" or self.logprobs.shape != self.token_ids.shape:
            raise ValueError(
                f"logprobs must be float32 {self.token_ids.shape}, got {self.logprobs.dtype}{self.logprobs.shape}"
            )
        if self.index >= self.group_size:
            raise ValueError(f"index {self.index} is outside a group of {self.group_size}")
        if self.token_ids.shape[0]:
            # One reduction each: min < 0 catches negative ids; a NaN or infinite logprob makes the sum
            # non-finite, and a positive one shows in the max.
            if self.token_ids.to_numpy().min() < 0:
                raise ValueError("token_ids must be non-negative")
            lp = self.logprobs.to_numpy()
            if not (math.isfinite(float(lp.sum(dtype=np.float64))) and lp.max() <= 0.0):
                raise ValueError("logprobs must be finite values <= 0")

    @property
    def response_len(self) -> int:
        return self.token_ids.shape[0]


SamplesEntry = Sample


# ---------------------------------------------------------------------------------------------------- hidden


class HiddenWindow(_Entry, tag="hidden"):
    """A window of target hidden states with the tokens they were computed at (drafter training data).

    Row i of `hidden` is the target's final-layer hidden state at the position of `token_ids[i]`, i.e. the
    state whose logits predicted `token_ids[i + 1]`. The first `prompt_len` rows are prompt positions
    (context, not trained on).
    """

    sample_id: str
    policy_version: NonNegInt
    token_ids: list[NonNegInt]
    hidden: Tensor
    start: NonNegInt = 0
    prompt_len: NonNegInt = 0

    def __post_init__(self) -> None:
        if len(self.hidden.shape) != 2 or self.hidden.shape[0] != len(self.token_ids):
            raise ValueError(
                f"hidden must be [len(token_ids), H] = [{len(self.token_ids)}, H], got {self.hidden.shape}"
            )
        if self.prompt_len > len(self.token_ids):
            raise ValueError("prompt_len exceeds the window")


HiddenEntry = HiddenWindow


# ---------------------------------------------------------------------------------------------------- stats


class WorkerStatus(enum.StrEnum):
    GENERATING = "GENERATING"
    IDLE = "IDLE"
    TRAINING_DRAFTER = "TRAINING_DRAFTER"
    LOADING = "LOADING"
    STOPPED = "STOPPED"


class WorkerState(_Entry, tag="worker_state"):
    """A worker changed state (the timeline of GENERATING / IDLE / TRAINING_DRAFTER / ...)."""

    worker_id: str
    state: WorkerStatus
    previous: WorkerStatus | None = None
    reason: str = ""


class RolloutStats(_Entry, tag="rollout"):
    """A rollout worker's measurements over one reporting interval."""

    worker_id: str
    policy_version: NonNegInt
    drafter_version: Version
    batch_size: NonNegInt
    tokens: NonNegInt
    seconds: Annotated[float, Meta(ge=0)]
    target_forwards: NonNegInt = 0
    sd_on: bool = False
    drafted: dict[str, NonNegInt] = {}
    """Draft nodes verified in the interval, per source (eagle, group, ngram; a node two sources proposed
    counts for both)."""
    accepted: dict[str, NonNegInt] = {}
    """Drafted tokens accepted and emitted in the interval, per source (as `drafted`)."""
    collapses: NonNegInt = 0
    """Swaps after which the worker's acceptance collapsed, since it started (`rollout.collapse`)."""
    kept_tokens: NonNegInt = 0
    """Partial rollouts: tokens of rows in flight (drafts generated ahead of their version, or rows running
    at a version change) that a re-verification under the new version kept, in the interval."""
    discarded_tokens: NonNegInt = 0
    """Partial rollouts: such tokens a re-verification discarded (the first rejected one and all after it)."""
    ahead_seconds: Annotated[float, Meta(ge=0)] = 0.0
    """Partial rollouts: generation seconds in the interval with a draft group in flight, i.e. time the tail
    of one step was filled with the next step's work."""
    load_latency_s: dict[str, Annotated[float, Meta(ge=0)]] = {}
    """Policy versions loaded since the last report (by version number, as a string): wall-clock seconds from
    the version's `PolicyVersion.published_at` to this worker having it loaded (publisher and worker clocks:
    skew shifts it; a negative difference is reported as 0)."""


class SdArmReport(_Entry, tag="sd_arm"):
    """Measured throughput of one speculative-decoding arm in one batch-size bucket."""

    worker_id: str
    drafter_version: Version
    bucket: NonNegInt
    depth: NonNegInt
    topk: NonNegInt
    verify: NonNegInt
    tokens: NonNegInt
    seconds: Annotated[float, Meta(ge=0)]
    proposer: Literal["plain", "ngram", "drafter", "group", "mixed", "either"] = "drafter"
    """What drafted: no SD (depth 0), prompt lookup, the trained drafter, the group/history source, the
    drafter and the group source in one tree, or either one's chain per row."""
    steps: NonNegInt = 0
    group: NonNegInt = 0
    """Group-source nodes beside the drafter's (proposer mixed) or instead of them (either)."""


class LearnerStats(_Entry, tag="learner"):
    """One learner update."""

    step: NonNegInt
    policy_version: NonNegInt
    groups: NonNegInt
    samples: NonNegInt
    metrics: dict[str, float] = {}


class DrafterStats(_Entry, tag="drafter_train"):
    """One drafter-training slice on an idle worker and, when it was judged, whether its drafter was adopted."""

    worker_id: str
    fence: NonNegInt
    """The lease's fencing token the slice trained under."""
    policy_version: Version
    """The policy version whose embedding, LM head and hidden states the slice trained against."""
    step: NonNegInt
    """The trainer's step count after the slice (it survives preemption and changes of holder)."""
    steps: NonNegInt
    seconds: Annotated[float, Meta(ge=0)]
    loss: float
    end: str
    """Why the slice ended: preempted, time, steps or no_data."""
    windows: NonNegInt = 0
    """Windows in the training buffer."""
    preempt_latency_s: Annotated[float, Meta(ge=0)] = 0.0
    """From new work arriving to the slice returning (0 when not preempted)."""
    judged: bool = False
    """Whether the slice's drafter was judged on the held-out windows (every `judge_every_steps` steps);
    the four fields below are its verdict, and mean nothing when it was not."""
    judge_s: Annotated[float, Meta(ge=0)] = 0.0
    """Seconds the judgement (two held-out measurements, and publishing) took."""
    accept_new: float = 0.0
    """Held-out acceptance (expected draft tokens accepted per verification) of the slice's drafter."""
    accept_current: float = 0.0
    """The same for the drafter in use when the slice ended."""
    adopted: bool = False
    drafter_version: Version = -1
    """The version published for this slice's drafter (-1: not published)."""


StatsEntry = WorkerState | RolloutStats | SdArmReport | LearnerStats | DrafterStats


# ---------------------------------------------------------------------------------------------------- dead


class DeadLetter(_Entry, tag="dead"):
    """An entry that failed to decode, validate or be handled, with why and where it came from."""

    stream: str
    entry_id: str
    reason: str
    origin: str
    deliveries: NonNegInt = 0
    payload: bytes = b""
    """The raw entry, truncated to `payload_limit` bytes."""
    payload_size: NonNegInt = 0


DeadEntry = DeadLetter


# ---------------------------------------------------------------------------------------------------- control
# Retained MQTT messages (JSON, so `mosquitto_sub -v -t 'tlt/#'` is readable), mirrored in a Redis hash.

Sha256 = Annotated[str, Meta(pattern=r"^[0-9a-f]{64}$")]


class PolicyVersion(_Entry, tag="policy"):
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


class DrafterVersion(_Entry, tag="drafter"):
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


class SdConfigVersion(_Entry, tag="sd_config"):
    """The speculative-decoding table aggregated across workers."""

    version: NonNegInt
    drafter_version: Version = -1
    table: list[SdArmChoice] = []


ControlMessage = PolicyVersion | DrafterVersion | SdConfigVersion
CONTROL_KINDS = ("policy", "drafter", "sd_config")


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
