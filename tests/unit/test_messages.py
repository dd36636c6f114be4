"""Wire schemas: every entry round-trips; anything malformed, mismatched or of an unknown version is refused."""

from __future__ import annotations

import math
import time

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tlt_stream.basics.messages import (
    CONTROL_CODEC,
    DeadLetter,
    DrafterVersion,
    HiddenWindow,
    LearnerStats,
    PolicyVersion,
    PromptGroup,
    RolloutStats,
    Sample,
    SdArmChoice,
    SdArmReport,
    SdConfigVersion,
    Tensor,
    WorkerState,
    WorkerStatus,
    codec_for,
)

ids = st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=50)
text = st.text(max_size=30)
version = st.integers(0, 10**6)
seconds = st.floats(0, 1e6, allow_nan=False)
sha = st.text(alphabet="0123456789abcdef", min_size=64, max_size=64)


@st.composite
def tensors(draw: st.DrawFn, dtype: str | None = None, rows: int | None = None) -> Tensor:
    dtype = dtype or draw(st.sampled_from(["float32", "float16", "int64", "int32", "uint8", "bool"]))
    n = rows if rows is not None else draw(st.integers(0, 6))
    shape = [n, draw(st.integers(1, 5))]
    values = draw(st.lists(st.integers(0, 100), min_size=math.prod(shape), max_size=math.prod(shape)))
    return Tensor.from_values(np.array(values).reshape(shape), dtype)


@st.composite
def samples(draw: st.DrawFn) -> Sample:
    n = draw(st.integers(0, 40))
    group = draw(st.integers(1, 16))
    return Sample(
        sample_id=draw(text),
        task_id=draw(text),
        prompt_id=draw(text),
        index=draw(st.integers(0, group - 1)),
        group_size=group,
        prompt_ids=draw(ids),
        token_ids=Tensor.from_values(draw(st.lists(st.integers(0, 50_000), min_size=n, max_size=n)), "int32"),
        logprobs=Tensor.from_values(draw(st.lists(st.floats(-50, 0), min_size=n, max_size=n)), "float32"),
        policy_version=draw(version),
        drafter_version=draw(st.integers(-1, 100)),
        reward=draw(st.floats(-10, 10)),
        finish_reason=draw(st.sampled_from(["eos", "length"])),
        worker_id=draw(text),
        gen_seconds=draw(seconds),
    )


@st.composite
def hidden_windows(draw: st.DrawFn) -> HiddenWindow:
    n = draw(st.integers(1, 8))
    return HiddenWindow(
        sample_id=draw(text),
        policy_version=draw(version),
        token_ids=draw(st.lists(st.integers(0, 1000), min_size=n, max_size=n)),
        hidden=draw(tensors("float32", rows=n)),
        prompt_len=draw(st.integers(0, n)),
    )


stats_entries = st.one_of(
    st.builds(WorkerState, worker_id=text, state=st.sampled_from(WorkerStatus)),
    st.builds(
        RolloutStats,
        worker_id=text,
        policy_version=version,
        drafter_version=version,
        batch_size=st.integers(0, 512),
        tokens=st.integers(0, 10**6),
        seconds=seconds,
    ),
    st.builds(
        SdArmReport,
        worker_id=text,
        drafter_version=version,
        bucket=st.integers(0, 8),
        depth=st.integers(0, 8),
        topk=st.integers(0, 8),
        verify=st.integers(0, 64),
        tokens=st.integers(0, 10**6),
        seconds=seconds,
    ),
    st.builds(
        LearnerStats,
        step=version,
        policy_version=version,
        groups=st.integers(0, 100),
        samples=st.integers(0, 1000),
        metrics=st.dictionaries(text, st.floats(allow_nan=False)),
    ),
)

entries_by_stream = {
    "prompts": st.builds(
        PromptGroup, task_id=text, prompt_id=text, prompt_ids=ids, answer=text, group_size=st.integers(1, 64)
    ),
    "samples": samples(),
    "hidden": hidden_windows(),
    "stats": stats_entries,
    "dead": st.builds(DeadLetter, stream=text, entry_id=text, reason=text, origin=text, payload=st.binary()),
}


@pytest.mark.parametrize("stream", list(entries_by_stream))
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_every_schema_round_trips(stream: str, data: st.DataObject) -> None:
    message = data.draw(entries_by_stream[stream])
    codec = codec_for(stream)
    assert codec.decode(codec.encode(message)) == message


