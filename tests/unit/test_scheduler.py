"""Continuous-batching bookkeeping as plain code: admission, stopping, and slot compaction."""

from __future__ import annotations

import pytest

from tlt_stream.rollout.scheduler import Scheduler, Sequence, SequenceStatus, SlotMove


def seq(rid: int, prompt_len: int = 3, max_new: int = 4, eos: tuple[int, ...] = ()) -> Sequence:
    return Sequence(rid, list(range(1, prompt_len + 1)), max_new, frozenset(eos))


def test_sequence_stops_on_eos_or_length() -> None:
    s = seq(0, max_new=3, eos=(7,))
    s.status = SequenceStatus.RUNNING
    assert s.last_token == 3
    assert not s.append(5, -0.1)
    assert s.append(7, -0.2)
    assert (s.finish_reason, s.token_ids, s.logprobs) == ("eos", [5, 7], [-0.1, -0.2])
    assert s.is_finished and s.num_tokens == 5

    s = seq(1, max_new=2)
    s.status = SequenceStatus.RUNNING
    assert not s.append(1, 0.0)
    assert s.append(1, 0.0)
    assert s.finish_reason == "length"
    with pytest.raises(ValueError, match="FINISHED"):
        s.append(2, 0.0)


def test_sequence_rejects_bad_requests() -> None:
    with pytest.raises(ValueError, match="empty prompt"):
        Sequence(0, [], 4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        Sequence(0, [1], 0)
    with pytest.raises(ValueError, match="max_batch"):
        Scheduler(0)


def test_admits_fifo_into_free_slots_only() -> None:
    sched = Scheduler(max_batch=2)
    for i in range(3):
        sched.add(seq(i))
    admitted = sched.admit()
    assert [(s.request_id, s.slot, s.status) for s in admitted] == [
        (0, 0, SequenceStatus.RUNNING),
        (1, 1, SequenceStatus.RUNNING),
    ]
    assert sched.admit() == []
    assert sched.num_waiting == 1 and sched.num_running == 2
    with pytest.raises(ValueError, match="already queued or running"):
        sched.add(seq(2))


def test_prefill_budget_limits_padded_tokens_but_never_starves() -> None:
    sched = Scheduler(max_batch=8, max_prefill_tokens=10)
    sched.add(seq(0, prompt_len=12))
    sched.add(seq(1, prompt_len=2))
    assert [s.request_id for s in sched.admit()] == [0]
    for i in range(2, 6):
        sched.add(seq(i, prompt_len=3))
    assert [s.request_id for s in sched.admit()] == [1, 2, 3]  # 3 rows x 3 tokens <= 10


def finish(s: Sequence) -> None:
    s.status = SequenceStatus.FINISHED
    s.finish_reason = "length"


def test_retire_fills_holes_from_the_tail() -> None:
    sched = Scheduler(max_batch=6)
    seqs = [seq(i) for i in range(6)]
    for s in seqs:
        sched.add(s)
    sched.admit()
    for i in (1, 3, 5):
        finish(seqs[i])
    finished, moves = sched.retire()
    assert [s.request_id for s in finished] == [1, 3, 5]
    assert all(s.slot is None for s in finished)
    assert moves == [SlotMove(src=4, dst=1)]
    assert [(s.request_id, s.slot) for s in sched.running] == [(0, 0), (4, 1), (2, 2)]


def test_retire_moves_several_and_keeps_slots_contiguous() -> None:
    sched = Scheduler(max_batch=8)
    seqs = [seq(i) for i in range(8)]
    for s in seqs:
        sched.add(s)
    sched.admit()
    for i in (0, 2, 6):
        finish(seqs[i])
    _, moves = sched.retire()
    assert moves == [SlotMove(src=7, dst=0), SlotMove(src=5, dst=2)]
    assert [s.slot for s in sched.running] == list(range(5))
    assert [s.request_id for s in sched.running] == [7, 1, 5, 3, 4]


def test_retire_when_all_finish_and_reuse_of_ids() -> None:
    sched = Scheduler(max_batch=2)
    a, b = seq(0), seq(1)
    sched.add(a)
    sched.add(b)
    sched.admit()
    finish(a)
    finish(b)
    finished, moves = sched.retire()
    assert len(finished) == 2 and moves == [] and sched.is_idle
    sched.add(seq(0))
    assert [s.slot for s in sched.admit()] == [0]
    assert sched.retire() == ([], [])


def apply_moves(slots: list[int | None], moves: list[SlotMove]) -> list[int | None]:
    slots = list(slots)
    for m in moves:
        assert slots[m.dst] is None and slots[m.src] is not None
        slots[m.dst], slots[m.src] = slots[m.src], None
    return slots


def test_random_churn_keeps_cache_mirror_consistent() -> None:
    import random

    rng = random.Random(0)
    sched = Scheduler(max_batch=5)
    cache: list[int | None] = [None] * 5  # which request's KV each slot holds
    next_id = 0
    for _ in range(200):
        for _ in range(rng.randrange(3)):
            sched.add(seq(next_id))
            next_id += 1
        for s in sched.admit():
            cache[s.slot] = s.request_id
        for s in sched.running:
            if rng.random() < 0.3:
                finish(s)
        finished, moves = sched.retire()
        for s in finished:
            cache[cache.index(s.request_id)] = None
        cache = apply_moves(cache, moves)
        assert cache[: sched.num_running] == [s.request_id for s in sched.running]
        assert all(c is None for c in cache[sched.num_running :])
        assert [s.slot for s in sched.running] == list(range(sched.num_running))


def test_scheduler_imports_no_torch() -> None:
    import subprocess
    import sys
    from pathlib import Path

    code = "import sys, tlt_stream.rollout.scheduler; sys.exit('torch' in sys.modules)"
    root = Path(__file__).resolve().parents[2]
    assert subprocess.run([sys.executable, "-c", code], cwd=root, check=False).returncode == 0


def test_drafts_fill_only_the_rows_below_draft_rows_and_ordinary_requests_overtake_them() -> None:
    sched = Scheduler(max_batch=6, draft_rows=3)
    tail = [seq(i) for i in range(2)]
    drafts = [Sequence(f"d{i}", [1, 2], 8, ahead_limit=4) for i in range(4)]
    for s in [*tail, *drafts]:
        sched.add(s)
    assert [s.request_id for s in sched.admit()] == [0, 1, "d0"], "drafts only while fewer than 3 rows run"
    late = seq(9)
    sched.add(late)
    assert [s.request_id for s in sched.admit()] == [9], "an on-policy request is not held behind drafts"
    assert [s.request_id for s in sched.waiting] == ["d1", "d2", "d3"], "held drafts keep their order"
    for s in (tail[0], late):
        finish(s)
    sched.retire()
    assert [s.request_id for s in sched.admit()] == ["d1"], "a freed row below draft_rows takes the next draft"
    assert sched.num_running == 3
    with pytest.raises(ValueError, match="draft_rows"):
        Scheduler(4, draft_rows=0)
