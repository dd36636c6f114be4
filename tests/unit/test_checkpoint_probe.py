"""A user's own checkpoint, tokenizer and dataset unlike the repo's own, read as transformers reads them: config
keys left out (each family's defaults), no `architectures`, `rope_scaling` beside `rope_parameters`, a top-level
`original_max_position_embeddings`, `swish`; a checkpoint saved whole over a sharded one; a BOS the tokenizer's
post-processor adds without `bos_token` naming it; a tokenizer the policy cannot embed; `.json` datasets and
float answers; and a Llama-3-like checkpoint (bf16 shards, GQA 8:1, explicit head_dim, a padded vocabulary)
decoded plain and speculatively. transformers is the oracle throughout."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.families import LLAMA3_SPECIALS, chat_tokenizer
from tlt_stream.model import CheckpointError, load_model, load_spec
from tlt_stream.model.loader import check_checkpoint, checkpoint_positions, prompt_encoder
from tlt_stream.rl.datasets import DatasetError, load_examples

SHAPE: dict[str, Any] = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=64,
    max_position_embeddings=128,
    initializer_range=0.3,
)
ORIGINAL = 16
"""`original_max_position_embeddings` of the scaled variants: the test's sequence runs past it."""


def _config_class(arch: str):
    import transformers

    return getattr(transformers, arch.replace("ForCausalLM", "Config"))


def _edited(root: Path, arch: str, edit, **overrides: Any) -> tuple[Path, Any]:
    """A checkpoint whose config.json is `arch`'s config dict after `edit(dict)`, with random weights of the
    shapes transformers reads from that edited dict; returns (path, transformers' model loaded from it)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = _config_class(arch)(**{**SHAPE, **overrides}).to_dict()
    cfg["architectures"] = [arch]
    edit(cfg)
    path = root / "ckpt"
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(cfg))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path)).save_pretrained(path / "w")
    shutil.copy(path / "config.json", path / "w" / "config.json")  # the edited dict, not transformers' rewrite
    return path / "w", AutoModelForCausalLM.from_pretrained(path / "w").eval()


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.logits(model(ids, torch.arange(ids.shape[1])[None], model.new_cache(1, ids.shape[1])))[0]


def _drop(*keys: str):
    return lambda cfg: [cfg.pop(k, None) for k in keys]


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
YARN = {"rope_type": "yarn", "factor": 4.0}
EDITS = {
    # Qwen3's config class takes heads of 128 whatever hidden/heads: the runtime refused the tensors' shapes
    "qwen3-no-head_dim": ("Qwen3ForCausalLM", _drop("head_dim"), dict(head_dim=16)),
    # a config saved on its own (no `architectures`): transformers' Auto classes go by model_type
    "llama-no-architectures": ("LlamaForCausalLM", _drop("architectures"), {}),
    "qwen3-no-architectures": ("Qwen3ForCausalLM", _drop("architectures"), dict(head_dim=16)),
    # transformers maps `swish` to SiLU too
    "llama-swish": ("LlamaForCausalLM", lambda cfg: cfg.update(hidden_act="swish"), {}),
    # rope_scaling wins over rope_parameters in transformers (the runtime read rope_parameters)
    "llama-rope_scaling-beside-rope_parameters": (
        "LlamaForCausalLM",
        lambda cfg: cfg.update(rope_scaling={"type": "linear", "factor": 4.0}),
        dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}),
    ),
    # a top-level original_max_position_embeddings wins over the RoPE parameters' own in transformers
    "llama3-original-at-the-top": (
        "LlamaForCausalLM",
        lambda cfg: cfg.update(original_max_position_embeddings=ORIGINAL // 2),
        dict(rope_parameters={**LLAMA3, "original_max_position_embeddings": ORIGINAL, "rope_theta": 5e5}),
    ),
    "qwen2-yarn-original-at-the-top": (
        "Qwen2ForCausalLM",
        lambda cfg: cfg.update(original_max_position_embeddings=ORIGINAL * 4),
        dict(rope_parameters={**YARN, "original_max_position_embeddings": ORIGINAL, "rope_theta": 1e4}),
    ),
}


@pytest.mark.parametrize("name", sorted(EDITS))
def test_a_config_is_read_as_transformers_reads_it(tmp_path: Path, name: str) -> None:
    """Each edit used to load as another model than transformers' (or be refused): now prefill logits past the
    original context are transformers'."""
    arch, edit, overrides = EDITS[name]
    path, hf = _edited(tmp_path, arch, edit, **overrides)
    ids = torch.randint(1, SHAPE["vocab_size"], (1, 3 * ORIGINAL), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf(ids).logits[0]
    torch.testing.assert_close(_logits(load_model(path), ids), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    ("arch", "key", "overrides"),
    [
        ("MistralForCausalLM", "sliding_window", dict(sliding_window=None)),  # transformers: a 4096-token window
        ("LlamaForCausalLM", "max_position_embeddings", {}),  # 2048, not 32768
        ("MistralForCausalLM", "max_position_embeddings", dict(sliding_window=None)),  # 131072
        ("Qwen2ForCausalLM", "max_position_embeddings", {}),  # 32768
    ],
)
def test_a_key_left_out_takes_the_familys_default(tmp_path: Path, arch: str, key: str, overrides: dict) -> None:
    """The window and the context a config leaves out are transformers' defaults for the family: the spec's, and
    the context `rollout.max_len` defaults to (`checkpoint_positions`) and is checked against."""
    path, hf = _edited(tmp_path, arch, _drop(key), **overrides)
    spec = load_spec(path)
    assert spec.sliding_window == getattr(hf.config, "sliding_window", None)
    assert spec.max_position_embeddings == hf.config.max_position_embeddings
    assert checkpoint_positions(path) == hf.config.max_position_embeddings


@pytest.mark.parametrize(
    ("key", "value"), [("max_position_embeddings", None), ("hidden_size", "64"), ("num_hidden_layers", 2.5)]
)
def test_a_config_value_of_the_wrong_kind_is_refused_naming_its_key(tmp_path: Path, key: str, value: Any) -> None:
    """A null, text or fractional size used to escape as a TypeError traceback (or be read as a number)."""
    from tlt_stream.model.families import spec_from_hf_config

    cfg = {**SHAPE, "architectures": ["LlamaForCausalLM"], key: value}
    with pytest.raises(CheckpointError, match=rf"config\.json's {key} must be"):
        spec_from_hf_config(cfg)


def test_a_checkpoint_saved_whole_over_a_sharded_one_loads_its_own_weights(tmp_path: Path) -> None:
    """`save_pretrained` removes the old shards but not the old index: transformers reads model.safetensors,
    the runtime read the index and refused (a shard missing). Pickled weights alone are named as such."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**SHAPE)
    path = tmp_path / "policy"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path, max_shard_size="20KB")
    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    assert (path / "model.safetensors.index.json").is_file() and (path / "model.safetensors").is_file()
    check_checkpoint(path)
    ids = torch.arange(1, 30)[None]
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(path).eval()(ids).logits[0]
    torch.testing.assert_close(_logits(load_model(path), ids), expected, atol=1e-4, rtol=0)

    (path / "model.safetensors").unlink()
    (path / "model.safetensors.index.json").unlink()
    (path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"no model\.safetensors .*pytorch_model\.bin is not read"):
        check_checkpoint(path)


def _post_processor_bos(bos_attribute: str | None):
    """A Llama-3-like tokenizer whose post-processor begins every text with `<|begin_of_text|>`, wrapped with
    `bos_token` = `bos_attribute` (None: not named at all)."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    base = chat_tokenizer([*LLAMA3_SPECIALS], "<|eot_id|>", "")
    core = base.backend_tokenizer
    bos = "<|begin_of_text|>"
    core.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, core.token_to_id(bos))]
    )
    extra = {} if bos_attribute is None else {"bos_token": bos_attribute}
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|eot_id|>", **extra)


