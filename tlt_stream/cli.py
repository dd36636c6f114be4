"""The `tlt-stream` command. Parses arguments with nothing heavy imported, so `--help` answers at once;
each subcommand imports what it needs (torch, redis, ...) only when it runs."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pathlib import Path

EXIT_CONFIG = 2


def _add_config_args(parser: argparse.ArgumentParser, *, bus: bool = True) -> None:
    group = parser.add_argument_group("configuration")
    group.add_argument("--config", metavar="FILE", help="TOML configuration file")
    group.add_argument(
        "--set",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        dest="overrides",
        help="override one setting, e.g. --set bus.block_ms=500 (repeatable)",
    )
    group.add_argument("--run", help="run name (key and topic prefix); env TLT_RUN")
    if bus:
        group.add_argument("--redis-url", help="Redis URL; env TLT_REDIS_URL; default: embedded server")
        group.add_argument("--mqtt-url", help="MQTT URL; env TLT_MQTT_URL; default: embedded broker")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")


def _add_device_arg(parser: argparse.ArgumentParser) -> None:
    import os

    parser.add_argument(
        "--device",
        default=os.environ.get("TLT_DEVICE", "auto"),
        help="auto (CUDA when torch sees a device, else CPU), cpu, cuda or cuda:N; env TLT_DEVICE (default auto)",
    )


def _cmd_doctor(args: argparse.Namespace) -> int:
    from tlt_stream.doctor import doctor

    return doctor(load(args), as_json=args.json, timeout=args.timeout)


def _cmd_config(args: argparse.Namespace) -> int:
    import msgspec

    from tlt_stream.config import describe, redact_config

    if args.action == "describe":
        for key, default, text in describe():
            print(f"{key} = {default!r}\n    {text}")
        return 0
    config = load(args)
    print(msgspec.json.format(msgspec.json.encode(redact_config(msgspec.to_builtins(config)))).decode())
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from pathlib import Path

    from tlt_stream.generate import GenerateOptions, InputError, run_generate
    from tlt_stream.model import CheckpointError
    from tlt_stream.rollout.vllm.backend import BackendUnavailable

    sd = args.sd or ("on" if args.drafter else "off")
    if sd == "on" and not args.drafter:
        print("tlt-stream generate: --sd on needs --drafter DIR or --drafter ngram", file=sys.stderr)
        return EXIT_CONFIG
    options = GenerateOptions(
        model=Path(args.model),
        input=Path(args.input),
        output=Path(args.output),
        drafter=args.drafter if sd == "on" else None,
        depth=args.depth,
        topk=args.topk,
        verify=args.verify,
        temperature=args.temperature,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        batch_size=args.batch_size,
        dtype=args.dtype,
        backend=args.backend,
    )
    try:
        run_generate(options)
    except (InputError, CheckpointError, ValueError, BackendUnavailable) as exc:
        print(f"tlt-stream generate: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    return 0


def _cmd_bootstrap(args: argparse.Namespace) -> int:
    import json

    import torch

    from tlt_stream.progress import PhaseProgress
    from tlt_stream.tasks.bootstrap import bootstrap

    torch.set_num_threads(args.threads)
    with PhaseProgress() as progress:
        record = bootstrap(args.out, seed=args.seed, size=args.size, progress=progress)
    print(json.dumps(record, indent=2))
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    import asyncio
    import os
    import time
    from pathlib import Path

    import msgspec
    import torch

    from tlt_stream.aio import install_stop_signals
    from tlt_stream.config import redact_text
    from tlt_stream.launch import RunPlan, ensure_new_run, evaluate_version, run_plan
    from tlt_stream.model import resolve_device
    from tlt_stream.progress import PhaseProgress
    from tlt_stream.report import write_report
    from tlt_stream.tasks.bootstrap import SIZES, bootstrap, unfinished

    config = load(args)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    if args.run is None and "TLT_RUN" not in os.environ:  # a fresh namespace per run unless one is named
        config = msgspec.structs.replace(config, run=f"{config.run}-{stamp}")
    out = Path(args.out or f"runs/{config.run}")
    world = Path(args.world)
    if (out / "checkpoints").exists() and any((out / "checkpoints").iterdir()):
        print(f"tlt-stream run: {out} already holds checkpoints; choose a new --out", file=sys.stderr)
        return EXIT_CONFIG
    if config.bus.redis_url is not None:  # a configured server may hold this run's state already
        try:
            asyncio.run(ensure_new_run(config))
        except RuntimeError as exc:
            print(f"tlt-stream run: {redact_text(str(exc))}", file=sys.stderr)
            return 1
    cores = len(os.sched_getaffinity(0))
    torch.set_num_threads(cores)
    with PhaseProgress() as progress:
        if (why := _world_to_build(world, args.sd)) is not None:
            pending = unfinished(world) or {}
            print(f"tlt-stream run: {why}; bootstrapping the tiny world (a few minutes)", file=sys.stderr)
            size = pending.get("size") if pending.get("size") in SIZES else "default"
            bootstrap(world, seed=pending.get("seed", 0), size=size, progress=progress)
        try:
            resolve_device(args.device)  # a bad --device fails here, not in every service after start-up
            plan = RunPlan(
                world=world,
                run_dir=out,
                steps=args.steps,
                workers=args.workers,
                prompts_per_step=args.prompts_per_step,
                group_size=args.group_size,
                max_staleness=args.max_staleness,
                lr=args.lr,
                warmup_steps=args.warmup_steps,
                final_norm_lr_scale=args.final_norm_lr_scale,
                seed=args.seed,
                sd=args.sd,
                train_drafter=not args.no_drafter_training,
                adaptive_sd=not args.fixed_sd,
                hidden_share=args.hidden_share,
                max_len=args.max_len,
                device=args.device,
                cores=cores,
            )
        except (FileNotFoundError, ValueError) as exc:
            print(f"tlt-stream run: {redact_text(str(exc))}", file=sys.stderr)
            return EXIT_CONFIG
        print(f"tlt-stream run: {plan.steps} steps, {plan.workers} worker(s), run dir {out}", file=sys.stderr)
        if args.eval and not (out / "eval.jsonl").exists():
            row = evaluate_version(out, 0, world / "policy", n=args.eval, seed=args.seed, threads=cores)
            print(f"held-out accuracy before training: {row['accuracy']:.3f} ({args.eval} prompts)", file=sys.stderr)
        started = time.perf_counter()

        def on_step(rows: list[dict]) -> None:
            for row in rows:
                figures = {
                    "reward": row["reward_mean"],
                    "len_p50": row.get("response_len_p50", 0.0),
                    "rollout_tok/s": row.get("rollout_tokens_per_s", 0.0),
                    "learn_s": row["learn_seconds"],
                    "wait_s": row.get("wait_seconds", 0.0),
                }
                drafters = [int(k.rsplit("_", 1)[1]) for k in row if k.startswith("accept_length_drafter_")]
                if plan.sd != "off":  # tokens per target forward and the newest drafter version in the step
                    figures["accept"] = row.get("accept_length_mean", 1.0)
                    figures["drafter_v"] = float(max(drafters, default=-1))
                progress("train", row["version"], plan.steps, figures)

        async def main() -> int:
            stop = asyncio.Event()
            install_stop_signals(stop)
            code = await run_plan(plan, config, on_step=on_step, stop=stop)
            if code == 130:
                print("tlt-stream run: stopped; every service was shut down, checkpoints are intact", file=sys.stderr)
            return code

        try:
            code = asyncio.run(main())
        except (RuntimeError, FileNotFoundError, ValueError) as exc:  # a service's log tail among them
            print(f"tlt-stream run: {redact_text(str(exc))}", file=sys.stderr)
            return 1
    seconds = time.perf_counter() - started
    if code == 0 and args.eval:
        from tlt_stream.rl.checkpoint import latest_checkpoint

        final = latest_checkpoint(out / "checkpoints")
        assert final is not None
        row = evaluate_version(out, final.step, final.policy_dir, n=args.eval, seed=args.seed, threads=cores)
        print(f"held-out accuracy after {final.step} steps: {row['accuracy']:.3f}", file=sys.stderr)
    try:
        where = f"report: {write_report(out)}"
    except FileNotFoundError:  # stopped before the first update
        where = "no step finished, so no report"
    print(f"tlt-stream run: {'finished' if code == 0 else 'stopped'} in {seconds:.0f}s; {where}", file=sys.stderr)
    return code


DEFAULT_WORLD = "artifacts/world"


def _world_to_build(world: Path, sd: str) -> str | None:
    """Why `tlt-stream run` must bootstrap `world` first (None: it holds what the run needs). The default world
    is the command's own, built until it has a drafter; one given with --world is used as it is (a bootstrap
    left unfinished in it is finished), so a world of one's own without a drafter is refused, not replaced."""
    from pathlib import Path

    from tlt_stream.tasks.bootstrap import unfinished

    if unfinished(world) is not None:
        return f"{world} holds an unfinished bootstrap"
    if not (world / "policy").is_dir():
        return f"no policy in {world}"
    if sd == "eagle" and not (world / "drafter").is_dir() and world.resolve() == Path(DEFAULT_WORLD).resolve():
        return f"no drafter in {world}"
    return None


