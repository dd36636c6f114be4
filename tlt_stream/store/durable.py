"""Durable writes: a directory that appears whole or not at all, files and directories fsynced before they
count. A process may die at any instant (OOM, preemption, SIGKILL); what it leaves is either the old state
or the new one, plus `.tmp-*` leftovers that readers skip and the next writer clears."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = [
    "TMP_PREFIX",
    "atomic_directory",
    "atomic_file",
    "describe_write_error",
    "disk_full",
    "fsync_dir",
    "fsync_tree",
    "remove_dir",
    "write_json",
]

TMP_PREFIX = ".tmp-"
"""Names that readers skip: a directory being built, or being removed."""
_FULL = ("No space left on device", "os error 28", "Disk quota exceeded", "os error 122")


def disk_full(exc: BaseException) -> bool:
    """Whether `exc`, or an error of a group it is, is a full file system (ENOSPC, EDQUOT), also when a library's
    writer wraps it (safetensors says `I/O error: No space left on device (os error 28)`)."""
    if isinstance(exc, BaseExceptionGroup):
        return any(disk_full(inner) for inner in exc.exceptions)
    return getattr(exc, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or any(word in str(exc) for word in _FULL)


def describe_write_error(exc: BaseException) -> str:
    """One line: the error's type and first line (a group's first full-disk error, else its first), and "(the
    file system is full)" when it is."""
    if isinstance(exc, BaseExceptionGroup):
        inner = [e for e in exc.exceptions if disk_full(e)] or list(exc.exceptions)
        return describe_write_error(inner[0])
    lines = str(exc).strip().splitlines()
    said = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    return f"{said} (the file system is full)" if disk_full(exc) else said


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file, then every directory bottom-up, so the whole tree is on disk before it is renamed."""
    for dirpath, _, filenames in os.walk(root, topdown=False):
        for f in filenames:
            fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


def write_json(path: Path, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())


def atomic_file(path: Path, data: bytes) -> None:
    """`path` holds `data` whole, durably, or is untouched: a `.tmp-` sibling, fsynced, renamed over it, the
    directory fsynced."""
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}-{uuid.uuid4().hex[:12]}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except Exception:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


@contextlib.contextmanager
def atomic_directory(final: Path) -> Iterator[Path]:
    """Build a directory that appears whole or not at all.

    Yields a temporary sibling of `final` (named `.tmp-...`, which readers skip) to fill. On a clean exit
    every file and directory in it is fsynced, it is renamed to `final` and the parent is fsynced. On an
    error it is removed; a process that dies meanwhile leaves only the `.tmp-` directory behind.
    """
    tmp = final.with_name(f"{TMP_PREFIX}{final.name}-{uuid.uuid4().hex[:12]}")
    tmp.mkdir()
    try:
        yield tmp
        fsync_tree(tmp)
        os.rename(tmp, final)
    except Exception:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(final.parent)


def remove_dir(path: Path) -> None:
    """Delete a checkpoint directory: first renamed to a `.tmp-` name (atomic), so no half-deleted one remains."""
    trash = path.with_name(f"{TMP_PREFIX}trash-{path.name}-{uuid.uuid4().hex[:12]}")
    os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)
