"""RL pieces: datasets, rewards (and, later, GRPO math and the learner core)."""