def _cmd_report(args: argparse.Namespace) -> int:
    from tlt_stream.report import write_report

    try:
        page = write_report(args.run_dir)
    except (FileNotFoundError, ValueError) as exc:
        print(f"tlt-stream report: {exc}", file=sys.stderr)
        return 1
    print(page)
    return 0


def _cmd_learner(args: argparse.Namespace) -> int:
    import torch

    from tlt_stream.roles.learner import serve_learner

    torch.set_num_threads(args.threads)
    return serve_learner(load(args), args)


def _cmd_rollout_worker(args: argparse.Namespace) -> int:
    import torch

    from tlt_stream.roles.rollout_worker import serve_rollout_worker

    torch.set_num_threads(args.threads)
    return serve_rollout_worker(load(args), args)


def _cmd_policy(args: argparse.Namespace) -> int:
    from tlt_stream.roles.policy import serve_policy

    return serve_policy(load(args), args)


def _cmd_monitor(args: argparse.Namespace) -> int:
    from tlt_stream.monitor import MonitorOptions, monitor

    options = MonitorOptions(
        once=args.once,
        as_json=args.json,
        prometheus=args.prometheus,
        bind=args.bind,
        interval=args.interval,
        window_s=args.window,
        timeout=args.timeout,
    )
    return monitor(load(args), options)


