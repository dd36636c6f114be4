"""The sharded learner (FSDP2 over gloo, 2 ranks) against the single-process one, tensor by tensor.

Each rank is its own process, started as torchrun would start it (WORLD_SIZE, RANK, MASTER_ADDR/PORT in the
environment) and driven through `Trainer` as the learner service drives it; what the ranks leave is
checkpoints on disk, read back here with the ordinary readers (safetensors, `store/shards.py`, the model
loader). The reference is the same updates on one process, in this test's process.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO

import pytest
import torch
from safetensors.torch import load_file

from tests.ports import free_port
from tlt_stream.basics.messages import Sample, Tensor
from tlt_stream.rl.checkpoint import checkpoint_at, latest_checkpoint, restore_checkpoint
from tlt_stream.rl.groups import ReadyGroup
from tlt_stream.rl.learner import LearnerSettings, deal_by_tokens
from tlt_stream.rl.sharded import Trainer
from tlt_stream.store.shards import piece, read_shards

# One xdist worker runs this module, so its module-scoped fixtures are built once.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("test_sharded_learner")]

ROOT = Path(__file__).parents[2]
SETTINGS = LearnerSettings(lr=1e-2, micro_batch_tokens=24, max_grad_norm=0.5, final_norm_lr_scale=4.0)
"""Small micro-batches (several per rank, unequal counts), clipping that bites, two parameter groups."""


def tiny_policy(out: Path) -> Path:
    """Two decoder layers (two FSDP units besides the root), a tied head, a vocabulary of 25 (odd: the
    embedding splits 13 + 12 over two ranks)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=25,
        hidden_size=16,
        intermediate_size=36,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
        max_position_embeddings=64,
    )
    LlamaForCausalLM(config).save_pretrained(out)
    return out


def groups_of(update: int) -> list[ReadyGroup]:
    """The fixed groups of update `update` (1-based): responses of different lengths, rewards that differ
    within each group, behaviour logprobs that are not the policy's (ratios != 1, some clipped)."""
    out = []
    for g in range(3):
        task = f"u{update}g{g}"
        samples = []
        for i in range(3):
            n = 2 + (update * 3 + g * 5 + i * 7) % 9  # response lengths 2..10
            tokens = [(update + g * 3 + i * 5 + j * 7) % 23 + 1 for j in range(n)]
            samples.append(
                Sample(
                    sample_id=f"{task}/{i}",
                    task_id=task,
                    prompt_id=task,
                    index=i,
                    group_size=3,
                    prompt_ids=[3, 4 + g, 5 + i],
                    token_ids=Tensor.from_values(tokens, "int32"),
                    logprobs=Tensor.from_values([-3.0 - 0.1 * ((j + i) % 5) for j in range(n)], "float32"),
                    policy_version=update - 1,
                    drafter_version=-1,
                    reward=float((i + g + update) % 3 == 0),
                    finish_reason="eos",
                    worker_id="w",
                )
            )
        out.append(ReadyGroup(task, samples, [f"{update}-{g}-{i}" for i in range(3)]))
    return out


def ledger_after(update: int) -> set[str]:
    return {s.sample_id for u in range(1, update + 1) for g in groups_of(u) for s in g.samples}


def drive(
    trainer: Trainer,
    root: Path,
    init: Path,
    *,
    resume: int | None,
    updates: range,
    metrics: Path,
    keep: int = 10,
    save_last: bool = True,
) -> None:
    """What the learner service does with its trainer: build (or resume), then update and checkpoint (the
    last update too, unless not `save_last`); `metrics` gets the updates' figures, with the background
    optimizer writes' after each save, once all are done (and, after a resume, `metrics.resume.json` the step
    its optimizer moments came from), then the background optimizer write is waited for."""
    if resume is None:
        trainer.build(init)
        save(trainer, root, 0, keep=keep)
    else:
        info = checkpoint_at(root, resume)
        trainer.build(info.master_dir, step=resume)
        ledger, meta = trainer.restore(info)
        assert ledger == ledger_after(resume)
        metrics.with_suffix(".resume.json").write_text(json.dumps({"optimizer_step": meta["optimizer_step"]}))
    assert trainer.core is not None
    rows = []
    for update in updates:
        rows.append(trainer.core.step(groups_of(update)))
        if save_last or update != updates[-1]:
            save(trainer, root, update, keep=keep)
            rows[-1].update(trainer.write_figures())  # as the service adds them to the update's metrics
    metrics.write_text(json.dumps(rows))
    trainer.wait_for_writes()  # this process's optimizer state (or piece) is on disk for the test to read


