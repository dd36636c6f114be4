"""Soak: Redis memory over a long run stays flat once every bounded stream has reached its bound.

    python bench/soak.py                     # 300 steps of the tiny loop (~10 minutes on 2 cores)
    python bench/soak.py --steps 60 --every 10

Runs the services as processes (the command lines `tlt-stream run` uses) against a private redis-server and
Mosquitto, on the tests' tiny random policy (small steps: 2 prompts x 2 samples, 64 tokens), and samples
Redis' own `INFO memory` (`used_memory`) and the length of every stream of the run each `--every` steps.
What would grow without bound is trimmed by the services (`prompts` after each dispatch, `samples` after each
checkpoint); `stats`, `hidden` and `dead` are bounded by their `MAXLEN ~`, set small here (`--stats-maxlen`,
`--hidden-maxlen`) so that each bound is reached within the warm-up and the figure measures growth, not the
filling of a bounded buffer. With `--sd eagle` (the default) the worker streams every sample's hidden states
and trains the drafter in its idle time, as `tlt-stream run` does.
Prints one JSON object: the samples, and the spread of `used_memory` after `--warmup` steps (max / min - 1;
the goal is <= 10%).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


async def soak(args: argparse.Namespace, tmp: Path) -> dict:
    import redis.asyncio as aioredis

    from tests.faults.harness import PrivateServers
    from tests.worlds import build_world, tiny_policy
    from tlt_stream.basics.config import BusConfig, Config, override
    from tlt_stream.bus.streams import STREAMS, Keys
    from tlt_stream.commands.run.launch import RunPlan, service_commands, write_service_config
    from tlt_stream.rl.records import load_metrics

    build_world(tiny_policy(tmp / "init"), tmp / "world")
    run_dir = tmp / "run"
    (run_dir / "logs").mkdir(parents=True)
    small = {
        "preset": "tiny-world",
        "policy.steps": args.steps,
        "launch.workers": 1,
        "policy.prompts_per_step": 2,
        "policy.group_size": 2,
        "rollout.max_len": 64,
        "rollout.max_batch": 8,
        "launch.sd": args.sd,
        "rollout.hidden_share": 1.0,
    }
    samples: list[dict] = []
    async with PrivateServers(tmp / "servers") as servers:
        bus = BusConfig(redis_url=servers.redis_url, mqtt_url=servers.mqtt_url)
        config = override(Config(run="soak", bus=bus), small)
        plan = RunPlan(world=tmp / "world", run_dir=run_dir, config=config, cores=2)
        write_service_config(plan, config)
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("TLT_")},
            "TLT_REDIS_URL": servers.redis_url,
            "TLT_MQTT_URL": servers.mqtt_url,
            "TLT_BUS__STATS_MAXLEN": str(args.stats_maxlen),
            "TLT_BUS__HIDDEN_MAXLEN": str(args.hidden_maxlen),
            "PYTHONPATH": str(ROOT),
            "PYTHONUNBUFFERED": "1",
        }
        processes = []
        for command in service_commands(plan, config):
            with (run_dir / "logs" / f"{command.name}.log").open("ab") as log:
                processes.append(
                    await asyncio.create_subprocess_exec(*command.argv, env=env, stdout=log, stderr=log, cwd=ROOT)
                )
        redis = aioredis.Redis.from_url(servers.redis_url)
        keys = Keys(config.run)
        started = time.monotonic()
        next_sample = 0
        try:
            while True:
                rows = load_metrics(run_dir)
                version = rows[-1]["version"] if rows else 0
                if version >= next_sample:
                    info = await redis.info("memory")
                    lengths = {name: int(await redis.xlen(keys.stream(name))) for name in STREAMS}
                    samples.append(
                        {
                            "step": version,
                            "used_memory": int(info["used_memory"]),
                            "seconds": round(time.monotonic() - started, 1),
                            **{f"xlen_{k}": v for k, v in lengths.items()},
                        }
                    )
                    print(json.dumps(samples[-1]), file=sys.stderr)
                    next_sample += args.every
                if version >= args.steps:
                    break
                for p in processes:
                    if p.returncode not in (None, 0):
                        raise RuntimeError(f"a service exited with {p.returncode}: see {run_dir / 'logs'}")
                await asyncio.sleep(0.5)
        finally:
            await redis.aclose()
            for p in processes:
                if p.returncode is None:
                    p.terminate()
            await asyncio.gather(*(p.wait() for p in processes))
    after = [s["used_memory"] for s in samples if s["step"] >= args.warmup]
    spread = max(after) / min(after) - 1 if after else None
    return {
        "bench": "soak",
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
        "steps": args.steps,
        "warmup_steps": args.warmup,
        "stats_maxlen": args.stats_maxlen,
        "hidden_maxlen": args.hidden_maxlen,
        "sd": args.sd,
        "samples": samples,
        "used_memory_after_warmup": {"min": min(after), "max": max(after)} if after else None,
        "spread_after_warmup": None if spread is None else round(spread, 4),
        "goal": "spread <= 0.10",
        "reached": spread is not None and spread <= 0.10,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--every", type=int, default=25, help="sample Redis memory every this many steps")
    p.add_argument("--warmup", type=int, default=100, help="steps before the spread is measured")
    p.add_argument("--stats-maxlen", type=int, default=500, help="bus.stats_maxlen for the run")
    p.add_argument(
        "--sd", choices=("off", "eagle"), default="eagle", help="eagle: workers stream every hidden window and train"
    )
    p.add_argument("--hidden-maxlen", type=int, default=50, help="bus.hidden_maxlen for the run")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        print(json.dumps(asyncio.run(soak(args, Path(tmp))), indent=1))


if __name__ == "__main__":
    main()
