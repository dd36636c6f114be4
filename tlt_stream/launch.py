"""Launching a whole run: the policy service, N rollout workers and the learner as separate OS processes.

`RunPlan` says what to run; `service_commands(plan, config)` turns it into the exact command lines (the
same entry points `docker compose` and a cluster scheduler start, `python -m services.X`), and `Supervisor`
starts them with their logs in `RUN_DIR/logs/`, watches them, and stops them all cleanly: SIGTERM first
(each service drains and exits), SIGKILL only after a grace period, so no process outlives the run.

Torch threads: the machine's cores are shared out deliberately. With `max_staleness = 0` rollout and
learning alternate (each waits for the other), so every process may use all cores; with asynchrony they
run at once and the cores are split between the workers and the learner.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tlt_stream.config import Config, redact_url

__all__ = [
    "RunPlan",
    "ServiceCommand",
    "Supervisor",
    "ensure_new_run",
    "evaluate_version",
    "run_plan",
    "save_timeline",
    "service_commands",
    "thread_split",
]


TINY_WORLD_LR = 2.5e-5
TINY_WORLD_FINAL_NORM_LR_SCALE = 800.0
"""The tiny world's learner recipe: its policy learns mostly by sharpening, which the final norm's gain does
fastest (`LearnerSettings.final_norm_lr_scale`; here at lr 2e-2), while the matrices, at an eighth of the
earlier lr 2e-4, are damaged least: +15.2 held-out points in 160 steps (~15 minutes on 2 cores) and +16.8 in
200, against +14.5 in 221 for lr 1e-4 with x 200 and +7.4 for lr 2e-4 with x 50 (docs/benchmarks.md, issue 5)."""


@dataclass(frozen=True)
class RunPlan:
    world: Path
    """The tiny world (or any directory) with `policy/` and, for speculative decoding, `drafter/`."""
    run_dir: Path
    """Checkpoints, metrics, logs and plots of the run."""
    steps: int = 20
    """Policy updates (RL steps) to run."""
    workers: int = 1
    prompts_per_step: int = 16
    group_size: int = 8
    max_staleness: int = 0
    lr: float = TINY_WORLD_LR
    warmup_steps: int = 20
    final_norm_lr_scale: float = TINY_WORLD_FINAL_NORM_LR_SCALE
    """The learner's lr multiplier for the final norm's gain (`LearnerSettings.final_norm_lr_scale`)."""
    seed: int = 0
    sd: str = "off"
    """Rollout speculative decoding: "off", "eagle" (the world's drafter) or "ngram"."""
    train_drafter: bool = True
    """With `sd="eagle"`: train the drafter online in the workers' idle time."""
    adaptive_sd: bool = True
    """With SD on: decide per step (TLT's adaptive rollout) rather than always speculating."""
    hidden_share: float = 0.25
    """Share of samples whose hidden states the workers stream for drafter training. A quarter: on a CPU the
    drafter trains on ~2k of the ~19k tokens a tiny-world step streams, and streaming all of them made
    rollouts ~8% slower (docs/benchmarks.md, issue 6)."""
    max_batch: int = 128
    max_len: int = 1408
    device: str = "auto"
    """Where rollout workers and the learner run (`--device` of each service): auto, cpu, cuda or cuda:N."""
    cores: int = field(default_factory=lambda: len(os.sched_getaffinity(0)))

    def __post_init__(self) -> None:
        if self.steps < 1 or self.workers < 1 or self.prompts_per_step < 1 or self.group_size < 1:
            raise ValueError("need steps, workers, prompts_per_step and group_size >= 1")
        if self.sd not in ("off", "eagle", "ngram"):
            raise ValueError(f"sd must be off, eagle or ngram, got {self.sd!r}")
        if not (self.world / "policy").is_dir():
            raise FileNotFoundError(f"{self.world}/policy: no policy checkpoint (run `tlt-stream bootstrap` first)")
        if self.sd == "eagle" and not (self.world / "drafter").is_dir():
            raise FileNotFoundError(f"{self.world}/drafter: no drafter for --sd eagle (bootstrap, or use --sd off)")


def thread_split(cores: int, workers: int, max_staleness: int) -> tuple[int, int]:
    """Torch threads for (each rollout worker, the learner)."""
    if max_staleness == 0:  # rollout and learning alternate: each side may use the whole machine
        return max(1, cores // workers), max(1, cores)
    learner = max(1, cores // (workers + 1))
    return max(1, (cores - learner) // workers) if cores > learner else 1, learner


@dataclass(frozen=True)
class ServiceCommand:
    name: str
    argv: list[str]


def service_commands(plan: RunPlan, config: Config) -> list[ServiceCommand]:
    """The command lines of one run, policy service first and learner last."""
    worker_threads, learner_threads = thread_split(plan.cores, plan.workers, plan.max_staleness)
    common = ["--run", config.run]
    python = [sys.executable, "-m"]
    commands = [
        ServiceCommand(
            "policy",
            [
                *python,
                "services.policy",
                *common,
                *("--prompts-per-step", str(plan.prompts_per_step), "--group-size", str(plan.group_size)),
                *("--max-staleness", str(plan.max_staleness), "--steps", str(plan.steps), "--seed", str(plan.seed)),
            ],
        )
    ]
    drafter = {"off": [], "ngram": ["--drafter", "ngram"], "eagle": ["--drafter", str(plan.world / "drafter")]}
    if plan.sd == "eagle" and plan.train_drafter:
        drafter["eagle"] += ["--train-drafter", str(plan.run_dir / "drafter-states")]
    if plan.adaptive_sd:
        drafter["eagle"] += ["--adaptive-sd"]
        drafter["ngram"] += ["--adaptive-sd"]
    # Hidden-state windows (~40 KB a sample) only feed drafter training: without it, nobody reads them.
    hidden = ["--no-hidden"]
    if plan.sd == "eagle" and plan.train_drafter:
        hidden = ["--hidden-share", str(plan.hidden_share)]
    for i in range(plan.workers):
        commands.append(
            ServiceCommand(
                f"rollout-{i}",
                [
                    *python,
                    "services.rollout_worker",
                    *common,
                    *("--worker-id", f"rollout-{i}", "--threads", str(worker_threads)),
                    *("--max-batch", str(plan.max_batch), "--max-len", str(plan.max_len)),
                    *("--device", plan.device),
                    *drafter[plan.sd],
                    *hidden,
                ],
            )
        )
    commands.append(
        ServiceCommand(
            "learner",
            [
                *python,
                "services.learner",
                *common,
                *("--run-dir", str(plan.run_dir), "--policy", str(plan.world / "policy")),
                *("--groups-per-step", str(plan.prompts_per_step), "--max-staleness", str(plan.max_staleness)),
                *("--lr", str(plan.lr), "--warmup-steps", str(plan.warmup_steps)),
                *("--final-norm-lr-scale", str(plan.final_norm_lr_scale)),
                *("--until-version", str(plan.steps), "--threads", str(learner_threads)),
                *("--device", plan.device),
            ],
        )
    )
    return commands


class Supervisor:
    """Starts the services of a run, fails fast when one dies, and stops every one of them on the way out."""

    def __init__(self, commands: list[ServiceCommand], config: Config, log_dir: Path, *, grace_s: float = 20.0):
        self.commands = commands
        self.log_dir = log_dir
        self.grace_s = grace_s
        assert config.bus.redis_url and config.bus.mqtt_url, "resolve the endpoints first (bus.connect.endpoints)"
        self.env = {
            **os.environ,
            "TLT_REDIS_URL": config.bus.redis_url,
            "TLT_MQTT_URL": config.bus.mqtt_url,
            "PYTHONUNBUFFERED": "1",
        }
        root = str(Path(__file__).resolve().parents[1])  # services/ lives next to tlt_stream/
        self.env["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
        self.processes: dict[str, asyncio.subprocess.Process] = {}
        self.started_at: dict[str, float] = {}

    async def start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for command in self.commands:
            log = (self.log_dir / f"{command.name}.log").open("ab")
            try:
                # Its own process group (Ctrl-C in the terminal reaches only us; we stop the services with
                # SIGTERM) but our session: a new session would be a new scheduler autogroup on Linux, and
                # autogroups share the CPU equally whatever their threads' nice values, so a rollout worker's
                # nice-19 drafter training would take half the cores from a learner it should yield to.
                self.processes[command.name] = await asyncio.create_subprocess_exec(
                    *command.argv, env=self.env, stdout=log, stderr=log, process_group=0
                )
            finally:
                log.close()  # the child holds its own descriptor
            self.started_at[command.name] = time.monotonic()

    def log_tail(self, name: str, lines: int = 20) -> str:
        path = self.log_dir / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    async def wait_for(self, name: str, *, stop: asyncio.Event | None = None) -> int | None:
        """Wait for service `name` to exit and return its code (None when `stop` was set first); raise if
        another service fails first."""
        stop = stop or asyncio.Event()
        stopper = asyncio.create_task(stop.wait())
        waits = {asyncio.create_task(p.wait()): n for n, p in self.processes.items()}
        try:
            while True:
                done, _ = await asyncio.wait([*waits, stopper], return_when=asyncio.FIRST_COMPLETED)
                if stopper in done:
                    return None
                for task in done:
                    who = waits.pop(task)
                    code = task.result()
                    if who == name:
                        return code
                    if code != 0:  # the policy service ends on its own once every step is trained
                        raise RuntimeError(
                            f"service {who} exited with code {code} before {name} finished; "
                            f"last lines of its log:\n{self.log_tail(who)}"
                        )
        finally:
            stopper.cancel()
            for task in waits:
                task.cancel()

    async def stop(self) -> dict[str, int | None]:
        """SIGTERM every live service, wait up to the grace period, then SIGKILL what is left; exit codes."""
        live = [p for p in self.processes.values() if p.returncode is None]
        for process in live:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        for process in live:
            try:
                await asyncio.wait_for(process.wait(), timeout=max(0.1, deadline - time.monotonic()))
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                await process.wait()
        return {name: p.returncode for name, p in self.processes.items()}


def evaluate_version(run_dir: Path, version: int, policy_dir: Path, *, n: int, seed: int, threads: int) -> dict:
    """Held-out accuracy of one policy version at the rollout temperature, appended to `eval.jsonl`."""
    import json

    import torch

    from tlt_stream.tasks.evaluate import evaluate

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        report = evaluate(policy_dir, n=n, temperature=1.0, seed=seed, batch_size=64)
    finally:
        torch.set_num_threads(previous)
    row = {"version": version, "accuracy": report["accuracy"], "prompts": n, "seed": seed, "policy": str(policy_dir)}
    run_dir.mkdir(parents=True, exist_ok=True)
    with (run_dir / "eval.jsonl").open("a") as out:
        out.write(json.dumps(row) + "\n")
    return row


async def ensure_new_run(config: Config) -> None:
    """A run name is a namespace of streams, cursor and versions: starting a new run in a used one would
    resume someone else's dispatch cursor and versions."""
    import redis.asyncio as aioredis

    from tlt_stream.bus.streams import Keys

    redis = aioredis.Redis.from_url(config.bus.redis_url)
    try:
        keys = Keys(config.run)
        used = await redis.exists(keys.versions, f"{config.key_prefix}dispatch", keys.stream("samples"))
    finally:
        await redis.aclose()
    if used:
        raise RuntimeError(
            f"run {config.run!r} already has state in Redis ({redact_url(config.bus.redis_url)}); choose another "
            f"--run name (or delete its keys: redis-cli --scan --pattern '{config.key_prefix}*' | xargs redis-cli del)"
        )


async def save_timeline(config: Config, path: Path) -> int:
    """Write the run's `stats` timeline (worker states, rollout reports, drafter slices) as JSON lines, so
    the report can draw it after the servers are gone; returns the number of entries written."""
    import json

    import msgspec
    import redis.asyncio as aioredis

    from tlt_stream.bus.streams import Keys
    from tlt_stream.messages import DrafterStats, RolloutStats, WorkerState, codec_for

    codec = codec_for("stats")
    redis = aioredis.Redis.from_url(config.bus.redis_url)
    written = 0
    try:
        with path.open("w") as out:
            cursor = "-"
            while True:
                entries = await redis.xrange(Keys(config.run).stream("stats"), min=cursor, count=1000)
                for _, fields in entries:
                    try:
                        message = codec.decode(fields[b"m"])
                    except Exception:  # an undecodable entry is the dead-letter path's business
                        continue
                    if isinstance(message, WorkerState | RolloutStats | DrafterStats):
                        row = {"kind": message.kind, **msgspec.to_builtins(message)}
                        out.write(json.dumps(row) + "\n")
                        written += 1
                if len(entries) < 1000:
                    break
                last = entries[-1][0].decode()
                ms, seq = last.split("-")
                cursor = f"{ms}-{int(seq) + 1}"
    finally:
        await redis.aclose()
    return written


async def run_plan(
    plan: RunPlan, config: Config, *, on_step=None, stop: asyncio.Event | None = None, purge: bool = False
) -> int:
    """Run the services of `plan` until the learner has made `plan.steps` updates (exit code 0) or `stop`
    is set (130). Raises RuntimeError when a service fails.

    `on_step(rows)` is called with every newly written learner step (dicts from `metrics.jsonl`). Every
    service is stopped on the way out, whatever happened: SIGTERM, so the learner finishes the update in
    hand and its checkpoints stay intact. `purge`: once the timeline is saved, delete the run's keys and
    retained messages from the servers (benchmarks on shared servers; the run directory keeps the figures).
    """
    from tlt_stream.bus.connect import endpoints
    from tlt_stream.rl.records import load_metrics

    plan.run_dir.mkdir(parents=True, exist_ok=True)
    with endpoints(config) as resolved:
        await ensure_new_run(resolved)
        supervisor = Supervisor(service_commands(plan, resolved), resolved, plan.run_dir / "logs")
        if resolved.bus.store_root is None:  # every checkpoint the run announces lives under its run directory
            supervisor.env["TLT_BUS__STORE_ROOT"] = str(plan.run_dir.resolve())
        seen = len(load_metrics(plan.run_dir))

        async def watch() -> None:
            nonlocal seen
            while True:
                await asyncio.sleep(1.0)
                rows = load_metrics(plan.run_dir)
                if len(rows) > seen and on_step is not None:
                    on_step(rows[seen:])
                seen = len(rows)

        watcher = asyncio.create_task(watch())
        try:
            await supervisor.start()
            code = await supervisor.wait_for("learner", stop=stop)
        finally:
            watcher.cancel()
            await supervisor.stop()
        rows = load_metrics(plan.run_dir)
        if len(rows) > seen and on_step is not None:
            on_step(rows[seen:])
        await save_timeline(resolved, plan.run_dir / "timeline.jsonl")
        if purge:
            from tlt_stream.bus.connect import purge_run

            await purge_run(resolved)
        if code is None:
            return 130
        if code != 0:
            raise RuntimeError(f"the learner exited with code {code}:\n{supervisor.log_tail('learner')}")
        return code
