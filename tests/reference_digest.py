"""The directory digests written out again from their definition (docs/architecture.md), independently of
`store/digest.py`, so a test can check what the learner announces without trusting the code under test."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def _files(root: Path) -> list[Path]:
    return sorted((p for p in root.rglob("*") if p.is_file()), key=lambda p: p.relative_to(root).as_posix())


def _prefix(root: Path, path: Path) -> bytes:
    name = path.relative_to(root).as_posix().encode()
    return len(name).to_bytes(8, "big") + name + os.path.getsize(path).to_bytes(8, "big")


def sha256_v2(root: Path) -> str:
    """sha256("tlt-stream directory sha256 v2: name, size, file sha256\\0" + for each file, by sorted
    relative name: len(name) (8 bytes, big-endian) + name + size (8 bytes) + sha256(file))."""
    outer = hashlib.sha256(b"tlt-stream directory sha256 v2: name, size, file sha256\0")
    for path in _files(root):
        outer.update(_prefix(root, path) + hashlib.sha256(path.read_bytes()).digest())
    return outer.hexdigest()


def sha256_v1(root: Path) -> str:
    """sha256("tlt-stream policy sha256 v1\\0" + for each file, by sorted relative name: len(name) + name +
    size + the file's bytes)."""
    outer = hashlib.sha256(b"tlt-stream policy sha256 v1\0")
    for path in _files(root):
        outer.update(_prefix(root, path) + path.read_bytes())
    return outer.hexdigest()
