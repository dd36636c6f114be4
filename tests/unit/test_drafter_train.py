"""Drafter training: packing is exact (no cross-window attention), the unrolled loss trains, state resumes."""

from __future__ import annotations

import pytest
import torch

from tlt_stream.drafter.model import Drafter
from tlt_stream.drafter.train import DrafterTrainer, Window, eagle_loss, pack_windows
from tlt_stream.model.spec import ModelSpec
from tlt_stream.model.transformer import Transformer

SPEC = ModelSpec(
    "qwen2", vocab_size=29, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8
)


@pytest.fixture
def target() -> Transformer:
    torch.manual_seed(0)
    model = Transformer(SPEC)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return model.eval().requires_grad_(False)


def windows(target: Transformer, lengths: list[int], seed: int = 0) -> list[Window]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        tokens = torch.randint(0, SPEC.vocab_size, (n,), generator=g)
        with torch.inference_mode():
            features = target(tokens[None], torch.arange(n)[None], target.new_cache(1, n))[0]
        out.append(Window(tokens, features.clone(), prompt_len=min(3, n - 1)))
    return out


def test_packed_loss_equals_the_windows_one_by_one(target: Transformer) -> None:
    torch.manual_seed(1)
    drafter = Drafter(SPEC).bind(target)
    ws = windows(target, [9, 5, 12, 7])
    packed = pack_windows(ws, row_tokens=16)
    assert len(packed) == 1 and packed[0].tokens.shape[0] < 4, "several windows share a row"
    loss_packed, _ = eagle_loss(drafter, packed[0], unroll=3)
    # One by one: the same per-token losses, so the token-weighted mean must match.
    total, count = 0.0, 0.0
    for w in ws:
        (single,) = pack_windows([w], row_tokens=16)
        loss, _ = eagle_loss(drafter, single, unroll=3)
        n = float(single.loss_mask.sum())
        total += loss.item() * n
        count += n
    assert abs(loss_packed.item() - total / count) < 1e-5


def test_positions_reset_and_attention_stays_within_a_window(target: Transformer) -> None:
    ws = windows(target, [4, 6])
    (batch,) = pack_windows(ws, row_tokens=16)
    row = batch.segments[0].tolist()
    assert row[:8] == [0] * 5 + [1] * 3 and batch.positions[0, :8].tolist() == [1, 2, 3, 4, 5, 1, 2, 3]
    mask = batch.attention_mask[0, 0]
    assert not mask[5:8, :5].any() and mask[7, 5:8].all() and not mask[5, 6]


def test_training_reduces_the_loss_and_resumes_exactly(target: Transformer) -> None:
    torch.manual_seed(2)
    drafter = Drafter(SPEC).bind(target)
    ws = windows(target, [20] * 8)
    (batch,) = pack_windows(ws, row_tokens=64)
    trainer = DrafterTrainer(drafter, lr=3e-3, total_steps=60, warmup=5, unroll=2)
    first = trainer.step(batch)
    for _ in range(50):
        last = trainer.step(batch)
    # The loss has a floor (the soft cross-entropy's target entropy); agreement with the target's top-1
    # token is what training buys.
    assert last["loss"] < first["loss"] - 0.05
    assert first["top1_1"] < 0.2 and last["top1_1"] > 0.6 and last["top1_2"] > 0.6
    state = trainer.state_dict()
    weights = {k: v.clone() for k, v in drafter.state_dict().items()}
    twin = Drafter(SPEC).bind(target)
    twin.load_state_dict(weights)
    resumed = DrafterTrainer(twin, lr=3e-3, total_steps=60, warmup=5, unroll=2)
    resumed.load_state_dict(state)
    assert resumed.step_count == trainer.step_count
    a, b = trainer.step(batch), resumed.step(batch)
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
    assert all(
        torch.allclose(x, y) for x, y in zip(drafter.state_dict().values(), twin.state_dict().values(), strict=True)
    )
