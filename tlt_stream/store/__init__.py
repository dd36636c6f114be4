"""Checkpoint storage shared by the cores: one directory digest, durable (atomic, fsynced) writes, and
training state as safetensors + JSON. No pickles, no bus: the learner's checkpoint layout is `rl/checkpoint.py`,
the drafter's online state `drafter/online.py`."""
