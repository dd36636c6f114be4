"""An EAGLE drafter warmed up for any policy, offline: the policy samples its own responses to training
prompts, and the drafter learns to predict its next features and tokens on them (TLT's warm-up, the tiny
world's bootstrap phase generalised). The online trainer continues from it during the run."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = ["policy_windows", "warm_up_drafter"]

Progress = Callable[[str, int, int, dict[str, float]], None]


def _silent(phase: str, done: int, total: int, metrics: dict[str, float]) -> None:
    pass


def policy_windows(
    policy_dir: str | Path,
    prompts: Sequence[list[int]],
    *,
    max_len: int,
    stops: Sequence[int],
    seed: int,
    temperature: float = 1.0,
    batch: int = 32,
    progress: Progress = _silent,
) -> list:
    """The policy's own sampled responses to `prompts` (row i seeded `seed + i`), with its hidden states over
    each whole sequence: the drafter's training windows."""
    from tlt_stream.drafter.train import Window
    from tlt_stream.model import load_model
    from tlt_stream.rollout.engine import GenerationEngine

    model = load_model(policy_dir)
    engine = GenerationEngine(model, batch, max_len)
    budget = max_len - max(len(p) for p in prompts)
    if budget < 1:
        raise ValueError(f"a prompt of {max(len(p) for p in prompts)} tokens leaves no room under max_len {max_len}")
    ids = [engine.add_request(p, budget, temperature, seed + i, list(stops)) for i, p in enumerate(prompts)]
    results: dict[Any, Any] = {}
    while engine.has_unfinished:
        for r in engine.step():
            results[r.request_id] = r
            progress("drafter data", len(results), len(ids), {})
    windows = []
    with torch.inference_mode():
        for rid in ids:
            r = results[rid]
            sequence = r.prompt_ids + r.token_ids
            cache = model.new_cache(1, len(sequence))
            hidden = model(torch.tensor([sequence]), torch.arange(len(sequence))[None], cache)[0]
            windows.append(Window(torch.tensor(sequence), hidden.clone(), len(r.prompt_ids)))
    return windows


def warm_up_drafter(
    policy_dir: str | Path,
    windows: list,
    *,
    steps: int,
    lr: float,
    seed: int,
    out: str | Path,
    progress: Progress = _silent,
) -> dict[str, float]:
    """A fresh drafter bound to the policy, trained `steps` steps on `windows`, saved to `out`; its last
    step's loss and top-1 agreement."""
    from tlt_stream.drafter.model import Drafter, save_drafter
    from tlt_stream.drafter.train import DrafterTrainer, batches
    from tlt_stream.model import load_model

    target = load_model(policy_dir)
    torch.manual_seed(seed)
    drafter = Drafter(target.spec).bind(target)
    trainer = DrafterTrainer(drafter, lr=lr, total_steps=steps, unroll=3)
    stream = batches(windows, row_tokens=512, rows_per_batch=4, seed=seed)
    stats: dict[str, float] = {}
    for step in range(steps):
        stats = trainer.step(next(stream))
        progress("drafter", step + 1, steps, {"loss": stats["loss"], "top1": stats["top1_1"]})
    drafter.eval()
    save_drafter(drafter, Path(out), metadata={"policy_version": 0, "trained_steps": steps})
    return {k: v for k, v in stats.items() if k.startswith(("loss", "top1"))}
