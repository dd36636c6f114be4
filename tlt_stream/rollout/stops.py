"""Stop strings: a response ends with the token that completes one of them, kept in the response as an EOS
token is (the learner trains on exactly the tokens that were sampled).

The rule looks only at the response's own decoded text, one token at a time, so the engine applies it the
same way with and without speculative decoding: the tokens a round accepts are appended one by one and the
row stops at the first that completes a stop string, whatever was accepted after it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["StopStrings"]


class StopStrings:
    """Stop when the text of the response's last tokens contains any of `strings`.

    Only a window of the newest tokens is decoded per check (a stop string of L characters spans at most 4L
    bytes, so at most 4L byte-level tokens; eight more cover a window that starts inside a character or a
    SentencePiece word), so a check costs the same at token 10 and token 10,000. Because the rule runs after
    every token, a match is always one the newest token completed. Special tokens are decoded as text, so a
    stop string may name one that is not an EOS id.
    """

    def __init__(self, tokenizer: Any, strings: Iterable[str]) -> None:
        unique = tuple(dict.fromkeys(strings))
        if not unique:
            raise ValueError("StopStrings needs at least one stop string")
        for s in unique:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        decode = getattr(tokenizer, "decode", None)
        if not callable(decode):
            raise TypeError(f"stop strings need a tokenizer with decode(), got {type(tokenizer).__name__}")
        self.strings = unique
        self.window = 4 * max(len(s) for s in unique) + 8
        self._decode = decode

    def __call__(self, token_ids: Sequence[int]) -> bool:
        text = self._decode(list(token_ids[-self.window :]), skip_special_tokens=False)
        return any(s in text for s in self.strings)

    def first_stop(self, token_ids: Sequence[int]) -> int | None:
        """How many of `token_ids` a response stopped by this rule keeps (the rule applied token by token, as
        the engine does), or None when none completes a stop string. An engine that checks stop strings
        after a whole multi-token step (vLLM with SD) may return tokens past the stop: this cuts them."""
        for n in range(1, len(token_ids) + 1):
            if self(token_ids[:n]):
                return n
        return None

    def __repr__(self) -> str:
        return f"StopStrings({list(self.strings)!r})"
