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


def tiny_policy(out: Path) -> Path:
    """A tiny random Llama policy with the character tokenizer, saved as a Hugging Face checkpoint in `out`
    (the tests' `init_policy`; `bench/soak.py` runs on it too)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tlt_stream.tasks.tokenizer import build_tokenizer

    torch.manual_seed(0)
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
