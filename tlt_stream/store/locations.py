"""Checkpoint locations relative to the checkpoint store, so each node may mount the store where it likes.

The learner announces where a policy version is. An absolute path makes every node mount the store at the
learner's path; with `bus.relative_locations` the learner announces the path relative to its own
`bus.store_root` and each reader resolves it under *its* `bus.store_root`. The sha256 covers names
relative to the policy directory and the bytes, never where the directory lives, so it checks the same
wherever the store is mounted.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath

__all__ = ["announced_location", "local_location", "unresolvable"]


def announced_location(path: Path, store_root: str | None, *, relative: bool) -> str:
    """What to announce for the checkpoint directory `path`: relative to `store_root` (POSIX separators) when
    `relative`, else its absolute path. ValueError when `path` is not inside `store_root`."""
    target = path.resolve()
    if not relative:
        return str(target)
    if store_root is None:
        raise ValueError("relative checkpoint locations need bus.store_root")
    root = Path(store_root).resolve()
    if not target.is_relative_to(root):
        raise ValueError(f"checkpoint {target} is outside the checkpoint store {root} (bus.store_root)")
    return target.relative_to(root).as_posix()


def local_location(location: str, store_root: str | None) -> str:
    """An announced location as a path on this node: a relative one under this node's `store_root`; an
    absolute one, or a relative one with no store root to resolve it under (`unresolvable` says so), as is."""
    if store_root is None or PurePosixPath(location).is_absolute():
        return location
    return str(Path(store_root) / PurePosixPath(location))


def unresolvable(location: str, store_root: str | None) -> str | None:
    """Why a location cannot be read on this node, or None: a relative location needs a store root, and
    must not climb out of it (`..`: what stays inside after symlinks is the store-root check's to say)."""
    path = PurePosixPath(location)
    if path.is_absolute():
        return None
    if store_root is None:
        return f"checkpoint location {location!r} is relative to a checkpoint store, and bus.store_root is not set"
    if ".." in path.parts:
        return f"checkpoint location {location!r} climbs out of the checkpoint store"
    return None
