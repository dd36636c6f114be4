"""One digest for any checkpoint directory (a policy, a drafter): the integrity check behind every version
a worker adopts.

Workers load a version only after `verify_directory` matches the sha256 its publisher announced, so a torn copy
or a flipped bit is refused before it can steer rollouts. The hash covers relative names and bytes,
length-prefixed, never mtimes or absolute paths: the same weights hash the same wherever they are copied.
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

__all__ = ["ChecksumMismatch", "directory_sha256", "verify_directory"]

_HASH_DOMAIN = b"tlt-stream policy sha256 v1\0"
"""Mixed in first (unchanged since the first release: every published sha256 depends on it)."""
_HASH_CHUNK = 1 << 20


class ChecksumMismatch(Exception):
    """A checkpoint directory's contents do not hash to the expected sha256."""

    def __init__(self, policy_dir: Path | str, expected: str, found: str) -> None:
        self.policy_dir, self.expected, self.found = Path(policy_dir), expected, found
        super().__init__(f"{policy_dir}: policy sha256 mismatch: expected {expected[:12]}..., found {found[:12]}...")


def _files(root: Path) -> list[str]:
    """Relative POSIX names of every file under `root`, sorted; symlinked files count as their target."""
    names = []

    def vanished(error: OSError) -> None:  # os.walk skips an unreadable directory silently: an empty digest
        raise FileNotFoundError(f"{root}: policy directory vanished or unreadable while hashed ({error})")

    for dirpath, dirnames, filenames in os.walk(root, onerror=vanished):
        for d in dirnames:
            if os.path.islink(os.path.join(dirpath, d)):
                raise ValueError(f"{root}: symlinked directory {d!r} is not supported in a policy directory")
        for f in filenames:
            full = os.path.join(dirpath, f)
            if not stat.S_ISREG(os.stat(full).st_mode):
                raise ValueError(f"{full}: not a regular file")
            names.append(Path(full).relative_to(root).as_posix())
    return sorted(names)


def directory_sha256(directory: Path | str) -> str:
    """Deterministic sha256 of a directory's files: their relative names (sorted) and bytes, each length-prefixed.

    Files are streamed in 1 MiB chunks. The digest ignores mtimes, permissions and where the directory lives.
    """
    root = Path(directory)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: checkpoint directory does not exist")
    digest = hashlib.sha256(_HASH_DOMAIN)
    for name in _files(root):
        encoded = name.encode("utf-8", "surrogateescape")
        digest.update(len(encoded).to_bytes(8, "big"))
        digest.update(encoded)
        with open(root / name, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            digest.update(size.to_bytes(8, "big"))
            read = 0
            while chunk := f.read(_HASH_CHUNK):
                digest.update(chunk)
                read += len(chunk)
        if read != size:
            raise OSError(f"{root / name}: file changed size while it was being hashed")
    return digest.hexdigest()


def verify_directory(directory: Path | str, expected_sha256: str) -> None:
    """Raise `ChecksumMismatch` unless `directory` hashes to `expected_sha256` (FileNotFoundError if missing)."""
    found = directory_sha256(directory)
    if found != expected_sha256.strip().lower():
        raise ChecksumMismatch(directory, expected_sha256, found)
