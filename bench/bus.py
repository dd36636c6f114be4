"""Bus throughput: the project's stream layer vs bare redis-py, in one run against the same Redis.

Produces and consumes 256 KiB hidden-state windows (the `hidden` buffer stream) and small sample entries
(the durable `samples` stream, with backpressure accounting) three ways:
- `project`: `StreamProducer.send` / `StreamReader.read` + `ack` (encode, decode + validate, hidden windows
  turned into torch tensors);
- `bare`: the same messages with bare redis-py calls (pipelined XADD, XREADGROUP + XACK) doing the same
  msgspec encode and decode (+ torch tensor) a user of redis-py would: the ratio project/bare isolates
  what the layer adds (pipelining, bookkeeping, reclaim/dead-letter checks, ack notifications);
- `raw`: bare redis-py moving pre-encoded bytes and never decoding them: the ceiling of the transport.
Rounds rotate the order so machine noise hits all three; medians are reported. Also measures encode /
decode (+ tensor copy) cost per message. Prints one JSON object.

    python bench/bus.py [--quick] [--redis-url redis://127.0.0.1:6379/0]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
import timeit
import uuid

import redis.asyncio as aioredis
import torch
from redis.utils import HIREDIS_AVAILABLE

from tlt_stream.basics.config import BusConfig
from tlt_stream.basics.messages import HiddenWindow, Sample, Tensor, codec_for
from tlt_stream.bus.consumer import StreamReader
from tlt_stream.bus.producer import PAYLOAD_FIELD, StreamProducer
from tlt_stream.bus.streams import Keys

BATCH = 16


def hidden_window(i: int, rows: int = 128, width: int = 512) -> HiddenWindow:
    # 128 x 512 float32 = 256 KiB of hidden state
    return HiddenWindow(
        sample_id=f"s{i}",
        policy_version=1,
        token_ids=list(range(rows)),
        hidden=Tensor.from_torch(torch.randn(rows, width)),
    )


def sample(i: int, n: int = 512) -> Sample:
    return Sample(
        sample_id=f"t{i}/0",
        task_id=f"t{i}",
        prompt_id=f"p{i}",
        index=0,
        group_size=8,
        prompt_ids=list(range(64)),
        token_ids=Tensor.from_values(list(range(n)), "int32"),
        logprobs=Tensor.from_values([-0.5] * n, "float32"),
        policy_version=1,
        drafter_version=0,
        reward=1.0,
        finish_reason="eos",
        worker_id="bench",
    )


async def project_round(redis: aioredis.Redis, bus: BusConfig, stream: str, messages: list) -> tuple[float, float]:
    keys = Keys(f"bench-{uuid.uuid4().hex[:8]}")
    producer = StreamProducer(redis, keys, bus)
    reader: StreamReader = StreamReader(redis, keys, bus, stream, "bench", group="bench")
    await reader.ensure_group()
    t0 = time.perf_counter()
    for start in range(0, len(messages), BATCH):
        await producer.send(stream, messages[start : start + BATCH])
    produce = time.perf_counter() - t0
    t0 = time.perf_counter()
    seen = 0
    while seen < len(messages):
        batch = await reader.read(count=BATCH, block_ms=1000)
        if stream == "hidden":
            for delivery in batch:
                delivery.message.hidden.to_torch()
        await reader.ack([d.entry_id for d in batch])
        seen += len(batch)
    consume = time.perf_counter() - t0
    await redis.delete(keys.stream(stream))
    return produce, consume


async def bare_round(
    redis: aioredis.Redis, bus: BusConfig, stream: str, messages: list, *, codec_work: bool = True
) -> tuple[float, float]:
    key = f"bench-bare-{uuid.uuid4().hex[:8]}"
    codec = codec_for(stream)
    pre = None if codec_work else [codec.encode(m) for m in messages]
    maxlen = bus.hidden_maxlen if stream == "hidden" else None
    await redis.xgroup_create(key, "bench", id="0", mkstream=True)
    t0 = time.perf_counter()
    for start in range(0, len(messages), BATCH):
        batch = messages[start : start + BATCH]
        payloads = [codec.encode(m) for m in batch] if pre is None else pre[start : start + BATCH]
        async with redis.pipeline(transaction=False) as pipe:
            for payload in payloads:
                pipe.xadd(key, {PAYLOAD_FIELD: payload}, maxlen=maxlen, approximate=True)
            await pipe.execute()
    produce = time.perf_counter() - t0
    t0 = time.perf_counter()
    seen = 0
    while seen < len(messages):
        reply = await redis.xreadgroup("bench", "bench", {key: ">"}, count=BATCH, block=1000)
        entries = reply[0][1] if reply else []
        if codec_work:
            for _, fields in entries:
                message = codec.decode(fields[PAYLOAD_FIELD])
                if stream == "hidden":
                    message.hidden.to_torch()
        if entries:
            await redis.xack(key, "bench", *[entry_id for entry_id, _ in entries])
        seen += len(entries)
    consume = time.perf_counter() - t0
    await redis.delete(key)
    return produce, consume


async def raw_round(redis: aioredis.Redis, bus: BusConfig, stream: str, messages: list) -> tuple[float, float]:
    return await bare_round(redis, bus, stream, messages, codec_work=False)


def codec_costs(messages: dict[str, object]) -> dict[str, dict[str, float]]:
    costs = {}
    for stream, message in messages.items():
        codec = codec_for(stream)
        raw = codec.encode(message)
        n = 2000
        encode = timeit.timeit(lambda: codec.encode(message), number=n) / n  # noqa: B023
        decode = timeit.timeit(lambda: codec.decode(raw), number=n) / n  # noqa: B023
        entry = {"bytes": len(raw), "encode_us": encode * 1e6, "decode_us": decode * 1e6}
        if stream == "hidden":
            full = timeit.timeit(lambda: codec.decode(raw).hidden.to_torch(), number=n) / n  # noqa: B023
            entry["decode_to_torch_us"] = full * 1e6
        costs[stream] = entry
    return costs


async def run(args: argparse.Namespace) -> dict:
    redis = aioredis.Redis.from_url(args.redis_url)
    info = await redis.info("server")
    n_hidden = 200 if args.quick else 1000
    n_samples = 2000 if args.quick else 10000
    rounds = 3 if args.quick else 5
    bus = BusConfig(redis_url=args.redis_url, hidden_maxlen=n_hidden * 2, backlog_limit=n_samples * 2)
    workloads = {
        "hidden_256KiB": ("hidden", [hidden_window(i) for i in range(n_hidden)]),
        "samples_small": ("samples", [sample(i) for i in range(n_samples)]),
    }
    results: dict[str, dict] = {}
    for name, (stream, messages) in workloads.items():
        nbytes = sum(len(codec_for(stream).encode(m)) for m in messages)
        runners = {"project": project_round, "bare": bare_round, "raw": raw_round}
        timings: dict[str, list[tuple[float, float]]] = {who: [] for who in runners}
        for r in range(rounds):
            print(f"{name}: round {r + 1}/{rounds}", file=sys.stderr)
            order = list(runners)[r % 3 :] + list(runners)[: r % 3]
            for who in order:
                timings[who].append(await runners[who](redis, bus, stream, messages))
        entry: dict[str, object] = {"messages": len(messages), "mean_entry_bytes": nbytes / len(messages)}
        for who, rows in timings.items():
            produce = statistics.median(p for p, _ in rows)
            consume = statistics.median(c for _, c in rows)
            entry[who] = {
                "produce_msg_s": len(messages) / produce,
                "produce_MiB_s": nbytes / produce / 2**20,
                "consume_msg_s": len(messages) / consume,
                "consume_MiB_s": nbytes / consume / 2**20,
            }
        project, bare, raw = entry["project"], entry["bare"], entry["raw"]
        entry["ratio_produce"] = project["produce_msg_s"] / bare["produce_msg_s"]  # type: ignore[index]
        entry["ratio_consume"] = project["consume_msg_s"] / bare["consume_msg_s"]  # type: ignore[index]
        entry["ratio_produce_vs_raw"] = project["produce_msg_s"] / raw["produce_msg_s"]  # type: ignore[index]
        entry["ratio_consume_vs_raw"] = project["consume_msg_s"] / raw["consume_msg_s"]  # type: ignore[index]
        results[name] = entry
    await redis.aclose()
    return {
        "benchmark": "bus",
        "quick": args.quick,
        "redis": f"redis {info.get('redis_version')} at {args.redis_url}",
        "hiredis": HIREDIS_AVAILABLE,
        "batch": BATCH,
        "rounds": rounds,
        "workloads": results,
        "codec": codec_costs({"hidden": hidden_window(0), "samples": sample(0)}),
        "goal": {"ratio_min": 0.8, "codec_us_max": 30},
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "platform": platform.platform(),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer messages and rounds (under a minute)")
    parser.add_argument("--redis-url", default=os.environ.get("TLT_REDIS_URL", "redis://127.0.0.1:6379/0"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(json.dumps(asyncio.run(run(args)), indent=2))


if __name__ == "__main__":
    main()
