"""A pooled encode buffer that is still exported does not crash the next send.

`StreamProducer.send` encodes into bytearrays it pools across sends. A buffer can outlive its send while
still viewed: a redis-py pipeline retried after a socket timeout keeps its frames (memoryviews of the
buffers) alive in the exception's traceback, a cycle only the garbage collector breaks. Resizing a viewed
bytearray raises `BufferError: Existing exports of data`, which crashed the rollout worker on its next
send. The producer now encodes such a message into a fresh buffer instead. Here a memoryview of a pooled
buffer stands in for the traceback's; the next send, of a different size, must store the message intact
(read back with XRANGE and decoded).
"""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis

from tlt_stream.basics.config import Config
from tlt_stream.basics.messages import Sample, Tensor, codec_for
from tlt_stream.bus.producer import PAYLOAD_FIELD, StreamProducer
from tlt_stream.bus.streams import Keys

pytestmark = [pytest.mark.redis]


def sample(i: int, n: int) -> Sample:
    return Sample(
        sample_id=f"t{i}/0",
        task_id=f"t{i}",
        prompt_id="p",
        index=0,
        group_size=1,
        prompt_ids=[3],
        token_ids=Tensor.from_values(list(range(n)), "int32"),
        logprobs=Tensor.from_values([-0.5] * n, "float32"),
        policy_version=0,
        drafter_version=-1,
        reward=1.0,
        finish_reason="eos",
        worker_id="w",
    )


async def test_a_still_exported_pooled_buffer_is_not_reused(bus_config: Config) -> None:
    keys = Keys(bus_config.run)
    redis = aioredis.Redis.from_url(bus_config.bus.redis_url)
    producer = StreamProducer(redis, keys, bus_config.bus)
    codec = codec_for("samples")
    first, second = sample(1, 2), sample(2, 40)
    try:
        [first_id] = await producer.send("samples", [first])
        assert len(producer._buffers) == 1, "the sent buffer went back to the pool"
        stale = memoryview(producer._buffers[-1])  # as a retried pipeline's traceback still holds it
        try:
            [second_id] = await producer.send("samples", [second])  # a different size: the buffer must resize
            rows = await redis.xrange(keys.stream("samples"))
            assert [entry_id.decode() for entry_id, _ in rows] == [first_id, second_id]
            assert [codec.decode(fields[PAYLOAD_FIELD]) for _, fields in rows] == [first, second]
            assert all(b is not stale.obj for b in producer._buffers), "the viewed buffer left the pool"
        finally:
            stale.release()
    finally:
        await redis.aclose()
