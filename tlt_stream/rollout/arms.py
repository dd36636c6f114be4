"""The speculative-decoding arm: the one type for what the engine speculates with, what the tuner chooses and
what the wire reports (`messages.SdArmReport`, `SdArmChoice`); its text form is the label (`plain`,
`ngram-d4`, `d4k1v4`), which configurations and tables carry."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

__all__ = ["Arm", "ArmKind"]

ArmKind = Literal["plain", "ngram", "drafter"]

_KIND_RANK = {"plain": 0, "ngram": 1, "drafter": 2}
_LABEL = re.compile(r"d(\d+)k(\d+)v(\d+)")
_NGRAM_LABEL = re.compile(r"ngram-d(\d+)")


@dataclass(frozen=True)
class Arm:
    """One choice the tuner can make, with the wire's fields (`SdArmReport`, `SdArmChoice`).

    - `plain`: no speculation (depth = topk = verify = 0);
    - `ngram`: a prompt-lookup chain of `depth` tokens (topk 1, verify = depth);
    - `drafter`: the trained drafter: a tree of `depth` levels with `topk` children per frontier node,
      `verify` of its nodes verified.
    """

    kind: ArmKind
    depth: int = 0
    topk: int = 0
    verify: int = 0

    def __post_init__(self) -> None:
        if self.kind == "plain":
            valid = self.depth == self.topk == self.verify == 0
        elif self.kind == "ngram":
            valid = self.depth >= 1 and self.topk == 1 and self.verify == self.depth
        elif self.kind == "drafter":
            valid = min(self.depth, self.topk, self.verify) >= 1 and self.verify <= self.depth * self.topk**2
        else:
            raise ValueError(f"unknown arm kind {self.kind!r} (plain, ngram, drafter)")
        if not valid:
            raise ValueError(f"invalid {self.kind} arm: depth={self.depth}, topk={self.topk}, verify={self.verify}")

    @classmethod
    def plain(cls) -> Arm:
        return cls("plain")

    @classmethod
    def ngram(cls, depth: int) -> Arm:
        return cls("ngram", depth, 1, depth)

    @classmethod
    def drafter(cls, depth: int, topk: int, verify: int) -> Arm:
        return cls("drafter", depth, topk, verify)

    @classmethod
    def from_label(cls, label: str) -> Arm:
        """Inverse of `label`: `plain`, `ngram-d4`, `d4k2v8`."""
        if label == "plain":
            return cls.plain()
        if m := _NGRAM_LABEL.fullmatch(label):
            return cls.ngram(int(m[1]))
        if m := _LABEL.fullmatch(label):
            return cls.drafter(int(m[1]), int(m[2]), int(m[3]))
        raise ValueError(f"not an arm label: {label!r} (plain, ngram-d<depth>, d<depth>k<topk>v<verify>)")

    @property
    def label(self) -> str:
        if self.kind == "plain":
            return "plain"
        if self.kind == "ngram":
            return f"ngram-d{self.depth}"
        return f"d{self.depth}k{self.topk}v{self.verify}"

    @property
    def shape(self) -> tuple[int, int, int]:
        """(depth, topk, verify)."""
        return self.depth, self.topk, self.verify

    @property
    def uses_drafter(self) -> bool:
        """Its measurements depend on the drafter's weights (stale when a new drafter arrives)."""
        return self.kind == "drafter"

    @property
    def simplicity(self) -> tuple[int, int, int, int]:
        """Sort key, simplest first (plain, n-gram, then drafter arms by size): ties go to the simpler arm."""
        return (_KIND_RANK[self.kind], self.depth, self.topk, self.verify)
