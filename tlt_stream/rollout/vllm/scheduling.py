"""A vLLM scheduler that takes a new speculation schedule without a new engine.

vLLM keeps its batch-size schedule (`num_speculative_tokens_per_batch_size`, the switch and per-bucket chain
lengths of a published `sd_config`) in the scheduler of its engine core process, fixed when the engine is
built; `collective_rpc` reaches only the workers, which run in other processes. What does reach the engine
core is each request: so `VllmEngine.set_schedule` attaches the newest schedule to every request it adds
(`SamplingParams.extra_args`, which vLLM carries for plug-ins), and `TltScheduler`, named by `scheduler_cls`,
rebuilds its lookup from it with vLLM's own `build_dynamic_sd_schedule_lookup` when it changes. A schedule
takes effect from the first request added after it; chain lengths stay at most the engine's
`num_speculative_tokens` (vLLM caps them).

This module imports vllm: only vLLM's engine core imports it, by the name `SCHEDULER`.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

__all__ = ["SCHEDULE_KEY", "TltScheduler"]

SCHEDULE_KEY = "tlt_sd_schedule"
"""The `SamplingParams.extra_args` key of the schedule: [[first batch, last batch, K], ...]."""


class TltScheduler(Scheduler):
    """vLLM's scheduler, whose batch-size schedule follows the newest one its requests carry."""

    _tlt_schedule: Any = None

    def add_request(self, request: Any) -> None:
        params = getattr(request, "sampling_params", None)
        schedule = (getattr(params, "extra_args", None) or {}).get(SCHEDULE_KEY)
        if schedule is not None and schedule != self._tlt_schedule and self.num_spec_tokens > 0:
            self.dynamic_sd_lookup = build_dynamic_sd_schedule_lookup(
                schedule,
                vllm_max_batch_size=self.scheduler_config.max_num_seqs,
                vllm_num_speculative_tokens=self.num_spec_tokens,
            )
            self._tlt_schedule = schedule
        super().add_request(request)
