"""A swap is judged by the acceptance after it against the acceptance since the swap before it."""

from __future__ import annotations

import pytest

from tlt_stream.rollout.collapse import AcceptanceWatch


def test_a_drafter_swap_that_halves_the_drafters_acceptance_is_a_collapse_judged_once() -> None:
    watch = AcceptanceWatch(min_drafted=100, ratio=0.5)
    watch.swapped("policy", 0, {}, {})
    drafted, accepted = {"eagle": 400, "group": 100}, {"eagle": 300, "group": 10}  # eagle 0.75 before
    watch.swapped("drafter", 3, drafted, accepted)
    assert watch.check({"eagle": 450, "group": 900}, {"eagle": 310, "group": 800}) is None, "too few eagle nodes"
    verdict = watch.check({"eagle": 500, "group": 900}, {"eagle": 320, "group": 800})
    assert verdict is not None and verdict.kind == "drafter" and verdict.version == 3
    assert verdict.before == pytest.approx(0.75) and verdict.after == pytest.approx(0.2) and verdict.collapsed
    assert watch.check({"eagle": 900}, {"eagle": 320}) is None, "judged once"


def test_a_policy_swap_is_judged_on_every_source_and_a_mild_drop_is_no_collapse() -> None:
    watch = AcceptanceWatch(min_drafted=100, ratio=0.5)
    watch.swapped("policy", 1, {"eagle": 0}, {"eagle": 0})
    watch.swapped("policy", 2, {"eagle": 100, "group": 100}, {"eagle": 80, "group": 40})  # 0.6 before
    verdict = watch.check({"eagle": 150, "group": 150}, {"eagle": 110, "group": 50})  # 0.4 after
    assert verdict is not None and not verdict.collapsed and verdict.before == pytest.approx(0.6)


def test_without_a_measured_baseline_there_is_no_collapse_to_call() -> None:
    watch = AcceptanceWatch(min_drafted=100)
    watch.swapped("policy", 0, {}, {})  # the first version: nothing before it
    verdict = watch.check({"group": 100}, {"group": 0})
    assert verdict is not None and verdict.before is None and not verdict.collapsed
    with pytest.raises(ValueError):
        AcceptanceWatch(ratio=1.5)
