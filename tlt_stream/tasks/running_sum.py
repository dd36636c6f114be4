"""The tiny default world's task: add up named single-digit numbers, step by step, in words.

    Q: a=3, b=5, c=8, d=2. Add them up.
    A: Start with a=3.
    Add b=5: 3+5=8.
    Add c=8: 8+8=16.
    Add d=2: 16+2=18.
    The answer is 18.

Each step names the next term (the next letter: predictable), copies its value from the prompt (a lookup
by name, which attention does well), restates the running total from the line above, and then does the
one piece of real computation: the new total. A small model can master it, since every step is a
single-digit addition to a number it has just written, and a drafter can predict most of the text. The
number of terms is heavy-tailed (P(n) ~ n^-1.8 on 2..48), so in a batch of prompts the longest solution
is ~10x the median: a real long tail. Problems are split into train and held-out sets by a hash of the
prompt, so the two never overlap whatever their sizes.
"""

from __future__ import annotations

import hashlib
import random
import re
import string
from dataclasses import dataclass

__all__ = ["ANSWER_RE", "Problem", "RunningSumTask", "reward"]

ANSWER_RE = re.compile(r"The answer is (-?\d+)\.")
NAMES = string.ascii_lowercase + string.ascii_uppercase


@dataclass(frozen=True)
class Problem:
    prompt: str
    solution: str
    """The worked solution that follows the prompt (what the policy should generate, without EOS)."""
    answer: str
    terms: tuple[int, ...]

    @property
    def prompt_id(self) -> str:
        return hashlib.sha1(self.prompt.encode()).hexdigest()[:16]


def reward(response: str, answer: str) -> float:
    """1.0 when the response's first stated answer equals `answer` exactly, else 0.0."""
    match = ANSWER_RE.search(response)
    return 1.0 if match is not None and match.group(1) == answer.strip() else 0.0


@dataclass(frozen=True)
class RunningSumTask:
    """Problem generator; every method is deterministic for its seed."""

    min_terms: int = 2
    max_terms: int = 48
    tail_exponent: float = 1.8
    heldout_percent: int = 10

    def __post_init__(self) -> None:
        if not 2 <= self.min_terms <= self.max_terms <= len(NAMES):
            raise ValueError(
                f"need 2 <= min_terms <= max_terms <= {len(NAMES)}, got {self.min_terms}, {self.max_terms}"
            )
        if not 0 < self.heldout_percent < 100:
            raise ValueError("heldout_percent must be in 1..99")

    def _term_weights(self) -> list[float]:
        return [n**-self.tail_exponent for n in range(self.min_terms, self.max_terms + 1)]

    def make(self, terms: tuple[int, ...]) -> Problem:
        named = [f"{NAMES[i]}={t}" for i, t in enumerate(terms)]
        prompt = "Q: " + ", ".join(named) + ". Add them up.\nA:"
        total = terms[0]
        lines = [f" Start with {named[0]}."]
        for name, term in zip(named[1:], terms[1:], strict=True):
            new = total + term
            lines.append(f"Add {name}: {total}+{term}={new}.")
            total = new
        lines.append(f"The answer is {total}.")
        return Problem(prompt, "\n".join(lines), str(total), terms)

    def random_problem(self, rng: random.Random) -> Problem:
        sizes = range(self.min_terms, self.max_terms + 1)
        n = rng.choices(sizes, weights=self._term_weights())[0]
        return self.make(tuple(rng.randint(1, 9) for _ in range(n)))

    def is_heldout(self, problem: Problem) -> bool:
        return int(problem.prompt_id, 16) % 100 < self.heldout_percent

    def problems(self, count: int, seed: int, *, heldout: bool) -> list[Problem]:
        """`count` problems drawn from the task distribution within one split, deterministic for `seed`.

        Short problems repeat (there are only 81 with two terms), as they would in the distribution.
        """
        rng = random.Random(f"running-sum/{seed}/{'heldout' if heldout else 'train'}")
        found: list[Problem] = []
        while len(found) < count:
            problem = self.random_problem(rng)
            if self.is_heldout(problem) == heldout:
                found.append(problem)
        return found
