"""What every entry is made of: the schema version and timestamp every entry carries (`Entry`), and tensors as
(dtype, shape, bytes), checked for consistency while decoding (`Tensor`). Importing this module does not import
torch; `Tensor.to_torch`/`from_torch` import it on first use."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Annotated, Literal

import numpy as np
from msgspec import Meta, Struct, field

if TYPE_CHECKING:
    import torch

__all__ = ["DTYPE_SIZES", "SCHEMA", "Entry", "NonNegInt", "Tensor", "Version"]

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


class Entry(Struct, frozen=True, kw_only=True, tag_field="kind", forbid_unknown_fields=True):
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
