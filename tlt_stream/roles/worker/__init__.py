"""The rollout worker's components. `roles/rollout_worker.py` holds the worker's loop and its wiring; the
`RolloutWorker` owns one of each, and each is handed the configuration and the few other parts it uses:

- `tasks.py`: `InFlight`, the tasks the worker holds (started groups, tasks waiting for their version);
- `loading.py`: `PolicyLoader`, the engine and the policy version in it, verified and loaded between steps;
- `drafters.py`: `DrafterSwaps`, drafter hot swaps, a verdict on every swap, the SD table;
- `intake.py`: `TaskIntake`, which tasks to read and when, poison dead-lettered, groups started;
- `generation.py`: `Generation`, hops of engine steps, each response scored, whole groups sent then acked;
- `reports.py`: `RolloutReports`, `RolloutStats` and `SdArmReport` entries counted since the last report;
- `follow.py`: `SampleFollower`, other workers' responses indexed as history for group drafts.

Every component logs under the role's one logger (`tlt_stream.roles.rollout_worker`), so a worker's lines
carry one name whichever part wrote them.
"""
