"""Weight sync that scales (issue 25 point 3): the learner hashes a version's files while it writes them, and
a worker verifies them while it reads them, once, loading its tensors from the very bytes it hashed."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.reference_digest import sha256_v1, sha256_v2
from tlt_stream.basics.config import Config
from tlt_stream.basics.messages import PolicyVersion, Sample, Tensor
from tlt_stream.rl.checkpoint import CheckpointInfo, latest_checkpoint, restore_checkpoint
from tlt_stream.rl.groups import ReadyGroup
from tlt_stream.rl.learner import LearnerSettings
from tlt_stream.rl.sharded import Trainer
from tlt_stream.store.digest import ChecksumMismatch, directory_sha256
from tlt_stream.store.weights import read_weights

# --- helpers ------------------------------------------------------------------------------------------------


def one_group(task: str, vocab: int) -> list[ReadyGroup]:
    samples = [
        Sample(
            sample_id=f"{task}/{i}",
            task_id=task,
            prompt_id=task,
            index=i,
            group_size=2,
            prompt_ids=[3, 4, 5],
            token_ids=Tensor.from_values([(7 + i + j) % vocab for j in range(6)], "int32"),
            logprobs=Tensor.from_values([-2.0] * 6, "float32"),
            policy_version=0,
            drafter_version=-1,
            reward=float(i),
            finish_reason="eos",
            worker_id="test",
        )
        for i in range(2)
    ]
    return [ReadyGroup(task, samples, [f"{task}-0", f"{task}-1"])]


def trainer_on(init_policy: Path) -> Trainer:
    trainer = Trainer(LearnerSettings(lr=1e-2), "cpu")
    trainer.build(init_policy)
    return trainer


def save(
    trainer: Trainer, root: Path, step: int, *, dtype: torch.dtype = torch.float32, wait: bool = True
) -> CheckpointInfo:
    """The learner's checkpoint, with the tokenizer in `policy/` (a worker builds its tokenizer from it), its
    optimizer state written too unless `wait` is False: that write goes on in the background after `save`
    returns, and its `.tmp-` directory, renamed when done, made a listing of the checkpoint fail now and then."""
    from transformers import AutoTokenizer

    from tlt_stream.tasks.tokenizer import build_tokenizer

    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(root.parent / "tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(root.parent / "tokenizer")
    info = trainer.save(root, step=step, ledger=set(), extra={}, tokenizer=tokenizer, keep=3, publish_dtype=dtype)
    if wait:
        trainer.wait_for_writes()
    return info


_COUNTERS: list[tuple[Callable[[Path], bool], Counter[Any]]] = []


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if event != "open" or not _COUNTERS or not isinstance(args[0], (str, bytes, os.PathLike)):
        return
    path = Path(os.fsdecode(args[0]))
    mode, flags = args[1], args[2]
    reading = ("r" in mode and "+" not in mode) if isinstance(mode, str) else not flags & (os.O_WRONLY | os.O_RDWR)
    kind = "read" if reading else "write"
    frame = sys._getframe(1)
    while frame is not None:  # durable.fsync_tree opens each file (read-only) to fsync it, reading nothing
        if frame.f_code.co_name == "fsync_tree":
            kind = "fsync"
        frame = frame.f_back
    for match, counts in _COUNTERS:
        if path.suffix == ".safetensors" and match(path):
            counts[kind, path.name] += 1


sys.addaudithook(_audit)  # hooks cannot be removed: it counts only while a `weight_file_opens` is active


@contextlib.contextmanager
def weight_file_opens(match: Callable[[Path], bool]) -> Iterator[Counter[Any]]:
    """Every open of a safetensors file whose path `match`es, by ("read" | "write", name): Python's own opens
    (an audit hook sees `open`, `io.open`, `os.open`, pathlib) and safetensors' native readers (as reads)."""
    import safetensors
    import safetensors.torch

    import tlt_stream.model.loader as loader

    counts: Counter[Any] = Counter()

    def counting(real: Any) -> Any:
        def opened(path: Any, *args: Any, **kwargs: Any) -> Any:
            if str(path).endswith(".safetensors") and match(Path(path)):
                counts["read", Path(path).name] += 1
            return real(path, *args, **kwargs)

        return opened

    patch = pytest.MonkeyPatch()
    for module, name in ((safetensors, "safe_open"), (safetensors.torch, "safe_open"), (loader, "safe_open")):
        patch.setattr(module, name, counting(getattr(module, name)))
    patch.setattr(safetensors.torch, "load_file", counting(safetensors.torch.load_file))
    entry = (match, counts)
    _COUNTERS.append(entry)
    try:
        yield counts
    finally:
        _COUNTERS.remove(entry)
        patch.undo()


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


# --- the learner: hashed while written ------------------------------------------------------------------------


