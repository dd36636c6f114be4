"""The speculative-decoding arm: the one type for what the engine speculates with, what the tuner chooses and
what the wire reports (`messages.SdArmReport`, `SdArmChoice`); its text form is the label (`plain`,
`ngram-d4`, `d4k1v4`, `d6k1v6|g12`), which configurations and tables carry."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

__all__ = ["MAX_DRAFT_DEPTH", "Arm", "ArmKind", "ArmTooDeep"]

MAX_DRAFT_DEPTH = 256
"""The deepest draft an arm may ask for: each level costs a drafter forward (or a lookup) every round, and
accepted lengths stay far below it for any drafter, so a deeper arm is a typo that would stall every round."""


class ArmTooDeep(ValueError):
    """An arm deeper than `MAX_DRAFT_DEPTH` (a command names its own flag for it)."""


ArmKind = Literal["plain", "ngram", "group", "drafter", "mixed", "either"]

_KIND_RANK = {"plain": 0, "ngram": 1, "group": 2, "drafter": 3, "either": 4, "mixed": 5}
_LABEL = re.compile(r"d(\d+)k(\d+)v(\d+)")
_MIXED_LABEL = re.compile(r"d(\d+)k(\d+)v(\d+)\+g(\d+)")
_EITHER_LABEL = re.compile(r"d(\d+)k1v(\d+)\|g(\d+)")
_NGRAM_LABEL = re.compile(r"ngram-d(\d+)")
_GROUP_LABEL = re.compile(r"group-d(\d+)v(\d+)")


@dataclass(frozen=True)
class Arm:
    """One choice the tuner can make, with the wire's fields (`SdArmReport`, `SdArmChoice`).

    - `plain`: no speculation (depth = topk = verify = 0);
    - `ngram`: a prompt-lookup chain of `depth` tokens (topk 1, verify = depth);
    - `drafter`: the trained drafter: a tree of `depth` levels with `topk` children per frontier node,
      `verify` of its nodes verified.
    - `group`: the group/history source (`rollout.suffix`): a tree of at most `verify` nodes and `depth`
      levels of what the prompt's other responses wrote after the row's latest tokens (topk 0).
    - `mixed`: the drafter's tree (as for `drafter`, point masses) and up to `group_nodes` nodes of the group
      source, merged into one tree and verified in one forward.
    - `either`: per row and round, one chain from one source: the group source's chain of at most
      `group_nodes` tokens where the row's latest tokens match the index strongly
      (`GroupProposer.strong_match`), else the drafter's chain of `depth` tokens (topk 1, verify = depth).
      A round where every row takes the group chain runs no drafter forward at all.
    """

    kind: ArmKind
    depth: int = 0
    topk: int = 0
    verify: int = 0
    group_nodes: int = 0
    """Group-source nodes beside the drafter's (`mixed`) or instead of them (`either`)."""

    def __post_init__(self) -> None:
        if self.kind == "plain":
            valid = self.depth == self.topk == self.verify == 0
        elif self.kind == "ngram":
            valid = self.depth >= 1 and self.topk == 1 and self.verify == self.depth
        elif self.kind == "group":
            valid = self.depth >= 1 and self.verify >= 1 and self.topk == 0
        elif self.kind in ("drafter", "mixed"):
            valid = min(self.depth, self.topk, self.verify) >= 1 and self.verify <= self.depth * self.topk**2
        elif self.kind == "either":
            valid = self.depth >= 1 and self.topk == 1 and self.verify == self.depth
        else:
            raise ValueError(f"unknown arm kind {self.kind!r} (plain, ngram, group, drafter, mixed, either)")
        valid = valid and (self.group_nodes >= 1 if self.kind in ("mixed", "either") else self.group_nodes == 0)
        if self.depth > MAX_DRAFT_DEPTH:
            raise ArmTooDeep(f"{self.kind} arm of depth {self.depth}: an arm drafts at most {MAX_DRAFT_DEPTH} levels")
        if not valid:
            raise ValueError(
                f"invalid {self.kind} arm: depth={self.depth}, topk={self.topk}, verify={self.verify}, "
                f"group_nodes={self.group_nodes}"
            )

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
    def group_source(cls, depth: int, verify: int) -> Arm:
        return cls("group", depth, 0, verify)

    @classmethod
    def mixed(cls, depth: int, topk: int, verify: int, group_nodes: int) -> Arm:
        return cls("mixed", depth, topk, verify, group_nodes)

    @classmethod
    def either(cls, depth: int, group_nodes: int) -> Arm:
        return cls("either", depth, 1, depth, group_nodes)

    @classmethod
    def from_label(cls, label: str) -> Arm:
        """Inverse of `label`: `plain`, `ngram-d4`, `group-d8v12`, `d4k2v8`, `d4k2v8+g8`, `d6k1v6|g12`."""
        if label == "plain":
            return cls.plain()
        if m := _NGRAM_LABEL.fullmatch(label):
            return cls.ngram(int(m[1]))
        if m := _GROUP_LABEL.fullmatch(label):
            return cls.group_source(int(m[1]), int(m[2]))
        if m := _MIXED_LABEL.fullmatch(label):
            return cls.mixed(int(m[1]), int(m[2]), int(m[3]), int(m[4]))
        if m := _EITHER_LABEL.fullmatch(label):
            return cls("either", int(m[1]), 1, int(m[2]), int(m[3]))
        if m := _LABEL.fullmatch(label):
            return cls.drafter(int(m[1]), int(m[2]), int(m[3]))
        raise ValueError(
            f"not an arm label: {label!r} (plain, ngram-d<depth>, group-d<depth>v<verify>, "
            "d<depth>k<topk>v<verify>, d<depth>k<topk>v<verify>+g<nodes>, d<depth>k1v<depth>|g<nodes>)"
        )

    @property
    def label(self) -> str:
        if self.kind == "plain":
            return "plain"
        if self.kind == "ngram":
            return f"ngram-d{self.depth}"
        if self.kind == "group":
            return f"group-d{self.depth}v{self.verify}"
        if self.kind == "mixed":
            return f"d{self.depth}k{self.topk}v{self.verify}+g{self.group_nodes}"
        if self.kind == "either":
            return f"d{self.depth}k1v{self.verify}|g{self.group_nodes}"
        return f"d{self.depth}k{self.topk}v{self.verify}"

    @property
    def nodes(self) -> int:
        """Draft nodes one round verifies at most (the verify forward's width)."""
        if self.kind == "either":
            return max(self.verify, self.group_nodes)
        return self.verify + self.group_nodes

    @property
    def levels(self) -> int:
        """The deepest draft a round verifies: the drafter's `depth`, or the group source's chain or tree where
        it reaches deeper (`mixed` and `either` draft up to `group_nodes` levels from it; 0 for plain)."""
        return max(self.depth, self.group_nodes)

    @property
    def most_tokens(self) -> int:
        """Tokens one round emits at most: every level accepted plus the verifier's own token (1 for plain)."""
        return self.levels + 1

    @property
    def shape(self) -> tuple[int, int, int]:
        """(depth, topk, verify)."""
        return self.depth, self.topk, self.verify

    @property
    def uses_drafter(self) -> bool:
        """Its measurements depend on the drafter's weights (stale when a new drafter arrives)."""
        return self.kind in ("drafter", "mixed", "either")

    @property
    def simplicity(self) -> tuple[int, int, int, int]:
        """Sort key, simplest first (plain, n-gram, then drafter arms by size): ties go to the simpler arm."""
        return (_KIND_RANK[self.kind], self.depth, self.topk, self.verify + self.group_nodes)
