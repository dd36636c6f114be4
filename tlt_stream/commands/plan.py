"""`tlt-stream plan`: project an RL step's time in each mode on a workload and hardware, before running it."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from tlt_stream.commands.args import EXIT_CONFIG

__all__ = ["handle", "register"]

_MODE_NAMES = "a_sync_plain,b_sync_tlt,c_stream_tlt,g_sync_partial,h_stream_partial,o_sync_overlap"


def register(commands: Any) -> None:
    p = commands.add_parser(
        "plan",
        help="project each mode's RL step time and speedup on your workload and hardware (a simulation)",
        description="Simulate RL steps (rollout workers, SD switch and arms, drafter training in idle time, the "
        "learner and weight publication) under an engine cost model and print each mode's projected step time "
        "and speedup over synchronous plain decoding, with the settings the model favours. Every figure is a "
        "PROJECTION from the inputs printed beside it, never a measurement.\n\n"
        "  tlt-stream plan --from-run runs/NAME --model-size 7B --gpu h100 --rollout-gpus 6 --learner-gpus 2\n"
        "  tlt-stream plan --lengths lognormal:3000:1.0:32768 --acceptance 5 --model-size 32B --gpu h200\n"
        "  tlt-stream plan --cpu-model artifacts/plan/cpu.json --from-run runs/NAME   # this machine\n"
        "  tlt-stream plan --paper                       # TLT's published setup against its 1.7x claim",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    src = p.add_argument_group("workload (one of)")
    src.add_argument("--from-run", metavar="DIR", help="a run directory: response lengths and acceptance from it")
    src.add_argument(
        "--lengths",
        metavar="LAW",
        help="a long-tailed law: lognormal:MEDIAN:SIGMA[:CAP], pareto:MIN:ALPHA[:CAP], uniform:LO:HI, const:N",
    )
    src.add_argument("--lengths-file", metavar="FILE", help="a JSON list of response lengths (a short rollout)")
    p.add_argument(
        "--acceptance", type=float, help="tokens per speculative round for every SD arm (default: the run's)"
    )
    p.add_argument(
        "--acceptance-table",
        metavar="JSON",
        help='tokens per round per arm and bucket, e.g. {"d4k1v4": {"0": 3.4, "*": 3.0}, "*": {"*": 2.5}} '
        "(bucket indices of the SD edges; * for any; an arm's figure at most what its round can emit, its "
        "deepest draft + 1, a * figure capped there), inline or a file holding it; arms it omits use --acceptance",
    )
    p.add_argument(
        "--acceptance-arm",
        metavar="ARM",
        help="the arm --acceptance was measured with (e.g. d8k4v48); other arms then by the budget law "
        "tau = 1 + (tau_ref - 1) log2(1 + nodes) / log2(1 + nodes_ref)",
    )
    p.add_argument("--arms", help="comma-separated SD arm labels the tuner chooses from (default: the config's)")
    p.add_argument(
        "--trained-share",
        type=float,
        help="share of groups the update trains on (groups whose rewards are all equal are left out; "
        "default: the run's, else 1)",
    )
    p.add_argument("--prompts", type=int, default=None, help="prompts per step (default 16; the paper's 64)")
    p.add_argument("--group-size", type=int, default=8, help="responses per prompt (default 8)")
    p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 32 on CPU, 512 on GPUs)")
    p.add_argument("--max-response", type=int, default=None, help="response tokens at most")
    p.add_argument("--steps", type=int, default=6, help="RL steps simulated per mode (default 6)")
    p.add_argument("--seeds", type=int, default=3, help="simulations per mode; the median is shown (default 3)")
    p.add_argument("--modes", default=_MODE_NAMES, help=f"comma-separated (default {_MODE_NAMES})")
    hw = p.add_argument_group("hardware (a GPU roofline, or this machine's fitted CPU model)")
    hw.add_argument("--gpu", help="GPU type: h100, h200 or a100 (datasheet figures)")
    hw.add_argument("--model-size", help=f"7B, 14B or 32B (Qwen2.5 shapes; default {_DEFAULT_MODEL_SIZE})")
    hw.add_argument("--rollout-gpus", type=int, help=f"GPUs generating (default {_DEFAULT_ROLLOUT_GPUS})")
    hw.add_argument("--learner-gpus", type=int, default=None, help="GPUs training; none: colocated with rollout")
    hw.add_argument("--tp", type=int, default=None, help="tensor-parallel GPUs per engine (default: by size)")
    hw.add_argument("--cpu-model", metavar="FILE", help="a CPU cost model fitted by bench/plan_fit.py")
    p.add_argument(
        "--vary", action="store_true", help="also project with each GPU assumption at its low and high (with --gpu)"
    )
    p.add_argument("--paper", action="store_true", help="TLT's published setup (Qwen2.5-7B/32B on H100) vs 1.7x")
    p.add_argument("--no-recommend", action="store_true", help="skip the recommended settings (faster)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument(
        "--plot",
        metavar="PNG",
        help="draw each mode's projected step time to this file (default with --from-run: RUN/plan.png)",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    p.set_defaults(handler=handle)


class PlanInputError(ValueError):
    """Bad input: one line for the user."""


def _positive(name: str, value: int | float | None) -> None:
    if value is not None and not (value > 0 and math.isfinite(value)):
        raise PlanInputError(f"{name} must be a positive number, got {value}")


def handle(args: argparse.Namespace) -> int:
    from tlt_stream.plan.lengths import LengthError

    try:
        path = _plot_path(args)
        result = _finite(run(args))
    except (PlanInputError, LengthError, ValueError, OSError) as exc:
        print(f"tlt-stream plan: {_one_line(exc)}", file=sys.stderr)
        return EXIT_CONFIG
    if args.json:
        print(json.dumps(result, indent=2, allow_nan=False))
    else:
        print(render(result))
    if path and result.get("modes"):
        try:
            plot(result, path)
        except (OSError, ValueError) as exc:
            if args.plot:  # asked for: the command did not do all it was told
                print(f"tlt-stream plan: --plot {path}: not drawn ({_one_line(exc)})", file=sys.stderr)
                return EXIT_CONFIG
            # the default beside the run is an extra: the projection stands; say why no plot is there
            print(
                f"tlt-stream plan: plot not written ({_one_line(exc)}); give --plot PNG to draw it elsewhere",
                file=sys.stderr,
            )
            return 0
        print(f"[plan] plot: {path}", file=sys.stderr)
    return 0


def _one_line(exc: BaseException) -> str:
    """An error's message on one line (an OSError's without its errno prefix)."""
    text = f"{exc.filename}: {exc.strerror}" if isinstance(exc, OSError) and exc.strerror and exc.filename else exc
    return " ".join(str(text).split())


def _finite(value: Any) -> Any:
    """`value` with every float that is not finite (an unbounded assumption such as a GPU's `cores`) as None, so
    the JSON output and the table are standard JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


_PLOT_FORMATS = (".png", ".pdf", ".svg", ".jpg", ".jpeg")


def _plot_path(args: argparse.Namespace) -> str | None:
    """Where to draw the plot (a folder given: plan.png in it). A --plot path is checked before the simulation
    runs: its folder must exist and be writable, its name end in a format the plot can be drawn in and not be a
    folder. The default beside the run is not: where it cannot be drawn, `handle` says so after the projection."""
    import os

    if not args.plot:
        usable = args.from_run and not args.paper and Path(args.from_run).is_dir()
        return str(Path(args.from_run) / "plan.png") if usable else None
    path = Path(args.plot)
    if path.is_dir():
        path = path / "plan.png"
    if path.suffix.lower() not in _PLOT_FORMATS:
        raise PlanInputError(f"--plot {path}: name the file with one of {', '.join(_PLOT_FORMATS)}")
    folder = path.parent
    if not folder.is_dir():
        raise PlanInputError(f"--plot {path}: no folder {folder}; create it or give another path")
    if path.is_dir():
        raise PlanInputError(f"--plot {path}: a folder is in its place; give another path")
    if not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise PlanInputError(f"--plot {path}: not writable; give another path")
    return str(path)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tlt_stream.plan.project import MODES

    for name in ("prompts", "group_size", "prompt_len", "max_response", "steps", "seeds", "rollout_gpus", "tp"):
        _positive("--" + name.replace("_", "-"), getattr(args, name))
    _positive("--learner-gpus", args.learner_gpus)
    if args.acceptance is not None and not (args.acceptance >= 1 and math.isfinite(args.acceptance)):
        raise PlanInputError(f"--acceptance is tokens per round (a finite number >= 1), got {args.acceptance}")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if unknown := [m for m in modes if m not in MODES]:
        raise PlanInputError(f"unknown modes {unknown}; choose from {_MODE_NAMES}")
    if not modes:
        raise PlanInputError(f"--modes names no mode; choose from {_MODE_NAMES}")
    args.gpu = _gpu(args.gpu)
    say = (lambda text: None) if args.quiet else (lambda text: print(f"[plan] {text}", file=sys.stderr, flush=True))
    if args.paper:
        from tlt_stream.plan.paper import compare

        if ignored := _given(args, _PAPER_IGNORES):
            raise PlanInputError(
                f"--paper projects TLT's published workload and hardware (only --gpu, --seeds and --vary apply); "
                f"drop {', '.join(ignored)}, or leave out --paper to project your own"
            )

        return compare(gpu=args.gpu or "h100", seeds=args.seeds, progress=say, vary=args.vary)
    return _workload(args, modes, say)


def _gpu(name: str | None) -> str | None:
    """The GPU table's key for a --gpu as written (any case, spaces around it)."""
    from tlt_stream.plan.roofline import GPUS

    if name is None:
        return None
    key = name.strip().lower()
    if key not in GPUS:
        raise PlanInputError(f"unknown --gpu {name!r}; choose from {', '.join(GPUS)}")
    return key


def _model_size(name: str) -> str:
    """The model table's key for a --model-size as written (7b, 7B, " 7B ")."""
    from tlt_stream.plan.roofline import MODELS

    key = name.strip().upper()
    if key not in MODELS:
        raise PlanInputError(
            f"unknown --model-size {name!r}; choose from {', '.join(MODELS)} (the Qwen2.5 shapes the planner knows)"
        )
    return key


_DEFAULT_MODEL_SIZE, _DEFAULT_ROLLOUT_GPUS = "7B", 8
"""What the GPU roofline projects when --model-size and --rollout-gpus are not given (they default to None, so
that one given beside --cpu-model or --paper, which ignore them, is told apart)."""

_GPU_ONLY = {
    "--model-size": "model_size",
    "--rollout-gpus": "rollout_gpus",
    "--learner-gpus": "learner_gpus",
    "--tp": "tp",
    "--vary": "vary",
}
"""The flags only the GPU roofline reads (each None or False unless given): --cpu-model ignores them."""

_WORKLOAD = {
    "--from-run": "from_run",
    "--lengths": "lengths",
    "--lengths-file": "lengths_file",
    "--acceptance": "acceptance",
    "--acceptance-table": "acceptance_table",
    "--acceptance-arm": "acceptance_arm",
    "--arms": "arms",
    "--trained-share": "trained_share",
    "--prompts": "prompts",
    "--prompt-len": "prompt_len",
    "--max-response": "max_response",
}
"""The flags of a user's own workload (each None unless given)."""

_PAPER_IGNORES = {**_WORKLOAD, **{f: d for f, d in _GPU_ONLY.items() if f != "--vary"}, "--cpu-model": "cpu_model"}
"""The flags of a user's own workload and hardware, which `--paper` does not read (its --vary it does)."""


def _given(args: argparse.Namespace, flags: dict[str, str]) -> list[str]:
    """Those of `flags` (flag -> its dest, None or False unless given) that the user gave, in their order."""
    return [flag for flag, dest in flags.items() if getattr(args, dest) not in (None, False)]


def _workload(args: argparse.Namespace, modes: list[str], say) -> dict[str, Any]:
    import dataclasses

    from tlt_stream.plan import lengths as L
    from tlt_stream.plan.acceptance import Acceptance, from_run
    from tlt_stream.plan.costs import CpuCosts
    from tlt_stream.plan.project import MODES, project, recommend, split_devices
    from tlt_stream.plan.roofline import GPUS, MODELS, GpuCosts
    from tlt_stream.plan.simulate import Setup
    from tlt_stream.rollout.arms import Arm

    if args.cpu_model:
        if args.gpu:
            raise PlanInputError("choose --gpu or --cpu-model, not both")
        if ignored := _given(args, _GPU_ONLY):
            raise PlanInputError(
                f"--cpu-model ignores {', '.join(ignored)} (the GPU roofline's inputs); drop them, or give --gpu "
                "instead of --cpu-model"
            )
    given = [x for x in (args.from_run, args.lengths, args.lengths_file) if x]
    if len(given) != 1:
        raise PlanInputError("give the workload once: --from-run DIR, --lengths LAW or --lengths-file FILE")
    if args.from_run:
        dist = L.from_run(args.from_run)
    elif args.lengths:
        dist = L.named(args.lengths)
    else:
        dist = L.from_lengths(_json_file(args.lengths_file, "--lengths-file"), args.lengths_file)
    sd_modes = [m for m in modes if MODES[m].sd]
    measured = _run_acceptance(args.from_run) if args.from_run and not args.acceptance else None
    tokens = args.acceptance or (measured[0] if measured else None)
    unpriced = tokens is None and not sd_modes  # plain decoding only: no speculative round to price
    if unpriced:
        tokens = 1.0
        acceptance = Acceptance.uniform(tokens, "not used: no mode with speculative decoding")
    elif tokens is None and args.from_run:
        raise PlanInputError(
            f"{args.from_run} recorded no speculative decoding (a plain run?); its acceptance is unknown, so give "
            f"--acceptance TOKENS per round for the modes with speculative decoding ({', '.join(sd_modes)}), "
            "or --modes a_sync_plain"
        )
    elif tokens is None:
        raise PlanInputError("--acceptance TOKENS is needed without --from-run (tokens per speculative round)")
    elif measured:  # each arm's own acceptance per bucket, where the run's timeline measured it
        source = f"{Path(args.from_run) / 'metrics.jsonl'} ({measured[1]})"
        timeline = Path(args.from_run) / "timeline.jsonl"
        acceptance = from_run(args.from_run, fallback=tokens) or Acceptance.uniform(
            tokens,
            f"{source}; every SD arm alike: {timeline} "
            f"{'has no usable SD arm report' if timeline.is_file() else 'is missing'}",
        )
    else:
        acceptance = Acceptance.uniform(tokens, "given")
    if args.arms:
        labels = tuple(a.strip() for a in args.arms.split(",") if a.strip())
        if sd_modes and not any(Arm.from_label(label).kind != "plain" for label in labels):
            raise PlanInputError(
                f"--arms {args.arms!r} names no SD arm; the modes with speculative decoding ({', '.join(sd_modes)}) "
                "need one (e.g. d4k1v4), or give --modes a_sync_plain"
            )
        if "plain" not in labels:
            labels = ("plain", *labels)
    if args.acceptance_arm:
        ref = Arm.from_label(args.acceptance_arm)
        if ref.kind == "plain":
            raise PlanInputError("--acceptance-arm must be an SD arm")
        if tokens > ref.most_tokens:
            raise PlanInputError(
                f"--acceptance {tokens:g} for {ref.label}: a round of {ref.levels} levels emits at most "
                f"{ref.most_tokens} tokens"
            )
        acceptance = Acceptance.published(tokens, ref, f"given for {ref.label}; other arms by the budget law")
    if args.acceptance_table:
        acceptance = _table(args.acceptance_table, acceptance)
    if args.gpu:
        size = _model_size(_DEFAULT_MODEL_SIZE if args.model_size is None else args.model_size)
        rollout_gpus = _DEFAULT_ROLLOUT_GPUS if args.rollout_gpus is None else args.rollout_gpus
        tp = args.tp or (8 if size == "32B" else 4 if size == "14B" else 1)
        if rollout_gpus % tp:
            raise PlanInputError(f"--rollout-gpus {rollout_gpus} is not a multiple of --tp {tp}")
        if MODELS[size].heads % tp:
            raise PlanInputError(
                f"{size}'s {MODELS[size].heads} attention heads do not split over --tp {tp}; give a --tp dividing them"
            )
        engines, prompts = rollout_gpus // tp, args.prompts or 16
        colocated = args.learner_gpus is None
        costs = GpuCosts(GPUS[args.gpu], MODELS[size], tp=tp, learner_gpus=args.learner_gpus or rollout_gpus)
        if costs.kv_capacity_tokens < 1:
            raise PlanInputError(
                f"{size}'s weights ({2 * costs.model.total_params / 1e9:.0f} GB) leave no room for a KV cache on "
                f"--tp {tp} {args.gpu} ({costs.gpu.memory_bytes / 1e9:.0f} GB each); give a larger --tp"
            )
        if args.prompt_len and args.prompt_len >= costs.kv_capacity_tokens:
            raise PlanInputError(
                f"--prompt-len {args.prompt_len} does not fit an engine's KV cache ({costs.kv_capacity_tokens} tokens "
                f"for {size} on --tp {tp} {args.gpu}); give a shorter --prompt-len or a larger --tp"
            )
        setup = Setup(
            workers=engines,
            # an even split, at least a group: engines beyond the step's groups stay idle
            max_batch=max(args.group_size, -(-prompts * args.group_size // engines)),
            prompt_len=args.prompt_len or 512,
            colocated=colocated,
            kv_capacity_tokens=costs.kv_capacity_tokens,
            macro_steps=32,
            crossover=1 + 32,
        )
    elif args.cpu_model:
        try:
            costs = CpuCosts.load(args.cpu_model)
        except OSError as exc:
            raise PlanInputError(f"--cpu-model {args.cpu_model}: cannot read it ({exc.strerror or exc})") from None
        except (TypeError, ValueError) as exc:
            raise PlanInputError(f"--cpu-model {exc}") from None
        setup = Setup(prompt_len=args.prompt_len or 32)
    else:
        raise PlanInputError("give the hardware: --gpu h100|h200|a100, or --cpu-model FILE from bench/plan_fit.py")
    setup = dataclasses.replace(
        setup,
        prompts=args.prompts or 16,
        group_size=args.group_size,
        steps=args.steps,
        max_response=args.max_response or setup.max_response,
        trained_share=_trained_share(args),
    )
    if args.arms:
        setup = dataclasses.replace(setup, arms=labels)
    if setup.group_size > setup.max_batch:
        raise PlanInputError(f"--group-size {setup.group_size} exceeds the engine's {setup.max_batch} rows")
    no_recommend = args.no_recommend or unpriced  # the settings turn on acceptance, which is not known here
    if args.gpu:  # the recommended switch, then the projection with it
        rec = recommend(setup, dist, acceptance, costs, progress=say) if not no_recommend else None
        if rec:
            setup = dataclasses.replace(setup, crossover=rec["sd_crossover"], margin=0)
    else:
        rec = None
    rows = project(setup, dist, acceptance, costs, modes, seeds=args.seeds, progress=say)
    if rec is None and not no_recommend:
        rec = recommend(setup, dist, acceptance, costs, progress=say)
    out: dict[str, Any] = {
        "kind": "PROJECTION (simulated, not measured)",
        "inputs": {
            "lengths": {"source": dist.source, **dist.summary()},
            "trained_share": setup.trained_share,
            "acceptance": {
                "tokens_per_round": tokens,
                "source": acceptance.source,
                "table": {
                    f"{arm}@{'*' if bucket is None else bucket}": round(v, 3)
                    for (arm, bucket), v in acceptance.table.items()
                },
            },
            "costs": costs.describe(),
            "setup": {k: v for k, v in dataclasses.asdict(setup).items() if k != "seed"},
            "seeds": args.seeds,
        },
        "modes": rows,
        "recommended": rec,
    }
    if args.gpu and not no_recommend:
        out["device_split"] = split_devices(
            setup, dist, acceptance, costs, rollout_gpus + (args.learner_gpus or 0), progress=say
        )
    if args.vary and args.gpu:
        from tlt_stream.plan.paper import vary_assumptions

        out["varied"] = vary_assumptions(setup, dist, acceptance, costs, modes, progress=say)
    return out


def _json_file(path: str, flag: str) -> Any:
    """A JSON file the user named with `flag` (one line naming it when it cannot be read or is not JSON)."""
    try:
        return json.loads(Path(path).read_text())
    except OSError as exc:
        raise PlanInputError(f"{flag} {path}: cannot read it ({exc.strerror or exc})") from None
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise PlanInputError(f"{flag} {path}: not JSON ({exc})") from None


def _table(path: str, fallback):
    """An acceptance table, inline or a file: {arm label or *: {bucket index or *: tokens per round}}; each
    entry a number from 1 to its arm's `most_tokens` (what a round can emit), each bucket one of the SD edges'."""
    from tlt_stream.plan.acceptance import Acceptance
    from tlt_stream.rollout.arms import Arm
    from tlt_stream.rollout.switch import DEFAULT_EDGES

    inline = path.lstrip().startswith(("{", "["))
    try:
        raw = json.loads(path) if inline else _json_file(path, "--acceptance-table")
    except (json.JSONDecodeError, RecursionError) as exc:
        raise PlanInputError(f"--acceptance-table: not JSON ({exc})") from None
    name = "--acceptance-table" + ("" if inline else f" {path}")
    shape = f"{name}: not {{arm: {{bucket: tokens}}}}"
    if not isinstance(raw, dict) or not all(isinstance(b, dict) for b in raw.values()):
        raise PlanInputError(f'{shape}, e.g. {{"d4k1v4": {{"0": 3.4, "*": 3.0}}, "*": {{"*": 2.5}}}}')
    buckets_known = range(len(DEFAULT_EDGES) + 1)
    table = {}
    for label, buckets in raw.items():
        arm = None if label == "*" else Arm.from_label(label)
        if arm is not None and arm.kind == "plain":
            raise PlanInputError(f"{name}: plain decoding emits 1 token per step; leave 'plain' out")
        for bucket, value in buckets.items():
            if bucket != "*" and not (bucket.isdigit() and int(bucket) in buckets_known):
                raise PlanInputError(
                    f"{name}: bucket {bucket!r} of {label!r} is not * or an SD bucket index 0-{buckets_known[-1]} "
                    f"(edges {list(DEFAULT_EDGES)})"
                )
            top = math.inf if arm is None else arm.most_tokens
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not 1 <= value <= top
                or math.isinf(value)
            ):
                most = "" if arm is None else f" and at most {top} ({arm.levels} levels + 1)"
                raise PlanInputError(f"{name}: {label}@{bucket} is {value!r}; tokens per round are >= 1{most}")
            table[label, None if bucket == "*" else int(bucket)] = float(value)
    source = "--acceptance-table (given)" if inline else path
    return Acceptance({**fallback.table, **table}, fallback.ref_nodes, fallback.ref_tokens, source=source)


def _trained_share(args: argparse.Namespace) -> float:
    if args.trained_share is not None:
        if not 0 < args.trained_share <= 1:
            raise PlanInputError(f"--trained-share is a share of groups in (0, 1], got {args.trained_share}")
        return args.trained_share
    if not args.from_run:
        return 1.0
    from tlt_stream.plan.lengths import run_rows, trained_share

    rows = run_rows(args.from_run)
    return round(trained_share(rows[1:] if len(rows) > 1 else rows), 4)


def _run_acceptance(run_dir: str) -> tuple[float, str] | None:
    """Tokens per target forward of the run's SD samples (every step but the first), and how it was read: per
    sample where the learner recorded them (weighted by length, as forwards are), else the median of the steps'
    means. None: the run recorded no SD sample."""
    from tlt_stream.plan.lengths import run_rows

    rows = run_rows(run_dir)
    rows = rows[1:] if len(rows) > 1 else rows
    tokens = forwards = 0.0
    for r in rows:
        lens, accepts = r.get("response_lens"), r.get("accept_lengths")
        if not isinstance(lens, list) or not isinstance(accepts, list):
            continue
        for n, a in zip(lens, accepts, strict=False):
            if _real(n) and _real(a) and n > 0 and a > 1.0:
                tokens, forwards = tokens + n, forwards + n / a
    if forwards:
        return tokens / forwards, "tokens per target forward of its SD samples"
    sd = sorted(a for r in rows if _real(a := r.get("accept_length_mean")) and a > 1.0)
    return (sd[len(sd) // 2], "the median of its steps' accept_length_mean") if sd else None


def _real(value: object) -> bool:
    """A finite number (not a bool) in a run's records."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


_SECTIONS = {
    "recommended": "the settings the projections favour; times PROJECTED",
    "device_split": "PROJECTED step time of each rollout + learner split, s",
    "varied": "PROJECTED speedup over (a) with each assumption at its low and high",
    "paper": "PROJECTED",
    "verdict": "from the PROJECTIONS",
}
"""The sections after the table, each headed as the projection it is."""


def render(result: dict[str, Any]) -> str:
    lines = [f"== {result.get('kind', 'PROJECTION')} =="]
    inputs = result.get("inputs", {})
    for key, value in inputs.items():
        lines.append(f"  {key}: {json.dumps(value, default=str)[:300]}")
    lines.append("")
    lines.append("  PROJECTED per mode (median over seeds):")
    lines.append(f"  {'mode':<18} {'step s':>10} {'vs (a)':>8} {'rollout s':>10} {'learner s':>10} {'SD steps':>9}")
    for name, row in result.get("modes", {}).items():
        lines.append(
            f"  {name:<18} {_cell(row.get('step_time_s'), '>10.3f')} {_cell(row.get('speedup_over_a'), '>7.2f')}x "
            f"{_cell(row.get('rollout_span_s') or 0, '>10.3f')} {_cell(row.get('learner_s') or 0, '>10.3f')} "
            f"{_cell(row.get('sd_step_share'), '>9.1%')}"
        )
    for key, heading in _SECTIONS.items():
        if result.get(key):
            lines.append(f"\n  {key} ({heading}): {json.dumps(result[key], indent=2, default=str)}")
    return "\n".join(lines)


def _cell(value: Any, spec: str) -> str:
    """A table figure; one the JSON holds as null (not a finite number) as "-"."""
    width = spec.lstrip("<>^").split(".")[0]
    return format(value, spec) if isinstance(value, int | float) else format("-", f">{width or 1}")


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result.get("modes", {})
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar(list(rows), [r["step_time_s"] or 0 for r in rows.values()])
    ax.set(ylabel="projected step time (s)", title="PROJECTION: step time per mode")
    ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
