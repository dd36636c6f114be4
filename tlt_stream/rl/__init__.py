"""RL pieces: datasets, rewards, GRPO math (advantages, clipped token-mean loss); the learner core comes next."""
