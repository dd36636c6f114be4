"""Checkpoint locations relative to the store root: announced by the learner, resolved by each reader."""

from __future__ import annotations

from pathlib import Path

import pytest

from tlt_stream.store.locations import announced_location, local_location, unresolvable


def test_a_location_is_announced_relative_to_the_root_and_resolved_under_the_readers(tmp_path: Path) -> None:
    policy = tmp_path / "a" / "run" / "checkpoints" / "step-00000001" / "policy"
    policy.mkdir(parents=True)
    assert announced_location(policy, str(tmp_path / "a"), relative=True) == "run/checkpoints/step-00000001/policy"
    assert announced_location(policy, str(tmp_path / "a"), relative=False) == str(policy.resolve())
    assert announced_location(policy, None, relative=False) == str(policy.resolve())
    with pytest.raises(ValueError, match="outside"):
        announced_location(policy, str(tmp_path / "b"), relative=True)
    with pytest.raises(ValueError, match="store_root"):
        announced_location(policy, None, relative=True)
    assert local_location("run/x/policy", "/mnt/store") == "/mnt/store/run/x/policy"
    assert local_location("/abs/policy", "/mnt/store") == "/abs/policy", "absolute: as announced"
    assert local_location("run/x/policy", None) == "run/x/policy"


def test_what_cannot_be_resolved_says_why() -> None:
    assert unresolvable("/abs/policy", None) is None
    assert unresolvable("run/x/policy", "/mnt/store") is None
    assert "store_root is not set" in (unresolvable("run/x/policy", None) or "")
    assert "climbs out" in (unresolvable("run/../../etc", "/mnt/store") or "")
