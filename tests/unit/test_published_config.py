"""The `config.json` of a published policy (and of an exported drafter) reads as the same RoPE and dtype under
transformers 5 and under transformers 4, whose readers (and a vLLM pinned to one) know only `rope_theta` at the
top level, `rope_scaling` and `torch_dtype`. The oracles: transformers 5's `AutoConfig` on the written
directory; the same `AutoConfig` on that config stripped to the keys transformers 4 knows (transformers 5 still
reads that older spelling); and a transformers-4-style reader written here from transformers 4.x's
`rope_config_validation` (`rope_type`, or the older `type`, inside `rope_scaling`; `rope_theta` beside it,
10000 when absent; `torch_dtype`). Each is compared with the source checkpoint as transformers loads it."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tests.families import build_family
from tlt_stream.drafter.export import eagle_config
from tlt_stream.model.families import spec_from_hf_config
from tlt_stream.store.digest import directory_sha256
from tlt_stream.store.weights import save_policy

CASES = {
    "llama3": "LlamaForCausalLM",  # Llama 3.1's scaled RoPE
    "yarn": "Qwen2ForCausalLM",
    "linear": "LlamaForCausalLM",
    "llama": "LlamaForCausalLM",  # default RoPE, theta 1e4
    "qwen3": "Qwen3ForCausalLM",  # default RoPE, theta 1e6
}
TRANSFORMERS5_ONLY = ("rope_parameters", "dtype")
"""The keys transformers 4 never reads."""
V4_DEFAULT_THETA = 10_000.0
"""What a transformers 4 Llama config takes for a `rope_theta` left out."""


def v4_rope_and_dtype(config: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """RoPE (in transformers 5's `rope_parameters` shape, to compare) and dtype as a transformers 4 reader
    takes them from a `config.json`: blind to `rope_parameters` and `dtype`."""
    scaling = dict(config.get("rope_scaling") or {})
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", "default")
    scaling.pop("type", None)
    rope = {"rope_type": rope_type, "rope_theta": config.get("rope_theta", V4_DEFAULT_THETA), **scaling}
    return rope, config.get("torch_dtype")


def published(tmp_path: Path, family: str, dtype: torch.dtype) -> tuple[Path, Path]:
    """A source checkpoint of `family` saved by transformers, and the policy `save_policy` publishes from the
    model transformers loads from it (as the learner does), its weights in `dtype`."""
    source = tmp_path / "source"
    build_family(family, source)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    save_policy(model, tmp_path / "policy", None, None, dtype=dtype)
    return source, tmp_path / "policy"


def config_of(path: Path) -> dict[str, Any]:
    return json.loads((path / "config.json").read_text())


def v4_only(config: dict[str, Any], out: Path) -> Path:
    """`config` without the keys transformers 4 does not read, as a directory of its own."""
    out.mkdir()
    (out / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k not in TRANSFORMERS5_ONLY}))
    return out


@pytest.mark.parametrize("family", sorted(CASES))
def test_a_published_policy_reads_as_the_source_rope_and_dtype_under_both_transformers(
    tmp_path: Path, family: str
) -> None:
    source, policy = published(tmp_path, family, torch.bfloat16)
    theirs = AutoConfig.from_pretrained(source)
    assert theirs.architectures == [CASES[family]]
    written = config_of(policy)

    v5 = AutoConfig.from_pretrained(policy)
    assert (v5.rope_parameters, v5.dtype) == (theirs.rope_parameters, torch.bfloat16)

    rope, dtype = v4_rope_and_dtype(written)
    assert (rope, dtype) == (theirs.rope_parameters, "bfloat16")

    older = AutoConfig.from_pretrained(v4_only(written, tmp_path / "v4"))
    assert (older.rope_parameters, older.dtype) == (theirs.rope_parameters, torch.bfloat16)

    assert spec_from_hf_config(written, policy) == spec_from_hf_config(config_of(source), source)


def test_a_published_config_holds_both_spellings_and_loads_as_the_published_model(tmp_path: Path) -> None:
    """`save_policy` writes `config.json` itself, in one pass: it must still parse, carry transformers 5's keys
    and transformers 4's beside them, name the published class and dtype (not the float32 source's), be part
    of the returned digest, and leave the live model's config as it was."""
    source = tmp_path / "source"
    build_family("yarn", source)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    before = model.config.to_dict()
    sha = save_policy(model, tmp_path / "policy", None, None, dtype=torch.bfloat16)
    policy = tmp_path / "policy"

    written = config_of(policy)
    assert {*TRANSFORMERS5_ONLY, "rope_theta", "rope_scaling", "torch_dtype"} <= written.keys()
    assert written["dtype"] == written["torch_dtype"] == "bfloat16"
    assert written["architectures"] == ["Qwen2ForCausalLM"]

    config = AutoConfig.from_pretrained(policy)
    assert (config.architectures, config.dtype) == (["Qwen2ForCausalLM"], torch.bfloat16)
    loaded = AutoModelForCausalLM.from_pretrained(policy)
    assert (type(loaded).__name__, loaded.dtype) == ("Qwen2ForCausalLM", torch.bfloat16)

    assert sha == directory_sha256(policy, scheme="v2")
    assert model.config.to_dict() == before


def test_a_llama3_policy_is_not_default_rope_to_a_transformers4_reader(tmp_path: Path) -> None:
    """The failure this guards: transformers 5 writes RoPE only as `rope_parameters`, which a transformers 4
    reader never sees, so it would run Llama 3.1's scaled RoPE as default RoPE with theta 1e4."""
    _, policy = published(tmp_path, "llama3", torch.float32)
    rope, dtype = v4_rope_and_dtype(config_of(policy))
    assert rope["rope_type"] == "llama3" and rope["rope_theta"] == 500_000.0
    assert dtype == "float32"


@pytest.mark.parametrize("family", ["llama3", "yarn", "linear", "llama"])
def test_an_exported_drafter_config_reads_as_the_target_rope_under_both_transformers(
    tmp_path: Path, family: str
) -> None:
    source = tmp_path / "source"
    build_family(family, source)
    spec = spec_from_hf_config(config_of(source), source)
    config = eagle_config(spec, dtype="bfloat16")
    (tmp_path / "draft").mkdir()
    (tmp_path / "draft" / "config.json").write_text(json.dumps(config))

    v5 = AutoConfig.from_pretrained(tmp_path / "draft")
    rope, dtype = v4_rope_and_dtype(config)
    assert (rope, dtype) == (v5.rope_parameters, "bfloat16") and v5.dtype == torch.bfloat16
    older = AutoConfig.from_pretrained(v4_only(config, tmp_path / "v4"))
    assert (older.rope_parameters, older.dtype) == (v5.rope_parameters, torch.bfloat16)

    def rope_fields(cfg: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(spec_from_hf_config(cfg)).items() if k.startswith("rope_")}

    stripped = {k: v for k, v in config.items() if k not in TRANSFORMERS5_ONLY}
    assert rope_fields(config) == rope_fields(stripped) == rope_fields(config_of(source))
    if family != "llama":
        assert rope_fields(stripped)["rope_type"] == family
