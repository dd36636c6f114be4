"""The role loops, one file per role: each holds its settings, its loop and its wiring to the bus; a role too
large for one file keeps its parts (mixins over the role's one object) in a folder beside it.

- `policy.py`: the policy service (dispatches prompt groups inside the staleness window);
- `sd_config.py`: the SD-config publisher (runs beside the policy service);
- `rollout_worker.py`: the rollout worker (generates on the newest verified policy, streams samples), its
  parts in `worker/`;
- `drafter_trainer.py`: the drafter trainer (trains the drafter on an idle worker, under a fenced lease);
- `learner.py`: the learner service (consumes groups, updates, checkpoints, acks, publishes), its parts
  in `learner_parts/`;
- `serve.py`: what every role's process shares (endpoints, Redis, the control plane, stop signals).

The cores below (`model`, `rollout`, `drafter`, `rl`, `tasks`) never import this package or the bus; the
entry points (`services/`, the `tlt-stream` command) import it late, after parsing their arguments.
"""
