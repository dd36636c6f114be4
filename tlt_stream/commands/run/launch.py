"""Launching a whole run: the policy service, N rollout workers and the learner as separate OS processes.

`RunPlan` says what to run; `service_commands(plan, config)` turns it into the exact command lines (the
same entry points `docker compose` and a cluster scheduler start, `python -m services.X`), and `Supervisor`
starts them with their logs in `RUN_DIR/logs/`, watches them, and stops them all cleanly: SIGTERM first
(each service drains and exits), SIGKILL only after a grace period, so no process outlives the run.

GPUs: each service sees only its own (`CUDA_VISIBLE_DEVICES`, decided by `placement.place`): the learner the
first `launch.learner_gpus` (under torchrun, one rank per GPU, when more than one), each rollout worker one of
the rest. Torch threads: the machine's cores are shared out deliberately. With `max_staleness = 0` rollout and
learning alternate (each waits for the other), so every process may use all cores; with asynchrony they
run at once and the cores are split between the workers and the learner. An on-policy learner that
accumulates (`learner.accumulate`: by default, unless the policy has dropout) overlaps only the step's tail,
when the rollout has few rows left: it adds those groups on `learner.accumulate_threads` (one), or holds them
while the rollout still has `learner.accumulate_below_rows` rows in flight, and keeps all its threads for the
groups left once the step's last group is in and for the optimizer step, when the rollout waits for it.
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

from tlt_stream.basics.config import Config, redact_url
from tlt_stream.commands.placement import LEARNER, POLICY, place, visible_gpus, worker_name
from tlt_stream.roles.serve import LAUNCHER_PID_ENV

__all__ = [
    "RunPlan",
    "ServiceCommand",
    "Supervisor",
    "ensure_new_run",
    "evaluate_version",
    "gpus_here",
    "learner_launcher",
    "placement",
    "run_plan",
    "save_timeline",
    "service_commands",
    "service_config",
    "thread_split",
    "write_service_config",
]


TINY_WORLD = "tiny-world"
WATCH_BLOCK_MS = 5000
"""The launcher reads new metrics rows when the run's stats stream grows, and at least this often."""
"""The preset of the tiny world's learner recipe (`config.PRESETS`), which `tlt-stream run` uses on it."""


@dataclass(frozen=True)
class RunPlan:
    world: Path
    """The tiny world (or any directory) with `policy/` and, for speculative decoding, `drafter/`."""
    run_dir: Path
    """Checkpoints, metrics, logs and plots of the run."""
    config: Config = field(default_factory=Config)
    """Every setting of the run (steps, workers, SD, the learner, ...): the services read it from
    RUN_DIR/config.toml, written from it."""
    cores: int = field(default_factory=lambda: len(os.sched_getaffinity(0)))
    gpus: tuple[str, ...] = field(default_factory=lambda: gpus_here())
    """The GPUs the run hands out, as `CUDA_VISIBLE_DEVICES` names them (empty on a CPU-only host)."""

    def __post_init__(self) -> None:
        if self.config.launch.policy is not None:  # a policy of one's own: no world
            if not self.policy_dir.is_dir():
                raise FileNotFoundError(f"{self.policy_dir}: no such policy checkpoint directory (--policy)")
            if self.drafter_dir is not None and not self.drafter_dir.is_dir():
                raise FileNotFoundError(f"{self.drafter_dir}: no such drafter directory (--drafter)")
            return
        if not (self.world / "policy").is_dir():
            raise FileNotFoundError(f"{self.world}/policy: no policy checkpoint (run `tlt-stream bootstrap` first)")
        if self.config.launch.sd == "eagle" and not (self.world / "drafter").is_dir():
            raise FileNotFoundError(f"{self.world}/drafter: no drafter for --sd eagle (bootstrap, or use --sd off)")

    @property
    def policy_dir(self) -> Path:
        """The initial policy: `launch.policy`, else the world's."""
        own = self.config.launch.policy
        return Path(own) if own is not None else self.world / "policy"

    @property
    def drafter_dir(self) -> Path | None:
        """The EAGLE drafter to start from: `launch.drafter` with a policy of one's own, else the world's."""
        if self.config.launch.policy is not None:
            return Path(self.config.launch.drafter) if self.config.launch.drafter else None
        return self.world / "drafter"

    @property
    def sd(self) -> str:
        """What the workers draft with: `launch.sd`, except eagle without a drafter, which drafts n-grams."""
        sd = self.config.launch.sd
        return "ngram" if sd == "eagle" and self.drafter_dir is None else sd

    @property
    def steps(self) -> int:
        return self.config.policy.steps

    @property
    def workers(self) -> int:
        return self.config.launch.workers

    @property
    def config_file(self) -> Path:
        return self.run_dir / "config.toml"


