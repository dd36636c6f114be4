"""The learner service's parts. `roles/learner.py` holds the learner's settings, its loop and its wiring;
`LearnerService` is put together from these, one concern per module:

- `lease.py`: the run's one learner, held by a fenced lease taken at start and renewed through updates;
- `checkpoints.py`: resuming from the newest checkpoint that verifies, saving, publishing the version;
- `intake.py`: samples handed to the group assembler, poison and stale groups dealt with, entries acked;
- `update.py`: one GRPO update over complete groups, checkpointed and acked, tried again when it fails;
- `records.py`: what an update leaves behind: `LearnerStats`, `metrics.jsonl`, samples, trackers.

Each part is a mixin over the service's one state (the trainer and its core, the version and its
checkpoint, the assembler and the ready groups): the parts call each other through `self`, each declares
the attributes it reads from the others, and sets up its own in an `_init_<part>` method the service's
constructor calls. Every part logs under the role's one logger, so the learner's lines carry one name
whichever part wrote them.
"""

from __future__ import annotations

import logging

log = logging.getLogger("tlt_stream.roles.learner")
