"""Verifiable rewards: exact answers for the tiny task, `\\boxed{...}` answers checked with math-verify.

A reward function maps (response text, reference answer) to a float. Nothing here raises on odd model
output: a response without a parsable answer simply earns 0.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from tlt_stream.tasks.repeated_add import reward as repeated_add_reward

__all__ = [
    "REWARDS",
    "RewardError",
    "RewardFn",
    "call_reward",
    "exact_reward",
    "last_boxed",
    "math_reward",
    "resolve_reward",
    "reward_fields",
]

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


def exact_reward(response: str, answer: str) -> float:
    """1.0 when the response, stripped, is the answer, stripped."""
    return 1.0 if response.strip() == answer.strip() else 0.0


REWARDS: dict[str, RewardFn] = {"repeated_add": repeated_add_reward, "math": math_reward, "exact": exact_reward}


class RewardError(ValueError):
    """A reward name that names nothing callable; the message is one line."""


def resolve_reward(name: str) -> RewardFn:
    """A built-in reward by name, or a function of your own: `package.module:function` (importable) or
    `path/to/file.py:function` (loaded from the file). Raises `RewardError` with one line."""
    if name in REWARDS:
        return REWARDS[name]
    module_name, sep, attribute = name.rpartition(":")
    if not sep or not module_name or not attribute:
        raise RewardError(
            f"unknown reward {name!r}: use {', '.join(REWARDS)}, module:function or path/to/file.py:function"
        )
    import importlib
    import importlib.util
    from pathlib import Path

    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            if not path.is_file():
                raise RewardError(f"reward {name!r}: {path} does not exist")
            spec = importlib.util.spec_from_file_location(f"tlt_user_reward_{abs(hash(path.resolve()))}", path)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except RewardError:
        raise
    except Exception as exc:  # the user's module failed to import: say which and why, in one line
        raise RewardError(f"reward {name!r}: importing {module_name} failed: {type(exc).__name__}: {exc}") from None
    function = getattr(module, attribute, None)
    if not callable(function):
        raise RewardError(f"reward {name!r}: {module_name} has no function {attribute!r}")
    return function


@functools.lru_cache(maxsize=64)
def _wants(fn: RewardFn) -> tuple[bool, frozenset[str]]:
    """(takes **kwargs, the keyword parameters it names beyond the response and the answer)."""
    import inspect

    try:
        parameters = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin or a C function: call it with the two only
        return False, frozenset()
    var_keyword = any(p.kind is p.VAR_KEYWORD for p in parameters)
    named = frozenset(p.name for p in parameters[2:] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
    return var_keyword, named


def call_reward(fn: RewardFn, response: str, answer: str, fields: dict | None = None) -> float:
    """`fn(response, answer, ...)` with the dataset row's other fields a reward asks for: all of them to one
    that takes `**kwargs`, those it names as parameters otherwise (none to the built-ins). What it returns must
    be a finite real number or a bool (text, None, NaN or an infinity raises `RewardError`, as the reward
    raising would: its group goes to `dead` whole rather than trained with one member scored wrong)."""
    return _score(fn(response, answer, **reward_fields(fn, fields)))  # type: ignore[call-arg]


def reward_fields(fn: RewardFn, fields: dict | None) -> dict:
    """The row's other fields `fn` is called with (`call_reward`): all of them to a reward that takes
    `**kwargs`, those it names as parameters otherwise."""
    if not fields:
        return {}
    var_keyword, named = _wants(fn)
    return dict(fields) if var_keyword else {k: v for k, v in fields.items() if k in named}


def _score(value: object) -> float:
    """A reward's return as a score: any real number (numpy's and torch's scalars too; a bool is 1 or 0), not
    text, which `float` would read."""
    import math

    try:
        if isinstance(value, str | bytes) or value is None:
            raise TypeError
        score = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise RewardError(f"the reward returned {type(value).__name__} {value!r:.60}, not a number") from None
    if not math.isfinite(score):
        raise RewardError(f"the reward returned {score}, not a finite number")
    return score