def gpus_here() -> tuple[str, ...]:
    """The GPUs this process sees (torch's count, named as this process's CUDA_VISIBLE_DEVICES names them)."""
    import torch

    return visible_gpus(torch.cuda.device_count() if torch.cuda.is_available() else 0, os.environ)


def thread_split(cores: int, workers: int, max_staleness: int) -> tuple[int, int]:
    """Torch threads for (each rollout worker, the learner)."""
    if max_staleness == 0:  # rollout and learning alternate: each side may use the whole machine
        return max(1, cores // workers), max(1, cores)
    learner = max(1, cores // (workers + 1))
    return max(1, (cores - learner) // workers) if cores > learner else 1, learner


def service_config(plan: RunPlan, config: Config) -> Config:
    """What every service of the run reads (RUN_DIR/config.toml): `config` with the run's own places filled in
    (the world's policy and drafter, the run directory, the drafter-training states, the checkpoint store)."""
    from tlt_stream.basics.config import override

    sd = plan.sd
    train = sd == "eagle" and config.drafter.train
    data, launch = config.data, config.launch
    drafter = _absolute(str(plan.drafter_dir)) if plan.drafter_dir is not None else None
    values: dict[str, object] = {
        "learner.run_dir": str(plan.run_dir.resolve()),
        "learner.policy": str(plan.policy_dir.resolve()),
        "sd.drafter": {"off": None, "ngram": "ngram", "eagle": drafter}[sd],
        # Every path absolute: `--resume RUN_DIR` reads this file from wherever it is started.
        "data.dataset": _absolute(data.dataset),
        "data.eval_dataset": _absolute(data.eval_dataset),
        "data.tokenizer": _absolute(data.tokenizer),
        "launch.world": _absolute(launch.world),
        "launch.policy": _absolute(launch.policy),
        "launch.drafter": _absolute(launch.drafter),
        "rollout.reward": _absolute_reward(config.rollout.reward),
        "drafter.state_dir": str(plan.run_dir / "drafter-states") if train else None,
        # Hidden-state windows (~40 KB a sample) only feed drafter training: without it, nobody reads them.
        "rollout.stream_hidden": config.rollout.stream_hidden and train,
    }
    if config.bus.store_root is None:  # every checkpoint the run announces lives under its run directory
        values["bus.store_root"] = str(plan.run_dir.resolve())
    return override(config, values)


def _absolute(path: str | None) -> str | None:
    return str(Path(path).resolve()) if path else path


def _absolute_reward(name: str) -> str:
    """A reward named as `path/to/file.py:function` with its file's path absolute; any other name as it is."""
    where, sep, function = name.rpartition(":")
    return f"{_absolute(where)}{sep}{function}" if sep and where.endswith(".py") else name


@dataclass(frozen=True)
class ServiceCommand:
    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    """What this process's environment has beside the run's (its CUDA_VISIBLE_DEVICES when GPUs are placed)."""


def placement(plan: RunPlan, config: Config) -> dict[str, str]:
    """The CUDA_VISIBLE_DEVICES of each service of the run ({} on a CPU-only host); ConfigError when the
    workers and the learner's GPUs do not fit on the plan's GPUs."""
    return place(
        plan.gpus,
        workers=config.launch.workers,
        learner_gpus=config.launch.learner_gpus,
        rollout_device=config.rollout.device,
        learner_device=config.learner.device,
    )


def learner_launcher(ranks: int, python: str = sys.executable) -> list[str]:
    """How the learner is started, up to its module name: `python -m` for one process, torchrun with one rank
    per GPU for more (one node, its own rendezvous; `deploy/slurm/` shows the several-node form)."""
    if ranks <= 1:
        return [python, "-m"]
    return [python, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", f"--nproc-per-node={ranks}", "-m"]


def service_commands(plan: RunPlan, config: Config) -> list[ServiceCommand]:
    """The command lines of one run, policy service first and learner last: each reads the run's settings
    from `plan.config_file`; only what differs per process (ids, threads, its GPUs) is a flag or variable."""
    worker_threads, learner_threads = thread_split(plan.cores, config.launch.workers, config.policy.max_staleness)
    placed = placement(plan, config)

    def env(name: str) -> dict[str, str]:
        return {"CUDA_VISIBLE_DEVICES": placed[name]} if placed else {}

    python = [sys.executable, "-m"]
    common = ["--config", str(plan.config_file), "--run", config.run]  # the name in `ps`, as in the file
    commands = [ServiceCommand(POLICY, [*python, "services.policy", *common], env(POLICY))]
    for i in range(config.launch.workers):
        name = worker_name(i)
        flags = ["--worker-id", name, "--threads", str(worker_threads)]
        commands.append(ServiceCommand(name, [*python, "services.rollout_worker", *common, *flags], env(name)))
    ranks = len(placed[LEARNER].split(",")) if placed.get(LEARNER) else 1
    threads = max(1, learner_threads // ranks)
    # torchrun's parser reads `--run` as an ambiguous abbreviation of its --run-path even after the module name,
    # so under torchrun the learner takes the run name from the file alone
    own = common if ranks == 1 else common[:2]
    learner = [*learner_launcher(ranks), "services.learner", *own, "--threads", str(threads)]
    commands.append(ServiceCommand(LEARNER, learner, env(LEARNER)))
    return commands


def write_service_config(plan: RunPlan, config: Config) -> Path:
    """RUN_DIR/config.toml from `service_config`; the servers' URLs (which may hold passwords) are not
    written: the services get them from the environment."""
    from tlt_stream.basics.config import dump_toml

    text = dump_toml(service_config(plan, config), leave_out=("bus.redis_url", "bus.mqtt_url"))
    plan.run_dir.mkdir(parents=True, exist_ok=True)
    plan.config_file.write_text(
        "# Written by tlt-stream run: every service of the run reads this file (--config); the Redis and MQTT "
        "URLs come from\n# the environment. `tlt-stream config describe` explains each key.\n" + text
    )
    return plan.config_file


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
            LAUNCHER_PID_ENV: str(os.getpid()),  # the services stop if this process dies without stopping them
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
                    *command.argv, env={**self.env, **command.env}, stdout=log, stderr=log, process_group=0
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
        stopper = asyncio.create_task(stop.wait(), name="launcher-stop")
        waits = {asyncio.create_task(p.wait(), name=f"wait-{n}"): n for n, p in self.processes.items()}
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
            try:  # asyncio.timeout, not wait_for: Python 3.11's wait_for can drop a cancellation
                async with asyncio.timeout(max(0.1, deadline - time.monotonic())):
                    await process.wait()
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                await process.wait()
        return {name: p.returncode for name, p in self.processes.items()}


def evaluate_version(
    run_dir: Path, version: int, policy_dir: Path, *, n: int, seed: int, threads: int, config: Config | None = None
) -> dict:
    """Held-out accuracy of one policy version at the rollout temperature, appended to `eval.jsonl`: on
    `data.eval_dataset` with the run's reward when the configuration names one (also its mean reward), else
    on the tiny world's held-out problems."""
    import json

    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    extra: dict = {}
    try:
        if config is not None and config.data.eval_dataset is not None:
            from tlt_stream.rl.evaluate import evaluate_dataset

            report = evaluate_dataset(policy_dir, config, n=n, batch_size=64)
            n = report["prompts"]
            extra = {"mean_reward": report["mean_reward"], "dataset": report["dataset"]}
        else:
            from tlt_stream.tasks.evaluate import evaluate

            report = evaluate(policy_dir, n=n, temperature=1.0, seed=seed, batch_size=64)
    finally:
        torch.set_num_threads(previous)
    row = {"version": version, "accuracy": report["accuracy"], "prompts": n, "seed": seed, "policy": str(policy_dir)}
    row.update(extra)
    run_dir.mkdir(parents=True, exist_ok=True)
    with (run_dir / "eval.jsonl").open("a") as out:
        out.write(json.dumps(row) + "\n")
    if config is not None and config.learner.log_to:
        _track_evaluation(run_dir, row, config)
    return row


def _track_evaluation(run_dir: Path, row: dict, config: Config) -> None:
    """The evaluation's figures to the run's trackers, as their own job ("eval", beside the learner's)."""
    from tlt_stream.rl.tracking import scalars, trackers_for

    trackers = trackers_for(config, run_dir, job="eval")
    try:
        figures = scalars({k: v for k, v in row.items() if k not in ("prompts", "seed")}, "eval/")
        for tracker in trackers:
            tracker.log(row["version"], figures)
    finally:
        for tracker in trackers:
            tracker.close()


async def ensure_new_run(config: Config) -> None:
    """A run name is a namespace of streams, cursor and versions: starting a new run in a used one would
    resume someone else's dispatch cursor and versions."""
    import redis.asyncio as aioredis

    from tlt_stream.bus.streams import Keys

    redis = aioredis.Redis.from_url(config.bus.redis_url)
    try:
        keys = Keys(config.run)
        used = await redis.exists(keys.versions, keys.dispatch, keys.stream("samples"))
    finally:
        await redis.aclose()
    if used:
        raise RuntimeError(
            f"run {config.run!r} already has state in Redis ({redact_url(config.bus.redis_url)}); choose another "
            f"--run name, or delete its state from the servers with `tlt-stream purge --run {config.run} --yes` and "
            "the same --redis-url and --mqtt-url (its keys and retained messages; the run directory stays)"
        )


async def save_timeline(config: Config, path: Path) -> int:
    """Write the run's `stats` timeline (worker states, rollout reports, drafter slices, the SD arms'
    measurements) as JSON lines, so the report can draw it and `tlt-stream plan --from-run` read each arm's
    acceptance per batch bucket after the servers are gone; returns the number of entries written."""
    import json

    import msgspec
    import redis.asyncio as aioredis

    from tlt_stream.basics.messages import DrafterStats, RolloutStats, SdArmReport, WorkerState, codec_for
    from tlt_stream.bus.streams import Keys

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
                    if isinstance(message, WorkerState | RolloutStats | DrafterStats | SdArmReport):
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
    plan: RunPlan, *, on_step=None, stop: asyncio.Event | None = None, purge: bool = False, resume: bool = False
) -> int:
    """Run the services of `plan` until the learner has made `policy.steps` updates (exit code 0) or `stop`
    is set (130). Raises RuntimeError when a service fails.

    `on_step(rows)` is called with every newly written learner step (dicts from `metrics.jsonl`). Every
    service is stopped on the way out, whatever happened: SIGTERM, so the learner finishes the update in
    hand and its checkpoints stay intact. `purge`: once the timeline is saved, delete the run's keys and
    retained messages from the servers (benchmarks on shared servers; the run directory keeps the figures).
    `resume`: the run goes on from its own state in Redis (`--resume`), which a new run must not find.
    """
    from redis.exceptions import RedisError

    from tlt_stream.bus.connect import connect_redis, endpoints
    from tlt_stream.bus.streams import Keys
    from tlt_stream.rl.records import load_metrics

    plan.run_dir.mkdir(parents=True, exist_ok=True)
    with endpoints(plan.config) as resolved:
        if not resume:
            await ensure_new_run(resolved)
        write_service_config(plan, resolved)
        supervisor = Supervisor(service_commands(plan, resolved), resolved, plan.run_dir / "logs")
        seen = len(load_metrics(plan.run_dir))

        async def watch() -> None:
            """New `metrics.jsonl` rows to `on_step` whenever the run's `stats` stream grows (the learner
            writes its row before its `LearnerStats` entry), and at least every few seconds."""
            nonlocal seen
            redis = connect_redis(resolved.bus.redis_url, name="launcher", block_ms=WATCH_BLOCK_MS)
            stream, last = Keys(resolved.run).stream("stats"), "$"
            try:
                while True:
                    try:
                        for _, entries in await redis.xread({stream: last}, count=256, block=WATCH_BLOCK_MS):
                            last = entries[-1][0]
                    except RedisError:  # the services' own outage handling is theirs; the file is read anyway
                        await asyncio.sleep(WATCH_BLOCK_MS / 1000)
                    rows = load_metrics(plan.run_dir)
                    if len(rows) > seen and on_step is not None:
                        on_step(rows[seen:])
                    seen = len(rows)
            finally:
                await redis.aclose()

        watcher = asyncio.create_task(watch(), name="launcher-watch-metrics")
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
