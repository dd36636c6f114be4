"""The learner service's components. `roles/learner.py` holds the learner's loop and its wiring; the
`LearnerService` owns one of each, and each is handed the configuration and the few other parts it uses:

- `lease.py`: `RunLease`, the run's one learner, held by a fenced lease taken at start and renewed through
  updates;
- `checkpoints.py`: `Checkpoints`, the resume from the newest checkpoint that verifies, the policy trained
  from it, each save and the version it publishes;
- `intake.py`: `SampleIntake`, samples handed to the group assembler, poison and stale groups dealt with,
  entries acked;
- `update.py`: `Updates`, one GRPO update over complete groups, checkpointed and acked, tried again when it
  fails;
- `records.py`: `UpdateRecords`, what an update leaves behind: `LearnerStats`, `metrics.jsonl`, samples,
  trackers.

Every component logs under the role's one logger (`tlt_stream.roles.learner`), so the learner's lines carry
one name whichever part wrote them.
"""
