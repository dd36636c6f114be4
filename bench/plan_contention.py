"""What the machine's other load costs the engine and the learner: the planner's CPU contention constants,
fitted on microbenchmarks alone.

Plain decode steps of the tiny world's policy (b = 1, 16, 128 rows) and learner updates (4 groups), at 1 and 2
torch threads, alone and beside synthetic load: `procs` processes that each compute `duty` of every 10 ms and
sleep the rest (as the run's services, Redis and the machine's neighbours wake and compute). Beside every
measurement the cores other processes kept busy are read from /proc (`bench/plan_load.py`): the synthetic
load plus whatever else ran, so the fit is against the load measured, not the load asked for.

Per kind (engine or learner) and thread count t, the fitted law (`tlt_stream/plan/costs.py`, `slowdown`):

    seconds(u) = seconds(0) * (1 + k_t * u) + w_t * u     u: cores busy with other work
                                                          w_t: per forward (engine only; 0 for the learner)

k_t, w_t and each batch's seconds(0) by least squares of the relative error (a grid over k, the rest linear);
the output keeps every point, so another law can be tried on the same data.

    flock /tmp/tlt-heavy.lock python bench/plan_contention.py --world artifacts/world \
        --out artifacts/plan/contention.json

Run it with the OpenMP setting of the runs it is for (`OMP_WAIT_POLICY`): with the default policy a 2-thread
step beside other work is 4-100x its quiet cost and erratic (docs/benchmarks.md, the planner's check), and the
fit takes many minutes.

Prints one JSON object and writes it to --out (`bench/plan_check.py --contention` reads it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

SPINNER = (
    "import time\nperiod, duty = {period}, {duty}\nwhile True:\n    t = time.perf_counter()\n"
    "    while time.perf_counter() - t < period * duty: pass\n    if duty < 1: time.sleep(period * (1 - duty))\n"
)
LOADS = ((0, 0.0), (1, 0.25), (1, 0.5), (1, 1.0), (2, 0.5), (2, 1.0), (3, 1.0))
"""(processes, duty) of the synthetic load."""
SESSIONS = ((0, 0.0, False), (1, 0.1, False), (1, 0.1, True), (1, 0.3, False), (1, 0.3, True))
"""`--sessions`: (processes, duty, in a session of their own) of the synthetic load."""


def log(text: str) -> None:
    print(f"[plan_contention] {text}", file=sys.stderr, flush=True)


def measured(fn, window: float, mine: set[int]) -> tuple[float, float]:
    """(seconds per call of `fn` over at least `window` seconds, cores other processes kept busy meanwhile)."""
    from plan_load import background_cores, cpu_seconds

    before, started, calls = cpu_seconds(), time.perf_counter(), 0
    while True:
        fn()
        calls += 1
        elapsed = time.perf_counter() - started
        if elapsed >= window:
            break
    return elapsed / calls, background_cores(before, cpu_seconds(), elapsed, mine)


def engine_point(policy, batch: int, window: float, mine: set[int]) -> tuple[float, float]:
    from plan_fit import prompts_of

    from tlt_stream.rollout.engine import GenerationEngine

    engine = GenerationEngine(policy, batch, 2200)
    for i, p in enumerate(prompts_of(batch)):
        engine.add_request(p, 2000, 1.0, seed=i, eos_ids=())
    for _ in range(4):
        engine.step()
    return measured(engine.step, window, mine)


def fit_law(points: list[dict], wait: bool) -> dict:
    """k (and, with `wait`, w) of `s = base_x (1 + k u) + w u` over points {x, s, u} (one forward per point:
    w is the seconds a forward waits per busy core), all >= 0: a grid over k and w; for each pair the bases
    minimise the squared relative error in closed form."""
    import numpy as np

    keys = sorted({p["x"] for p in points})
    s = np.array([p["s"] for p in points])
    u = np.array([p["u"] for p in points])
    ks = np.arange(0, 30.001, 0.05)
    ws = np.concatenate([[0.0], np.geomspace(1e-6, 0.1, 400)]) if wait else np.array([0.0])
    best = (np.inf, 0.0, 0.0, {})
    for k in ks:
        a = (1 + k * u) / s  # base's coefficient in the relative error
        rest = ws[:, None] * u[None, :] / s[None, :] - 1  # [w, point]: the rest of the relative error
        err = np.zeros(len(ws))
        bases = {}
        for x in keys:
            m = np.array([p["x"] == x for p in points])
            base = np.maximum(0.0, -(rest[:, m] @ a[m]) / (a[m] @ a[m]))  # [w]
            bases[x] = base
            err += ((base[:, None] * a[None, m] + rest[:, m]) ** 2).sum(axis=1)
        i = int(np.argmin(err))
        if err[i] < best[0]:
            best = (float(err[i]), float(k), float(ws[i]), {x: float(b[i]) for x, b in bases.items()})
    err, k, w, bases = best
    model = np.array([bases[p["x"]] * (1 + k * p["u"]) + w * p["u"] for p in points])
    return {
        "k": round(k, 3),
        "wait_s": w,
        "rms_relative_error": round(float(np.sqrt(err / len(points))), 4),
        "max_relative_error": round(float(np.max(np.abs(model / s - 1))), 4),
        "bases_s": {str(x): round(b, 6) for x, b in bases.items()},
    }


KINDS = ("engine", "learner")


def per_kind(points: list[dict], fit, kinds: tuple[str, ...] = KINDS) -> dict:
    """`fit(kind, its points)` per kind and thread count (1, 2), keyed `KIND_tTHREADS`."""
    return {
        f"{kind}_t{threads}": fit(kind, [q for q in points if q["kind"] == kind and q["threads"] == threads])
        for kind in kinds
        for threads in (1, 2)
    }


def fit_curve(points: list[dict]) -> list[list[float]]:
    """The slowdown as measured, load by load: per synthetic load (processes, duty), the median cores busy with
    other work and the median over batches and repeats of each point's seconds over its batch's unloaded median;
    sorted by those cores, starting at (0, 1). `costs.slowdown` interpolates it linearly (no law assumed)."""
    base = {
        x: statistics.median(p["s"] for p in points if p["x"] == x and p["load"][0] == 0)
        for x in {p["x"] for p in points}
    }
    curve = {}
    for load in sorted({tuple(p["load"]) for p in points if p["load"][0] > 0}):
        mine = [p for p in points if tuple(p["load"]) == load]
        u = statistics.median(p["u"] for p in mine)
        curve[load] = [round(u, 3), round(max(1.0, statistics.median(p["s"] / base[p["x"]] for p in mine)), 3)]
    return [[0.0, 1.0], *sorted(curve.values())]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", default=str(ROOT / "artifacts" / "world"))
    p.add_argument("--out", default=str(ROOT / "artifacts" / "plan" / "contention.json"))
    p.add_argument("--window", type=float, default=0.5, help="seconds each point is measured")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--period", type=float, default=0.01, help="seconds of each load process's compute+sleep cycle")
    p.add_argument("--quick", action="store_true", help="two loads, one repeat: a smoke check, not a fit")
    p.add_argument(
        "--sessions",
        action="store_true",
        help="the engine only, beside light load started in this process's session and in a session of its own "
        "(Linux shares the CPU between sessions' autogroups first): is the neighbours' session what hurts?",
    )
    args = p.parse_args()
    import os

    import torch
    from plan_fit import learner_batch

    from tlt_stream.model import load_model
    from tlt_stream.rl.learner import LearnerCore, LearnerSettings

    world = Path(args.world)
    loads = [(n, d, False) for n, d in (LOADS[::3] if args.quick else LOADS)]
    if args.sessions:
        loads = list(SESSIONS)
    repeats = 1 if args.quick else args.repeats
    policy = load_model(world / "policy")
    model, groups = learner_batch(world, 4)
    core = LearnerCore(model, LearnerSettings(lr=1e-6))
    core.step(groups)
    mine = {os.getpid()}
    points: list[dict] = []
    started = time.time()
    for procs, duty, apart in loads:
        spinners = [
            subprocess.Popen(
                [sys.executable, "-c", SPINNER.format(period=args.period, duty=duty)], start_new_session=apart
            )
            for _ in range(procs)
        ]
        try:
            time.sleep(0.3)
            for _ in range(repeats):
                for threads in (1, 2):
                    torch.set_num_threads(threads)
                    for batch in (1, 16, 128):
                        s, u = engine_point(policy, batch, args.window, mine)
                        load = [procs, duty, apart]
                        points.append({"kind": "engine", "threads": threads, "x": batch, "s": s, "u": u, "load": load})
                        log(f"engine t={threads} b={batch} load={load}: {1e3 * s:.2f} ms, u={u:.2f}")
                    if args.sessions:
                        continue
                    s, u = measured(lambda: core.step(groups), 2 * args.window, mine)
                    points.append(
                        {"kind": "learner", "threads": threads, "x": 4, "s": s, "u": u, "load": [procs, duty, apart]}
                    )
                    log(f"learner t={threads} load={procs}x{duty}: {s:.3f} s, u={u:.2f}")
        finally:
            for proc in spinners:
                proc.kill()
                proc.wait()
    kinds = ("engine",) if args.sessions else KINDS
    laws = per_kind(points, lambda kind, mine: fit_law(mine, wait=kind == "engine"), kinds)
    curves = per_kind(points, lambda _, mine: fit_curve(mine), kinds)
    out = {
        "bench": "plan_contention",
        "curve": curves,
        "law": "seconds(u) = seconds(0) * (1 + k * u) + wait_s * u per forward, u = cores busy with other work",
        "fit": laws,
        "points": [{**q, "s": round(q["s"], 6), "u": round(q["u"], 3)} for q in points],
        "period_s": args.period,
        "seconds": round(time.time() - started, 1),
        "median_u_unloaded": statistics.median(q["u"] for q in points if q["load"][0] == 0),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
