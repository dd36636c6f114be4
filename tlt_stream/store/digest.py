"""One digest for any checkpoint directory (a policy, a drafter): the integrity check behind every version
a worker adopts.

Workers load a version only after its files hash to the sha256 its publisher announced, so a torn copy or a
flipped bit is refused before it can steer rollouts. The hash covers relative names, sizes and bytes,
length-prefixed, never mtimes or absolute paths: the same weights hash the same wherever they are copied.

Two schemes, told apart by what the publisher says it computed (`PolicyVersion.digest`, a checkpoint's
`meta.json` `policy_digest`; absent means v1, so announcements and checkpoints from before v2 still verify):

- **v1**: one sha256 streamed over every file in sorted order (name, size, bytes). Kept for checkpoints
  written before v2, which a learner resumes from and re-announces after an upgrade.
- **v2** (what is written now): a sha256 over the sorted (name, size, sha256 of the file) of every file. Each
  file is hashed on its own, so a writer hashes the bytes it writes as it writes them, in any order
  (`HashingWriter`), and never reads them back.

Either is verified in the pass that reads the files: `read_verified` reads each file once, hashes it and
hands the very bytes it hashed to the caller (a loader parses tensors from them), so what is loaded is
what was verified; nothing it returned counts until the whole directory matched.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Literal, TypeVar

__all__ = [
    "ChecksumMismatch",
    "DigestScheme",
    "HashingWriter",
    "directory_sha256",
    "read_verified",
    "verify_directory",
]

DigestScheme = Literal["v1", "v2"]
_DOMAINS: dict[str, bytes] = {
    "v1": b"tlt-stream policy sha256 v1\0",  # unchanged since the first release: every v1 sha256 depends on it
    "v2": b"tlt-stream directory sha256 v2: name, size, file sha256\0",
}
_HASH_CHUNK = 1 << 20
T = TypeVar("T")


class ChecksumMismatch(Exception):
    """A checkpoint directory's contents do not hash to the expected sha256."""

    def __init__(self, policy_dir: Path | str, expected: str, found: str) -> None:
        self.policy_dir, self.expected, self.found = Path(policy_dir), expected, found
        super().__init__(f"{policy_dir}: policy sha256 mismatch: expected {expected[:12]}..., found {found[:12]}...")


def _files(root: Path) -> list[str]:
    """Relative POSIX names of every file under `root`, sorted; symlinked files count as their target."""
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: checkpoint directory does not exist")
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


def _entry(name: str, size: int) -> bytes:
    encoded = name.encode("utf-8", "surrogateescape")
    return len(encoded).to_bytes(8, "big") + encoded + size.to_bytes(8, "big")


class _Digest:
    """The running digest of one scheme, fed file by file in sorted order."""

    def __init__(self, scheme: DigestScheme) -> None:
        if scheme not in _DOMAINS:
            raise ValueError(f"unknown digest scheme {scheme!r} (known: {sorted(_DOMAINS)})")
        self.scheme = scheme
        self.outer = hashlib.sha256(_DOMAINS[scheme])
        self.file: hashlib._Hash | None = None

    def start(self, name: str, size: int) -> None:
        self.outer.update(_entry(name, size))
        self.file = hashlib.sha256() if self.scheme == "v2" else self.outer

    def update(self, chunk: bytes | memoryview) -> None:
        assert self.file is not None
        self.file.update(chunk)

    def end(self) -> None:
        if self.scheme == "v2":
            assert self.file is not None
            self.outer.update(self.file.digest())
        self.file = None


