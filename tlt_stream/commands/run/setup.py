"""`tlt-stream run`'s phases, in order: the settings (a new run or a resumed one), the tiny world when the run
needs it, the checks that stop a run before any service starts, the evaluation before training, the services
with a progress bar per step, and the end (the evaluation after, the report).

Anything a user can fix stops the run with one line (`RunRefused`, its exit code: 2 for a setting, 1 for
a failure, 0 for a resumed run with nothing left to train), before a service is started where it can be.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Any

from tlt_stream.basics.config import DEFAULTS, Config, override, redact_text, redact_url
from tlt_stream.basics.errors import CheckpointError
from tlt_stream.commands.args import EXIT_CONFIG, load
from tlt_stream.commands.run.launch import RunPlan
from tlt_stream.rl.datasets import DatasetError

__all__ = [
    "RunRefused",
    "check_plan",
    "evaluate_before",
    "finish",
    "run_services",
    "settings_of",
    "world_ready",
]

DEFAULT_WORLD = DEFAULTS.launch.world
EVAL_ERRORS = (OSError, ValueError, CheckpointError, DatasetError)
"""What a held-out evaluation may raise that is one line to the user (a checkpoint pruned while read, a file
changed since `check_plan` read it), not a traceback."""


class RunRefused(Exception):
    """The run stops here, with one line and an exit code."""

    def __init__(self, why: str, code: int = EXIT_CONFIG) -> None:
        super().__init__(why)
        self.code = code


def settings_of(args: argparse.Namespace) -> tuple[Config, Path, bool]:
    """(the configuration, the run directory, whether the policy is one's own): a new run gets a fresh
    namespace and directory; `--resume` takes the stopped run's own settings and goes on from its newest
    checkpoint."""
    from tlt_stream.commands.run.launch import TINY_WORLD, ensure_new_run
    from tlt_stream.rl.checkpoint import latest_checkpoint

    resume = Path(args.resume) if args.resume else None
    if resume is not None:  # the stopped run's own settings, as its services read them; flags still apply
        if not (resume / "config.toml").is_file():
            raise RunRefused(f"{resume} holds no config.toml: not a run directory to resume")
        args.config = args.config or str(resume / "config.toml")
        args.out = str(resume)
    config = load(args)
    own = config.launch.policy is not None  # a policy of one's own: no world, no tiny-world recipe
    if not own:
        config = load(args, default_preset=TINY_WORLD)
    if resume is None and args.run is None and "TLT_RUN" not in os.environ:  # a fresh namespace per new run
        from tlt_stream.basics.config.tree import RUN_MAX_CHARS

        stamp = f"-{time.strftime('%Y%m%d-%H%M%S')}"  # after the name cut to leave it room: still a valid run
        config = override(config, {"run": config.run[: RUN_MAX_CHARS - len(stamp)] + stamp})
    out = Path(args.out or f"runs/{config.run}")
    if resume is not None:
        newest = latest_checkpoint(out / "checkpoints")
        at = newest.step if newest is not None else 0
        config = override(config, {"policy.start_step": at})  # on fresh servers, dispatch continues from there
        if at >= config.until_version:  # nothing to train: say so rather than start services that have no work
            raise RunRefused(
                f"{out} is already at policy version {at} of {config.until_version}: nothing left to train "
                f"(a larger --steps goes on from there)",
                code=0,
            )
        print(f"tlt-stream run: resuming {out} at policy version {at} (run {config.run})", file=sys.stderr)
    elif (out / "checkpoints").exists() and any((out / "checkpoints").iterdir()):
        raise RunRefused(f"{out} already holds checkpoints; choose a new --out, or go on with --resume {out}")
    if resume is None and config.bus.redis_url is not None:  # a configured server may hold this run's state
        from redis.exceptions import RedisError

        try:
            asyncio.run(ensure_new_run(config))
        except RuntimeError as exc:
            raise RunRefused(redact_text(str(exc)), code=1) from None
        except (RedisError, OSError, ValueError) as exc:  # unreachable, refused credentials, a URL redis-py refuses
            where = redact_url(config.bus.redis_url)
            raise RunRefused(redact_text(f"cannot use Redis at {where}: {exc}")) from None
    return config, out, own


def world_ready(config: Config, own: bool, progress: Any) -> None:
    """Build or finish the tiny world the run needs (nothing for a policy of one's own)."""
    from tlt_stream.tasks.bootstrap import SIZES, bootstrap, ships, unfinished

    world = Path(config.launch.world)
    if own or (why := world_to_build(world, config.launch.sd)) is None:
        return
    pending = unfinished(world) or {}
    size = pending.get("size") if pending.get("size") in SIZES else "default"
    seed = pending.get("seed", 0)
    how = "copying the tiny world shipped with the package" if ships(seed, size) else "bootstrapping the tiny world"
    print(f"tlt-stream run: {why}; {how}", file=sys.stderr)
    bootstrap(world, seed=seed, size=size, progress=progress)


def world_to_build(world: Path, sd: str) -> str | None:
    """Why `tlt-stream run` must bootstrap `world` first (None: it holds what the run needs). The default world
    is the command's own, built until it has a drafter; one given with --world is used as it is (a bootstrap
    left unfinished in it is finished), so a world of one's own without a drafter is refused, not replaced."""
    from tlt_stream.tasks.bootstrap import unfinished

    if unfinished(world) is not None:
        return f"{world} holds an unfinished bootstrap"
    if not (world / "policy").is_dir():
        return f"no policy in {world}"
    if sd == "eagle" and not (world / "drafter").is_dir() and world.resolve() == Path(DEFAULT_WORLD).resolve():
        return f"no drafter in {world}"
    return None


def check_plan(config: Config, out: Path, own: bool, cores: int) -> RunPlan:
    """The run's plan, once what would stop a service later is checked now: the devices, the trackers, the
    datasets' rows (the held-out one too), the reward and how it is called, the GPUs' placement."""
    from tlt_stream.commands.placement import describe
    from tlt_stream.commands.run.launch import placement, service_config
    from tlt_stream.model import resolve_device
    from tlt_stream.rl.rewards import resolve_reward
    from tlt_stream.rl.tracking import require_trackers

    try:
        resolve_device(config.rollout.device)  # a bad --device fails here, not in every service after start-up
        resolve_device(config.learner.device)
        require_trackers(config.learner.log_to)  # a missing tracker package: one line now, not in the learner
        if config.rollout.backend == "vllm":  # not imported here (seconds, and the workers do): only looked for
            import importlib.util

            from tlt_stream.rollout.vllm.install import INSTALL_HINT

            if importlib.util.find_spec("vllm") is None:
                raise RunRefused(f"rollout.backend = vllm needs vLLM, which is not installed: {INSTALL_HINT}")
        plan = RunPlan(world=Path(config.launch.world), run_dir=out, config=config, cores=cores)
        tokenizer = check_policy(plan.policy_dir, config)  # what a worker would refuse of it: now, not a wait
        reward = resolve_reward(config.rollout.reward)  # a missing module, file or function: before any service
        if config.data.dataset is not None:
            warn_tiny_reward(config.rollout.reward, "run")
        rows: list[dict] = []  # the other fields of every row the reward will score
        if config.data.dataset is not None:  # a bad row stops the run here, in one line, not a service later
            from tlt_stream.roles.policy import task_source

            pool = task_source(service_config(plan, config), tokenizer)  # the one check_policy loaded
            rows += [pool.fields.get(prompt_id) or {} for prompt_id, *_ in pool.rows]
            print(
                f"tlt-stream run: {config.data.dataset}: {len(pool)} prompts, {pool.skipped} over the prompt "
                "limit skipped (data.max_prompt_len)",
                file=sys.stderr,
            )
        if config.launch.eval and config.data.eval_dataset is not None:  # read as the evaluations will read it
            from tlt_stream.rl.evaluate import held_out_pool

            held_out, _ = held_out_pool(plan.policy_dir, config, tokenizer)
            rows += [held_out.fields.get(prompt_id) or {} for prompt_id, *_ in held_out.rows[: config.launch.eval]]
            if held_out.skipped:  # else "accuracy ... (N prompts)" later, fewer than the file has, unexplained
                print(
                    f"tlt-stream run: {config.data.eval_dataset}: {len(held_out)} held-out prompts, "
                    f"{held_out.skipped} over the prompt limit skipped (data.max_prompt_len)",
                    file=sys.stderr,
                )
        check_reward_call(reward, config.rollout.reward, rows or [{}])
    except (CheckpointError, FileNotFoundError, ValueError, DatasetError) as exc:
        raise RunRefused(redact_text(str(exc))) from None
    print(  # the name is what `monitor --run`, `doctor --run` and `purge --run` take
        f"tlt-stream run: {plan.steps} steps, {plan.workers} worker(s), run {config.run}, run dir {out}",
        file=sys.stderr,
    )
    if placed := placement(plan, config):  # a ConfigError (too few GPUs) stops the run here, exit code 2
        print(f"tlt-stream run: GPUs (CUDA_VISIBLE_DEVICES): {describe(placed)}", file=sys.stderr)
    if own and plan.sd != config.launch.sd:
        print(f"tlt-stream run: no drafter for {plan.policy_dir} (--drafter): drafting n-grams", file=sys.stderr)
    return plan


def warn_tiny_reward(reward: str, command: str) -> None:
    """One line on stderr where a dataset of one's own is scored with the tiny task's reward (the default):
    it reads `answer: N` lines only, so most responses of another task would score 0 and train nothing."""
    if reward == TINY_REWARD:
        print(
            f"tlt-stream {command}: warning: the reward is {TINY_REWARD} (the tiny task's, the default) on a dataset "
            "of your own; give --reward math, exact or module:function unless that is what you want",
            file=sys.stderr,
        )


TINY_REWARD = "repeated_add"
"""The tiny task's reward (`rl.rewards.REWARDS`), the configuration's default."""


def check_reward_call(reward: Any, name: str, rows: list[dict]) -> None:
    """Raise `ValueError` in one line when `reward` cannot take the call the rollout workers make
    (`rewards.call_reward`) on one of `rows` (each row's fields beside the prompt and the answer):
    `(response, answer)`, plus all the row's fields to a reward that takes `**kwargs` and those it names
    otherwise. Each distinct set of field names is tried once."""
    import inspect

    from tlt_stream.rl.rewards import reward_fields

    try:
        signature = inspect.signature(reward)
    except (TypeError, ValueError):  # a builtin or a C function: nothing to check before calling it
        return
    shapes = {frozenset(fields): fields for fields in rows}
    for fields in shapes.values():
        extra = reward_fields(reward, fields)
        try:
            signature.bind("", "", **extra)
        except TypeError as exc:
            given = ", ".join(["response", "answer", *(f"{k}=..." for k in extra)])
            others = ", ".join(sorted(fields)) or "none"
            raise ValueError(
                f"reward {name!r} cannot be called as f({given}), as the rollout workers call it: {exc} "
                f"(the rows' other fields: {others})"
            ) from None


def check_policy(policy: Path, config: Config) -> Any:
    """What the services would refuse of the policy checkpoint, checked before they start (a worker that
    refuses version 0 has no other to run, and would wait for one): its tokenizer (`data.tokenizer` where
    set) and, on the torch backend, its architecture and features, its safetensors and tensors, and the
    attention window at the run's `rollout.max_len`. Raises `CheckpointError` or `ValueError` in one line;
    returns the tokenizer."""
    from tlt_stream.model import load_tokenizer
    from tlt_stream.model.loader import check_checkpoint
    from tlt_stream.model.sizing import context_len

    tokenizer = load_tokenizer(config.data.tokenizer or policy)
    if config.rollout.backend == "torch":  # vLLM runs architectures of its own and reads its own files
        spec = check_checkpoint(policy)
        spec.check_window(context_len(config.rollout.max_len, spec.max_position_embeddings, str(policy)))
    return tokenizer


def evaluate_before(plan: RunPlan, config: Config, own: bool) -> int:
    """Held-out accuracy of version 0 (once per run directory); the prompts evaluated per evaluation."""
    from tlt_stream.commands.run.launch import evaluate_version

    evals = config.launch.eval
    if evals and own and config.data.eval_dataset is None:
        print("tlt-stream run: no --eval-dataset for this policy: no held-out evaluation", file=sys.stderr)
        return 0
    if evals and not (plan.run_dir / "eval.jsonl").exists():
        seed = config.policy.seed
        try:
            row = evaluate_version(
                plan.run_dir, 0, plan.policy_dir, n=evals, seed=seed, threads=plan.cores, config=config
            )
        except EVAL_ERRORS as exc:  # check_plan read the dataset and the reward: what is left is one line too
            raise RunRefused(redact_text(f"evaluation before training failed: {exc}"), code=1) from None
        shown = row["prompts"]
        print(f"held-out accuracy before training: {row['accuracy']:.3f} ({shown} prompts)", file=sys.stderr)
    return evals


def run_services(plan: RunPlan, config: Config, evals: int, progress: Any, *, resume: bool = False) -> int:
    """The services until the learner's last version (a bar per step), a stop (130), or a failure. `resume`:
    a stopped run goes on, from its own state where its servers kept it."""
    from tlt_stream.basics.aio import install_stop_signals
    from tlt_stream.commands.run.launch import run_plan

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
            if config.launch.sd != "off":  # tokens per target forward and the newest drafter version in the step
                figures["accept"] = row.get("accept_length_mean", 1.0)
                figures["drafter_v"] = float(max(drafters, default=-1))
            progress("train", row["version"], plan.steps, figures)
            every = config.launch.eval_every
            if evals and every and row["version"] % every == 0 and row["version"] < plan.steps:
                _evaluate_during(plan.run_dir, row["version"], evals, config)

    async def main() -> int:
        stop = asyncio.Event()
        install_stop_signals(stop)
        progress("train", 0, plan.steps, {})  # the bar (and its clock, which the last line's agrees with) starts now
        code = await run_plan(plan, on_step=on_step, stop=stop, resume=resume)
        if code == 130:
            print("tlt-stream run: stopped; every service was shut down, checkpoints are intact", file=sys.stderr)
        return code

    try:
        return asyncio.run(main())
    except (RuntimeError, FileNotFoundError, ValueError) as exc:  # a service's log tail among them
        raise RunRefused(redact_text(str(exc)), code=1) from None


def finish(plan: RunPlan, config: Config, code: int, evals: int, seconds: float) -> int:
    """Held-out accuracy after the last version, the report, and the line that says how the run ended."""
    from tlt_stream.basics.interrupts import sigint_received
    from tlt_stream.commands.report import write_report
    from tlt_stream.commands.run.launch import evaluate_version
    from tlt_stream.rl.checkpoint import latest_checkpoint

    out = plan.run_dir
    if code == 0 and evals:
        final = latest_checkpoint(out / "checkpoints")
        if final is not None:
            seed = config.policy.seed
            try:
                row = evaluate_version(
                    out, final.step, final.policy_dir, n=evals, seed=seed, threads=plan.cores, config=config
                )
                print(f"held-out accuracy after {final.step} steps: {row['accuracy']:.3f}", file=sys.stderr)
            except EVAL_ERRORS as exc:  # the run is done: its report is still written
                if sigint_received():  # a Ctrl-C that torch turned into this error
                    raise KeyboardInterrupt from None
                print(redact_text(f"tlt-stream run: evaluation after training failed: {exc}"), file=sys.stderr)
    try:
        where = f"report: {write_report(out)}"
    except FileNotFoundError:  # stopped before the first update
        where = "no step finished, so no report"
    except (OSError, ValueError) as exc:  # the run is done whatever befalls its report (a full disk, say)
        where = redact_text(f"the report was not written ({exc}); `tlt-stream report {out}` draws it later")
    print(f"tlt-stream run: {'finished' if code == 0 else 'stopped'} in {seconds:.0f}s; {where}", file=sys.stderr)
    return code


def _evaluate_during(out: Path, version: int, n: int, config: Config) -> None:
    """Held-out evaluation of the checkpoint of `version` while the run goes on (one thread: the services
    have the cores); a checkpoint already pruned is skipped."""
    from tlt_stream.commands.run.launch import evaluate_version
    from tlt_stream.rl.checkpoint import complete_checkpoints

    found = next((c for c in complete_checkpoints(out / "checkpoints") if c.step == version), None)
    if found is None:
        return
    seed = config.policy.seed
    try:
        row = evaluate_version(out, version, found.policy_dir, n=n, seed=seed, threads=1, config=config)
    except EVAL_ERRORS as exc:  # pruned while read: the next evaluation will do
        print(f"tlt-stream run: evaluation of version {version} skipped ({exc})", file=sys.stderr)
        return
    print(f"held-out accuracy at version {version}: {row['accuracy']:.3f}", file=sys.stderr)
