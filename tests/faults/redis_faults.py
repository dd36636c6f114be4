"""Redis losing its newest writes and refusing writes for memory, in whole runs."""

from __future__ import annotations

from tests.faults.scenario import Scenario

REDIS_FAULTS_SCENARIOS: list[Scenario] = []
