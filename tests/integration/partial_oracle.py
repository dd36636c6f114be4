"""Oracles for the partial-rollout pipeline tests that the code under test did not write: Hugging Face
transformers' log-probabilities and exact first-token distributions from a checkpoint directory, and the
power of a pooled chi-square test against an alternative.

A sample's first token given its prompt follows softmax(logits / T) of the policy it is stamped with,
exactly; over samples of different prompts the counts of each first token are a sum of independent
categoricals. Pearson's statistic against their summed expectation has, per cell, at most the variance the
chi-square law assumes, so `tests.stats.chi2_threshold` keeps its false-alarm rate (or less).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

__all__ = ["first_token_distributions", "hf_logprobs", "noncentrality", "power"]


@functools.lru_cache(maxsize=8)
def _model(location: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(location, torch_dtype=torch.float32).eval()


def hf_logprobs(location: Path, prompt: list[int], response: list[int], temperature: float) -> torch.Tensor:
    """log softmax(logits / T) of the response tokens under the checkpoint at `location` (transformers)."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = _model(str(location))(ids).logits[0, len(prompt) - 1 : -1].float() / temperature  # [n, V]
    return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(response)[:, None]).squeeze(1)


def first_token_distributions(location: Path, prompts: Sequence[list[int]], temperature: float) -> torch.Tensor:
    """`[N, V]` softmax(logits / T) after each prompt under the checkpoint at `location` (transformers): the
    exact distribution of a response's first token."""
    model = _model(str(location))
    with torch.no_grad():
        rows = [model(torch.tensor([p])).logits[0, -1].double() / temperature for p in prompts]  # [V] each
    return torch.softmax(torch.stack(rows), dim=-1)


def noncentrality(alternative: Mapping[int, float], expected: Mapping[int, float], n: int) -> tuple[float, int]:
    """(lambda, degrees of freedom) of `tests.stats.chi_square` against `expected` (probabilities) when the
    counts follow `alternative`, on the same cells (those expected below 5 merged into one)."""
    lam, df, rest_e, rest_a = 0.0, -1, 0.0, 0.0
    for key, p in expected.items():
        a = alternative.get(key, 0.0)
        if p * n < 5:
            rest_e, rest_a = rest_e + p * n, rest_a + a * n
            continue
        lam += (a * n - p * n) ** 2 / (p * n)
        df += 1
    if rest_e > 0:
        lam += (rest_a - rest_e) ** 2 / rest_e
        df += 1
    return lam, df


def power(lam: float, df: int, threshold: float) -> float:
    """P(statistic > threshold) for a noncentral chi-square(df, lam), by its normal approximation."""
    mean, sd = df + lam, math.sqrt(2 * (df + 2 * lam))
    return 0.5 * math.erfc((threshold - mean) / (sd * math.sqrt(2)))
