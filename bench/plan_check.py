"""Check the planner against this machine: predicted beside measured step times and ratios of `bench/e2e.py`'s
(a) sync_plain, (b) sync_tlt, (c) stream_tlt and (g) sync_partial.

The cost model comes from `bench/plan_fit.py` (microbenchmarks only; one fit per thread count, since
`tlt-stream run` gives each process all cores when synchronous and splits them when streaming). The
workload comes from the measured runs themselves: each run's config replays its own groups in the order they
were dispatched, with their recorded response lengths and which of them the update trained (`--replay`: the
same seeds make (a)'s runs generate the same responses, so they differ only in the machine; with SD the arms
the tuner picks from measured timings, and in streaming the groups each update takes, vary with the machine,
and the policy and its responses with them), and
each SD arm's tokens per round per batch bucket from that run's timeline (`--no-replay`: lengths and
acceptance pooled over every run): the inputs of runs the model was not fitted on. Measured: the median over
`--runs` e2e runs (each run's own figure is the median step time of its steps after the first, or with
`--step-figure mean` their mean), with the runs' spread (min-max over median) beside it. A prediction within
15% of the measured median passes.

    flock /tmp/tlt-heavy.lock python bench/plan_check.py --world artifacts/world --runs 3 --steps 8 \\
        --costs-sync artifacts/plan/cpu-t2.json --costs-stream artifacts/plan/cpu-t1.json
    python bench/plan_check.py --e2e-json a.json b.json c.json ...   # runs already made

The check of docs/benchmarks.md: fits (`t2-pre.json`, `t1-pre.json`, ... `-post.json`) and the contention bench
made in the same lock hold as the runs, `--calibrated DIR --contention DIR/contention.json --load load.jsonl`:
each run predicted with the fits made around it, each fit's own background taken out and the run's own (its
services, Redis, the broker: `bench/plan_load.py`) put back by the contention bench's measured curve, and with
`--beside DIR/beside.json` the update beside the drafter's idle training (`bench/plan_beside.py`). With
`--probes DIR` (`bench/plan_hold.sh` makes them), each run's model is also scaled by how much slower the machine
was beside the run than beside its fits, from a few seconds of bare decode steps (`bench/plan_probe.py`) before
and after every fit and between the runs. With `--engine-factor in-run`, a diagnostic and not the check: each
run's engine made as fast as its own hops were (its measured hop seconds over the model's), so that what is
left of the error is the rest of the model (the worker's loop, loading, the learner, the schedule).

Each config's row also sets the worker's time per step beside the model's: generating (its engine hops and its
loop beside them, the loop by part as the worker's reports give it), loading and idle.

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

CONFIGS = ("a_sync_plain", "b_sync_tlt", "c_stream_tlt", "g_sync_partial")
RATIOS = {"b_over_a": "b_sync_tlt", "c_over_a": "c_stream_tlt", "g_over_a": "g_sync_partial"}
TOLERANCE = 0.15
STEP_FIGURE = "median"
"""A run's step time: the median of its steps after the first (`--step-figure median`), or their mean (`mean`:
its span from the first version to the last over the steps between)."""


def step_figure(times: list[float]) -> float:
    """A run's step time from its step times (after the first), as `STEP_FIGURE` says."""
    return statistics.median(times) if STEP_FIGURE == "median" else statistics.fmean(times)


def log(text: str) -> None:
    print(f"[plan_check] {text}", file=sys.stderr, flush=True)


def run_e2e(args: argparse.Namespace, i: int) -> dict:
    out = Path(args.out) / f"run{i}"
    command = [sys.executable, str(ROOT / "bench" / "e2e.py"), "--world", args.world, "--out", str(out)]
    command += ["--only", ",".join(CONFIGS), "--steps", str(args.steps), "--eval", "0"]
    command += ["--prompts-per-step", str(args.prompts)]
    log(f"e2e run {i + 1}/{args.runs}: {' '.join(command)}")
    done = subprocess.run(command, check=True, capture_output=True, text=True, cwd=ROOT)
    result = json.loads(done.stdout)
    (out / "e2e.json").parent.mkdir(parents=True, exist_ok=True)
    (out / "e2e.json").write_text(json.dumps(result, indent=2))
    return result


def split_reps(result: dict) -> list[dict]:
    """An e2e result of `--reps R` as R runs, one per rotation (a, b, c, g of rep r: run directories
    `CONFIG-r`), each config's figure from its steady steps' wall times (the gaps between consecutive versions
    after the first, as `bench/e2e.py` times them; `step_figure`); a result without reps as itself."""
    from tlt_stream.rl.records import load_metrics

    last = Path(next(iter(result["configs"].values()))["run_dir"])
    base, _, rep = last.name.rpartition("-")
    if not rep.isdigit() or not base:
        return [result]
    runs = []
    for r in range(1, int(rep) + 1):
        configs = {}
        for name in result["configs"]:
            run_dir = last.parent / f"{name}-{r}"
            times = [row["time"] for row in load_metrics(run_dir)]
            gaps = [b - a for a, b in itertools.pairwise(times)]
            configs[name] = {"run_dir": str(run_dir), "step_time_s_median": round(step_figure(gaps), 3)}
        runs.append({**result, "configs": configs})
    return runs


