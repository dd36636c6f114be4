"""What a rollout engine and a learner running at once on the same cores cost each other, and what idle-priority
drafter training costs a learner: diagnostics of the planner's contention model (the simulator takes none of
these factors; it takes the contention bench's curves, `bench/plan_contention.py`).

A streaming run (`max_staleness` >= 1) gives its worker and its learner their own share of the cores (on 2:
one thread each) and runs them at once. Besides the CPU they share the caches and the memory bus, which the
contention bench's synthetic load (a Python spin loop) does not touch. Here the neighbour is the real thing:

- the engine's plain decode steps (b = 1, 16, 128; `--worker-threads`) alone, then beside a process that runs
  `LearnerCore.step` over 4 synthetic groups in a loop (`--learner-threads`);
- the learner's update alone, then beside a process that runs plain decode steps of 64 rows in a loop;
- with `--drafter`, the learner's update alone, then beside a process that trains the drafter in a loop on one
  thread at the idle priority, as a rollout worker trains it in its idle time (`roles/drafter_trainer.py`):
  in a synchronous run on shared cores that is during the learner's update (`learner_beside_training`).

Alone and beside alternate `--rounds` times; each factor is the median over rounds (and batches) of beside
over alone, so the machine's drift between minutes cancels. The machine's other load is read beside every
point (`bench/plan_load.py`).

    flock /tmp/tlt-heavy.lock python bench/plan_corun.py --out artifacts/plan/corun.json

Prints one JSON object and writes it to --out. The engine and learner pair is a diagnostic of the streaming
config's overlap: the simulator does not take those factors (on 2 cores they came out near what the contention
curve gives a 1-thread process beside one busy core; docs/benchmarks.md, the planner's check).

    flock /tmp/tlt-heavy.lock python bench/plan_corun.py --drafter --learner-threads 2 --out DIR/corun-t2.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

BATCHES = (1, 16, 128)
NEIGHBOUR_BATCH = 64


def log(text: str) -> None:
    print(f"[plan_corun] {text}", file=sys.stderr, flush=True)


def neighbour(kind: str, world: Path, threads: int) -> None:
    """Run `kind`'s work in a loop until killed (the child process)."""
    import torch

    torch.set_num_threads(threads)
    if kind == "drafter":
        from tlt_stream.roles.drafter_trainer import _side_thread

        trainer, batch = drafter_training(world)
        _side_thread()  # one torch thread, the idle scheduling class: the worker's own setting
        print("ready", flush=True)
        while True:
            trainer.step(batch)
    if kind == "learner":
        from plan_fit import learner_batch

        from tlt_stream.rl.learner import LearnerCore, LearnerSettings

        model, groups = learner_batch(world, 4)
        core = LearnerCore(model, LearnerSettings(lr=1e-6))
        print("ready", flush=True)
        while True:
            core.step(groups)
    else:
        from plan_contention import engine_point

        from tlt_stream.model import load_model

        policy = load_model(world / "policy")
        print("ready", flush=True)
        while True:
            engine_point(policy, NEIGHBOUR_BATCH, 5.0, {os.getpid()})


