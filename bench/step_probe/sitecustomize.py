"""A per-step probe of the torch engine inside a run's rollout workers (a diagnostic of the planner's check):
every plain decode step and speculative round the engine runs, with its rows, its longest context, its seconds
and (plain steps) the proposer's share, written as JSON lists to `$TLT_STEP_PROBE_OUT/<pid>.json` every 2 s.

Python imports `sitecustomize` at start-up from the path, so putting this directory first on `PYTHONPATH`
probes every process the run starts, with no change to the services:

    PYTHONPATH=bench/step_probe:$PWD TLT_STEP_PROBE_OUT=/tmp/steps python bench/e2e.py --only a_sync_plain ...
    python bench/step_probe/analyze.py --a /tmp/steps-a --b /tmp/steps-b

The engine module is imported late (when a worker builds its engine), so an import hook wraps its two step
methods as soon as the class exists, then removes itself.
"""

from __future__ import annotations

import atexit
import builtins
import json
import os
import sys
import threading
import time

OUT = os.environ.get("TLT_STEP_PROBE_OUT")
_steps: list[tuple] = []
_import = builtins.__import__


def _wrap(cls: type) -> None:
    decode, speculate = cls._decode_step, cls._speculative_step

    def longest(engine, rows: int) -> int:
        return int(engine.cache.lengths[:rows].max()) if rows else 0

    def timed_decode(self, seqs):
        rows, context, observed = len(seqs), longest(self, len(seqs)), [0.0]
        proposer = self.proposer
        if proposer is not None:
            observe = proposer.observe_step
            own = "observe_step" in vars(proposer)  # an instance attribute already (else the class's method)

            def timed_observe(*args, **kwargs):
                started = time.perf_counter()
                try:
                    return observe(*args, **kwargs)
                finally:
                    observed[0] += time.perf_counter() - started

            proposer.observe_step = timed_observe
        started = time.perf_counter()
        try:
            decode(self, seqs)
        finally:
            if proposer is not None:
                if own:
                    proposer.observe_step = observe
                else:
                    del proposer.observe_step
        _steps.append(("plain", rows, context, time.perf_counter() - started, observed[0]))

    def timed_speculate(self, seqs, arm):
        rows, context = len(seqs), longest(self, len(seqs))
        started = time.perf_counter()
        speculate(self, seqs, arm)
        _steps.append((arm.label, rows, context, time.perf_counter() - started, 0.0))

    cls._decode_step, cls._speculative_step = timed_decode, timed_speculate


def _hook(name, *args, **kwargs):
    module = _import(name, *args, **kwargs)
    engine = sys.modules.get("tlt_stream.rollout.engine")
    cls = getattr(engine, "GenerationEngine", None)
    if cls is not None:
        builtins.__import__ = _import
        _wrap(cls)
    return module


def _dump() -> None:
    if _steps:
        path = os.path.join(OUT, f"{os.getpid()}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(_steps, f)
        os.replace(path + ".tmp", path)


def _every_2s() -> None:
    while True:
        time.sleep(2)
        try:
            _dump()
        except OSError:
            pass


if OUT:
    os.makedirs(OUT, exist_ok=True)
    builtins.__import__ = _hook
    atexit.register(_dump)
    threading.Thread(target=_every_2s, name="step-probe", daemon=True).start()
