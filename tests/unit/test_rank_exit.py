"""A learner rank's exit: nothing of the rank link outlives the interpreter.

A gloo worker thread lets go of a finished collective's tensors a moment after the caller has its result,
and letting go of a tensor Python also holds takes the GIL. When that moment falls after the interpreter
began shutting down, the thread is stopped inside a destructor and the process aborts ("terminate called
without an active exception", SIGABRT): seen as a rare exit code -6 of a 2-rank test whose every assertion
had passed, from the worker thread of the all-gather after STOP (core dump: `~AsyncAllgatherWork` in
`ProcessGroupGloo::runLoop`, the main thread in `Py_FinalizeEx`). The default group cannot be ended for
certain (once `torch.distributed.fsdp` is imported, `torch.distributed.nn` holds it in default arguments),
so the rank link's messages run on a group of their own, which `leave_ranks` destroys and drops.

The evidence is the operating system's list of this process's threads, not anything the link reports: the
threads the link's collectives started must be gone once `leave_ranks` returns, and both ranks exit 0.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tests.unit.test_sharded_learner import finish_ranks, start_ranks


def threads() -> set[int]:
    """This process's thread ids, from /proc."""
    return {int(t) for t in os.listdir("/proc/self/task")}


def rank_main(spec: str) -> None:
    """One rank (`python -c`): the default group and a collective on it (its threads), then the link (its
    group's threads) and its messages as a learner's last ones run (STOP, the reports after it), then
    `leave_ranks`; the thread sets at each point go to `rank-{rank}.json` in `spec["out"]`."""
    import datetime

    import torch
    import torch.distributed as dist

    from tlt_stream.rl.ranks import Command, WriteFailures, join_ranks, leave_ranks

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    import torch.distributed.fsdp  # as the trainer does: it pins the default group

    dist.all_reduce(torch.ones(1))
    before = threads()
    link = join_ranks("cpu", timeout_s=60)  # joins the default group made above, and makes its own
    assert link is not None
    if link.leader:
        link.command(Command.STOP)
    else:
        assert link.next_command()[0] == Command.STOP
    ok, reports = link.agree_reporting(True, WriteFailures(link.rank, link.rank, "x" * link.rank))
    assert ok and [r.count for r in reports] == [0, 1]
    during = threads()
    leave_ranks(link)
    after = threads()
    seen = {"before": sorted(before), "during": sorted(during), "after": sorted(after)}
    (Path(json.loads(spec)["out"]) / f"rank-{link.rank}.json").write_text(json.dumps(seen))


def test_leave_ranks_joins_every_thread_the_links_collectives_started(tmp_path: Path) -> None:
    finish_ranks(start_ranks(2, entry="tests.unit.test_rank_exit:rank_main", out=str(tmp_path)))  # each exits 0
    for rank in range(2):
        seen = {key: set(ids) for key, ids in json.loads((tmp_path / f"rank-{rank}.json").read_text()).items()}
        started = seen["during"] - seen["before"]
        assert started, "the link's group has threads of its own"
        assert not started & seen["after"], "leave_ranks joined every one of them"
