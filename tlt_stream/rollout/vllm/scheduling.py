"""A vLLM scheduler that takes a new speculation schedule without a new engine.

vLLM keeps its batch-size schedule (`num_speculative_tokens_per_batch_size`, the switch and per-bucket chain
lengths of a published `sd_config`) in the scheduler of its engine core process, fixed when the engine is
built; `collective_rpc` reaches only the workers, which run in other processes. Two channels reach the engine
core, and `TltScheduler` (named by `scheduler_cls`) reads both, rebuilding its lookup with vLLM's own
`build_dynamic_sd_schedule_lookup` when the schedule changes:
- a file the engine names in `additional_config["tlt_schedule_file"]`, which `VllmEngine.set_schedule`
  replaces atomically and the scheduler stats before every step (a new schedule applies from the next step,
  also to a batch that admits nothing new);
- each request: `set_schedule` attaches the newest schedule to every request it adds
  (`SamplingParams.extra_args`, which vLLM carries for plug-ins), for a vLLM without `additional_config`.
Chain lengths stay at most the engine's `num_speculative_tokens` (vLLM caps them).

This module imports vllm: only vLLM's engine core imports it, by the name `SCHEDULER`.
"""

from __future__ import annotations

import json
import os
from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

__all__ = ["SCHEDULE_KEY", "TltScheduler"]

SCHEDULE_KEY = "tlt_sd_schedule"
"""The `SamplingParams.extra_args` key of the schedule: [[first batch, last batch, K], ...]."""
SCHEDULE_FILE_KEY = "tlt_schedule_file"
"""The `additional_config` key naming the schedule file (JSON: the same list)."""


class TltScheduler(Scheduler):
    """vLLM's scheduler, whose batch-size schedule follows the newest one its requests carry."""

    _tlt_schedule: Any = None
    _tlt_stamp: Any = None

    def _tlt_apply(self, schedule: Any) -> None:
        if schedule is not None and schedule != self._tlt_schedule and self.num_spec_tokens > 0:
            self.dynamic_sd_lookup = build_dynamic_sd_schedule_lookup(
                schedule,
                vllm_max_batch_size=self.scheduler_config.max_num_seqs,
                vllm_num_speculative_tokens=self.num_spec_tokens,
            )
            self._tlt_schedule = schedule

    def add_request(self, request: Any) -> None:
        params = getattr(request, "sampling_params", None)
        self._tlt_apply((getattr(params, "extra_args", None) or {}).get(SCHEDULE_KEY))
        super().add_request(request)

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        extra = getattr(self.vllm_config, "additional_config", None)
        path = extra.get(SCHEDULE_FILE_KEY) if isinstance(extra, dict) else None
        if path is not None:
            try:
                stat = os.stat(path)
                stamp = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
                if stamp != self._tlt_stamp:
                    with open(path) as f:
                        schedule = json.load(f)
                    self._tlt_stamp = stamp
                    self._tlt_apply(schedule)
            except (OSError, ValueError):
                pass  # no schedule written yet (or a torn read: the next step reads it again)
        return super().schedule(*args, **kwargs)
