"""The EAGLE-style drafter: model, checkpoints (and, later, its online training)."""