def save(trainer: Trainer, root: Path, step: int, *, keep: int = 10) -> None:
    trainer.save(
        root, step=step, ledger=ledger_after(step), extra={}, tokenizer=None, keep=keep, publish_dtype=torch.float32
    )


def hold_writes(hold: dict, rank: int) -> None:
    """This rank's background write of step `hold["step"]`'s optimizer piece (if `rank` is in `hold["ranks"]`)
    says it started (`started-{rank}` in `hold["dir"]`) and waits until the test creates `release` there: a
    slow disk, deterministically, across processes. The write itself is the real one, into real files."""
    from tlt_stream.rl import sharded

    real, gate = sharded._write_piece, Path(hold["dir"])

    def held(directory: Path, **shard: object) -> None:
        if rank in hold["ranks"] and directory.parent.name == f"step-{hold['step']:08d}":
            (gate / f"started-{rank}").touch()
            while not (gate / "release").exists():
                time.sleep(0.02)
        real(directory, **shard)

    sharded._write_piece = held


def fail_writes(fail: dict, rank: int) -> None:
    """This rank's background writes of the steps in `fail["steps"]` (if `rank` is in `fail["ranks"]`) fail
    for real: a directory stands where the piece lands, so the write's own rename raises (IsADirectoryError)."""
    from tlt_stream.rl import sharded
    from tlt_stream.store.shards import rank_file

    real = sharded._write_piece

    def failing(directory: Path, **shard: object) -> None:
        if rank in fail["ranks"] and directory.parent.name in {f"step-{s:08d}" for s in fail["steps"]}:
            directory.mkdir(exist_ok=True)
            rank_file(directory, rank).mkdir()
        real(directory, **shard)

    sharded._write_piece = failing


def rank_main(spec: str) -> None:
    """One rank's process (`python -c`): torchrun's environment is set by the caller."""
    from tlt_stream.rl.ranks import join_ranks, leave_ranks
    from tlt_stream.rl.sharded import follow

    args = json.loads(spec)
    torch.set_num_threads(1)
    settings = LearnerSettings(**{**SETTINGS.__dict__, **args.get("settings", {})})
    link = join_ranks("cpu", timeout_s=120)
    assert link is not None
    if "hold" in args:
        hold_writes(args["hold"], link.rank)
    if "fail" in args:
        fail_writes(args["fail"], link.rank)
    trainer = Trainer(settings, "cpu", link)
    root, init = Path(args["root"]), Path(args["init"])
    if link.leader:
        updates, out = range(*args["updates"]), Path(args["out"])
        options = {key: args[key] for key in ("keep", "save_last") if key in args}
        drive(trainer, root, init, resume=args["resume"], updates=updates, metrics=out, **options)
        trainer.stop()
        out.with_suffix(".stopped.json").write_text(json.dumps(trainer.write_figures()))
    else:
        follow(trainer, root=root, init_policy=init)
    leave_ranks(link)


Ranks = list[tuple[subprocess.Popen, IO[bytes]]]
"""Rank processes and their stderr (a file: nobody drains a pipe while a test waits on the ranks)."""


def start_ranks(world: int, *, entry: str = "tests.unit.test_sharded_learner:rank_main", **spec: object) -> Ranks:
    """`world` rank processes under torchrun's environment, each running `entry` ("module:function") with
    `spec` as its one argument (a JSON string)."""
    port = free_port()  # rank 0's rendezvous store binds it
    module, function = entry.split(":")
    code = f"from {module} import {function}; {function}({json.dumps(json.dumps(spec))})"
    processes = []
    for rank in range(world):
        env = {**os.environ, "WORLD_SIZE": str(world), "RANK": str(rank), "LOCAL_RANK": str(rank)}
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        err = tempfile.TemporaryFile()  # noqa: SIM115 (closed by finish_ranks)
        processes.append((subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, stderr=err), err))
    return processes


def run_ranks(world: int, **spec: object) -> None:
    finish_ranks(start_ranks(world, **spec))


def finish_ranks(ranks: Ranks) -> list[str]:
    """Wait for the ranks, assert each exited 0, and return their stderr, by rank."""
    for process, _ in ranks:
        process.wait(timeout=240)
    logs = []
    for process, err in ranks:
        err.seek(0)
        logs.append(err.read().decode(errors="replace"))
        assert process.returncode == 0, logs[-1][-3000:]
        err.close()
    return logs


