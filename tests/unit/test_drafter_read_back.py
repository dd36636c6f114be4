"""A drafter swap into an engine that holds the draft weights elsewhere (vLLM's workers) is checked by reading
one tensor back: the worker records its digest when it is the announced checkpoint's, and refuses the version
when it is not. The engine here is a stand-in with `draft_tensor` (vLLM's own is checked in tests/vllm)."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path
from types import SimpleNamespace

import torch

from tlt_stream.basics.config import DEFAULTS, override
from tlt_stream.basics.messages import DrafterVersion
from tlt_stream.drafter.model import Drafter, read_drafter, save_drafter
from tlt_stream.model.spec import ModelSpec
from tlt_stream.roles.worker.drafters import READ_BACK, DrafterSwaps
from tlt_stream.store.digest import directory_sha256


class _RemoteDraft:
    """Loads a drafter as vLLM's workers would, maybe wrongly (`spoil`), and hands one tensor back by vLLM's name."""

    def __init__(self, spoil: bool) -> None:
        self.spoil = spoil
        self.held: dict[str, torch.Tensor] = {}

    def load_drafter(self, path: str) -> int:
        norm = read_drafter(path).state_dict()[READ_BACK[0]].clone()
        self.held[READ_BACK[1]] = norm + 1.0 if self.spoil else norm
        return 1

    def draft_tensor(self, name: str) -> torch.Tensor:
        return self.held[name].float().flatten()


def _announced(tmp_path: Path) -> DrafterVersion:
    spec = ModelSpec(
        "qwen2",
        vocab_size=29,
        hidden_size=32,
        intermediate_size=64,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
    )
    torch.manual_seed(0)
    drafter = Drafter(spec)
    with torch.no_grad():
        drafter.layer.post_attention_layernorm.weight.uniform_(0.5, 1.5)
    location = save_drafter(drafter, tmp_path / "drafter")
    return DrafterVersion(version=1, location=str(location), sha256=directory_sha256(location))


def _swap(tmp_path: Path, engine: _RemoteDraft) -> tuple[DrafterSwaps, dict[str, str]]:
    announced = _announced(tmp_path)
    config = override(DEFAULTS, {"sd.drafter": str(tmp_path / "warm-up"), "sd.adaptive": False})
    info: dict[str, str] = {}
    registry = SimpleNamespace(update_info=lambda **fields: info.update({k: str(v) for k, v in fields.items()}))
    swaps = DrafterSwaps(config, SimpleNamespace(current={"drafter": announced}), registry, "w")  # type: ignore[arg-type]
    asyncio.run(swaps.maybe_swap(engine, None))  # type: ignore[arg-type]
    return swaps, info


def test_the_tensor_read_back_after_a_swap_is_recorded_by_its_digest(tmp_path: Path) -> None:
    swaps, info = _swap(tmp_path, _RemoteDraft(spoil=False))
    norm = read_drafter(tmp_path / "drafter").state_dict()[READ_BACK[0]].float()
    assert (swaps.swaps, swaps.version) == (1, 1)
    assert info["drafter_read_back"] == f"1:{hashlib.sha256(norm.numpy().tobytes()).hexdigest()}"


def test_an_engine_holding_other_weights_after_the_swap_refuses_the_version(tmp_path: Path) -> None:
    swaps, info = _swap(tmp_path, _RemoteDraft(spoil=True))
    assert swaps.swaps == 0 and "drafter_read_back" not in info
    assert info["refused_drafter"].startswith("1: ") and "\n" not in info["refused_drafter"]
