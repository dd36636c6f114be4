"""The learner's update beside the drafter's idle training, as a rollout worker runs it: the planner's constant
for what the synchronous configs' updates lose to it (`CpuCosts.learner_beside_training`), fitted on a
microbenchmark.

In a synchronous run with the drafter trained online, the worker falls idle when its last group finishes,
which is when the learner's update starts: it takes the drafter's lease and trains under it until the next
policy version is announced. The training thread runs at the lowest priority (`SCHED_IDLE`), so the
simulator gives it no core while the update's threads hold them all; but the idle period's other work runs at
normal priority beside the update: the worker's event loop draining the step's hidden-state windows from
Redis and acknowledging them, the lease's keep-alive, the prompts watch, the commits, and the Redis server
serving them (the embedded one, a Python thread, in a laptop run).

This bench runs exactly that: a real `RolloutWorker`'s `IdleDrafterTrainer` in a process of its own, against
embedded Redis and MQTT servers in a third process (as `tlt-stream run` hosts them), with the step's
hidden-state windows (real generations of the world's policy) pushed before each idle period and the next
policy version announced over MQTT after the update to end it, as the run's learner and policy service do.
Beside it this process runs the learner's update (`LearnerCore.step` on `--groups` groups, `--threads`
torch threads), alone and beside the worker's idle period in interleaved pairs (the order alternating), and
reads from /proc the cores the worker's and the servers' processes took over each update.

    flock /tmp/tlt-heavy.lock python bench/plan_beside.py --world artifacts/world \\
        --out artifacts/plan/beside.json

The fit: the median over pairs (the first `--warm` left out: the trainer's first slice builds it) of each
pair's update beside over alone, at least 1 (`learner_beside_training`); `bench/plan_check.py --beside`
charges it.
Prints one JSON object and writes it to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def log(text: str) -> None:
    print(f"[plan_beside] {text}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------- the servers


def host() -> None:
    """Embedded Redis and MQTT servers until stdin closes; their URLs on the first line of stdout."""
    from tlt_stream.bus.embedded import embedded_servers

    with embedded_servers() as servers:
        print(json.dumps({"redis": servers.redis_url, "mqtt": servers.mqtt_url}), flush=True)
        sys.stdin.read()


# ---------------------------------------------------------------------------------------------- the worker


def windows_of(engine: Any, n: int, version: int, tag: str) -> list:
    """`n` hidden-state windows of real generations of the policy (sampled to the task's end of sequence)."""
    from plan_fit import prompts_of

    from tlt_stream.rl.samples import hidden_window
    from tlt_stream.tasks.tokenizer import build_tokenizer

    eos = build_tokenizer().eos_token_id
    results = engine.generate(prompts_of(n), 256, 1.0, seed=version * n, eos_ids=(eos,), return_hidden=True)
    return [hidden_window(r, f"{tag}/{version}/{i}", version) for i, r in enumerate(results)]


async def worker(spec: dict) -> None:
    """A rollout worker's idle training on command (stdin lines): `idle V` pushes a step's windows and starts
    an idle period at policy version V (`started`); `preempt V` announces version V + 1, which ends it
    (`ended`); `quit`."""
    import torch

    from tlt_stream.basics.config import load_config, override
    from tlt_stream.basics.messages import PolicyVersion
    from tlt_stream.bus.connect import connect_redis
    from tlt_stream.bus.control import ControlPlane
    from tlt_stream.bus.producer import StreamProducer
    from tlt_stream.bus.streams import Keys
    from tlt_stream.model import load_model
    from tlt_stream.roles.rollout_worker import RolloutWorker
    from tlt_stream.rollout.engine import GenerationEngine
    from tlt_stream.rollout.proposers import build_proposer

    world = Path(spec["world"])
    torch.set_num_threads(spec["threads"])
    values = {
        "run": spec["run"],
        "bus.redis_url": spec["redis"],
        "bus.mqtt_url": spec["mqtt"],
        "sd.drafter": str(world / "drafter"),
        "drafter.state_dir": spec["states"],
        "rollout.threads": spec["threads"],
    }
    config = override(load_config(None, environ={}), values)
    redis = connect_redis(config.bus.redis_url)
    control = ControlPlane(config, redis, role="rollout", owns=["drafter", "policy"])
    stop = asyncio.Event()
    plane = asyncio.create_task(control.run(stop))
    await asyncio.wait_for(control.connected.wait(), 30)
    rollout = RolloutWorker(config, redis, control, worker_id="beside-worker", reward=lambda *_: 0.0)
    trainer = rollout.idle_trainer
    assert trainer is not None, "the worker does not train the drafter: check the drafter settings"
    model = load_model(world / "policy")
    engine = GenerationEngine(model, spec["windows"], 1024, proposer=build_proposer(str(world / "drafter"), model))
    producer = StreamProducer(redis, Keys(config.run), config.bus)
    loop = asyncio.get_running_loop()
    idle: asyncio.Task | None = None
    print("ready", flush=True)
    while True:
        line = (await loop.run_in_executor(None, sys.stdin.readline)).split()
        if not line or line[0] == "quit":
            break
        version = int(line[1])
        if line[0] == "idle":
            await producer.send("hidden", windows_of(engine, spec["windows"], version, "beside"))
            idle = asyncio.create_task(trainer.run_idle(engine, version, [], stop))
            print("started", flush=True)
        elif line[0] == "preempt":
            announce = PolicyVersion(version=version + 1, location=str(world / "policy"), sha256="0" * 64)
            await control.publish(announce)
            assert idle is not None
            await asyncio.wait_for(idle, 60)
            print(f"ended {trainer.slices} {trainer.training_seconds:.3f}", flush=True)
    stop.set()
    await plane
    await redis.aclose()


# ---------------------------------------------------------------------------------------------- the learner


def expect(proc: subprocess.Popen, word: str) -> str:
    line = proc.stdout.readline().strip()
    if not line.startswith(word):
        raise SystemExit(f"plan_beside: the worker said {line!r}, not {word!r} (its log above)")
    return line


def fit(pairs: list[dict], warm: int) -> dict:
    """The median of beside / alone over the pairs after the first `warm`, and the cores beside the update."""
    kept = pairs[warm:] or pairs

    def median(key: str) -> float:
        return statistics.median(p[key] for p in kept)

    def ratio(part: str) -> float:
        return round(statistics.median(p[f"beside{part}_s"] / p[f"alone{part}_s"] for p in kept), 4)

    seconds = [f"{k}{part}_s" for k in ("alone", "beside") for part in ("", "_step", "_save")]
    cores = [f"{who}_cores{suffix}" for who in ("worker", "learner", "servers") for suffix in ("", "_alone")]
    return {
        "learner_beside_training": max(1.0, ratio("")),  # below 1 is the machine's noise: it cannot speed the update
        "ratios": [round(p["beside_s"] / p["alone_s"], 4) for p in kept],
        "median_over_median": round(median("beside_s") / median("alone_s"), 4),
        "step_ratio": ratio("_step"),
        "save_ratio": ratio("_save"),
        **{key: round(median(key), 4) for key in seconds},
        **{key: round(median(key), 3) for key in cores},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", default=str(ROOT / "artifacts" / "world"))
    p.add_argument("--out", default=str(ROOT / "artifacts" / "plan" / "beside.json"))
    p.add_argument(
        "--pairs", type=int, default=20, help="interleaved (alone, beside) pairs (one update each varies by 1.5x here)"
    )
    p.add_argument("--warm", type=int, default=2, help="first pairs left out of the fit")
    p.add_argument(
        "--groups", type=int, default=6, help="synthetic groups of the update (6: about as long as an e2e step's)"
    )
    p.add_argument("--windows", type=int, default=32, help="hidden-state windows a step streams (16 x 8 x 0.25)")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the learner and the worker")
    p.add_argument("--host", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.host:
        return host()
    if args.worker:
        return asyncio.run(worker(json.loads(args.worker)))

    import torch
    from plan_fit import learner_batch
    from plan_load import cpu_of

    from tlt_stream.rl.learner import LearnerSettings
    from tlt_stream.rl.sharded import Trainer

    if not (Path(args.world) / "drafter").is_dir():
        sys.exit(f"{args.world}: no policy/drafter; run `tlt-stream bootstrap --out {args.world}` first")
    started = time.time()
    torch.set_num_threads(args.threads)
    _, groups = learner_batch(Path(args.world), args.groups)
    trainer = Trainer(LearnerSettings(lr=1e-6), "cpu")
    core = trainer.build(Path(args.world) / "policy")
    core.step(groups)
    saves = 0

    def update(root: Path) -> tuple[float, float]:
        """One update as the learner service times it (`update_seconds`): the step, then its checkpoint
        written and hashed (the optimizer's state is written behind, as in the service; waited for after)."""
        nonlocal saves
        t = time.perf_counter()
        core.step(groups)
        stepped = time.perf_counter()
        saves += 1
        trainer.save(root, step=saves, ledger=set(), extra={}, tokenizer=None, keep=3, publish_dtype=torch.float32)
        return stepped - t, time.perf_counter() - stepped

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    servers = subprocess.Popen([sys.executable, __file__, "--host"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True, env=env)  # fmt: skip
    urls = json.loads(servers.stdout.readline())
    with tempfile.TemporaryDirectory(prefix="plan-beside-") as states:
        spec = {"world": args.world, "run": f"beside{os.getpid()}", "states": states, "threads": args.threads,
                "windows": args.windows, **urls}  # fmt: skip
        proc = subprocess.Popen([sys.executable, __file__, "--worker", json.dumps(spec)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, env=env)  # fmt: skip
        try:
            expect(proc, "ready")
            pairs = []
            for i in range(args.pairs):
                pair: dict[str, Any] = {}
                for beside in (i % 2 == 1, i % 2 == 0):
                    if beside:
                        proc.stdin.write(f"idle {i}\n")
                        proc.stdin.flush()
                        expect(proc, "started")
                    cpu = (cpu_of(proc.pid), cpu_of(servers.pid), cpu_of(os.getpid()))
                    step_s, save_s = update(Path(states) / "ckpt")
                    elapsed = step_s + save_s
                    worker_s, servers_s = cpu_of(proc.pid) - cpu[0], cpu_of(servers.pid) - cpu[1]
                    learner_s = cpu_of(os.getpid()) - cpu[2]
                    trainer.wait_for_writes()
                    which = "beside" if beside else "alone"
                    suffix = "" if beside else "_alone"
                    pair |= {f"{which}_s": elapsed, f"{which}_step_s": step_s, f"{which}_save_s": save_s}
                    pair |= {f"worker_cores{suffix}": worker_s / elapsed, f"servers_cores{suffix}": servers_s / elapsed}
                    pair[f"learner_cores{suffix}"] = learner_s / elapsed
                    if beside:
                        proc.stdin.write(f"preempt {i}\n")
                        proc.stdin.flush()
                        pair["slices"] = expect(proc, "ended").split()[1:]
                    time.sleep(0.2)
                pairs.append(pair)
                log(f"pair {i}: alone {pair['alone_s']:.3f} s (save {pair['alone_save_s']:.3f}), beside "
                    f"{pair['beside_s']:.3f} s (save {pair['beside_save_s']:.3f}) "
                    f"({pair['beside_s'] / pair['alone_s']:.3f}x; learner {pair['learner_cores_alone']:.2f} and "
                    f"{pair['learner_cores']:.2f} cores, worker {pair['worker_cores']:.2f}, "
                    f"servers {pair['servers_cores']:.2f})")  # fmt: skip
            proc.stdin.write("quit\n")
            proc.stdin.flush()
            proc.wait(60)
        finally:
            for child in (proc, servers):
                if child.poll() is None:
                    child.stdin.close()
                    try:
                        child.wait(10)
                    except subprocess.TimeoutExpired:
                        child.kill()
    out = {
        "bench": "plan_beside",
        "threads": args.threads,
        "groups": args.groups,
        "windows": args.windows,
        "fit": fit(pairs, args.warm),
        "pairs": [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in q.items()} for q in pairs],
        "seconds": round(time.time() - started, 1),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
