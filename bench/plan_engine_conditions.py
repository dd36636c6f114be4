"""Does the engine run as fast in a run's conditions as in the planner's fit? A diagnostic of the CPU model's
engine term (docs/notes/h44l.md): the fit times decode steps back to back in an engine sized to its rows;
a rollout worker runs hops of `rollout.steps_per_hop` steps in an engine of `rollout.max_batch` rows of
`rollout.max_len`, its rows scattered over the slots, with its loop's work between hops. Each comparison
alternates its contenders hop by hop over the same growing contexts (16 rows of the tiny world's policy),
and reports each contender's median seconds per step and the median ratio to the fit's condition:

- engine: the fit's engine (sized to its rows) against the run's (`Config()`'s rollout sizing), its rows
  contiguous and scattered over the slots (three rows of four finish after three tokens);
- between hops: nothing (as the fit), the loop's own work against an embedded Redis (three XADDs of a 5 KB
  entry, a read of a consumer group, a decode: ~1 ms, as a worker's poll and output), or 16 MB written (what
  evicts the caches);
- each contender's mean over its median: a heavy tail of slow steps would make a run's mean slower than the
  fit's medians.

    python bench/plan_engine_conditions.py --threads 2 --hops 150

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

ROWS = 16


def timed_hops(engines: dict, between: dict, hops: int, steps: int) -> dict[str, list[float]]:
    """Seconds per step of each (engine, between-hops work) contender, hop by hop in turn."""
    names = list(engines)
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(hops):
        name = names[i % len(names)]
        between[name]()
        started = time.perf_counter()
        for _ in range(steps):
            engines[name].step()
        times[name].append((time.perf_counter() - started) / steps)
    return times


def summary(times: dict[str, list[float]], base: str) -> dict:
    out = {}
    for name, seconds in times.items():
        row = {
            "median_ms": round(1e3 * statistics.median(seconds), 3),
            "mean_over_median": round(statistics.fmean(seconds) / statistics.median(seconds), 3),
        }
        if name != base:
            pairs = zip(seconds, times[base], strict=False)
            row["vs_fit"] = round(statistics.median(a / b for a, b in pairs), 3)
        out[name] = row
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", default="artifacts/world")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--hops", type=int, default=150, help="hops per comparison, shared among its contenders")
    args = p.parse_args()

    import msgspec
    import numpy as np
    import redis
    import torch
    from plan_fit import prompts_of, ragged

    from tlt_stream.basics.config import Config, override
    from tlt_stream.bus.embedded import EmbeddedServers
    from tlt_stream.model import load_model
    from tlt_stream.rollout.build import build_engine
    from tlt_stream.rollout.engine import GenerationEngine

    torch.set_num_threads(args.threads)
    policy_dir = Path(args.world) / "policy"
    policy = load_model(policy_dir)
    prompts = ragged(prompts_of(ROWS), 50)
    config = Config()
    steps = config.rollout.steps_per_hop
    longest = max(len(q) for q in prompts)
    run_config = override(config, {"rollout.max_len": policy.spec.max_position_embeddings})

    def engine(kind: str, hops: int):
        """An engine of `kind` with the rows for `hops` hops of its own (and one before them)."""
        new = (hops + 2) * steps
        if kind == "fit":
            built = GenerationEngine(policy, ROWS, longest + new + 70, max_draft_nodes=64)
        else:
            built, _ = build_engine(str(policy_dir), run_config)
        spread = kind == "run_scattered"
        for i in range(ROWS * 4 if spread else ROWS):
            budget = new if not spread or i % 4 == 0 else 3
            built.add_request(prompts[i // 4 if spread else i], budget, 1.0, seed=i, eos_ids=())
        for _ in range(steps):
            built.step()
        return built

    servers = EmbeddedServers()
    client = redis.Redis.from_url(servers.start_redis())
    client.xgroup_create("s", "g", id="0", mkstream=True)
    payload = msgspec.msgpack.encode({"ids": list(range(400)), "h": np.random.rand(1200).astype(np.float32).tobytes()})
    block = np.ones(16 * 2**20 // 8)

    def loop_work() -> None:
        for _ in range(3):
            client.xadd("s", {"m": payload}, maxlen=100)
        client.xreadgroup("g", "c", {"s": ">"}, count=10)
        msgspec.msgpack.decode(payload)

    def evict() -> None:
        block[:] += 1.0

    def nothing() -> None:
        pass

    try:
        sizing = {kind: engine(kind, args.hops // 3 + 1) for kind in ("fit", "run", "run_scattered")}
        by_engine = timed_hops(sizing, dict.fromkeys(sizing, nothing), args.hops, steps)
        fit = engine("fit", args.hops)  # one engine: the three kinds of work take turns before its hops
        work = {"fit": nothing, "loop_work": loop_work, "caches_evicted": evict}
        by_work = timed_hops(dict.fromkeys(work, fit), work, args.hops, steps)
    finally:
        client.close()
        servers.close()
    print(
        json.dumps(
            {
                "threads": args.threads,
                "rows": ROWS,
                "steps_per_hop": steps,
                "engine": summary(by_engine, "fit"),
                "between_hops": summary(by_work, "fit"),
            }
        )
    )


if __name__ == "__main__":
    main()
