"""The GRPO core: datasets, rewards, advantages and the clipped token-mean loss, group assembly, the learner
core, checkpoints, validation and per-step figures. Pure of the bus: the learner service is `roles/learner.py`."""
