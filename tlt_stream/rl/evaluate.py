"""Held-out evaluation on a dataset of your own: pass@1 and mean reward of a policy checkpoint.

The first `n` prompts of the eval dataset (the same ones at every evaluation), one sample each at the
rollout temperature, stopped at any of the checkpoint's EOS ids, scored with the run's reward. pass@1 counts
a response with reward >= 1 as solved (the built-in rewards are 0 or 1); the mean reward is reported beside
it for rewards that are not. A reward that raises on a row scores that row 0 (logged once per evaluation):
an evaluation never stops the run it is part of.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from tlt_stream.basics.config import Config
from tlt_stream.rl.datasets import PromptPool, pool_from_config
from tlt_stream.rl.rewards import RewardFn, call_reward, resolve_reward

__all__ = ["evaluate_dataset", "held_out_pool", "score"]

log = logging.getLogger(__name__)


def evaluate_dataset(
    policy_dir: str | Path, config: Config, *, n: int, batch_size: int = 32, temperature: float | None = None
) -> dict[str, Any]:
    """pass@1 and mean reward of `policy_dir` on `config.data.eval_dataset` (its first `n` usable prompts), at
    `temperature` (0: greedy) or the rollout's."""
    from tlt_stream.model import load_model, load_tokenizer, stop_token_ids
    from tlt_stream.rollout.engine import GenerationEngine
    from tlt_stream.rollout.stops import StopStrings

    data = config.data
    tokenizer = load_tokenizer(data.tokenizer or policy_dir)
    pool, max_len = held_out_pool(policy_dir, config, tokenizer)
    model = load_model(policy_dir)
    rows = pool.rows[:n]
    reward = resolve_reward(config.rollout.reward)
    engine = GenerationEngine(model, batch_size, max_len)
    stops = stop_token_ids(policy_dir, tokenizer)
    stop = StopStrings(tokenizer, config.rollout.stop) if config.rollout.stop else None
    started = time.perf_counter()
    seed, longest = config.policy.seed, config.rollout.max_response_len
    temperature = config.rollout.temperature if temperature is None else temperature
    ids = [
        engine.add_request(
            prompt, min(max_len - len(prompt), longest or max_len), temperature, seed + i, stops, stop=stop
        )
        for i, (_, _, prompt, _) in enumerate(rows)
    ]
    done: dict[Any, Any] = {}
    while engine.has_unfinished:
        for result in engine.step():
            done[result.request_id] = result
    scored = [
        (tokenizer.decode(done[request].token_ids, skip_special_tokens=True), answer, pool.fields.get(prompt_id))
        for request, (prompt_id, _, _, answer) in zip(ids, rows, strict=True)
    ]
    rewards = score(reward, scored, name=config.rollout.reward)
    lengths = [len(done[i].token_ids) for i in ids]
    return {
        "dataset": data.eval_dataset,
        "prompts": len(rows),
        "skipped_long_prompts": pool.skipped,
        "accuracy": sum(r >= 1.0 for r in rewards) / len(rows),
        "mean_reward": sum(rewards) / len(rows),  # finite: a reward's NaN is its failure (`call_reward`)
        "truncated": sum(done[i].finish_reason == "length" for i in ids) / len(rows),
        "length_mean": sum(lengths) / len(lengths),
        "seconds": round(time.perf_counter() - started, 2),
    }


def held_out_pool(policy_dir: str | Path, config: Config, tokenizer: Any) -> tuple[PromptPool, int]:
    """(the held-out prompts of `config.data.eval_dataset`, as every evaluation reads them with `tokenizer`,
    the context they are generated within: `rollout.max_len`, else the policy's positions)."""
    from tlt_stream.model.loader import checkpoint_positions
    from tlt_stream.model.sizing import context_len

    assert config.data.eval_dataset is not None
    max_len = context_len(config.rollout.max_len, checkpoint_positions(policy_dir), str(policy_dir))
    return pool_from_config(config.data.eval_dataset, config, tokenizer, seed=0, max_len=max_len), max_len


def score(reward: RewardFn, rows: list[tuple[str, str, dict | None]], *, name: str) -> list[float]:
    """The reward of each (response, answer, fields), called as the rollout workers call it; a row whose
    reward raises scores 0, and the first such failure is logged with the count of them."""
    rewards, failed, first = [], 0, ""
    for response, answer, fields in rows:
        try:
            rewards.append(call_reward(reward, response, answer, fields))
        except Exception as exc:  # the user's reward: whatever it raises, this row is unscored, not the run
            rewards.append(0.0)
            failed += 1
            first = first or f"{type(exc).__name__}: {exc}"
    if failed:
        log.warning(
            "evaluation: reward %s raised on %d of %d rows, scored 0 (first: %s)", name, failed, len(rows), first
        )
    return rewards