@pytest.mark.parametrize("bos_attribute", [None, "<|end_of_text|>"], ids=["unnamed", "named-otherwise"])
def test_a_bos_the_post_processor_adds_begins_a_raw_prompt(bos_attribute: str | None) -> None:
    """`tokenizer(text)` is the oracle: the raw prompt used to lack the BOS when `bos_token` did not name it."""
    tokenizer = _post_processor_bos(bos_attribute)
    text = "Question: what is 12 plus 3? Answer: 🙂"
    expected = tokenizer(text)["input_ids"]
    assert expected[0] == tokenizer.convert_tokens_to_ids("<|begin_of_text|>")
    encode = prompt_encoder(tokenizer)
    assert encode(text) == expected
    assert encode("<|begin_of_text|>" + text) == expected, "a text that begins with it gets no second"


def _small_vocab_policy(path: Path) -> Path:
    """A Qwen2 checkpoint of 40 token ids beside a tokenizer of 300 (another model's)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(**{**SHAPE, "vocab_size": 40, "num_hidden_layers": 1})
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    chat_tokenizer(["<pad>", "<eos>"], "<eos>", "").save_pretrained(path)
    return path


def test_a_tokenizer_the_policy_cannot_embed_is_refused_before_the_run_starts(tmp_path: Path) -> None:
    """Every prompt held a token id past the policy's vocabulary: the workers dead-lettered each, the policy
    service gave the step up, and `tlt-stream run` waited for ever. Now the dataset is refused in one line."""
    from tlt_stream.basics.config import Config, override
    from tlt_stream.model import load_tokenizer
    from tlt_stream.rl.datasets import pool_from_config

    policy = _small_vocab_policy(tmp_path / "policy")
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"what is {i} plus 2?", "answer": i + 2}) + "\n" for i in range(3)))
    config = override(Config(), {"learner.policy": str(policy), "rollout.max_len": 64})
    with pytest.raises(DatasetError, match=r"holds token id \d+, outside the policy's vocabulary of 40"):
        pool_from_config(str(data), config, load_tokenizer(policy), seed=0)
    result = subprocess.run(
        [sys.executable, "-m", "tlt_stream.commands.cli", "run", "--policy", str(policy), "--dataset", str(data),
         "--reward", "exact", "--steps", "1", "--eval", "0", "--max-len", "64", "--out", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    assert "outside the policy's vocabulary of 40" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "run" / "logs").exists(), "no service was started"


def test_json_datasets_and_an_upper_case_suffix_load(tmp_path: Path) -> None:
    """Hugging Face `datasets` writes `.json` as JSON lines; a JSON array is read too; `.JSONL` is JSONL. Each was
    refused as an unsupported format; a directory is named as one."""
    rows = [{"question": "what is 2 times 3? 🙂", "answer": 6}, {"question": "and 4 times 4?", "answer": "16"}]
    lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    files = {"lines.json": lines, "array.json": json.dumps(rows, indent=2), "upper.JSONL": lines}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
        examples = load_examples(tmp_path / name, prompt_field="question")
        assert [(e.prompt, e.answer) for e in examples] == [(r["question"], str(r["answer"])) for r in rows], name
    (tmp_path / "object.json").write_text(json.dumps({"rows": rows}))
    with pytest.raises(DatasetError, match=r"object\.json: row 1: missing field 'prompt'"):  # one row, as JSONL
        load_examples(tmp_path / "object.json")
    (tmp_path / "broken.json").write_text('[{"prompt": "a", "answer": 1},\n{"prompt": }]')
    with pytest.raises(DatasetError, match=r"broken\.json: line 2: not valid JSON"):
        load_examples(tmp_path / "broken.json")
    with pytest.raises(DatasetError, match="is a directory"):
        load_examples(tmp_path)


def test_float_answers_are_written_as_written(tmp_path: Path) -> None:
    """1.5e25 was written with a float's binary expansion (15000000000000000285212672) and 1e-07 in exponent
    form; an exact reward matches the number as a person writes it."""
    path = tmp_path / "d.jsonl"
    path.write_text(
        "".join(f'{{"prompt": "q{i}", "answer": {a}}}\n' for i, a in enumerate(["1.5e25", "1e-07", "-0.0"]))
    )
    assert [e.answer for e in load_examples(path)] == ["15000000000000000000000000", "0.0000001", "0"]


def test_a_llama3_like_checkpoint_decodes_as_transformers_plain_and_speculative(tmp_path: Path) -> None:
    """bf16 shards, GQA 8:1, head_dim apart from hidden/heads, llama3 RoPE, a vocabulary padded past the
    tokenizer's, an EOS list in config.json and another in generation_config.json: greedy output of the
    runtime, plain and with EAGLE and n-gram drafts, is transformers' `generate` on `tokenizer(text)`."""
    from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig

    from tlt_stream.drafter.model import Drafter
    from tlt_stream.model import load_tokenizer, stop_token_ids
    from tlt_stream.rollout.arms import Arm
    from tlt_stream.rollout.engine import GenerationEngine
    from tlt_stream.rollout.proposers import EagleProposer, NgramProposer

    tokenizer = _post_processor_bos("<|begin_of_text|>")
    eos = [tokenizer.convert_tokens_to_ids(t) for t in ("<|end_of_text|>", "<|eot_id|>")]
    config = LlamaConfig(
        **{
            **SHAPE,
            "num_attention_heads": 8,
            "num_key_value_heads": 1,
            "head_dim": 8,
            "vocab_size": len(tokenizer) + 60,
        },
        rope_parameters={**LLAMA3, "original_max_position_embeddings": ORIGINAL, "rope_theta": 5e5},
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=eos,
    )
    path = tmp_path / "llama3"
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        hf.model.norm.weight.fill_(4.0)
    hf.to(torch.bfloat16).save_pretrained(path, max_shard_size="40KB")
    tokenizer.save_pretrained(path)
    GenerationConfig(eos_token_id=eos[::-1], do_sample=False).save_pretrained(path)
    assert len(list(path.glob("model-*.safetensors"))) > 1
    reference_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    stops = stop_token_ids(path, load_tokenizer(path))
    assert stops == sorted(eos)
    encode = prompt_encoder(load_tokenizer(path))
    texts = ["what is 3 plus 4?", "Question: what is 12 plus 30? Answer: 12 plus 30 is"]
    prompts = [encode(t) for t in texts]
    reference = []
    for text in texts:
        ids = tokenizer(text, return_tensors="pt")["input_ids"]
        out = reference_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False)
        reference.append(out[0, ids.shape[1] :].tolist())
    model = load_model(path)
    torch.manual_seed(1)
    engines = {
        "plain": GenerationEngine(model, 2, 96),
        "eagle": GenerationEngine(
            model, 2, 96, proposer=EagleProposer(Drafter(model.spec).bind(model)), arm=Arm.drafter(3, 2, 6)
        ),
        "ngram": GenerationEngine(model, 2, 96, proposer=NgramProposer(), arm=Arm.drafter(4, 1, 4)),
    }
    for name, engine in engines.items():
        got = [r.token_ids for r in engine.generate(prompts, 24, eos_ids=stops)]
        assert got == reference, name
