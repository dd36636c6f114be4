"""The shared helpers: the stable hash is pinned (every sample's seed, every prompt id and the hidden-share
split come from it, so a change would silently change what a resumed run regenerates)."""

from __future__ import annotations

import hashlib

from tlt_stream.basics.common import as_text, stable_hex, stable_int


def test_the_stable_hash_is_sha1_of_the_utf8_text_truncated() -> None:
    assert stable_hex("s000000-0000/1", 12) == "407c728bbd02"  # pinned: the seed of task s000000-0000's sample 1
    assert stable_hex("é/0", 16) == hashlib.sha1("é/0".encode()).hexdigest()[:16]
    assert stable_int("task/3", 12) == int(stable_hex("task/3", 12), 16)


def test_as_text_decodes_bytes_only() -> None:
    assert as_text(b"1-0") == "1-0" and as_text("x") == "x" and as_text(None) is None and as_text(3) == 3
