"""What a user's checkpoint brings besides its weights, read as transformers reads it: the attention window its
config asks for, its tokenizer (or its absence), a BOS the tokenizer adds, a chat template that refuses a
prompt, tied embeddings saved under the head's name; and a checkpoint the runtime cannot run refused before a
run starts its services."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.families import LLAMA3_SPECIALS, build_family, chat_tokenizer, family_config
from tlt_stream.model import CheckpointError, load_model, load_tokenizer, spec_from_hf_config
from tlt_stream.model.loader import prompt_encoder
from tlt_stream.rl.datasets import DatasetError, load_examples

WINDOWED = [
    ("qwen2", dict(use_sliding_window=True, sliding_window=16, max_window_layers=1)),  # layer 1 slides
    ("qwen2", dict(use_sliding_window=True, sliding_window=16, max_window_layers=2)),  # past the last: none
    ("qwen2", dict(use_sliding_window=False, sliding_window=16, max_window_layers=0)),  # the flag off: none
    ("qwen3", dict(use_sliding_window=True, sliding_window=16, max_window_layers=0)),
    ("qwen3", dict(use_sliding_window=True, sliding_window=16, layer_types=["full_attention"] * 2)),
    ("qwen3", dict(use_sliding_window=False, sliding_window=16, layer_types=["sliding_attention", "full_attention"])),
    ("mistral", dict(sliding_window=16)),
    ("mistral", dict(sliding_window=None)),
    ("ministral", dict(sliding_window=16)),
    ("llama", dict()),
]


ARCHITECTURES = {
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "ministral": "MinistralForCausalLM",
    "llama": "LlamaForCausalLM",
}


def _oracle_window(config) -> int | None:
    """The window transformers' own model of this config applies in some layer (None: full attention)."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if not window:
        return None
    return window if types is None or "sliding_attention" in types else None


@pytest.mark.parametrize(("family", "changes"), WINDOWED)
@pytest.mark.parametrize("layer_types_saved", [True, False], ids=["as-saved", "older-config"])
def test_the_attention_window_is_read_as_transformers_reads_it(family, changes, layer_types_saved) -> None:
    """The config as transformers saves it (with its computed `layer_types`) and as older checkpoints carry it
    (without): the runtime's window is the one transformers' model of the same dict applies."""
    saved = family_config(family, **changes).to_dict()
    saved["architectures"] = [ARCHITECTURES[family]]  # as save_pretrained writes it
    if not layer_types_saved and "layer_types" not in changes:
        saved.pop("layer_types", None)
    oracle = type(family_config(family)).from_dict(saved)
    assert spec_from_hf_config(saved).sliding_window == _oracle_window(oracle), (saved.get("layer_types"), oracle)


def test_a_checkpoint_without_tokenizer_files_is_refused_in_one_line(tmp_path: Path) -> None:
    """transformers builds an empty tokenizer for such a directory (a run on it scored empty text); here it is
    an error naming what is missing and the setting that mends it, and a directory with the files loads."""
    build_family("qwen3", tmp_path / "weights")
    with pytest.raises(CheckpointError, match=r"no tokenizer files .* data\.tokenizer"):
        load_tokenizer(tmp_path / "weights")
    with pytest.raises(CheckpointError, match="no such tokenizer directory"):
        load_tokenizer(tmp_path / "nowhere")
    tokenizer = chat_tokenizer(["<pad>", "<eos>"], "<eos>", "")
    tokenizer.save_pretrained(tmp_path / "tok")
    loaded = load_tokenizer(tmp_path / "tok")
    assert loaded("what is 3 plus 4?")["input_ids"] == tokenizer("what is 3 plus 4?")["input_ids"]


def _bos_tokenizer():
    """A Llama-style tokenizer: its post-processor begins every sequence with `<|begin_of_text|>`."""
    from tokenizers import processors

    tokenizer = chat_tokenizer([*LLAMA3_SPECIALS], "<|eot_id|>", "")
    bos = "<|begin_of_text|>"
    tokenizer._tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, tokenizer.convert_tokens_to_ids(bos))]
    )
    tokenizer.bos_token = bos
    return tokenizer


def test_a_raw_prompt_begins_with_the_bos_its_tokenizer_adds() -> None:
    """transformers' `tokenizer(text)` is the oracle: a raw prompt gets the BOS the tokenizer adds; a text that
    already begins with it (a chat template wrote it) does not get a second; a tokenizer that adds none (Qwen's
    kind) gets none."""
    llama = _bos_tokenizer()
    text = "Question: what is 12 plus 3? Answer:"
    assert prompt_encoder(llama)(text) == llama(text)["input_ids"]
    assert prompt_encoder(llama)(text)[0] == llama.bos_token_id
    templated = "<|begin_of_text|>" + text
    assert prompt_encoder(llama)(templated) == llama(templated, add_special_tokens=False)["input_ids"]
    assert prompt_encoder(llama)(templated).count(llama.bos_token_id) == 1
    plain = chat_tokenizer(["<pad>", "<eos>"], "<eos>", "")
    assert prompt_encoder(plain)(text) == plain(text)["input_ids"] == plain(text, add_special_tokens=False)["input_ids"]


def test_a_chat_template_that_refuses_a_prompt_is_the_rows_error(tmp_path: Path) -> None:
    """Mistral's kind of template raises on a role it does not take: one `DatasetError` naming the row."""
    template = (
        "{%- for m in messages %}{%- if m['role'] == 'system' %}"
        "{{ raise_exception('system messages are not supported') }}{%- endif %}"
        "[INST] {{ m['content'] }} [/INST]{%- endfor %}"
    )
    tokenizer = chat_tokenizer(["<pad>", "<eos>"], "<eos>", template)
    rows = [
        {"prompt": [{"role": "user", "content": "what is 1 plus 2?"}], "answer": "3"},
        {
            "prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1 plus 1?"}],
            "answer": "2",
        },
    ]
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DatasetError, match=r"row 2: .*chat template refused the prompt \(system messages"):
        load_examples(path, tokenizer=tokenizer)
    assert len(load_examples(_first_row(path), tokenizer=tokenizer)) == 1


def _first_row(path: Path) -> Path:
    one = path.with_name("one.jsonl")
    one.write_text(path.read_text().splitlines()[0] + "\n")
    return one


def test_tied_embeddings_saved_under_the_heads_name_alone_load(tmp_path: Path) -> None:
    """A tied checkpoint whose file holds `lm_head.weight` and no `model.embed_tokens.weight` (transformers loads
    it): the runtime's logits equal transformers' on the same directory."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    build_family("qwen3", tmp_path / "tied")
    weights = load_file(tmp_path / "tied" / "model.safetensors")
    weights["lm_head.weight"] = weights.pop("model.embed_tokens.weight")
    save_file(weights, tmp_path / "tied" / "model.safetensors", metadata={"format": "pt"})
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "tied").eval()
    ids = torch.tensor([[3, 7, 11, 2, 5]])
    model = load_model(tmp_path / "tied")
    with torch.no_grad():
        expected = reference(ids).logits[0]
        got = model.logits(model(ids, torch.arange(ids.shape[1])[None], model.new_cache(1, ids.shape[1])))[0]
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def _gpt2(out: Path) -> Path:
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=300, n_positions=128)).save_pretrained(out)
    chat_tokenizer(["<pad>", "<eos>"], "<eos>", "").save_pretrained(out)
    return out


@pytest.mark.parametrize("case", ["unsupported", "no-tokenizer"])
def test_run_refuses_a_checkpoint_its_workers_would_refuse_before_starting_anything(tmp_path: Path, case) -> None:
    """A worker that refuses version 0 has no other version to run and waits: the run used to start its services
    and wait forever. Now it stops with one line and exit code 2, and no service was started (no logs)."""
    if case == "unsupported":
        policy, expected = _gpt2(tmp_path / "gpt2"), "unsupported architectures ['GPT2LMHeadModel']"
    else:
        policy, expected = tmp_path / "bare", "no tokenizer files"
        build_family("qwen3", policy)
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"prompt": "what is 1 plus 2?", "answer": "3"}) + "\n")
    out = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "tlt_stream.commands.cli", "run", "--policy", str(policy), "--dataset", str(data),
         "--reward", "exact", "--steps", "1", "--eval", "0", "--out", str(out)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    assert expected in result.stderr and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert not (out / "logs").exists()
