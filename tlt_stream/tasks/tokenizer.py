"""A character-level tokenizer built in code, as a transformers `PreTrainedTokenizerFast`.

Every printable ASCII character plus newline is one token; anything else maps to `<unk>`. It is saved with
each checkpoint (`tokenizer.json`), so `AutoTokenizer.from_pretrained(DIR)` loads it with no download.
"""

from __future__ import annotations

import string
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

__all__ = ["CHARACTERS", "SPECIAL_TOKENS", "build_tokenizer", "vocab"]

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
CHARACTERS = "\n" + "".join(c for c in string.printable if c.isprintable())
"""Newline and the 95 printable ASCII characters (space included)."""


def vocab() -> dict[str, int]:
    """Token -> id: the special tokens first (pad 0, bos 1, eos 2, unk 3), then the characters."""
    tokens = list(SPECIAL_TOKENS) + list(CHARACTERS)
    return {token: i for i, token in enumerate(tokens)}


def build_tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel(vocab=vocab(), unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )
