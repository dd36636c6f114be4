"""The tiny default world's task: repeated addition, one step per line, carries written out.

    Q: Start at 17 and add 8, 4 times.
    A: Step 1/4: 17+8: 7+8=15, carry 1, 1+1=2, total 25.
    Step 2/4: 25+8: 5+8=13, carry 1, 2+1=3, total 33.
    Step 3/4: 33+8: 3+8=11, carry 1, 3+1=4, total 41.
    Step 4/4: 41+8: 1+8=9, total 49.
    The answer is 49.

Every line restates the step counter and the running total from the line above and the increment from the
prompt (formulaic text a drafter can predict), then does the real work as single-digit facts: the ones
digits' sum and, when it carries, the rest of the total plus one. Every computed token depends only on the
line above and two numbers in the prompt, so a few-million-parameter model learns the procedure within
minutes on a CPU, and a mistake anywhere ruins the answer, so accuracy falls with length like a reasoning
model's. The number of steps is heavy-tailed (P(n) ~ n^-1.6 on 1..24): in a batch of prompts the longest
solution is ~10x the median, a real long tail. Problems are split into train and held-out sets by a hash
of the prompt, so the two never overlap whatever their size.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from tlt_stream.basics.common import stable_hex

__all__ = ["ANSWER_RE", "Problem", "RepeatedAddTask", "reward", "step_text"]

ANSWER_RE = re.compile(r"The answer is (-?\d+)\.")


@dataclass(frozen=True)
class Problem:
    prompt: str
    solution: str
    """The worked solution that follows the prompt (what the policy should generate, without EOS)."""
    answer: str
    start: int
    increment: int
    steps: int

    @property
    def prompt_id(self) -> str:
        return stable_hex(self.prompt, 16)


def reward(response: str, answer: str) -> float:
    """1.0 when the response's first stated answer equals `answer` exactly, else 0.0."""
    match = ANSWER_RE.search(response)
    return 1.0 if match is not None and match.group(1) == answer.strip() else 0.0


def step_text(total: int, term: int) -> str:
    """The single-digit work of adding `term` (1-9) to `total`: the ones digits, then the carry if any."""
    ones, rest = total % 10, total // 10
    text = f"{ones}+{term}={ones + term}"
    if ones + term >= 10:
        text += ", carry 1"
        if rest:
            text += f", {rest}+1={rest + 1}"
    return text


@dataclass(frozen=True)
class RepeatedAddTask:
    """Problem generator; every method is deterministic for its seed."""

    max_steps: int = 24
    max_start: int = 99
    tail_exponent: float = 1.6
    heldout_percent: int = 10

    def __post_init__(self) -> None:
        if not 1 <= self.max_steps <= 99 or not 1 <= self.max_start <= 999:
            raise ValueError("need 1 <= max_steps <= 99 and 1 <= max_start <= 999")
        if not 0 < self.heldout_percent < 100:
            raise ValueError("heldout_percent must be in 1..99")

    def make(self, start: int, increment: int, steps: int) -> Problem:
        if not (1 <= increment <= 9 and steps >= 1 and start >= 0):
            raise ValueError(f"bad problem start={start} increment={increment} steps={steps}")
        prompt = f"Q: Start at {start} and add {increment}, {steps} times.\nA:"
        total = start
        lines = []
        for i in range(1, steps + 1):
            work = step_text(total, increment)
            lines.append(f"Step {i}/{steps}: {total}+{increment}: {work}, total {total + increment}.")
            total += increment
        lines.append(f"The answer is {total}.")
        return Problem(prompt, " " + "\n".join(lines), str(total), start, increment, steps)

    def random_problem(self, rng: random.Random) -> Problem:
        sizes = range(1, self.max_steps + 1)
        steps = rng.choices(sizes, weights=[n**-self.tail_exponent for n in sizes])[0]
        return self.make(rng.randint(1, self.max_start), rng.randint(1, 9), steps)

    def is_heldout(self, problem: Problem) -> bool:
        return int(problem.prompt_id, 16) % 100 < self.heldout_percent

    def problems(self, count: int, seed: int, *, heldout: bool) -> list[Problem]:
        """`count` problems drawn from the task distribution within one split, deterministic for `seed`.

        Short problems repeat (the distribution is what it is), as they would in a real dataset's stream.
        """
        rng = random.Random(f"repeated-add/{seed}/{'heldout' if heldout else 'train'}")
        found: list[Problem] = []
        while len(found) < count:
            problem = self.random_problem(rng)
            if self.is_heldout(problem) == heldout:
                found.append(problem)
        return found
