"""What the torch engine holds for its rows over a long generation, counted from the tensors alive, against
the bound its budget was sized with and the worker prints (`model.sizing.engine_bytes_per_row`); and the
shapes its captured forwards take over a long context.

The held memory is read from the garbage collector's view of every live tensor, not from the engine's own
arithmetic: the storages of all tensors alive between steps, less those alive before the engine was built
and the weights of its model and drafter.
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from tests.families import VOCAB, build_family
from tlt_stream.basics.config import Config, override
from tlt_stream.drafter.model import Drafter, save_drafter
from tlt_stream.model import load_model
from tlt_stream.model.graphs import attention_span
from tlt_stream.rollout.arms import Arm
from tlt_stream.rollout.build import build_engine
from tlt_stream.rollout.engine import GenerationEngine

MAX_LEN = 1536
PROMPT = 24


def live_storages() -> dict[int, int]:
    """data pointer -> bytes of the storage of every tensor alive now."""
    gc.collect()
    found: dict[int, int] = {}
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor) and obj.device.type != "meta":
            storage = obj.untyped_storage()
            if storage.data_ptr():
                found[storage.data_ptr()] = storage.nbytes()
    return found


def weights(*modules: torch.nn.Module) -> set[int]:
    return {t.untyped_storage().data_ptr() for m in modules for t in [*m.parameters(), *m.buffers()]}


@pytest.fixture(scope="module")
def policy(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("rows")
    build_family("qwen3", root / "policy", max_position_embeddings=MAX_LEN)
    torch.manual_seed(0)
    save_drafter(Drafter(load_model(root / "policy").spec), root / "drafter")
    return root / "policy", root / "drafter"


@pytest.mark.slow
def test_memory_held_over_a_long_generation_stays_within_the_printed_bound(policy: tuple[Path, Path]) -> None:
    """Two rows run to the end of a 1536-token context, plain with an EAGLE drafter beside (whose pending
    states then pile up) and captured forwards, hidden states kept; then two more speculatively. At every
    checkpoint, the row just before its last token included, the tensors alive that the engine made take no
    more than `row_bytes` a row, and at the longest point at least all but a few states of it (so every term
    of the bound is needed: dropping one makes the held memory exceed it)."""
    path, drafter = policy
    config = override(
        Config(),
        {
            "rollout.max_len": MAX_LEN,
            "rollout.max_batch": 2,
            "rollout.kv_cache_gib": 1.0,
            "rollout.graphs": "trace",
            "sd.drafter": str(drafter),
            "sd.adaptive": False,
            "sd.arm": "d4k2v6",
        },
    )
    before = [t for t in gc.get_objects() if issubclass(type(t), torch.Tensor)]  # alive: their addresses stay theirs
    known = set(live_storages())
    engine, _ = build_engine(str(path), config, hidden=True)
    known |= weights(engine.model, engine.proposer.drafter)
    assert engine.row_bytes is not None and engine.cache.max_batch == 2
    bound = engine.row_bytes * engine.cache.max_batch
    state = engine.model.spec.hidden_size * 4

    def held() -> int:
        return sum(n for ptr, n in live_storages().items() if ptr not in known)

    g = torch.Generator().manual_seed(5)
    peaks = []
    for arm, new in ((None, MAX_LEN - PROMPT), (Arm.from_label("d4k2v6"), 400)):
        engine.arm = arm
        for _ in range(2):
            prompt = torch.randint(1, VOCAB, (PROMPT,), generator=g).tolist()
            engine.add_request(prompt, new, return_hidden=True)
        finished, steps, peak = [], 0, 0
        while engine.has_unfinished:
            last = max(s.num_generated for s in engine.scheduler.running) >= new - 1 if steps else False
            if steps % 256 == 0 or last:
                peak = max(peak, held())
                assert peak <= bound, (peak, bound, arm)
            done = engine.step()
            for r in done:  # the caller's now, not the engine's
                known.update(t.untyped_storage().data_ptr() for t in (r.hidden, r.prompt_hidden))
            finished += done
            steps += 1
        assert len(finished) == 2 and all(len(r.token_ids) == new for r in finished)
        assert all(r.hidden.shape == (new, engine.model.spec.hidden_size) for r in finished)
        assert all(r.prompt_hidden.shape == (PROMPT - 1, engine.model.spec.hidden_size) for r in finished)
        peaks.append(peak)
        del finished
    # At the end of the plain rows the bound is used but for a few states a row: no term of it is spare.
    assert bound - peaks[0] < 8 * state * engine.cache.max_batch, (bound, peaks)
    del before


def test_captured_shapes_stay_at_the_span_buckets_over_a_long_generation(policy: tuple[Path, Path]) -> None:
    """A plain greedy row through a 1536-token context with captured forwards: the shapes captured are one
    per span bucket the lengths pass through (counted from the spans the model's forward was called with),
    not one per length; the output is the eager engine's."""
    path, _ = policy
    model = load_model(path)
    spans: list[int | None] = []
    forward = model.forward

    def counting(*args, **kwargs):
        spans.append(kwargs.get("static_len"))
        return forward(*args, **kwargs)

    model.forward = counting  # type: ignore[method-assign]
    prompt = torch.randint(1, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(2)).tolist()
    new = MAX_LEN - PROMPT
    engine = GenerationEngine(model, 1, MAX_LEN, graphs="trace")
    graphed = engine.generate(prompt, new)[0].token_ids
    captured = [s for s in spans if s is not None]
    # Lengths PROMPT+1 .. MAX_LEN-1 are read: 128, 256, 384, 512 by steps of 128, then 1024 and the whole cache.
    expected = sorted({attention_span(n, 128, MAX_LEN) for n in range(PROMPT + 1, MAX_LEN)})
    assert expected == [128, 256, 384, 512, 1024, MAX_LEN]
    assert sorted(captured) == expected, captured  # one capture per bucket, none twice
    assert engine.graphs is not None and engine.graphs.captures == len(expected)
    assert engine.graphs.replays == new - 1 - len(expected)  # every other decode step replayed
    model.forward = forward  # type: ignore[method-assign]
    assert GenerationEngine(model, 1, MAX_LEN).generate(prompt, new)[0].token_ids == graphed