def drafter_training(world: Path) -> tuple:
    """(a `DrafterTrainer` of the world's drafter, one packed batch of synthetic windows of the world's lengths:
    the default batch of pairs, random tokens and hidden states)."""
    import random

    import torch

    from tlt_stream.basics.config import DEFAULTS
    from tlt_stream.drafter.model import load_drafter
    from tlt_stream.drafter.train import DrafterTrainer, Window, pack_windows
    from tlt_stream.model import load_model

    policy = load_model(world / "policy")
    drafter = load_drafter(world / "drafter", policy)
    rng, own = random.Random(0), DEFAULTS.drafter
    windows, pairs = [], 0
    while pairs < own.batch_pairs:
        n = min(1400, max(8, int(rng.lognormvariate(5.0, 0.6))))
        tokens = torch.tensor([rng.randrange(policy.spec.vocab_size) for _ in range(n)])
        windows.append(Window(tokens, torch.randn(n, policy.spec.hidden_size), prompt_len=0))
        pairs += n - 1
    (batch,) = pack_windows(windows, own.row_tokens)
    return DrafterTrainer(drafter, unroll=own.unroll), batch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", default=str(ROOT / "artifacts" / "world"))
    p.add_argument("--out", default=str(ROOT / "artifacts" / "plan" / "corun.json"))
    p.add_argument("--worker-threads", type=int, default=1)
    p.add_argument("--learner-threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--window", type=float, default=1.0, help="seconds each engine point is measured")
    p.add_argument(
        "--drafter",
        action="store_true",
        help="only the learner beside idle-priority drafter training (learner_beside_training)",
    )
    p.add_argument("--neighbour", choices=["learner", "engine", "drafter"], help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    world = Path(args.world)
    if args.neighbour:
        neighbour(args.neighbour, world, args.threads)
        return
    if not (world / "policy").is_dir():
        sys.exit(f"{world}: no policy; run `tlt-stream bootstrap --out {world}` first")
    import torch
    from plan_contention import engine_point, measured
    from plan_fit import learner_batch

    from tlt_stream.model import load_model
    from tlt_stream.rl.learner import LearnerCore, LearnerSettings

    policy = load_model(world / "policy")
    model, groups = learner_batch(world, 4)
    core = LearnerCore(model, LearnerSettings(lr=1e-6))
    mine = {os.getpid()}

    def beside(kind: str, threads: int) -> subprocess.Popen:
        command = [sys.executable, __file__, "--neighbour", kind, "--threads", str(threads), "--world", str(world)]
        child = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
        assert child.stdout is not None
        child.stdout.readline()  # "ready": loaded, about to loop
        time.sleep(1.0)
        mine.add(child.pid)
        return child

    def stop(child: subprocess.Popen) -> None:
        mine.discard(child.pid)
        child.send_signal(signal.SIGKILL)
        child.wait()

    def engine_points() -> dict[int, tuple[float, float]]:
        torch.set_num_threads(args.worker_threads)
        return {b: engine_point(policy, b, args.window, mine) for b in BATCHES}

    def learner_point() -> tuple[float, float]:
        torch.set_num_threads(args.learner_threads)
        core.step(groups)  # warm at this thread count
        return measured(lambda: core.step(groups), 2 * args.window, mine)

    def alone_then_beside(measure, kind: str, threads: int):
        alone = measure()
        child = beside(kind, threads)
        try:
            return alone, measure()
        finally:
            stop(child)

    started = time.time()
    rounds = []
    for r in range(args.rounds):
        if args.drafter:
            alone_l, beside_l = alone_then_beside(learner_point, "drafter", 1)
            rounds.append({"learner": [alone_l[0], beside_l[0]], "other_cores": [alone_l[1], beside_l[1]]})
            log(f"round {r + 1}/{args.rounds}: learner beside drafter training {beside_l[0] / alone_l[0]:.3f}")
            continue
        alone_e, beside_e = alone_then_beside(engine_points, "learner", args.learner_threads)
        alone_l, beside_l = alone_then_beside(learner_point, "engine", args.worker_threads)
        point = {
            "engine": {str(b): [alone_e[b][0], beside_e[b][0]] for b in BATCHES},
            "learner": [alone_l[0], beside_l[0]],
            "other_cores": [alone_e[1][1], beside_e[1][1], alone_l[1], beside_l[1]],
        }
        rounds.append(point)
        ratios = {b: round(v[1] / v[0], 3) for b, v in point["engine"].items()}
        log(f"round {r + 1}/{args.rounds}: engine beside learner {ratios}, learner beside engine "
            f"{point['learner'][1] / point['learner'][0]:.3f}")  # fmt: skip
    learner = round(statistics.median(x["learner"][1] / x["learner"][0] for x in rounds), 3)
    if args.drafter:
        factors = {"learner_beside_training": learner}
    else:
        engine = statistics.median(x["engine"][str(b)][1] / x["engine"][str(b)][0] for x in rounds for b in BATCHES)
        factors = {"engine_beside_learner": round(engine, 3), "learner_beside_engine": learner}
    out = {
        "bench": "plan_corun",
        "worker_threads": args.worker_threads,
        "learner_threads": args.learner_threads,
        **factors,
        "rounds": rounds,
        "seconds": round(time.time() - started, 1),
        "cpus": os.cpu_count(),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
