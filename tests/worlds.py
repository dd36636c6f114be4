"""The tiny world as `bootstrap` lays it out, built in a second from the tests' random policy."""

from __future__ import annotations

import shutil
from pathlib import Path


def build_world(init_policy: Path, world: Path) -> None:
    """`world/policy` (a copy of the tests' tiny random policy) and `world/drafter` (a random drafter bound
    to it): what `bootstrap` leaves in a world directory, without its minutes of training."""
    import torch

    from tlt_stream.drafter.model import Drafter, save_drafter
    from tlt_stream.model import load_model

    shutil.copytree(init_policy, world / "policy")
    torch.manual_seed(1)
    save_drafter(Drafter(load_model(world / "policy").spec), world / "drafter")
