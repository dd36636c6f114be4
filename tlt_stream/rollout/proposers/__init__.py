"""Draft proposers: who guesses the next tokens for speculative decoding.

- `eagle.py`: `EagleProposer`, the one-layer EAGLE drafter (chains and EAGLE-2 trees);
- `lookup.py`: `NgramProposer`, model-free prompt lookup, and `OracleProposer` for tests;
- `group.py`: `GroupProposer`, drafts from the responses to the row's own prompt;
- `mixed.py`: `MixedProposer`, EAGLE and the group source side by side;
- `base.py`: the `Proposal` every source returns, the `Proposer` surface the engine calls, tree helpers.
"""

from __future__ import annotations

from pathlib import Path

from tlt_stream.drafter.model import load_drafter
from tlt_stream.model.transformer import Transformer
from tlt_stream.rollout.proposers.base import (
    SOURCE_EAGLE,
    SOURCE_GROUP,
    Proposal,
    Proposer,
    merge_trees,
    pad_trees,
)
from tlt_stream.rollout.proposers.eagle import EagleProposer
from tlt_stream.rollout.proposers.group import GroupProposer
from tlt_stream.rollout.proposers.lookup import NgramProposer, OracleProposer
from tlt_stream.rollout.proposers.mixed import MixedProposer

__all__ = [
    "SOURCE_EAGLE",
    "SOURCE_GROUP",
    "EagleProposer",
    "GroupProposer",
    "MixedProposer",
    "NgramProposer",
    "OracleProposer",
    "Proposal",
    "Proposer",
    "build_proposer",
    "merge_trees",
    "pad_trees",
]


def build_proposer(source: str, target: Transformer) -> Proposer:
    """`"ngram"` for prompt lookup, else the path of a drafter checkpoint to bind to `target`."""
    if source == "ngram":
        return NgramProposer()
    return EagleProposer(load_drafter(Path(source), target))
