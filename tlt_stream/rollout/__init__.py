"""Rollout generation: continuous-batching scheduler (pure), sampling, and the generation engine.

Import `tlt_stream.rollout.engine` or `tlt_stream.rollout.sampling` for the torch parts; this package itself
imports only the torch-free scheduler.
"""

from tlt_stream.rollout.scheduler import Scheduler, Sequence, SequenceStatus, SlotMove

__all__ = ["Scheduler", "Sequence", "SequenceStatus", "SlotMove"]
