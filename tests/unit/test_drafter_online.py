"""Online drafter training: preemption within one step, exact resume, a long-tail-aware bounded buffer,
and an acceptance measure that tells a trained drafter from a random one."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from tlt_stream.basics.config import DrafterConfig
from tlt_stream.basics.messages import HiddenWindow, Tensor
from tlt_stream.drafter import online
from tlt_stream.drafter.buffer import WindowBuffer, window_from_message
from tlt_stream.drafter.model import Drafter, load_drafter
from tlt_stream.drafter.online import (
    OnlineDrafterTrainer,
    SliceEnd,
    held_out_acceptance,
    judgeable,
    lr_at,
)
from tlt_stream.drafter.train import PackedBatch, Window, pack_windows
from tlt_stream.model.loader import CheckpointError
from tlt_stream.model.spec import ModelSpec
from tlt_stream.model.transformer import Transformer

# One xdist worker runs this module, so its module-scoped fixtures are built once.
pytestmark = pytest.mark.xdist_group("test_drafter_online")

SPEC = ModelSpec(
    "qwen2", vocab_size=29, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8
)
CONFIG = DrafterConfig(
    lr=3e-3,
    lr_warmup_steps=5,
    lr_schedule="cosine",
    lr_total_steps=40,
    row_tokens=64,
    batch_pairs=128,
    unroll=3,
    seed=5,
)


@pytest.fixture(scope="module")
def target() -> Transformer:
    torch.manual_seed(0)
    model = Transformer(SPEC)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return model.eval().requires_grad_(False)


def greedy_windows(target: Transformer, n: int, length: int, seed: int, prompt_len: int = 3) -> list[Window]:
    """Windows as workers stream them: a random prompt, the target's greedy continuation, its final-norm states."""
    g = torch.Generator().manual_seed(seed)
    out = []
    with torch.inference_mode():
        for _ in range(n):
            tokens = torch.randint(0, SPEC.vocab_size, (prompt_len,), generator=g)
            while tokens.shape[0] < length:
                hidden = target(tokens[None], torch.arange(tokens.shape[0])[None], target.new_cache(1, length))[0]
                tokens = torch.cat([tokens, target.logits(hidden[-1]).argmax().view(1)])
            hidden = target(tokens[None], torch.arange(length)[None], target.new_cache(1, length))[0]
            out.append(Window(tokens.clone(), hidden.clone(), prompt_len=prompt_len))
    return out


@pytest.fixture(scope="module")
def train_windows(target: Transformer) -> list[Window]:
    return greedy_windows(target, 24, 24, seed=1)


def filled_buffer(windows: list[Window]) -> WindowBuffer:
    buffer = WindowBuffer(recent_tokens=256, reservoir_tokens=512, seed=3)
    for i, w in enumerate(windows):
        buffer.add(w, policy_version=i // 8)
    return buffer


def make_trainer(
    target: Transformer, buffer: WindowBuffer, init_seed: int, config: DrafterConfig = CONFIG
) -> OnlineDrafterTrainer:
    torch.manual_seed(init_seed)
    return OnlineDrafterTrainer(Drafter(SPEC).bind(target), buffer, config, policy_version=2)


def moments(trainer: OnlineDrafterTrainer) -> dict[str, torch.Tensor]:
    state = trainer.optimizer.state_dict()["state"]
    return {f"{i}.{k}": v.clone() for i, slots in state.items() for k, v in slots.items()}


def weights(trainer: OnlineDrafterTrainer) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in trainer.drafter.state_dict().items()}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys() and a
    for k in a:
        assert torch.equal(a[k], b[k]), k


# ------------------------------------------------------------------------------------------ preemption


def test_should_stop_flipping_mid_step_ends_the_slice_after_that_step(
    target: Transformer, train_windows: list[Window]
) -> None:
    trainer = make_trainer(target, filled_buffer(train_windows), init_seed=1)
    flipped_in_step: list[int] = []
    polls = 0

    def flip_during_the_fourth_step(module: torch.nn.Module, args: object, output: torch.Tensor) -> None:
        if trainer.step_count == 3 and not flipped_in_step:  # a prompt arrives in the middle of step 4
            flipped_in_step.append(trainer.step_count + 1)

    def should_stop() -> bool:
        nonlocal polls
        polls += 1
        return bool(flipped_in_step)

    handle = trainer.drafter.fc.register_forward_hook(flip_during_the_fourth_step)
    try:
        result = trainer.train_slice(max_steps=1000, max_seconds=60, should_stop=should_stop)
    finally:
        handle.remove()
    assert flipped_in_step == [4]
    assert result.end is SliceEnd.PREEMPTED
    assert result.steps == 4 and trainer.step_count == 4, "it finished the step in progress and no more"
    assert polls == 5, "asked before every step"
    assert result.loss is not None and result.last["loss"] > 0


