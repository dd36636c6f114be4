"""Verifiable rewards: exact answers for the tiny task, `\\boxed{...}` answers checked with math-verify.

A reward function maps (response text, reference answer) to a float. Nothing here raises on odd model
output: a response without a parsable answer simply earns 0.
"""

from __future__ import annotations

from collections.abc import Callable

from tlt_stream.tasks.repeated_add import reward as repeated_add_reward

__all__ = ["REWARDS", "RewardFn", "last_boxed", "math_reward"]

RewardFn = Callable[[str, str], float]


def last_boxed(text: str) -> str | None:
    """The contents of the last `\\boxed{...}` (braces balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth = 0
    begin = start + len("\\boxed{")
    for i in range(begin, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            if depth == 0:
                return text[begin:i]
            depth -= 1
    return None


def math_reward(response: str, answer: str) -> float:
    """1.0 when the last `\\boxed{}` answer is mathematically equivalent to `answer` (math-verify)."""
    from math_verify import parse, verify

    boxed = last_boxed(response)
    if boxed is None or not boxed.strip():
        return 0.0
    gold = parse(answer if "$" in answer or "\\boxed" in answer else f"${answer}$")
    predicted = parse(f"${boxed}$")
    if not gold or not predicted:
        return 0.0
    try:
        return 1.0 if verify(gold, predicted) else 0.0
    except Exception:  # math-verify raises on some exotic inputs; such an answer is not verified
        return 0.0


REWARDS: dict[str, RewardFn] = {"repeated_add": repeated_add_reward, "math": math_reward}