def release_and_kill(gate: Path, ranks: Ranks) -> None:
    """Release every held write (`gate/release`) and kill the ranks a failed test left running."""
    (gate / "release").touch()
    for process, err in ranks:
        if process.poll() is None:
            process.kill()
            process.wait()
        err.close()


def wait_for(path: Path, ranks: Ranks) -> None:
    """Block until `path` exists; a rank that exits first fails the test with its stderr."""
    deadline = time.monotonic() + 180
    while not path.exists():
        for process, err in ranks:
            if process.poll() is not None:
                err.seek(0)
                raise AssertionError(f"a rank exited ({process.returncode}) first:\n{err.read().decode()[-3000:]}")
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def weights(root: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(checkpoint_at(root, step).policy_dir / "model.safetensors")


def optimizer(root: Path, step: int) -> dict[str, torch.Tensor]:
    path = checkpoint_at(root, step).path
    if (path / "optimizer").is_dir():
        return read_shards(path / "optimizer", rank=None, world=1)[0]
    return load_file(path / "optimizer.safetensors")


def assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str, atol: float = 2e-6) -> None:
    assert set(a) == set(b), what
    for key in a:
        assert a[key].shape == b[key].shape, f"{what} {key}"
        assert torch.allclose(a[key], b[key], rtol=1e-5, atol=atol), f"{what} {key}: {(a[key] - b[key]).abs().max()}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One process: 3 updates from the initial policy. Two ranks: the same 3 updates; then two ranks resumed
    from the sharded checkpoint of update 2, and one process resumed from it, each redoing update 3."""
    tmp = tmp_path_factory.mktemp("sharded")
    init = tiny_policy(tmp / "init")
    torch.set_num_threads(1)
    single = Trainer(SETTINGS, "cpu")
    drive(single, tmp / "single", init, resume=None, updates=range(1, 4), metrics=tmp / "single.json")
    spec = {"init": str(init), "updates": [1, 4], "resume": None}
    run_ranks(2, root=str(tmp / "two"), out=str(tmp / "two.json"), settings={"activation_checkpointing": True}, **spec)
    for name in ("two-resumed", "one-resumed"):
        shutil.copytree(tmp / "two", tmp / name, ignore=shutil.ignore_patterns("step-00000003"))
        (tmp / name / "LATEST").write_text("step-00000002\n")
    run_ranks(
        2, root=str(tmp / "two-resumed"), out=str(tmp / "two-resumed.json"), **{**spec, "updates": [3, 4], "resume": 2}
    )
    drive(Trainer(SETTINGS, "cpu"), tmp / "one-resumed", init, resume=2, updates=range(3, 4), metrics=tmp / "one.json")
    return {name: tmp / name for name in ("single", "two", "two-resumed", "one-resumed")} | {"tmp": tmp}


def test_two_ranks_make_the_single_process_updates(runs: dict[str, Path]) -> None:
    single = json.loads((runs["tmp"] / "single.json").read_text())
    two = json.loads((runs["tmp"] / "two.json").read_text())
    assert all(row["grad_norm"] > SETTINGS.max_grad_norm for row in single), "clipping must bite to be tested"
    for update, (a, b) in enumerate(zip(single, two, strict=True), start=1):
        for key in ("loss", "grad_norm", "clip_fraction", "approx_kl_old", "logprob_mismatch_mean", "final_norm_gain"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), f"update {update}: {key}"
        for key in ("trained_tokens", "samples", "logprob_mismatch_max", "lr"):
            assert b[key] == pytest.approx(a[key], rel=1e-6), f"update {update}: {key}"
    for step in range(4):
        assert_close(weights(runs["single"], step), weights(runs["two"], step), f"weights of step {step}")
        if step:
            assert_close(optimizer(runs["single"], step), optimizer(runs["two"], step), f"optimizer of step {step}")
        for root in ("single", "two"):
            ledger, meta = restore_checkpoint(checkpoint_at(runs[root], step), restore_rng=False)
            assert ledger == ledger_after(step) and meta["step"] == step


def test_the_sharded_checkpoint_holds_pieces_no_pickle_and_a_policy_the_runtime_loads(runs: dict[str, Path]) -> None:
    from tlt_stream.model import load_model

    path = checkpoint_at(runs["two"], 3).path
    files = sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file())
    assert [f for f in files if f.startswith("optimizer")] == [
        "optimizer/index.json",
        "optimizer/rank-00000.safetensors",
        "optimizer/rank-00001.safetensors",
    ]
    assert not [f for f in files if f.endswith((".pt", ".pth", ".bin", ".pkl", ".distcp"))]
    whole = optimizer(runs["single"], 3)
    for rank in range(2):
        mine = load_file(path / "optimizer" / f"rank-{rank:05d}.safetensors")
        embedding = next(k for k, t in whole.items() if t.shape[0] == 25)
        assert mine[embedding].shape[0] == (13, 12)[rank], "each rank wrote its own piece"
        assert torch.allclose(mine[embedding], piece(whole[embedding], rank, 2), atol=2e-6)
    a = load_model(checkpoint_at(runs["single"], 3).policy_dir).state_dict()
    b = load_model(checkpoint_at(runs["two"], 3).policy_dir).state_dict()
    assert_close(a, b, "runtime weights")


def test_two_ranks_resumed_from_the_sharded_checkpoint_continue_exactly(runs: dict[str, Path]) -> None:
    for step in (3,):
        a, b = weights(runs["two"], step), weights(runs["two-resumed"], step)
        assert all(torch.equal(a[k], b[k]) for k in a) and set(a) == set(b)
        a, b = optimizer(runs["two"], step), optimizer(runs["two-resumed"], step)
        assert all(torch.equal(a[k], b[k]) for k in a) and set(a) == set(b)
    first = json.loads((runs["tmp"] / "two.json").read_text())[2]
    again = json.loads((runs["tmp"] / "two-resumed.json").read_text())[0]
    assert again["loss"] == first["loss"] and again["lr"] == first["lr"]
    found = latest_checkpoint(runs["two-resumed"])
    assert found is not None and found.step == 3


def test_one_process_resumes_a_two_rank_checkpoint(runs: dict[str, Path]) -> None:
    assert_close(weights(runs["two"], 3), weights(runs["one-resumed"], 3), "weights")
    assert_close(optimizer(runs["two"], 3), optimizer(runs["one-resumed"], 3), "optimizer")
    written = checkpoint_at(runs["one-resumed"], 3).path / "optimizer"  # one piece, written in the background
    assert json.loads((written / "index.json").read_text())["world"] == 1


def test_samples_are_dealt_to_ranks_by_tokens() -> None:
    assert deal_by_tokens([5, 9, 1, 7, 3], 2) == [[1, 4, 2], [3, 0]]
    assert deal_by_tokens([4], 3) == [[0], [], []]
    assert sorted(j for part in deal_by_tokens(list(range(17)), 4) for j in part) == list(range(17))
    with pytest.raises(ValueError):
        deal_by_tokens([1], 0)


def test_bf16_compute_on_ranks_keeps_fp32_masters_and_follows_the_single_process(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    """learner.compute_dtype bfloat16: FSDP gathers parameters in bf16 (MixedPrecisionPolicy) and reduces
    gradients in fp32; the single process autocasts. Not equal (bf16 rounds differently in each), but close,
    and what is saved are the fp32 masters."""
    bf16 = {"compute_dtype": "bfloat16"}
    init = runs["tmp"] / "init"
    single = Trainer(LearnerSettings(**{**SETTINGS.__dict__, **bf16}), "cpu")
    drive(single, tmp_path / "single", init, resume=None, updates=range(1, 4), metrics=tmp_path / "single.json")
    spec = {"init": str(init), "updates": [1, 4], "resume": None, "settings": bf16}
    run_ranks(2, root=str(tmp_path / "two"), out=str(tmp_path / "two.json"), **spec)
    one = json.loads((tmp_path / "single.json").read_text())
    two = json.loads((tmp_path / "two.json").read_text())
    fp32 = json.loads((runs["tmp"] / "two.json").read_text())
    assert [b["loss"] for b in two] == pytest.approx([a["loss"] for a in one], rel=2e-2)
    assert [b["loss"] for b in two] != pytest.approx([a["loss"] for a in fp32], rel=1e-5), "bf16 was used"
    saved = weights(tmp_path / "two", 3)
    assert {t.dtype for t in saved.values()} == {torch.float32}
    assert_close(saved, weights(tmp_path / "single", 3), "bf16 weights", atol=0.05)