def test_slice_budgets_and_an_empty_buffer(target: Transformer, train_windows: list[Window]) -> None:
    trainer = make_trainer(target, filled_buffer(train_windows), init_seed=1)
    result = trainer.train_slice(max_steps=2)
    assert (result.steps, result.end, trainer.step_count) == (2, SliceEnd.STEPS, 2)
    result = trainer.train_slice(max_seconds=0.3)
    assert result.end is SliceEnd.TIME and result.steps >= 1 and result.seconds >= 0.3
    assert trainer.train_slice(max_steps=5, should_stop=lambda: True).steps == 0
    empty = make_trainer(target, WindowBuffer(recent_tokens=64, reservoir_tokens=128), init_seed=1)
    result = empty.train_slice(max_steps=5)
    assert (result.steps, result.end, result.loss) == (0, SliceEnd.NO_DATA, None)
    with pytest.raises(ValueError, match="budget"):
        trainer.train_slice(should_stop=lambda: False)


# ------------------------------------------------------------------------------------------ state


def test_save_load_round_trip_and_resumed_training_match_uninterrupted_training(
    target: Transformer, train_windows: list[Window], tmp_path: Path
) -> None:
    buffer = filled_buffer(train_windows)
    uninterrupted = make_trainer(target, buffer, init_seed=1)
    assert uninterrupted.train_slice(max_steps=3).steps == 3
    saved = uninterrupted.save_state(tmp_path / "state-3", metadata={"fence": 7})
    at_save = (weights(uninterrupted), moments(uninterrupted), uninterrupted.lr, uninterrupted.generator.get_state())
    uninterrupted.train_slice(max_steps=4)

    resumed = make_trainer(target, buffer, init_seed=99)  # another worker, another random init
    assert resumed.load_state(saved) == {"fence": 7}
    assert resumed.step_count == 3 and resumed.policy_version == 2
    assert resumed.lr == at_save[2] != lr_at(CONFIG, 0) != lr_at(CONFIG, 7)
    assert_same(weights(resumed), at_save[0])
    assert_same(moments(resumed), at_save[1])
    assert torch.equal(resumed.generator.get_state(), at_save[3])
    resumed.train_slice(max_steps=4)
    assert resumed.step_count == uninterrupted.step_count == 7
    assert_same(weights(resumed), weights(uninterrupted))
    assert_same(moments(resumed), moments(uninterrupted))

    assert sorted(p.name for p in tmp_path.iterdir()) == ["state-3"], "no temporary leftovers"
    files = {p.relative_to(saved).as_posix() for p in saved.rglob("*") if p.is_file()}
    assert all(f.endswith((".safetensors", ".json")) for f in files), files
    published = load_drafter(saved / "drafter", target)
    assert_same({k: v.clone() for k, v in published.state_dict().items()}, at_save[0])
    with pytest.raises(FileExistsError):
        uninterrupted.save_state(saved)