def workload(runs: list[dict], configs: tuple[str, ...] | None = None):
    """Lengths of every measured step after the first (all configs: the same task and policy; with `configs`,
    those alone), and the SD configs' tokens per target forward over their longest quarter of samples, weighted
    by length: a sample's figure mixes its plain steps (while the batch was wide) with its SD rounds, and the
    longest samples ran mostly in the tail, where SD is on."""
    from tlt_stream.plan.lengths import from_lengths
    from tlt_stream.rl.records import load_metrics

    lengths: list[int] = []
    pairs: list[tuple[float, float]] = []
    for run in runs:
        for name, figures in run["configs"].items():
            if configs is not None and name not in configs:
                continue
            for r in load_metrics(Path(figures["run_dir"]))[1:]:
                lengths += [int(x) for x in r.get("response_lens", [])]
                if name == "a_sync_plain":
                    continue
                accepts = r.get("accept_lengths") or [r.get("accept_length_mean", 1.0)] * len(r["response_lens"])
                pairs += [(float(n), max(float(a), 1.0)) for n, a in zip(r["response_lens"], accepts, strict=False)]
    pairs.sort()
    tail = pairs[3 * len(pairs) // 4 :]
    tokens, forwards = sum(n for n, _ in tail), sum(n / a for n, a in tail)
    return from_lengths(lengths, "the measured runs' responses"), (tokens / forwards if forwards else 1.0)


def own_workload(args: argparse.Namespace, run: dict, name: str, acceptance):
    """One run's config as the simulator replays it (`--replay`): its groups in dispatch order with their
    recorded lengths and trained shares, every update's (`Setup.replay`), and, for an SD config, each arm's
    acceptance per bucket from its own timeline (the pooled table where it recorded none)."""
    from tlt_stream.plan.acceptance import Acceptance, from_reports
    from tlt_stream.plan.lengths import replay_groups
    from tlt_stream.rl.records import load_metrics

    run_dir = Path(run["configs"][name]["run_dir"])
    groups = replay_groups(load_metrics(run_dir))
    if name != "a_sync_plain":
        _, accept = workload([run], (name,))
        mine = Acceptance.uniform(accept, f"{run_dir.name}'s tokens per target forward")
        if args.per_arm:
            mine = from_reports(timeline_reports(run_dir), accept, f"{run_dir.name}'s arm reports") or mine
        acceptance = mine
    return groups, acceptance


def timeline_reports(run_dir: Path) -> list[dict]:
    from tlt_stream.plan.acceptance import timeline_reports as read

    path = run_dir / "timeline.jsonl"
    return read(path) if path.exists() else []


def arm_reports(runs: list[dict]) -> list[dict]:
    """The SD configs' arm reports (each arm's tokens and rows per bucket) their run directories' timelines
    kept; empty for runs made before the reports counted rows."""
    return [
        report
        for run in runs
        for name, figures in run["configs"].items()
        if name != "a_sync_plain"
        for report in timeline_reports(Path(figures["run_dir"]))
    ]


@functools.cache
def prompt_len() -> float:
    from tlt_stream.tasks.repeated_add import RepeatedAddTask
    from tlt_stream.tasks.tokenizer import build_tokenizer

    tokenizer = build_tokenizer()
    prompts = [
        tokenizer(q.prompt, add_special_tokens=False)["input_ids"]
        for q in RepeatedAddTask().problems(64, 0, heldout=False)
    ]
    return statistics.fmean(len(p) for p in prompts)


def background(args: argparse.Namespace, runs: list[dict]) -> list[dict[str, dict]]:
    """Per run and config, the cores other work kept busy over its measured steps (the steps after the first:
    from the first version's announcement to the last's), and the worker's and learner's own, from the load
    samples of `bench/plan_load.py` (`--load`); {} for a run the samples do not cover."""
    from plan_load import read_samples, window_mean

    from tlt_stream.rl.records import load_metrics

    samples = [s for path in args.load or [] for s in read_samples(path)]
    out = []
    for run in runs:
        figures = {}
        for name in CONFIGS:
            rows = load_metrics(Path(run["configs"][name]["run_dir"]))
            start, end = rows[0]["time"], rows[-1]["time"]
            other = window_mean(samples, start, end)
            if other is not None:
                figures[name] = {
                    "other": round(other, 3),
                    "worker": round(window_mean(samples, start, end, "worker") or 0.0, 3),
                    "learner": round(window_mean(samples, start, end, "learner") or 0.0, 3),
                }
        out.append(figures)
    return out


def simulated(mode, setup, inputs: tuple, seeds: int, background: float, own: tuple | None = None) -> dict:
    """The median over `seeds` simulations of `mode` with `background` cores busy with other work; with `own`
    (`own_workload`), the run's own groups replayed and its own acceptance."""
    import dataclasses

    from tlt_stream.plan.simulate import simulate

    lengths, acceptance, costs = inputs
    if own is not None:
        setup, acceptance = dataclasses.replace(setup, replay=own[0]), own[1]
    results = [
        simulate(mode, dataclasses.replace(setup, seed=s, background_cores=background), lengths, acceptance, costs)
        for s in range(seeds)
    ]
    summaries = [r.summary() for r in results]
    spent = [as_states(x["worker_s_per_step"]) for x in summaries]
    return {
        "worker_s": {k: round(statistics.median(x.get(k, 0.0) for x in spent), 3) for k in WORKER_FIGURES},
        "step_time_s": round(statistics.median(step_figure(r.steady_step_times) for r in results), 3),
        "rollout_s": round(statistics.median(x["rollout_span_s"] for x in summaries), 3),
        "update_s": round(statistics.median(x["learner_s"] for x in summaries), 3),
        "sd_step_share": round(statistics.median(x["sd_step_share"] for x in summaries), 3),
    }


STATES = ("generating", "loading", "idle")
"""A worker's time per step as the check compares it: generating (engine steps and what the worker's loop does
between them), loading (a version verified and loaded, and with partial rollouts the rows in flight
re-verified) and idle (training the drafter, or waiting for work)."""


WORKER_FIGURES = (*STATES, "hops", "loop")
"""`STATES`, and inside `generating` the engine's hops (steps and prefill) and the worker's loop beside them."""


def as_states(parts: dict[str, float]) -> dict[str, float]:
    """The simulator's `worker_s_per_step` parts summed into `WORKER_FIGURES`."""
    out = dict.fromkeys(WORKER_FIGURES, 0.0)
    for label, seconds in parts.items():
        key = "loading" if label in ("load", "reverify") else "idle" if label in ("idle", "train") else "generating"
        out[key] += seconds
        if key == "generating":
            out["loop" if label == "loop" else "hops"] += seconds
    return out


@functools.cache
def worker_states(run_dir: Path) -> dict:
    """A run's worker time per steady step by `STATES`, from its workers' state changes (`timeline.jsonl`; from
    the first version's announcement to the last's, summed over workers), with `hops`, the engine hops' own
    seconds (the rollout reports') inside `generating`, and `loop`, the worker's loop beside them (the reports'
    `loop_s`, summed; reports made before the worker kept it have none), its parts in `loop_parts`. Computed once
    per run directory (`predict` and `measured` both ask): callers only read it."""
    from tlt_stream.rl.records import load_metrics

    rows = load_metrics(run_dir)
    start, end = rows[0]["time"], rows[-1]["time"]
    steps = max(len(rows) - 1, 1)
    changes: dict[str, list[tuple[float, str]]] = {}
    for e in timeline_entries(run_dir):
        if e.get("kind") == "worker_state":
            changes.setdefault(e["worker_id"], []).append((e["created_at"], e["state"]))
    out = dict.fromkeys(STATES, 0.0)
    for seq in changes.values():
        seq.sort()
        for (t0, state), (t1, _) in itertools.pairwise([*seq, (end, "")]):
            overlap = min(t1, end) - max(t0, start)
            key = {"GENERATING": "generating", "LOADING": "loading"}.get(state, "idle")
            if overlap > 0 and state != "STOPPED":
                out[key] += overlap
    reports = [e for e in rollout_entries(run_dir) if start <= e["created_at"] <= end]
    parts: dict[str, float] = {}
    for e in reports:
        for part, seconds in e.get("loop_s", {}).items():
            parts[part] = parts.get(part, 0.0) + seconds
    hops, loop = sum(e["seconds"] for e in reports), sum(parts.values())
    figures = {k: round(v / steps, 3) for k, v in [*out.items(), ("hops", hops), ("loop", loop)]}
    return {**figures, "loop_parts": {k: round(v / steps, 4) for k, v in sorted(parts.items())}}


def contention_of(args: argparse.Namespace) -> dict | None:
    """The contention bench's output (`--contention`): `fit`, the law, and `curve`, the measured slowdown (made
    from its points where an older output lacks it; left out with `--contention-law`, so the law is used)."""
    if not args.contention:
        return None
    from plan_contention import fit_curve, per_kind

    raw = json.loads(Path(args.contention).read_text())
    if args.contention_law:
        raw.pop("curve", None)
    elif "curve" not in raw:
        raw["curve"] = per_kind(raw["points"], lambda _, mine: fit_curve(mine))
    if args.beside:
        raw["learner_beside_training"] = beside_fit(args.beside)
    return raw


def beside_fit(path: str) -> float:
    """`bench/plan_beside.py`'s fit in `path` (`fit.learner_beside_training`, at least 1); ValueError, in one
    line, where the file is missing, is not JSON or holds no usable fit."""
    try:
        value = json.loads(Path(path).read_text())["fit"]["learner_beside_training"]
    except OSError as exc:
        raise ValueError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ValueError(f"{path}: not JSON (bench/plan_beside.py writes it)") from None
    except (KeyError, TypeError):
        raise ValueError(f"{path}: no fit.learner_beside_training (not bench/plan_beside.py's output?)") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 1:
        raise ValueError(f"{path}: fit.learner_beside_training is {value!r}, not a slowdown of at least 1")
    return float(value)


def fitted_costs(path: str, contention: dict | None):
    """The CPU model `bench/plan_fit.py` wrote to `path`; with the contention fit, its law's constants added and
    the background the fit itself ran beside taken out (`CpuCosts.without_background`)."""
    import dataclasses

    from tlt_stream.plan.costs import CpuCosts

    costs = CpuCosts.load(path)
    if contention is None:
        return costs
    fit, curve = contention["fit"], contention.get("curve")
    costs = dataclasses.replace(
        costs,
        engine_k=(fit["engine_t1"]["k"], fit["engine_t2"]["k"]),
        engine_wait_s=(fit["engine_t1"]["wait_s"], fit["engine_t2"]["wait_s"]),
        learner_k=(fit["learner_t1"]["k"], fit["learner_t2"]["k"]),
        learner_beside_training=contention.get("learner_beside_training", 1.0),
    )
    if curve:  # the measured slowdown, interpolated, in place of the law
        as_points = {key: tuple(tuple(p) for p in points) for key, points in curve.items()}
        costs = dataclasses.replace(
            costs,
            engine_curve=(as_points["engine_t1"], as_points["engine_t2"]),
            learner_curve=(as_points["learner_t1"], as_points["learner_t2"]),
        )
    during = json.loads(Path(path).read_text()).get("fit", {}).get("background_cores")
    threads = int(costs.source.rsplit(" ", 1)[-1]) if costs.source.startswith("bench/plan_fit.py") else 1
    return costs.without_background(during["engine"], during["learner"], threads) if during else costs


def beside(directory: Path, threads: str, contention: dict | None = None):
    """The CPU model of the fits made just before and just after a run (`DIR/{threads}-pre.json`, `-post.json`):
    each constant their mean (the one before alone where none was made after); with the contention fit, each
    fit's own background taken out first (`fitted_costs`)."""
    from tlt_stream.plan.costs import CpuCosts

    pre = fitted_costs(str(directory / f"{threads}-pre.json"), contention)
    after = directory / f"{threads}-post.json"
    post = fitted_costs(str(after), contention) if after.exists() else pre
    mean = {
        k: (v + getattr(post, k)) / 2 if isinstance(v, float) else v for k, v in pre.describe().items() if k != "model"
    }
    return CpuCosts(**mean)


def probe_factors(directory: Path) -> dict[str, dict[str, float]]:
    """Per run (its run directory's name) and thread count ("t2", "t1"), how much slower the machine was beside
    it than beside the fits (`bench/plan_probe.py`'s probes: `run-NAME.json` made before each run, the next
    probe in time after it; `fit-tT-*.json` around the fits at T threads): the mean of the probes before and
    after the run over the mean of the fits', per row count, the median over the row counts."""
    probes = sorted((json.loads(f.read_text()) for f in directory.glob("*.json")), key=lambda probe: probe["at"])
    runs = [i for i, probe in enumerate(probes) if probe["label"].startswith("run-") and probe["label"] != "run-end"]
    out: dict[str, dict[str, float]] = {}
    for i in runs:
        factors = {}
        for threads in ("t2", "t1"):
            fits = [probe["ms"][threads] for probe in probes if probe["label"].startswith(f"fit-{threads}-")]
            if not fits or i + 1 >= len(probes):
                raise ValueError(f"{directory}: no fit probes at {threads} or no probe after {probes[i]['label']}")
            beside = (probes[i]["ms"][threads], probes[i + 1]["ms"][threads])
            factors[threads] = round(
                statistics.median(
                    statistics.fmean(b[rows] for b in beside) / statistics.fmean(f[rows] for f in fits)
                    for rows in beside[0]
                ),
                4,
            )
        out[probes[i]["label"].removeprefix("run-")] = factors
    return out


def on_machine(costs, factors: dict[str, dict[str, float]], run: dict, name: str, threads: str):
    """`costs` on the machine beside the run of config `name` (`probe_factors`; as they are without probes)."""
    if not factors:
        return costs
    return costs.slower(factors[Path(run["configs"][name]["run_dir"]).name][threads])


def predict(args: argparse.Namespace, runs: list[dict], loads: list[dict[str, dict]]) -> dict:
    """The simulator's step times: per run, with that run's background (0 where it was not sampled), and on
    a quiet machine (no background)."""

    from tlt_stream.commands.run.launch import thread_split
    from tlt_stream.plan.acceptance import Acceptance, from_reports
    from tlt_stream.plan.lengths import trained_share
    from tlt_stream.plan.project import MODES
    from tlt_stream.plan.simulate import Setup
    from tlt_stream.rl.records import load_metrics

    lengths, accept = workload(runs)
    share = trained_share(
        [row for r in runs for f in r["configs"].values() for row in load_metrics(Path(f["run_dir"]))[1:]]
    )
    acceptance = Acceptance.uniform(accept, "the measured SD runs' tokens per target forward")
    if args.per_arm:  # each arm's acceptance per bucket as the runs measured it, where they recorded it
        acceptance = from_reports(arm_reports(runs), accept, "the SD runs' arm reports") or acceptance
    contention = contention_of(args)
    factors = probe_factors(Path(args.probes)) if args.probes else {}
    cores = len(os.sched_getaffinity(0))
    table = {f"{arm}@{'*' if b is None else b}": round(v, 3) for (arm, b), v in acceptance.table.items()}
    out = {
        "inputs": {
            "lengths": lengths.summary(),
            "tokens_per_round": round(accept, 3),
            "acceptance": table,
            "trained_share": round(share, 3) if args.trained_share else 1.0,
            "contention": contention,
            "costs": {
                "sync": fits(args, "t2", contention).describe(),
                "stream": fits(args, "t1", contention).describe(),
            },
            "calibrated": args.calibrated,
            "probe_factors": factors or None,
        },
        "configs": {},
    }
    for name in CONFIGS:
        mode = MODES[name]
        worker_threads, learner_threads = thread_split(cores, 1, mode.max_staleness)
        threads = "t2" if mode.max_staleness == 0 else "t1"
        costs = as_asked(args, fits(args, threads, contention))
        setup = Setup(
            prompts=args.prompts,
            steps=args.steps,
            prompt_len=round(prompt_len()),
            worker_threads=worker_threads,
            learner_threads=learner_threads,
            trained_share=share if args.trained_share else 1.0,
            judged_as_run=args.judged == "as-run",
        )

        quiet = simulated(mode, setup, (lengths, acceptance, costs), args.seeds, 0.0)
        per_run, in_run = [], []
        for run, (model, u) in zip(runs, engines(args, loads, threads, name), strict=True):
            model = as_asked(args, model)
            if args.calibrated:  # the run's own fits, made beside it, and the machine's speed beside it (probes)
                model = on_machine(model, factors, run, name, threads)
            own = own_workload(args, run, name, acceptance) if args.replay else None
            result = simulated(mode, setup, (lengths, acceptance, model), args.seeds, u, own)
            if args.engine_factor == "in-run":  # a diagnostic: the engine as fast as the run's own hops were
                measured_hops = worker_states(Path(run["configs"][name]["run_dir"]))["hops"]
                factor = measured_hops / result["worker_s"]["hops"]
                in_run.append(round(factor, 3))
                result = simulated(mode, setup, (lengths, acceptance, model.engine_slower(factor)), args.seeds, u, own)
            per_run.append(result)
        out["configs"][name] = {
            "step_time_s": round(statistics.median(r["step_time_s"] for r in per_run), 3),
            "runs": [r["step_time_s"] for r in per_run],
            "rollout_s": round(statistics.median(r["rollout_s"] for r in per_run), 3),
            "update_s": round(statistics.median(r["update_s"] for r in per_run), 3),
            "worker_s": {k: round(statistics.median(r["worker_s"][k] for r in per_run), 3) for k in WORKER_FIGURES},
            "engine_factors": in_run or None,
            "quiet": quiet,
            "threads": worker_threads,
        }
    a = out["configs"]["a_sync_plain"]["runs"]
    out["ratios"] = {
        k: round(statistics.median(x / y for x, y in zip(a, out["configs"][v]["runs"], strict=True)), 3)
        for k, v in RATIOS.items()
    }
    return out


def as_asked(args: argparse.Namespace, costs):
    """The fitted model, without its cost of switching between plain steps and rounds where `--no-switching`
    asks (an ablation: what the switching constants move)."""
    import dataclasses

    if args.switching:
        return costs
    return dataclasses.replace(costs, after_round_frac=0.0, after_one_plain_frac=0.0, after_plain_frac=0.0)


def measured(runs: list[dict]) -> dict:
    from tlt_stream.rl.records import load_metrics

    out: dict = {"configs": {}, "ratios": {}}
    for name in CONFIGS:
        values = [r["configs"][name]["step_time_s_median"] for r in runs if name in r["configs"]]
        states = [worker_states(Path(r["configs"][name]["run_dir"])) for r in runs if name in r["configs"]]
        med = statistics.median(values)
        rows = [
            row for r in runs if name in r["configs"] for row in load_metrics(Path(r["configs"][name]["run_dir"]))[1:]
        ]
        out["configs"][name] = {
            "step_time_s": round(med, 3),
            "runs": values,
            "spread": round((max(values) - min(values)) / med, 3),
            "rollout_s": round(statistics.median(x["rollout_seconds"] for x in rows), 3) if rows else None,
            "update_s": round(statistics.median(x.get("update_seconds", 0.0) for x in rows), 3) if rows else None,
            "worker_s": {k: round(statistics.median(x[k] for x in states), 3) for k in WORKER_FIGURES},
            "loop_parts": {
                part: round(statistics.median(x["loop_parts"].get(part, 0.0) for x in states), 4)
                for part in sorted({part for x in states for part in x["loop_parts"]})
            },
        }
    for key, name in RATIOS.items():
        values = [
            r["configs"]["a_sync_plain"]["step_time_s_median"] / r["configs"][name]["step_time_s_median"] for r in runs
        ]
        out["ratios"][key] = {"median": round(statistics.median(values), 3), "runs": [round(v, 3) for v in values]}
    return out


OUTSIDE_GAP_MAX_S = 1.0
"""Two rollout reports further apart than this lie across an update: left out of the time outside the hops."""


def in_situ(runs: list[dict], engines: list[tuple] | None = None, stream_engines: list[tuple] | None = None) -> dict:
    """Per config, the worker's own account of its engine steps in the runs (`timeline.jsonl`'s rollout reports:
    engine-hop seconds over target forwards) beside the rollout span: where a rollout's time went; the median
    time between two consecutive reports outside the later one's hop (the worker's loop: intake, Redis, reports). With
    `engines` (per run: the synchronous cost model and the background it is slowed by), (a)'s hops beside
    what the model says its plain steps cost (each report's rows: its tokens per forward)."""
    out: dict = {}
    if engines:
        ratios = []
        for run, (costs, u) in zip(runs, engines, strict=True):
            hop = model = 0.0
            for entry in rollout_entries(Path(run["configs"]["a_sync_plain"]["run_dir"])):
                if entry["target_forwards"]:
                    step = modelled_round_s(costs, u, entry["tokens"] / entry["target_forwards"])
                    hop, model = hop + entry["seconds"], model + entry["target_forwards"] * step
            ratios.append({"hops_s": round(hop, 2), "model_s": round(model, 2), "ratio": round(hop / model, 3)})
        out["a_engine_hops_vs_model"] = ratios
        out["rounds_vs_model"] = rounds_vs_model(runs, engines, stream_engines)
        out["updates_vs_model"] = updates_vs_model(runs, engines, stream_engines)
    for name in CONFIGS:
        hop = forwards = span = 0.0
        gaps: list[float] = []
        for run in runs:
            run_dir = Path(run["configs"][name]["run_dir"])
            last = None
            for entry in rollout_entries(run_dir):
                hop, forwards = hop + entry["seconds"], forwards + entry["target_forwards"]
                if last is not None and entry["created_at"] - last < OUTSIDE_GAP_MAX_S:
                    gaps.append(entry["created_at"] - last - entry["seconds"])
                last = entry["created_at"]
            span += sum(json.loads(x)["rollout_seconds"] for x in (run_dir / "metrics.jsonl").read_text().splitlines())
        out[name] = {
            "ms_per_forward": round(1e3 * hop / forwards, 3) if forwards else None,
            "hop_share_of_rollout": round(hop / span, 3) if span else None,
            "ms_outside_hops_per_report": round(1e3 * statistics.median(gaps), 1) if gaps else None,
        }
    return out


@functools.cache
def timeline_entries(run_dir: Path) -> tuple[dict, ...]:
    """The entries of a run's `timeline.jsonl`, in order (read once per run directory)."""
    return tuple(json.loads(line) for line in (run_dir / "timeline.jsonl").read_text().splitlines())


@functools.cache
def rollout_entries(run_dir: Path) -> tuple[dict, ...]:
    """The rollout reports of a run's `timeline.jsonl`, in order."""
    return tuple(entry for entry in timeline_entries(run_dir) if entry.get("kind") == "rollout")


def modelled_round_s(
    costs, u: float, rows: float, arm=None, context: float | None = None, threads: int = 2, accepted: float = 0.0
) -> float:
    """What the cost model of `threads` torch threads charges one engine step of `arm` (plain by default) at
    `rows` rows, a context of `context` tokens (None: the prompt and 90), its rows accepting `accepted` draft
    tokens each, beside `u` cores of other work."""
    from tlt_stream.plan.costs import slowdown
    from tlt_stream.rollout.arms import Arm

    context = prompt_len() + 90 if context is None else context
    step = costs.round_s(max(1, round(rows)), arm or Arm("plain"), context, accepted)
    return step * slowdown(costs, "engine", threads, u, 1 / step)


def updates_vs_model(runs: list[dict], engines: list[tuple], stream_engines: list[tuple] | None = None) -> dict:
    """Per config, each run's updates (its steps after the first: `metrics.jsonl`'s `update_seconds`) over what
    the cost model charges the same update: the micro-batched forward and backward of the step's own trained rows
    (its groups with a signal, at their recorded lengths and trained share, `replay_groups`) plus `optimizer_s`,
    slowed by the background each run's model comes with (`engines`, as `rounds_vs_model` takes them); the median
    over the run's updates. The synchronous configs that train the drafter, (b) and (g), pay the update beside
    its idle training too (`learner_beside_training`, as the simulator charges an update that holds every core),
    so what the model still leaves out beside the learner shows here. The synchronous configs with `engines`
    (2 threads), the streaming one with `stream_engines` (1 thread; the worker's rounds beside its updates are not
    charged here, so its ratio carries them)."""
    from tlt_stream.plan.costs import slowdown
    from tlt_stream.plan.lengths import replay_groups
    from tlt_stream.plan.project import MODES
    from tlt_stream.rl.records import load_metrics

    out: dict = {}
    configs = [(name, engines, 2) for name in CONFIGS if name != "c_stream_tlt"]
    if stream_engines is not None:
        configs.append(("c_stream_tlt", stream_engines, 1))
    for name, models, threads in configs:
        per_run = []
        for run, (costs, u) in zip(runs, models, strict=True):
            ratios = []
            for row in load_metrics(Path(run["configs"][name]["run_dir"]))[1:]:
                groups = replay_groups([row])
                lengths = [x for g, share in groups if share > 0 for x in g]
                if not lengths or not row.get("update_seconds"):
                    continue
                trained = sum(sum(g) * share for g, share in groups)
                learn = costs.learn_rows_s(lengths, prompt_len()) * trained / sum(lengths) + costs.optimizer_s
                mode = MODES[name]  # a synchronous update beside the drafter's training (it trains where SD runs)
                beside = costs.learner_beside_training if mode.sd and not mode.max_staleness else 1.0
                ratios.append(row["update_seconds"] / (learn * slowdown(costs, "learner", threads, u) * beside))
            per_run.append(round(statistics.median(ratios), 3) if ratios else None)
        out[name] = per_run
    return out


def rounds_vs_model(runs: list[dict], engines: list[tuple], stream_engines: list[tuple] | None = None) -> dict:
    """Per SD config, the worker's own time in each kind of round (`timeline.jsonl`'s `sd_arm` reports: steps,
    row-steps, contexts, tokens and seconds per arm and batch bucket) over what the cost model gives the same steps
    at the same mean rows, longest context and acceptance (`modelled_round_s`; the prompt and 90 tokens for reports
    without contexts, as `in_situ` charges (a)'s hops): plain steps and drafter rounds apart, per run. The
    synchronous configs with `engines` (2 threads), the streaming one with `stream_engines` (its worker's 1 thread,
    the background its own runs kept busy; the learner's update beside some of its rounds is not charged here, so a
    ratio above the synchronous configs' is the engine slower in the streaming worker, one near theirs puts a miss
    of the check in the schedule). (a) reports no arms."""
    from tlt_stream.rollout.switch import arm_of_report

    out: dict = {}
    configs = [("b_sync_tlt", engines, 2), ("g_sync_partial", engines, 2)]
    if stream_engines is not None:
        configs.append(("c_stream_tlt", stream_engines, 1))
    for name, models, threads in configs:
        per_run = []
        for run, (costs, u) in zip(runs, models, strict=True):
            sums: dict[str, list[float]] = {}
            for entry in timeline_reports(Path(run["configs"][name]["run_dir"])):
                if not entry.get("steps"):
                    continue
                arm = arm_of_report(SimpleNamespace(**entry))
                # the steps' own longest context where the worker counted it (reports since 2026-12-06)
                context = entry["contexts"] / entry["steps"] if entry.get("contexts") else None
                accepted = max(0.0, entry["tokens"] / entry["rows"] - 1.0) if entry.get("rows") else 0.0
                step = modelled_round_s(costs, u, entry["rows"] / entry["steps"], arm, context, threads, accepted)
                measured, model = sums.setdefault(arm.kind, [0.0, 0.0])
                sums[arm.kind] = [measured + entry["seconds"], model + entry["steps"] * step]
            per_run.append({k: round(m / x, 3) for k, (m, x) in sorted(sums.items()) if x})
        out[name] = per_run
    return out


def engines(
    args: argparse.Namespace, loads: list[dict[str, dict]], threads: str = "t2", config: str = "a_sync_plain"
) -> list[tuple]:
    """Per run, the cost model of `threads` ("t2": the synchronous configs', "t1": the streaming worker's) and
    the background `config` ran beside: with `--calibrated`, the run's own fits, made beside it (the machine's
    state is in their constants), and its services' background (not in the fits) where a contention law says
    what it costs; else the one fit given, and the background as measured."""
    contention = contention_of(args)
    if args.calibrated:
        return [
            (beside(Path(d), threads, contention), load.get(config, {}).get("other", 0.0) if contention else 0.0)
            for d, load in zip(args.calibrated, loads, strict=True)
        ]
    costs = fits(args, threads, contention)
    return [(costs, load.get(config, {}).get("other", 0.0)) for load in loads]


def fits(args: argparse.Namespace, threads: str, contention: dict | None):
    """The fit given on the command line for `threads`: `--costs-sync` ("t2") or `--costs-stream` ("t1")."""
    return fitted_costs(args.costs_sync if threads == "t2" else args.costs_stream, contention)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", default=str(ROOT / "artifacts" / "world"))
    p.add_argument("--out", default=str(ROOT / "artifacts" / "plan-check" / time.strftime("%Y%m%d-%H%M%S")))
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--seeds", type=int, default=5, help="simulations per config (the median is the prediction)")
    p.add_argument("--costs-sync", default=str(ROOT / "artifacts" / "plan" / "cpu-t2.json"))
    p.add_argument("--costs-stream", default=str(ROOT / "artifacts" / "plan" / "cpu-t1.json"))
    p.add_argument(
        "--per-arm",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="acceptance per arm and bucket from the runs' timelines (--no-per-arm: one figure for every arm)",
    )
    p.add_argument(
        "--trained-share",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="charge the update only the groups with a signal, as the runs' `degenerate_groups` say "
        "(--no-trained-share: every group)",
    )
    p.add_argument(
        "--replay",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="predict each run's config from its own workload: its groups' recorded lengths and trained shares "
        "in dispatch order, and its own acceptance (--no-replay: every run from the lengths and acceptance "
        "pooled over all runs)",
    )
    p.add_argument(
        "--step-figure",
        choices=("median", "mean"),
        default="median",
        help="a run's step time: the median of its steps after the first, or their mean (its span over them: "
        "robust to a streaming run's first steady steps differing in kind)",
    )
    p.add_argument("--e2e-json", nargs="*", help="outputs of bench/e2e.py already made (instead of --runs)")
    p.add_argument(
        "--load", nargs="*", help="load samples beside the runs (bench/plan_load.py): each run's background cores"
    )
    p.add_argument("--contention", help="the contention bench's output (bench/plan_contention.py)")
    p.add_argument(
        "--beside",
        help="with --contention: the update beside the drafter's idle training (bench/plan_beside.py), charged "
        "where a synchronous update leaves the training no core",
    )
    p.add_argument(
        "--contention-law",
        action="store_true",
        help="with --contention: its fitted law (1 + k u + w u f) instead of its measured curve",
    )
    p.add_argument(
        "--calibrated",
        nargs="*",
        help="per run (in --e2e-json's order; one: for every run), the directory of the light fits made just "
        "before and after it in the same lock hold (t2-pre.json, t2-post.json, t1-pre.json, t1-post.json): "
        "the runs predicted with the machine's state around them",
    )
    p.add_argument(
        "--probes",
        help="with --calibrated: the directory of `bench/plan_probe.py`'s probes made beside the runs "
        "(`bench/e2e.py --probe-dir`) and the fits (`bench/plan_hold.sh`): each run's model scaled by how much "
        "slower the machine was beside it than beside the fits (`probe_factors`)",
    )
    p.add_argument(
        "--engine-factor",
        choices=("model", "in-run"),
        default="model",
        help="the engine's speed: the fitted model's (the check), or, as a diagnostic of everything else the "
        "simulator models, each run's own (its measured hop seconds over the model's for the same work, the "
        "engine's constants scaled by it: not a prediction)",
    )
    p.add_argument(
        "--switching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="charge a step what following steps of the other kind costs (the fits' `switch_s`; --no-switching: "
        "every step its back-to-back cost, an ablation)",
    )
    p.add_argument(
        "--judged",
        choices=("as-run", "back-to-back"),
        default="as-run",
        help="the simulated tuner judges an arm by what its step would cost after the steps the worker ran (as "
        "the real tuner measures it), or by its back-to-back cost (an ablation)",
    )
    args = p.parse_args()
    if args.beside and not args.contention:
        p.error("--beside needs --contention (it is a contention constant, charged with the rest)")
    if args.beside:
        try:
            beside_fit(args.beside)
        except ValueError as exc:
            p.error(f"--beside {exc}")
    if args.probes and not args.calibrated:
        p.error("--probes needs --calibrated (the fits the probes stand beside)")
    global STEP_FIGURE
    STEP_FIGURE = args.step_figure
    if args.e2e_json:
        runs = [run for f in args.e2e_json for run in split_reps(json.loads(Path(f).read_text()))]
        args.steps = runs[0]["steps"]
        args.prompts = runs[0]["prompts_per_step"]
    else:
        runs = [run_e2e(args, i) for i in range(args.runs)]
    if args.calibrated and len(args.calibrated) == 1:  # one set of fits for every run (made around all of them)
        args.calibrated = args.calibrated * len(runs)
    loads = background(args, runs)
    got, want = predict(args, runs, loads), measured(runs)
    table = {}
    for name in CONFIGS:
        pred, meas = got["configs"][name]["step_time_s"], want["configs"][name]["step_time_s"]
        table[name] = {
            "predicted_s": pred,
            "measured_s": meas,
            "error": round(pred / meas - 1, 3),
            "within_15pct": abs(pred / meas - 1) <= TOLERANCE,
            "measured_spread": want["configs"][name]["spread"],
            "predicted_runs": got["configs"][name]["runs"],
            "measured_runs": want["configs"][name]["runs"],
            "background_cores": [load.get(name, {}).get("other") for load in loads],
            "quiet_predicted_s": got["configs"][name]["quiet"]["step_time_s"],
            "rollout_s": [got["configs"][name]["rollout_s"], want["configs"][name]["rollout_s"]],
            "update_s": [got["configs"][name]["update_s"], want["configs"][name]["update_s"]],
            "worker_s_per_step": {
                "predicted": got["configs"][name]["worker_s"],
                "measured": want["configs"][name]["worker_s"],
            },
            "loop_parts_measured": want["configs"][name]["loop_parts"],
            "engine_factors": got["configs"][name]["engine_factors"],
        }
    for key in RATIOS:
        pred, meas = got["ratios"][key], want["ratios"][key]["median"]
        table[key] = {
            "predicted": pred,
            "measured": meas,
            "measured_runs": want["ratios"][key]["runs"],
            "error": round(pred / meas - 1, 3),
            "within_15pct": abs(pred / meas - 1) <= TOLERANCE,
        }
    print(
        json.dumps(
            {
                "bench": "plan_check",
                "runs": len(runs),
                "table": table,
                "predicted": got,
                "measured": want,
                "in_situ": in_situ(runs, engines(args, loads), engines(args, loads, "t1", "c_stream_tlt")),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
