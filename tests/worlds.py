"""The tiny world as `bootstrap` lays it out, built in a second from the tests' random policy."""

from __future__ import annotations

import shutil
from pathlib import Path


def build_world(init_policy: Path, world: Path) -> None:
    """`world/policy` (a copy of the tests' tiny random policy) and `world/drafter` (a random drafter bound
    to it): what `bootstrap` leaves in a world directory, without its minutes of training."""
    import torch

    from tlt_stream.drafter.model import Drafter, save_drafter
    from tlt_stream.model import load_model

    shutil.copytree(init_policy, world / "policy")
    torch.manual_seed(1)
    save_drafter(Drafter(load_model(world / "policy").spec), world / "drafter")


def tiny_policy(out: Path, seed: int = 0) -> Path:
    """A tiny random Llama policy with the character tokenizer, saved as a Hugging Face checkpoint in `out`
    (the tests' `init_policy`, seed 0; `bench/soak.py` runs on it too)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tlt_stream.tasks.tokenizer import build_tokenizer

    torch.manual_seed(seed)
    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
        max_position_embeddings=256,
    )
    LlamaForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


QWEN_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def qwen_like_policy(out: Path) -> Path:
    """A random Qwen2 policy saved in bf16 with a byte-level BPE tokenizer trained here (`tokenizers`): a chat
    template, `<|im_end|>` as the tokenizer's EOS and `<|endoftext|>` as a second one that only
    `generation_config.json` names, as Qwen's chat models ship. The final norm's gain is small, so the
    next-token distribution is near uniform over the ~260 tokens and a response meets either EOS within a
    few dozen tokens (what a test needs to see both stop a response)."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    from tests.families import chat_tokenizer

    tokenizer = chat_tokenizer(["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "<|im_end|>", QWEN_CHAT_TEMPLATE)
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
    )
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        model.model.norm.weight.fill_(0.01)
    model.to(torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out)
    eos = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    GenerationConfig(eos_token_id=eos, pad_token_id=eos[1]).save_pretrained(out)
    return out


def gsm8k_like_rows(pairs: list[tuple[int, int]]) -> list[dict]:
    """verl-style parquet rows (chat prompt, `reward_model.ground_truth`, `data_source`, `extra_info`) of
    "what is a plus b?" for each (a, b)."""
    return [
        {
            "data_source": "gsm8k-like",
            "prompt": [{"role": "user", "content": f"Question: what is {a} plus {b}?"}],
            "reward_model": {"style": "rule", "ground_truth": str(a + b)},
            "extra_info": {"index": i},
        }
        for i, (a, b) in enumerate(pairs)
    ]


def write_parquet(rows: list[dict], path: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path
