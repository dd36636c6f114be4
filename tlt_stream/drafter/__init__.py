"""The EAGLE-style drafter: model, losses and training steps, online training from hidden-state windows,
and export to serving engines. Pure of the bus: its Redis lease is `bus/lease.py`, its trainer is
`roles/drafter_trainer.py`."""
