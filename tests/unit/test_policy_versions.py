"""The rollout worker's policy-version state machine (`rollout/versions.py`) as plain transitions: a clock
passed in, no worker, no Redis."""

from __future__ import annotations

from tlt_stream.rollout.versions import PolicyVersions


def test_only_a_newer_version_that_was_never_refused_is_loadable() -> None:
    versions = PolicyVersions()
    assert not versions.loadable(None, current=-1, now=0.0)
    assert versions.loadable(0, current=-1, now=0.0)
    assert not versions.loadable(3, current=3, now=0.0) and not versions.loadable(2, current=3, now=0.0)
    versions.refuse(4)
    assert not versions.loadable(4, current=3, now=1e9), "refused for good, however long we wait"
    assert versions.loadable(5, current=3, now=0.0), "a newer announcement is still loaded"


def test_an_unreadable_version_is_retried_with_a_capped_doubling_backoff() -> None:
    versions = PolicyVersions(backoff_base_s=0.5, backoff_cap_s=3.0)
    delays = [versions.unreadable(7, now=100.0) for _ in range(5)]
    assert delays == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert versions.awaiting_retry(7, current=6) and not versions.awaiting_retry(8, current=6)
    assert not versions.loadable(7, current=6, now=102.9) and versions.loadable(7, current=6, now=103.0)
    assert versions.loadable(8, current=6, now=100.0), "a newer version does not wait for the old one's backoff"
    assert versions.unreadable(8, now=200.0) == 0.5, "another version starts its own backoff"
    versions.loaded(8)
    assert versions.unavailable is None and not versions.awaiting_retry(8, current=8)
    assert not versions.refused, "unreadable is never refused"
