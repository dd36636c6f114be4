"""What a fault scenario is: its injection, the evidence that its recovery path ran, what it may cost."""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.faults.audit import AuditResult
from tests.faults.harness import FaultRun, PrivateServers

__all__ = ["Check", "Scenario"]

Check = Callable[[FaultRun, AuditResult], None]


@dataclass(frozen=True)
class Scenario:
    name: str
    what: str
    inject: Callable[[FaultRun, PrivateServers], Awaitable[float]]
    plan: dict[str, Any] = field(default_factory=dict)
    """Configuration keys (`policy.steps`, `launch.sd`, ...) beyond the common small ones."""
    evidence: Check | None = None
    """Asserts from the services' logs that the recovery path under test ran (a reclaim, a retry, a fallback)."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment for every service of the run (TLT_BUS__* settings)."""
    may_lose: Callable[[FaultRun, AuditResult], list[str]] | None = None
    """The sample ids this fault may cost (what the system promises to lose; None: nothing)."""
    prepare: Callable[[FaultRun], contextlib.AbstractAsyncContextManager[None]] | None = None
    """Set up around the whole run (before the services start, after they stopped)."""
    extended: bool = False
    """Left out of CI (tests run it with TLT_FAULTS_EXTENDED=1; `bench/faults.py` always does)."""
    known_bug: str | None = None
    """A product bug this scenario exposes: expected to fail (strictly) until it is fixed."""
    servers: Callable[[Path], PrivateServers] = PrivateServers
    """The private servers the run uses (a Redis behind a link that can be cut, one with other settings)."""
    unavailable: Callable[[], str | None] | None = None
    """Why this machine cannot run the scenario (None when it can): it is skipped, saying so."""
