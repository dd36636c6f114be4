"""tlt-stream: reasoning-RL training that tames the long tail of rollouts.

Rollout workers generate with lossless, adaptive speculative decoding and stream finished samples and hidden
states through Redis; idle workers train the drafter online; a policy service announces versions over MQTT;
a learner consumes finished groups (GRPO). Importing this package imports nothing heavy (no torch).
"""

__version__ = "0.1.0"