@pytest.mark.parametrize("publish", [torch.float32, torch.bfloat16])
def test_the_announced_digest_is_the_files_digest_computed_while_writing_them(
    tmp_path: Path, init_policy: Path, monkeypatch: pytest.MonkeyPatch, publish: torch.dtype
) -> None:
    import tlt_stream.store.weights as weights_module

    monkeypatch.setattr(weights_module, "SHARD_BYTES", 8_000)  # several shards and an index
    trainer = trainer_on(init_policy)
    root = tmp_path / "checkpoints"
    with weight_file_opens(lambda path: root in path.parents) as opens:  # the `.tmp-` directory included
        info = save(trainer, root, 0, dtype=publish)
    files = [
        p.relative_to(info.path) for p in info.path.rglob("*.safetensors") if p.parent.name in ("policy", "master")
    ]
    assert len(files) >= 2 and all(opens["write", p.name] >= 1 for p in files)
    assert not any(opens["read", p.name] for p in files), "no weights file is read back to be hashed"

    meta = json.loads((info.path / "meta.json").read_text())
    assert meta["policy_digest"] == "v2" and info.digest == "v2"
    assert any(info.path.rglob("model.safetensors.index.json")), "sharded: fp32 weights exceed the shard size"
    assert info.policy_sha256 == meta["policy_sha256"] == sha256_v2(info.policy_dir), "independent recomputation"
    if publish == torch.bfloat16:
        assert info.master_sha256 == sha256_v2(info.master_dir)
    else:
        assert info.master_sha256 is None

    # What it wrote is what save_pretrained writes: Hugging Face and the runtime load it, tensor for tensor.
    from transformers import AutoModelForCausalLM

    from tlt_stream.model.loader import load_model

    own = trainer.core.model.state_dict()
    loaded = AutoModelForCausalLM.from_pretrained(info.policy_dir, dtype=publish).state_dict()
    assert all(torch.equal(loaded[k], v.to(publish)) for k, v in own.items())
    assert json.loads((info.policy_dir / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    load_model(info.policy_dir)


def test_the_written_config_matches_save_pretrained(tmp_path: Path, init_policy: Path) -> None:
    trainer = trainer_on(init_policy)
    info = save(trainer, tmp_path / "checkpoints", 0)
    trainer.core.model.save_pretrained(tmp_path / "hf")
    for name in ("config.json", "generation_config.json"):
        ours = json.loads((info.policy_dir / name).read_text())
        theirs = json.loads((tmp_path / "hf" / name).read_text())
        # plus the keys transformers 4 reads RoPE and dtype from (tests/unit/test_published_config.py)
        added = {"rope_theta", "rope_scaling", "torch_dtype"} if name == "config.json" else set()
        assert added.isdisjoint(theirs)
        assert {k: v for k, v in ours.items() if k not in added} == theirs
    from safetensors.torch import load_file

    ours, theirs = load_file(info.policy_dir / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_checkpoints_from_before_v2_still_verify_and_load(tmp_path: Path, init_policy: Path) -> None:
    """Resume after an upgrade: a checkpoint whose meta.json has no `policy_digest` holds a v1 sha256."""
    trainer = trainer_on(init_policy)
    root = tmp_path / "checkpoints"
    info = save(trainer, root, 0)
    meta = json.loads((info.path / "meta.json").read_text())
    del meta["policy_digest"], meta["optimizer"]
    meta["policy_sha256"] = sha256_v1(info.policy_dir)
    (info.path / "meta.json").write_text(json.dumps(meta))
    old = latest_checkpoint(root)
    assert old is not None and old.digest == "v1" and old.policy_sha256 == directory_sha256(old.policy_dir)
    restore_checkpoint(old, model=trainer_on(init_policy).core.model, restore_rng=False)  # verifies (v1)
    read_weights(old.policy_dir, old.policy_sha256, scheme="v1")
    flip_byte(old.policy_dir / "model.safetensors", -1)
    with pytest.raises(ChecksumMismatch):
        read_weights(old.policy_dir, old.policy_sha256, scheme="v1")
    assert PolicyVersion(version=0, location="x", sha256=old.policy_sha256).digest == "v1", "old announcements"


# --- the worker: verified while read ------------------------------------------------------------------------------


def worker_for(tmp_path: Path) -> Any:
    import fakeredis.aioredis

    from tlt_stream.basics.config import override
    from tlt_stream.roles.rollout_worker import RolloutWorker

    return RolloutWorker(
        override(Config(run="t"), {"rollout.max_batch": 2, "rollout.max_len": 64}),
        fakeredis.aioredis.FakeRedis(),
        None,  # type: ignore[arg-type]  # loading touches no control plane
        worker_id="w0",
        reward=lambda text, answer: 0.0,
    )


def versions(tmp_path: Path, init_policy: Path, monkeypatch: pytest.MonkeyPatch) -> list[PolicyVersion]:
    """Three learner checkpoints (a tokenizer in each, several weight shards), an update apart, announced."""
    import tlt_stream.store.weights as weights_module

    monkeypatch.setattr(weights_module, "SHARD_BYTES", 8_000)
    trainer = trainer_on(init_policy)
    root = tmp_path / "checkpoints"
    out = []
    for step in range(3):
        if step:
            trainer.core.step(one_group(f"g{step}", trainer.core.model.get_input_embeddings().weight.shape[0]))
        info = save(trainer, root, step)
        sha = info.policy_sha256
        out.append(PolicyVersion(version=step, location=str(info.policy_dir), sha256=sha, step=step, digest="v2"))
    return out


def engine_weights(worker: Any) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in worker.loader.engine.model.state_dict().items()}


def test_each_weight_file_is_read_once_per_load_and_the_engine_gets_those_tensors(
    tmp_path: Path, init_policy: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tlt_stream.model.loader import load_model

    announced = versions(tmp_path, init_policy, monkeypatch)
    worker = worker_for(tmp_path)
    for version in announced[:2]:  # the first builds the engine, the next is loaded into it in place
        directory = Path(version.location)
        files = sorted(p.name for p in directory.glob("*.safetensors"))
        assert len(files) > 1
        with weight_file_opens(lambda path, directory=directory: path.parent == directory) as opens:
            worker.loader._load(version, None, -1)
        assert opens == Counter({("read", name): 1 for name in files}), f"version {version.version}"
        expected = load_model(directory).state_dict()
        assert all(torch.equal(expected[k], v) for k, v in engine_weights(worker).items())
        assert worker.loader.policy == version


@pytest.mark.parametrize("where", ["tensor data", "safetensors header"])
def test_a_flipped_byte_is_refused_by_the_worker_and_nothing_of_it_is_loaded(
    tmp_path: Path, init_policy: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    announced = versions(tmp_path, init_policy, monkeypatch)
    worker = worker_for(tmp_path)
    worker.loader._load(announced[0], None, -1)
    before = engine_weights(worker)
    damaged = sorted(Path(announced[1].location).glob("model-*.safetensors"))[-1]
    flip_byte(damaged, -3 if where == "tensor data" else 20)  # the header's JSON starts at byte 8
    with pytest.raises(ChecksumMismatch):
        worker.loader._load(announced[1], None, -1)
    assert worker.loader.policy == announced[0]
    after = engine_weights(worker)
    assert all(torch.equal(before[k], after[k]) for k in before), "no tensor of the damaged version was loaded"
    worker.loader._load(announced[2], None, -1)  # the next good version loads
    assert worker.loader.policy == announced[2]


# --- the zero-copy reader ----------------------------------------------------------------------------------


def test_tensors_in_reads_every_dtype_as_safetensors_does_without_copying() -> None:
    from safetensors.torch import load, save

    from tlt_stream.store.weights import tensors_in

    g = torch.Generator().manual_seed(0)
    state = {
        "f32": torch.randn(3, 4, generator=g),
        "bf16": torch.randn(5, generator=g).to(torch.bfloat16),
        "f16": torch.randn(2, 2, generator=g).half(),
        "i64": torch.arange(7),
        "u8": torch.arange(9, dtype=torch.uint8).view(3, 3),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
    }
    data = bytearray(save(state, metadata={"format": "pt"}))
    got, expected = tensors_in(data), load(bytes(data))
    assert got.keys() == expected.keys() == state.keys()
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape and torch.equal(got[name], tensor)
    base = torch.frombuffer(data, dtype=torch.uint8).data_ptr()
    assert base <= got["f32"].data_ptr() < base + len(data)  # a view of the bytes read, not a copy


def test_tensors_in_refuses_headers_that_do_not_describe_the_bytes() -> None:
    from safetensors.torch import save

    from tlt_stream.store.weights import tensors_in

    good = save({"a": torch.ones(4), "b": torch.zeros(4)})
    n = int.from_bytes(good[:8], "little")
    header = json.loads(good[8 : 8 + n])

    def with_header(h: dict) -> bytearray:
        raw = json.dumps(h).encode()
        return bytearray(len(raw).to_bytes(8, "little") + raw + good[8 + n :])

    a, b = header["a"]["data_offsets"], header["b"]["data_offsets"]
    cases = {
        "shorter": bytearray(good[:5]),
        "past the end": bytearray((10**9).to_bytes(8, "little") + good[8:]),
        "not JSON": bytearray((3).to_bytes(8, "little") + b"{x:" + good[8 + n :]),
        "do not hold": with_header({**header, "a": {**header["a"], "shape": [5]}}),
        "overlap": with_header({**header, "b": {**header["b"], "data_offsets": [a[0] + 4, b[1] - 12]}}),
        "out of range": with_header({**header, "b": {**header["b"], "data_offsets": [b[0] + 4, b[1] + 4]}}),
    }
    for words, data in cases.items():
        with pytest.raises(ValueError, match=words):
            tensors_in(data)