def _cmd_eval(args: argparse.Namespace) -> int:
    import json

    import torch

    from tlt_stream.model import CheckpointError
    from tlt_stream.progress import PhaseProgress
    from tlt_stream.tasks.evaluate import evaluate

    torch.set_num_threads(args.threads)
    try:
        with PhaseProgress() as progress:
            report = evaluate(
                args.model,
                drafter=args.drafter,
                n=args.n,
                temperature=args.temperature,
                seed=args.seed,
                batch_size=args.batch_size,
                depth=args.depth,
                topk=args.topk,
                progress=lambda done, total: progress("eval", done, total, {}),
            )
    except CheckpointError as exc:
        print(f"tlt-stream eval: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    if args.json:
        print(json.dumps(report))
    else:
        length = report["length"]
        print(f"accuracy {report['accuracy']:.1%} on {report['prompts']} held-out prompts (T={report['temperature']})")
        print(
            f"response length p50 {length['p50']:.0f}  p90 {length['p90']:.0f}  p99 {length['p99']:.0f}  "
            f"max {length['max']}  (max/median {length['max_over_median']:.1f}x)"
        )
        if "mean_accept_length" in report:
            print(f"mean acceptance length {report['mean_accept_length']:.2f} ({report['arm']})")
    return 0


def _cmd_export_drafter(args: argparse.Namespace) -> int:
    import json

    from tlt_stream.drafter.export import export_drafter
    from tlt_stream.model import CheckpointError

    try:
        result = export_drafter(
            args.checkpoint, args.out, format=args.format, policy=args.policy, dtype=args.dtype, overwrite=args.force
        )
    except (CheckpointError, OSError) as exc:
        print(f"tlt-stream export-drafter: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    print(
        json.dumps(
            {
                "out": str(result.path),
                "format": args.format,
                "architecture": "EagleLlamaForCausalLM",
                "tensors": list(result.tensors),
                "with_embedding": result.with_embedding,
            }
        )
    )
    return 0


def _share(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tlt-stream",
        description="Reasoning-RL training that tames the long tail: adaptive speculative decoding with an "
        "online drafter, streamed through Redis and MQTT.",
    )
    from tlt_stream import __version__

    parser.add_argument("--version", action="version", version=f"tlt-stream {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    doctor = commands.add_parser(
        "doctor",
        help="check Redis and MQTT: versions, streams, pending entries, workers, retained versions",
        description="Connect to the configured (or embedded) Redis and MQTT and report what is there. Exits 1 "
        "when something is unreachable.",
    )
    _add_config_args(doctor)
    doctor.add_argument("--json", action="store_true", help="print one JSON object")
    doctor.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for each server")
    doctor.set_defaults(handler=_cmd_doctor)

    gen = commands.add_parser(
        "generate",
        help="generate from a JSONL file of prompts with the rollout engine (plain or speculative)",
        description='Rows {"prompt_ids": [...]} or {"prompt": "..."} in; rows {token_ids, logprobs, '
        "finish_reason, accept_lengths} out, in input order.",
    )
    gen.add_argument("--model", required=True, help="Hugging Face checkpoint directory (Llama/Qwen2)")
    gen.add_argument("--drafter", help="drafter checkpoint directory, or 'ngram' for prompt lookup")
    gen.add_argument("--sd", choices=["off", "on"], help="speculative decoding (default: on with --drafter)")
    gen.add_argument("--depth", type=_positive, default=4, help="draft depth (levels)")
    gen.add_argument("--topk", type=_positive, default=1, help="children per drafted node (1: a chain)")
    gen.add_argument("--verify", type=_positive, help="nodes verified per round (default depth x topk)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 for greedy")
    gen.add_argument("--max-new-tokens", type=_positive, default=256)
    gen.add_argument("--seed", type=int, default=0, help="row i samples with seed + i")
    gen.add_argument("--batch-size", type=_positive, default=32, help="rows decoded together at most")
    gen.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    gen.add_argument(
        "--backend",
        choices=["torch", "vllm"],
        default="torch",
        help="torch: this project's engine; vllm: vLLM on a GPU (pip install 'tlt-stream[vllm]'; EAGLE chains)",
    )
    gen.add_argument("--input", required=True, help="JSONL prompts")
    gen.add_argument("--output", required=True, help="JSONL results")
    gen.add_argument("-v", "--verbose", action="count", default=0)
    gen.set_defaults(handler=_cmd_generate)

    boot = commands.add_parser(
        "bootstrap",
        help="build the tiny world: a warmed-up policy (DIR/policy) and drafter (DIR/drafter)",
        description="Supervised warm-up of a small policy on the repeated-addition task, then an offline warm-up of "
        "the drafter on the policy's own generations. Deterministic for a seed; skipped when DIR already "
        "holds a matching result.",
    )
    boot.add_argument("--out", required=True, help="directory to build in")
    boot.add_argument("--seed", type=int, default=0)
    boot.add_argument("--size", choices=["small", "default"], default="default")
    boot.add_argument("--threads", type=_positive, default=2, help="torch threads")
    boot.add_argument("-v", "--verbose", action="count", default=0)
    boot.set_defaults(handler=_cmd_bootstrap)

    ev = commands.add_parser(
        "eval",
        help="accuracy and response lengths on held-out prompts (and acceptance length with a drafter)",
    )
    ev.add_argument("--model", required=True, help="policy checkpoint directory")
    ev.add_argument("--drafter", help="drafter checkpoint directory, or 'ngram'")
    ev.add_argument("--n", type=_positive, default=200, help="held-out prompts")
    ev.add_argument("--temperature", type=float, default=1.0)
    ev.add_argument("--seed", type=int, default=0)
    ev.add_argument("--batch-size", type=_positive, default=32)
    ev.add_argument("--depth", type=_positive, default=4)
    ev.add_argument("--topk", type=_positive, default=1)
    ev.add_argument("--threads", type=_positive, default=2)
    ev.add_argument("--json", action="store_true", help="print one JSON object")
    ev.add_argument("-v", "--verbose", action="count", default=0)
    ev.set_defaults(handler=_cmd_eval)

    export = commands.add_parser(
        "export-drafter",
        help="write a drafter checkpoint in the layout vLLM's EAGLE loader reads (config.json + safetensors)",
        description="Export CHECKPOINT (a drafter directory, or an online-training state holding drafter/) for "
        "serving: --format eagle writes vLLM's EAGLE-1 Llama draft layout, loaded with "
        'speculative_config={"method": "eagle", "model": OUT}. The embedding and LM head are shared from the '
        "target by vLLM and are not written (see docs/vllm.md).",
    )
    export.add_argument("checkpoint", help="drafter checkpoint directory (or an online-training state directory)")
    export.add_argument("--format", choices=["eagle"], default="eagle", help="target layout (default eagle)")
    export.add_argument("--out", required=True, help="directory to write (created; must be empty unless --force)")
    export.add_argument(
        "--policy", help="also write this policy checkpoint's embedding (vLLM loads it only with pipeline parallelism)"
    )
    export.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    export.add_argument("--force", action="store_true", help="replace an existing export in --out")
    export.add_argument("-v", "--verbose", action="count", default=0)
    export.set_defaults(handler=_cmd_export_drafter)

    from tlt_stream.launch import TINY_WORLD_FINAL_NORM_LR_SCALE, TINY_WORLD_LR  # light: dataclasses, config

    run = commands.add_parser(
        "run",
        help="the whole system on this machine: policy service, rollout workers and learner as processes",
        description="Bootstraps the tiny world if needed, starts (embedded or configured) Redis and MQTT, the "
        "policy service, N rollout workers and the learner as separate processes, shows progress, evaluates "
        "held-out accuracy before and after, and leaves metrics, checkpoints, logs and plots in --out.",
    )
    run.add_argument("--steps", type=_positive, default=60, help="policy updates to run")
    run.add_argument("--workers", type=_positive, default=1, help="rollout worker processes")
    run.add_argument("--out", help="run directory (default runs/RUN-TIMESTAMP)")
    run.add_argument(
        "--world",
        default=DEFAULT_WORLD,
        help=f"tiny world directory (built or finished when missing or unfinished; {DEFAULT_WORLD}, the default, "
        "also when it lacks the drafter --sd eagle needs)",
    )
    run.add_argument("--prompts-per-step", type=_positive, default=16)
    run.add_argument("--group-size", type=_positive, default=8)
    run.add_argument("--max-staleness", type=int, default=0, help="0: on-policy")
    run.add_argument(
        "--lr", type=float, default=TINY_WORLD_LR, help=f"learner AdamW learning rate (default {TINY_WORLD_LR:g})"
    )
    run.add_argument("--warmup-steps", type=int, default=20, help="learner learning-rate warmup (updates)")
    run.add_argument(
        "--final-norm-lr-scale",
        type=float,
        default=TINY_WORLD_FINAL_NORM_LR_SCALE,
        help="learner: the final norm's gain trains at lr x this "
        f"(default {TINY_WORLD_FINAL_NORM_LR_SCALE:g}: the tiny world's recipe, docs/benchmarks.md issue 5)",
    )
    run.add_argument(
        "--sd",
        choices=["off", "eagle", "ngram"],
        default="eagle",
        help="rollout speculative decoding (default eagle: adaptive SD with the drafter trained online)",
    )
    run.add_argument(
        "--no-drafter-training",
        action="store_true",
        help="with --sd eagle: keep the warm-up drafter (no online training)",
    )
    run.add_argument(
        "--hidden-share",
        type=_share,
        default=0.25,
        help="share of samples whose hidden states feed drafter training (default 0.25: on a CPU the trainer "
        "uses a fraction of them, and streaming all of them slowed rollouts ~8%%; docs/benchmarks.md issue 6)",
    )
    run.add_argument(
        "--fixed-sd", action="store_true", help="with --sd: always speculate with the default arm (no adaptive SD)"
    )
    run.add_argument("--max-len", type=_positive, default=1408, help="prompt + response tokens per rollout row")
    run.add_argument("--eval", type=int, default=256, help="held-out prompts evaluated before and after (0: skip)")
    run.add_argument("--seed", type=int, default=0)
    _add_device_arg(run)
    _add_config_args(run)
    run.set_defaults(handler=_cmd_run)

    rep = commands.add_parser("report", help="plots and an HTML page for a run directory")
    rep.add_argument("run_dir", help="a run directory written by `tlt-stream run` or the learner")
    rep.add_argument("-v", "--verbose", action="count", default=0)
    rep.set_defaults(handler=_cmd_report)

    learn = commands.add_parser(
        "learner",
        help="the GRPO learner service: consume samples, update, checkpoint, publish policy versions",
        description="Consumes the run's `samples` stream, assembles complete groups, applies one GRPO update "
        "per --groups-per-step groups, checkpoints to RUN_DIR/checkpoints (resuming from there after a "
        "restart) and publishes each new policy version on MQTT and in the Redis mirror.",
    )
    learn.add_argument("--run-dir", required=True, help="checkpoints, metrics.jsonl")
    learn.add_argument("--policy", required=True, help="initial policy checkpoint (used when RUN_DIR has none)")
    learn.add_argument("--groups-per-step", type=_positive, default=8)
    learn.add_argument("--max-staleness", type=int, default=0, help="0: on-policy (synchronous semantics)")
    learn.add_argument("--lr", type=float, default=2e-4, help="AdamW learning rate")
    learn.add_argument("--warmup-steps", type=int, default=20, help="linear learning-rate warmup (updates)")
    learn.add_argument(
        "--final-norm-lr-scale",
        type=float,
        default=1.0,
        help="the final norm's gain (the policy's inverse temperature) trains at lr x this (default 1)",
    )
    learn.add_argument("--max-updates", type=_positive, help="stop after this many updates (default: run on)")
    learn.add_argument(
        "--until-version",
        type=_positive,
        help="stop once the policy reaches this version, counting what a resumed checkpoint already holds",
    )
    learn.add_argument(
        "--keep-checkpoints", type=_positive, default=3, help="complete checkpoints kept on disk (the newest)"
    )
    learn.add_argument("--threads", type=_positive, default=1, help="torch threads")
    _add_device_arg(learn)
    _add_config_args(learn)
    learn.set_defaults(handler=_cmd_learner)

    worker = commands.add_parser(
        "rollout-worker",
        help="a rollout worker: generate prompt groups on the newest verified policy, stream scored samples",
    )
    worker.add_argument("--worker-id", help="default: rollout-HOST-PID")
    worker.add_argument("--max-batch", type=_positive, default=64, help="rows decoded together")
    worker.add_argument("--max-len", type=_positive, default=1408, help="prompt + response tokens per row")
    worker.add_argument("--temperature", type=float, default=1.0)
    worker.add_argument("--reward", default="repeated_add", help="reward function (repeated_add, math)")
    worker.add_argument(
        "--drafter", help='speculative decoding: a drafter checkpoint directory or "ngram" (default: off)'
    )
    worker.add_argument(
        "--sd-arm", type=_arm, default=(4, 1, 4), help="DEPTH,TOPK,VERIFY of the SD arm (default 4,1,4)"
    )
    worker.add_argument(
        "--no-hidden", action="store_true", help="do not stream hidden-state windows (no drafter training data)"
    )
    worker.add_argument(
        "--hidden-share",
        type=_share,
        default=1.0,
        help="share of samples whose hidden-state windows are streamed, by a stable hash of the id (default 1)",
    )
    worker.add_argument(
        "--adaptive-sd",
        action="store_true",
        help="with --drafter: decide SD per step (on/off by running batch, arm per batch bucket) instead of --sd-arm",
    )
    worker.add_argument(
        "--sd-crossover", type=_positive, default=16, help="batch size above which SD loses (measured; default 16)"
    )
    worker.add_argument(
        "--train-drafter",
        metavar="STATE_DIR",
        help="train the drafter online in idle time, keeping training states in STATE_DIR (shared by the "
        "run's workers); needs --drafter DIR",
    )
    worker.add_argument(
        "--backend",
        choices=["torch", "vllm"],
        default="torch",
        help="rollout engine: this project's (default) or vLLM (GPU, `pip install 'tlt-stream[vllm]'`, fixed "
        "--sd-arm only; UNVERIFIED, docs/vllm.md)",
    )
    worker.add_argument("--max-tasks", type=_positive, help="stop after this many tasks (default: run on)")
    worker.add_argument("--threads", type=_positive, default=1, help="torch threads")
    _add_device_arg(worker)
    _add_config_args(worker)
    worker.set_defaults(handler=_cmd_rollout_worker)

    policy = commands.add_parser(
        "policy", help="the policy service: dispatch prompt groups step by step inside the staleness window"
    )
    policy.add_argument("--prompts-per-step", type=_positive, default=8)
    policy.add_argument("--group-size", type=_positive, default=8, help="samples per prompt (GRPO's G)")
    policy.add_argument("--max-staleness", type=int, default=0)
    policy.add_argument("--steps", type=_positive, help="dispatch this many steps in all (default: run on)")
    policy.add_argument("--seed", type=int, default=0)
    _add_config_args(policy)
    policy.set_defaults(handler=_cmd_policy)

    mon = commands.add_parser(
        "monitor",
        help="live dashboard of a run from its Redis: streams, dead letters, workers, versions, throughput, SD, "
        "learner; --once --json for scripts; Prometheus metrics",
        description="Reads the run's Redis only (no broker): stream lengths, pending entries, consumer lag and the "
        "oldest pending entry, dead letters, workers and their states, policy/drafter/SD-config versions, rollout "
        "throughput, tokens per forward and SD on/off, the latest learner update and drafter-training slice.",
    )
    mode = mon.add_mutually_exclusive_group()
    mode.add_argument("--once", action="store_true", help="print one snapshot and exit (1: Redis unreachable)")
    mode.add_argument(
        "--prometheus", type=int, metavar="PORT", help="serve the figures at http://BIND:PORT/metrics (0: any port)"
    )
    mon.add_argument("--json", action="store_true", help="JSON: one object with --once, else one line per refresh")
    mon.add_argument("--bind", default="127.0.0.1", help="address the Prometheus endpoint listens on")
    mon.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes")
    mon.add_argument("--window", type=float, default=60.0, help="seconds of rollout reports behind throughput")
    mon.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for Redis per snapshot")
    _add_config_args(mon, bus=False)
    mon.add_argument("--redis-url", help="the run's Redis URL; env TLT_REDIS_URL")
    mon.set_defaults(handler=_cmd_monitor, mqtt_url=None)

    config = commands.add_parser("config", help="show the effective configuration or describe every setting")
    config.add_argument("action", choices=["show", "describe"], help="show: effective values as JSON")
    _add_config_args(config)
    config.set_defaults(handler=_cmd_config)
    return parser


def _arm(text: str) -> tuple[int, int, int]:
    try:
        depth, topk, verify = (int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected DEPTH,TOPK,VERIFY (three integers), got {text!r}") from None
    if min(depth, topk, verify) < 1 or verify > depth * topk * topk:
        raise argparse.ArgumentTypeError(f"need DEPTH, TOPK, VERIFY >= 1 and VERIFY <= DEPTH*TOPK^2, got {text!r}")
    return depth, topk, verify


def load(args: argparse.Namespace) -> Any:
    """The validated configuration from --config, the environment, --set and dedicated flags."""
    from tlt_stream.config import load_config

    extra: dict[tuple[str, ...], Any] = {("run",): getattr(args, "run", None)}
    if hasattr(args, "redis_url"):
        extra[("bus", "redis_url")] = args.redis_url
        extra[("bus", "mqtt_url")] = args.mqtt_url
    return load_config(args.config, overrides=args.overrides, extra=extra)


class RedactingFormatter(logging.Formatter):
    """Log lines (tracebacks included) with every URL password and password-like value replaced by `***`:
    whatever a library or a service logs, no secret reaches a terminal or a run's logs."""

    def format(self, record: logging.LogRecord) -> str:
        from tlt_stream.config import redact_text

        return redact_text(super().format(record))


def setup_logging(verbosity: int) -> None:
    level = logging.WARNING if verbosity == 0 else logging.INFO if verbosity == 1 else logging.DEBUG
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(RedactingFormatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s", "%H:%M:%S"))
    logging.basicConfig(level=level, handlers=[handler])


def _exit_on_sigterm() -> None:
    """Until a service's event loop installs its own handler (which drains and exits 0), SIGTERM raises
    SystemExit(143): a service stopped while still importing torch or loading a checkpoint exits at once,
    with the conventional code and its `finally` blocks run, rather than being killed mid-write."""
    import signal

    def handler(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    try:
        signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread (main() called from a test's worker thread): leave it be
        pass


def console(argv: Sequence[str] | None = None) -> int:
    """The process entry (`tlt-stream`, `python -m services.X`): `main` with the process-wide SIGTERM
    handling of a command-line program around it, which in-process callers of `main` (tests) do not want."""
    _exit_on_sigterm()
    try:
        return main(argv)
    finally:
        _ignore_sigterm()


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    setup_logging(getattr(args, "verbose", 0))
    handler: Callable[[argparse.Namespace], int] = args.handler
    from tlt_stream.config import ConfigError, redact_text

    try:
        return handler(args)
    except ConfigError as exc:  # its text may quote a --set or a value with a password in it
        print(f"tlt-stream: configuration error: {redact_text(str(exc))}", file=sys.stderr)
        return EXIT_CONFIG
    except KeyboardInterrupt:
        print("tlt-stream: interrupted", file=sys.stderr)
        return 130


def _ignore_sigterm() -> None:
    """The command is done and the process is exiting with its own code: a SIGTERM now (a supervisor
    stopping everything as this service finishes) must not turn a clean exit into death by signal."""
    import signal

    try:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    except ValueError:  # not the main thread
        pass


if __name__ == "__main__":
    sys.exit(console())
