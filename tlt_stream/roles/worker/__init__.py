"""The rollout worker's parts. `roles/rollout_worker.py` holds the worker's settings, its loop and its wiring;
`RolloutWorker` is put together from these, one concern per module:

- `intake.py`: which tasks to read and when, poison dead-lettered, each group's G requests started;
- `generation.py`: one hop of engine steps, each response scored, whole groups sent and then acked;
- `loading.py`: the announced policy verified and loaded between steps (refused, or tried again later);
- `drafters.py`: drafter hot swaps, a verdict on every swap, the SD table, drafter training in idle time;
- `reports.py`: `RolloutStats` and `SdArmReport` entries, counted since the last report;
- `follow.py`: other workers' responses, indexed as history for group drafts.

Each part is a mixin over the worker's one state (the engine, the policy and drafter in it, the tasks in
flight): the parts call each other through `self`, each declares the attributes it reads from the others,
and sets up its own in an `_init_<part>` method the worker's constructor calls. Every part logs under the
role's one logger, so a worker's lines carry one name whichever part wrote them.
"""

from __future__ import annotations

import logging

log = logging.getLogger("tlt_stream.roles.rollout_worker")