def test_a_failed_save_leaves_nothing_behind(
    target: Transformer, train_windows: list[Window], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trainer = make_trainer(target, filled_buffer(train_windows), init_seed=1)
    trainer.train_slice(max_steps=1)
    real_save = online.save_file

    def fail_on_rng(tensors: dict[str, torch.Tensor], path: str) -> None:
        if path.endswith(online.RNG):
            raise OSError("disk full")
        real_save(tensors, path)

    monkeypatch.setattr(online, "save_file", fail_on_rng)
    with pytest.raises(OSError, match="disk full"):
        trainer.save_state(tmp_path / "state-1")
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    saved = trainer.save_state(tmp_path / "state-1")
    (saved / online.OPTIMIZER).unlink()
    with pytest.raises(CheckpointError, match="missing"):
        make_trainer(target, trainer.buffer, init_seed=2).load_state(saved)


# ------------------------------------------------------------------------------------------ buffer


def synthetic(length: int, seq: int, hidden: int = 2) -> Window:
    tokens = torch.full((length,), seq % 1000, dtype=torch.long)
    return Window(tokens, torch.full((length, hidden), float(seq)), prompt_len=2)


def test_the_reservoir_keeps_long_windows_represented_in_bounded_memory() -> None:
    rng = random.Random(0)
    lengths = [64 if rng.random() < 0.03 else 8 for _ in range(3000)]  # 3% of windows, ~20% of tokens
    buffer = WindowBuffer(recent_tokens=256, reservoir_tokens=1024, seed=1)
    peak = 0
    for seq, n in enumerate(lengths):
        buffer.add(synthetic(n, seq))
        peak = max(peak, buffer.tokens)
    assert peak <= 256 + 1024
    assert buffer.long_threshold == 8
    entries = buffer.entries()
    reservoir_tokens = buffer.long.tokens + buffer.short.tokens
    assert reservoir_tokens > 0.9 * 1024
    assert buffer.long.tokens >= 0.45 * reservoir_tokens, "long windows hold their half of the older tokens"
    assert all(e.length == 64 for e in entries["long"]) and all(e.length == 8 for e in entries["short"])
    old = sum(e.seq < 1500 for e in entries["short"]) / len(entries["short"])
    assert 0.25 < old < 0.75, "a uniform sample over the whole stream, not just its end"
    assert [e.seq for e in entries["recent"]] == sorted(e.seq for e in entries["recent"])
    assert entries["recent"][-1].seq == 2999, "the newest windows are all kept"

    g = torch.Generator().manual_seed(0)
    picks = [w for _ in range(200) for w in buffer.sample(64, g)]
    long_share = sum(w.tokens.shape[0] == 64 for w in picks) / len(picks)
    assert long_share > 0.15, f"long windows are {long_share:.0%} of picks (3% of the stream)"

    twin = WindowBuffer(recent_tokens=256, reservoir_tokens=1024, seed=1)
    for seq, n in enumerate(lengths):
        twin.add(synthetic(n, seq))
    assert [e.seq for e in twin.short.entries()] == [e.seq for e in buffer.short.entries()], "seeded"
    g1, g2 = torch.Generator().manual_seed(4), torch.Generator().manual_seed(4)
    first, second = buffer.sample(128, g1), twin.sample(128, g2)
    assert [int(w.features[0, 0]) for w in first] == [int(w.features[0, 0]) for w in second]
    assert buffer.tokens == twin.tokens, "sampling does not change the buffer"


def test_long_windows_are_cut_into_chunks_that_keep_every_training_pair() -> None:
    buffer = WindowBuffer(recent_tokens=64, reservoir_tokens=128, max_window_tokens=16)
    g = torch.Generator().manual_seed(0)
    window = Window(torch.randint(0, 29, (50,), generator=g), torch.randn(50, 4, generator=g), prompt_len=20)
    buffer.add(window, policy_version=3)
    chunks = [e.window for e in buffer.entries()["recent"]]
    assert all(c.tokens.shape[0] <= 16 for c in chunks) and len(chunks) == 3, "the all-prompt chunk is not kept"
    (whole,) = pack_windows([window], row_tokens=64)
    (cut,) = pack_windows(chunks, row_tokens=64)
    assert cut.loss_mask.sum() == whole.loss_mask.sum() == 31, "pairs 19..49 predict the response tokens 20..50"
    assert trained_pairs(cut) == trained_pairs(whole)
    assert buffer.discard_before(4) == 3 and buffer.tokens == 0 and len(buffer) == 0


def trained_pairs(batch: PackedBatch) -> set[tuple[float, ...]]:
    """Every (x_i, f_{i-1}, f_i) the loss sees, as a hashable tuple."""
    keep = (batch.segments >= 0) & (batch.loss_mask > 0)
    rows = torch.cat([batch.tokens[keep][:, None].float(), batch.features[keep], batch.targets[keep]], dim=1)
    return {tuple(row.tolist()) for row in rows}


def test_a_stream_entry_becomes_a_window() -> None:
    states = torch.randn(6, 4).to(torch.bfloat16)
    message = HiddenWindow(
        sample_id="s", policy_version=1, token_ids=[1, 2, 3, 4, 5, 6], hidden=Tensor.from_torch(states), prompt_len=2
    )
    window = window_from_message(message)
    assert window.tokens.tolist() == [1, 2, 3, 4, 5, 6] and window.prompt_len == 2
    assert window.features.dtype == torch.bfloat16 and torch.equal(window.features, states)


# ------------------------------------------------------------------------------------------ acceptance


def test_held_out_acceptance_ranks_a_trained_drafter_above_a_random_one(
    target: Transformer, train_windows: list[Window]
) -> None:
    held_out = greedy_windows(target, 8, 24, seed=2)
    config = DrafterConfig(lr=3e-3, lr_warmup_steps=5, row_tokens=64, batch_pairs=256)
    trainer = make_trainer(target, filled_buffer(train_windows), init_seed=1, config=config)
    untrained = {d: held_out_acceptance(trainer.drafter, held_out, d) for d in (1, 4)}
    trainer.train_slice(max_steps=80)
    trained = {d: held_out_acceptance(trainer.drafter, held_out, d) for d in (1, 4)}
    assert trained[1] > max(untrained[1] + 0.2, 2 * untrained[1])
    assert trained[4] > untrained[4] + 0.6 and trained[4] > trained[1], "chains past the first draft are accepted"
    assert all(0 <= v <= d for v, d in ((trained[1], 1), (trained[4], 4), (untrained[4], 4)))
    assert trainer.drafter.training, "the measure leaves the drafter's mode as it found it"

    # Depth 1 is plain top-1 agreement with the next token on response positions that have one.
    trainer.drafter.eval()
    hits, count = 0, 0
    with torch.no_grad():
        for w in held_out:
            (batch,) = pack_windows([w], row_tokens=64)
            pred = trainer.drafter.dense(batch.tokens, batch.features, batch.positions, batch.attention_mask)
            draft = trainer.drafter.logits(pred)[0, :-1].argmax(-1)
            valid = batch.loss_mask[0, :-1] > 0
            hits += int(((draft == batch.tokens[0, 1:]) & valid).sum())
            count += int(valid.sum())
    assert abs(held_out_acceptance(trainer.drafter, held_out, 1) - hits / count) < 1e-9
    assert held_out_acceptance(trainer.drafter, held_out, 4, batch_pairs=30) == pytest.approx(trained[4])


class ScriptedDrafter(torch.nn.Module):
    """Drafts the window's next token exactly where `hits[step][row, t]` says, a wrong one elsewhere."""

    def __init__(self, hits: list[torch.Tensor], next_tokens: torch.Tensor) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(1, 1)
        self.hits, self.next_tokens, self.step = hits, next_tokens, 0

    def dense(
        self, tokens: torch.Tensor, features: torch.Tensor, positions: torch.Tensor, mask: object
    ) -> torch.Tensor:
        self.step += 1
        return features

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        hit = self.hits[self.step - 1].bool()
        drafted = torch.where(hit, self.next_tokens, (self.next_tokens + 1) % SPEC.vocab_size)
        return torch.nn.functional.one_hot(drafted, SPEC.vocab_size).float()


def test_a_chain_counts_drafts_up_to_its_first_rejection_and_stops_at_the_window_end() -> None:
    window = Window(torch.tensor([3, 1, 4, 1, 5, 9]), torch.zeros(6, 2), prompt_len=0)  # pairs t=0..4 predict x_2..x_6
    next_tokens = torch.tensor([[4, 1, 5, 9, 0]])  # x_{t+2}; t=4 has none in the window
    step1, step2 = torch.tensor([[1, 0, 1, 0, 1]]), torch.tensor([[0, 1, 1, 1, 1]])
    # Starts t=0..3. t=0: draft 1 hit, draft 2 (at t=1) hit -> 2; t=1: miss -> 0 (its later hit does not count);
    # t=2: hit, then t=3 hit -> 2; t=3: miss -> 0.
    assert held_out_acceptance(ScriptedDrafter([step1], next_tokens), [window], 1) == 2 / 4  # type: ignore[arg-type]
    assert held_out_acceptance(ScriptedDrafter([step1, step2], next_tokens), [window], 2) == 4 / 4  # type: ignore[arg-type]
    # Every draft right: a chain still ends where its window does, and never runs into the next window.
    both = torch.cat([next_tokens, next_tokens])
    always = [torch.ones(2, 5)] * 3
    assert held_out_acceptance(ScriptedDrafter(always, both), [window, window], 3) == (3 + 3 + 2 + 1) / 4  # type: ignore[arg-type]


def test_a_window_is_judgeable_exactly_when_the_measure_has_a_chain_to_start_in_it() -> None:
    """The held-out set takes only windows the measure can judge (`judgeable`, what the trainer asks): one whose
    only response token is its last is judged on the one pair that predicts it; one of prompt only, or of two
    tokens, has no start, and the measure refuses it."""
    tokens = torch.tensor([3, 1, 4, 1, 5])  # pairs t=1..4 predict x_2..x_5; x_4 = 5 is the one response token
    next_tokens = torch.tensor([[4, 1, 5, 0]])
    one_response = Window(tokens, torch.zeros(5, 2), prompt_len=4)
    assert judgeable(one_response)
    missed_there = ScriptedDrafter([torch.tensor([[1, 1, 0, 1]])], next_tokens)  # right everywhere but at t=3
    hit_there = ScriptedDrafter([torch.tensor([[0, 0, 1, 0]])], next_tokens)  # right only at t=3
    assert held_out_acceptance(missed_there, [one_response], 1) == 0.0  # type: ignore[arg-type]
    assert held_out_acceptance(hit_there, [one_response], 1) == 1.0  # type: ignore[arg-type]
    for nothing in (Window(tokens, torch.zeros(5, 2), prompt_len=5), Window(tokens[:2], torch.zeros(2, 2))):
        assert not judgeable(nothing)
        with pytest.raises(ValueError, match="held_out_acceptance needs"):
            held_out_acceptance(ScriptedDrafter([torch.ones(1, 4)], next_tokens), [nothing], 1)  # type: ignore[arg-type]