@settings(max_examples=40, deadline=None)
@given(
    message=st.one_of(
        st.builds(PolicyVersion, version=version, location=text, sha256=sha),
        st.builds(DrafterVersion, version=version, location=text, sha256=sha, policy_version=version),
        st.builds(
            SdConfigVersion,
            version=version,
            table=st.lists(
                st.builds(SdArmChoice, max_batch=st.integers(1, 64), depth=version, topk=version, verify=version)
            ),
        ),
    )
)
def test_control_messages_round_trip_as_json(message: object) -> None:
    assert CONTROL_CODEC.decode(CONTROL_CODEC.encode(message)) == message


def test_tensor_round_trips_torch_dtypes() -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool):
        x = (torch.randn(3, 4) * 5).to(dtype)
        back = (
            codec_for("hidden")
            .decode(
                codec_for("hidden").encode(
                    HiddenWindow(sample_id="s", policy_version=0, token_ids=[1, 2, 3], hidden=Tensor.from_torch(x))
                )
            )
            .hidden.to_torch()
        )
        assert back.dtype == dtype and torch.equal(back, x)
        back.add_(1) if dtype != torch.bool else None  # a writable private copy


def test_tensor_whose_bytes_do_not_match_is_refused_on_decode() -> None:
    good = HiddenWindow(sample_id="s", policy_version=0, token_ids=[1, 2], hidden=Tensor.from_torch(torch.zeros(2, 3)))
    raw = msgspec.to_builtins(good, builtin_types=(bytes, memoryview))
    raw["hidden"]["data"] = raw["hidden"]["data"][:-4]
    with pytest.raises(msgspec.ValidationError, match="tensor bytes do not match dtype and shape"):
        codec_for("hidden").decode(msgspec.msgpack.encode(raw))
    raw = msgspec.to_builtins(good, builtin_types=(bytes, memoryview))
    raw["hidden"]["dtype"] = "complex128"
    with pytest.raises(msgspec.ValidationError, match="unsupported tensor dtype"):
        codec_for("hidden").decode(msgspec.msgpack.encode(raw))
    raw = msgspec.to_builtins(good, builtin_types=(bytes, memoryview))
    raw["token_ids"] = [1, 2, 3]
    with pytest.raises(msgspec.ValidationError, match=r"hidden must be \[len\(token_ids\), H\]"):
        codec_for("hidden").decode(msgspec.msgpack.encode(raw))


def test_unknown_schema_version_and_kind_are_refused() -> None:
    message = PromptGroup(task_id="t", prompt_id="p", prompt_ids=[1], answer="2", group_size=4)
    raw = msgspec.to_builtins(message)
    with pytest.raises(msgspec.ValidationError, match=r"\$\.schema"):
        codec_for("prompts").decode(msgspec.msgpack.encode({**raw, "schema": 2}))
    with pytest.raises(msgspec.ValidationError, match=r"\$\.kind"):
        codec_for("stats").decode(msgspec.msgpack.encode({**raw, "kind": "nonsense"}))
    with pytest.raises(msgspec.ValidationError, match="unknown field"):
        codec_for("prompts").decode(msgspec.msgpack.encode({**raw, "surprise": 1}))


def test_sample_invariants_are_checked() -> None:
    base = dict(
        sample_id="t/0",
        task_id="t",
        prompt_id="p",
        index=0,
        group_size=2,
        prompt_ids=[1],
        token_ids=Tensor.from_values([5, 6], "int32"),
        logprobs=Tensor.from_values([-0.1, -2.0], "float32"),
        policy_version=1,
        drafter_version=-1,
        reward=1.0,
        finish_reason="eos",
        worker_id="w",
    )
    Sample(**base)
    for change, why in [
        ({"logprobs": Tensor.from_values([-0.1], "float32")}, "logprobs must be float32"),
        ({"logprobs": Tensor.from_values([-0.1, 0.5], "float32")}, "finite values <= 0"),
        ({"logprobs": Tensor.from_values([-0.1, float("nan")], "float32")}, "finite values <= 0"),
        ({"token_ids": Tensor.from_values([5, 6], "int64")}, "token_ids must be int32"),
        ({"index": 2}, "outside a group"),
    ]:
        raw = msgspec.to_builtins(Sample(**base), builtin_types=(bytes, memoryview))
        raw.update(msgspec.to_builtins(change, builtin_types=(bytes, memoryview)))
        with pytest.raises(msgspec.ValidationError, match=why):
            codec_for("samples").decode(msgspec.msgpack.encode(raw))


def test_timestamps_are_per_message_not_per_import() -> None:
    first = WorkerState(worker_id="w", state=WorkerStatus.IDLE)
    time.sleep(0.01)
    second = WorkerState(worker_id="w", state=WorkerStatus.IDLE)
    assert second.created_at > first.created_at


def test_codec_for_unknown_stream() -> None:
    with pytest.raises(KeyError, match="no codec for stream 'nope'"):
        codec_for("nope")