def _read(root: Path, name: str, digest: _Digest, *, whole: bool) -> bytearray | None:
    """Hash file `name` into `digest` in one read; its bytes when `whole`, else streamed in 1 MiB chunks."""
    with open(root / name, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        digest.start(name, size)
        if whole:  # into one buffer the caller may keep views of (no second copy)
            data = bytearray(size)
            view, read = memoryview(data), 0
            while read < size and (got := f.readinto(view[read:])):
                read += got
            if read == size and f.read(1):
                read += 1  # it grew while read: said below
            digest.update(view[: min(read, size)])
        else:
            data, read = None, 0
            while chunk := f.read(_HASH_CHUNK):
                digest.update(chunk)
                read += len(chunk)
        digest.end()
    if read != size:
        raise OSError(f"{root / name}: file changed size while it was being hashed")
    return data


def directory_sha256(directory: Path | str, *, scheme: DigestScheme = "v1") -> str:
    """Deterministic sha256 of a directory's files under `scheme` (module docstring), streamed in 1 MiB chunks.

    The digest ignores mtimes, permissions and where the directory lives.
    """
    root = Path(directory)
    digest = _Digest(scheme)
    for name in _files(root):
        _read(root, name, digest, whole=False)
    return digest.outer.hexdigest()


def verify_directory(directory: Path | str, expected_sha256: str, *, scheme: DigestScheme = "v1") -> None:
    """Raise `ChecksumMismatch` unless `directory` hashes to `expected_sha256` (FileNotFoundError if missing)."""
    found = directory_sha256(directory, scheme=scheme)
    if found != expected_sha256.strip().lower():
        raise ChecksumMismatch(directory, expected_sha256, found)


def read_verified(
    directory: Path | str,
    expected_sha256: str,
    parse: Callable[[str, bytearray], T | None],
    *,
    scheme: DigestScheme = "v1",
) -> dict[str, T]:
    """Read every file of `directory` once, hashing it, and give its bytes to `parse(name, data)`; return what
    `parse` made of each file (None: nothing kept) once the whole directory matched `expected_sha256`.

    Raises `ChecksumMismatch` instead, and then nothing it parsed is returned; what `parse` raises is raised
    only when the directory matched (bytes that do not parse because they are damaged are a mismatch, so
    the rest is still hashed). Each file's bytes are held only while `parse` runs, so memory is what `parse`
    keeps plus one file.
    """
    root = Path(directory)
    digest = _Digest(scheme)
    parsed: dict[str, T] = {}
    failed: Exception | None = None
    for name in _files(root):
        data = _read(root, name, digest, whole=True)
        assert data is not None
        if failed is None:
            try:
                kept = parse(name, data)
            except Exception as exc:  # judged once the whole directory is hashed
                failed, parsed = exc, {}
            else:
                if kept is not None:
                    parsed[name] = kept
        del data
    found = digest.outer.hexdigest()
    if found != expected_sha256.strip().lower():
        raise ChecksumMismatch(root, expected_sha256, found) from failed
    if failed is not None:
        raise failed
    return parsed


class HashingWriter:
    """Files written into one directory, each fsynced and hashed from the bytes written (the v2 digest), so
    the directory's sha256 needs no second read. Files another writer put there (a config, a tokenizer:
    kilobytes) are hashed from disk once by `sha256`."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._hashed: dict[str, tuple[int, bytes]] = {}
        """name -> (size, sha256 of the bytes written)."""

    def write(self, name: str, data: bytes | memoryview) -> None:
        """Write `data` to `root/name` (POSIX relative name; parents created), fsynced, and hash it."""
        path = self.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        self._hashed[name] = (len(data), hashlib.sha256(data).digest())

    def sha256(self) -> str:
        """The v2 digest of every file now in the directory (what `directory_sha256(scheme="v2")` gives)."""
        digest = _Digest("v2")
        for name in _files(self.root):
            if name not in self._hashed:
                _read(self.root, name, digest, whole=False)
                continue
            size, file_sha = self._hashed[name]
            if os.stat(self.root / name).st_size != size:
                raise OSError(f"{self.root / name}: changed size after it was written")
            digest.outer.update(_entry(name, size) + file_sha)
        return digest.outer.hexdigest()
