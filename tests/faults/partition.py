"""A real network partition between the services and Redis: packets dropped, not refused."""

from __future__ import annotations

from tests.faults.scenario import Scenario

PARTITION_SCENARIOS: list[Scenario] = []
