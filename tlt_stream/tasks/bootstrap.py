"""`tlt-stream bootstrap`: build the tiny world from nothing: a policy that is right sometimes, and a drafter.

1. Supervised warm-up of a small Llama-config policy on worked repeated-addition solutions (transformers'
   implementation, AdamW, warmup + cosine), saved as a Hugging Face checkpoint with the tokenizer in
   `DIR/policy`. The budget is set so held-out pass@1 lands in the range that leaves room for RL.
2. Offline warm-up of the EAGLE drafter on the policy's *own* generations: sample responses to training
   prompts with the rollout engine, take the target's hidden states over prompt + response, train with
   the unrolled EAGLE loss, save to `DIR/drafter`.
Everything is seeded and deterministic for a seed and thread count. `DIR/bootstrap.json` records what was
built; a second call with the same settings finds it and does nothing, and one whose settings differ only in
the drafter's keeps the policy and retrains the drafter. Parts are built in `DIR/.bootstrap-partial` and
renamed into place when complete, the record last: a build stopped half-way (Ctrl-C after the policy, before
the drafter) is never taken for a world, and the next call picks it up where it stopped.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import random
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from tlt_stream.tasks import shipped
from tlt_stream.tasks.repeated_add import RepeatedAddTask
from tlt_stream.tasks.tokenizer import build_tokenizer

__all__ = ["SIZES", "BootstrapSettings", "bootstrap", "unfinished"]

BOOTSTRAP_VERSION = 3


WORLD_LEN = 1408
"""The tiny world's own length (prompt + response tokens): its policy's positions, so `rollout.max_len` left
unset runs the world at this length whatever the default for other checkpoints."""


@dataclass(frozen=True)
class BootstrapSettings:
    hidden_size: int
    layers: int
    heads: int
    kv_heads: int
    intermediate_size: int
    sft_steps: int
    sft_batch_tokens: int
    sft_lr: float
    drafter_samples: int
    drafter_steps: int
    drafter_lr: float
    max_len: int = WORLD_LEN


SIZES: dict[str, BootstrapSettings] = {
    "small": BootstrapSettings(
        hidden_size=96,
        layers=2,
        heads=4,
        kv_heads=2,
        intermediate_size=256,
        sft_steps=60,
        sft_batch_tokens=4096,
        sft_lr=3e-3,
        drafter_samples=32,
        drafter_steps=30,
        drafter_lr=2e-3,
    ),
    "default": BootstrapSettings(
        hidden_size=128,
        layers=4,
        heads=4,
        kv_heads=2,
        intermediate_size=384,
        sft_steps=2000,
        sft_batch_tokens=1024,
        sft_lr=3e-3,
        drafter_samples=256,
        drafter_steps=1600,  # 400 left it far from converged: 3.65 tokens per SD round against 4.45
        drafter_lr=2e-3,
    ),
}


Progress = Callable[[str, int, int, dict[str, float]], None]
"""progress(phase, done, total, metrics): called as work advances (the CLI draws bars from it)."""


def _silent(phase: str, done: int, total: int, metrics: dict[str, float]) -> None:
    return None


def _encode(tokenizer: Any, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def sft_batches(task: Any, tokenizer: Any, seed: int, batch_tokens: int) -> Iterator[tuple[torch.Tensor, ...]]:
    """(input_ids, attention_mask, labels) batches of training problems; labels cover the solution and EOS.

    Problems are drawn in chunks from the task distribution, sorted by length and cut into batches of
    about `batch_tokens` tokens (little padding), and every batch of a chunk is used, in shuffled order,
    so long and short problems are trained on in their true proportions.
    """
    rng = random.Random(f"sft/{seed}")
    eos = tokenizer.eos_token_id
    while True:
        chunk: list[tuple[list[int], int]] = []
        while len(chunk) < 512:
            problem = task.random_problem(rng)
            if task.is_heldout(problem):
                continue
            prompt = _encode(tokenizer, problem.prompt)
            chunk.append((prompt + _encode(tokenizer, problem.solution) + [eos], len(prompt)))
        chunk.sort(key=lambda item: len(item[0]))
        groups: list[list[tuple[list[int], int]]] = []
        while chunk:
            longest = len(chunk[-1][0])
            count = max(1, batch_tokens // longest)
            groups.append(chunk[-count:])
            del chunk[-count:]
        rng.shuffle(groups)
        for group in groups:
            width = max(len(ids) for ids, _ in group)
            ids = torch.zeros(len(group), width, dtype=torch.long)
            attention = torch.zeros(len(group), width, dtype=torch.long)
            labels = torch.full((len(group), width), -100, dtype=torch.long)
            for i, (seq, prompt_len) in enumerate(group):
                ids[i, : len(seq)] = torch.tensor(seq)
                attention[i, : len(seq)] = 1
                labels[i, prompt_len : len(seq)] = torch.tensor(seq[prompt_len:])
            yield ids, attention, labels


def _lr(step: int, total: int, base: float, warmup: int = 30) -> float:
    if step < warmup:
        return base * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return base * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))


def train_policy(settings: BootstrapSettings, seed: int, out: Path, progress: Progress) -> dict[str, float]:
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=settings.hidden_size,
        intermediate_size=settings.intermediate_size,
        num_hidden_layers=settings.layers,
        num_attention_heads=settings.heads,
        num_key_value_heads=settings.kv_heads,
        max_position_embeddings=settings.max_len,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        rope_theta=10_000.0,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.sft_lr, betas=(0.9, 0.98), weight_decay=0.01)
    data = sft_batches(RepeatedAddTask(), tokenizer, seed, settings.sft_batch_tokens)
    model.train()
    smoothed = None
    for step in range(settings.sft_steps):
        ids, attention, labels = next(data)
        for group in optimizer.param_groups:
            group["lr"] = _lr(step, settings.sft_steps, settings.sft_lr)
        loss = model(input_ids=ids, attention_mask=attention, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        value = loss.item()
        smoothed = value if smoothed is None else 0.95 * smoothed + 0.05 * value
        progress("policy", step + 1, settings.sft_steps, {"loss": smoothed})
    model.eval()
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return {"sft_loss": smoothed or float("nan")}


def drafter_windows(policy_dir: Path, settings: BootstrapSettings, seed: int, progress: Progress) -> list:
    """The policy's own sampled responses to training prompts, with its hidden states over each sequence."""
    from tlt_stream.rollout.warmup import policy_windows

    tokenizer = build_tokenizer()
    problems = RepeatedAddTask().problems(settings.drafter_samples, seed + 1, heldout=False)
    prompts = [_encode(tokenizer, p.prompt) for p in problems]
    return policy_windows(
        policy_dir, prompts, max_len=settings.max_len, stops=[tokenizer.eos_token_id], seed=seed, progress=progress
    )


def train_drafter(
    policy_dir: Path, windows: list, settings: BootstrapSettings, seed: int, out: Path, progress: Progress
) -> dict[str, float]:
    from tlt_stream.rollout.warmup import warm_up_drafter

    return warm_up_drafter(
        policy_dir, windows, steps=settings.drafter_steps, lr=settings.drafter_lr, seed=seed, out=out, progress=progress
    )


_DRAFTER_ONLY = ("drafter_samples", "drafter_steps", "drafter_lr")
"""Settings that shape only the drafter (`max_len` also sets the policy's position limit)."""


def _same_policy(found: dict[str, Any], wanted: dict[str, Any]) -> bool:
    """Whether the world `found` recorded has the policy `wanted` would train (it differs at most in the drafter)."""
    if any(found.get(k) != wanted[k] for k in ("version", "seed", "size")) or "policy" not in found:
        return False
    old, new = found.get("settings") or {}, wanted["settings"]
    return all(old.get(k) == v for k, v in new.items() if k not in _DRAFTER_ONLY)


MARKER = "bootstrap.json"
STAGING = ".bootstrap-partial"
"""Where parts are built, inside the world directory (next to the parts it replaces, on their filesystem): a
part is renamed into place only once complete, and the marker, written last, is what makes the world one."""


def _read(marker: Path) -> dict[str, Any]:
    try:
        found = json.loads(marker.read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def _write(marker: Path, record: dict[str, Any]) -> None:
    partial = marker.with_name(marker.name + ".tmp")
    partial.write_text(json.dumps(record, indent=2))
    partial.replace(marker)  # atomic: a reader sees the old record or the new one, never half of one


def _finished(out: Path, found: dict[str, Any]) -> bool:
    return {"policy", "drafter"} <= found.keys() and (out / "policy").is_dir() and (out / "drafter").is_dir()


def ship(source: Path, dest: Path = shipped.SHIPPED, threads: int = 2) -> dict[str, Any]:
    """Make `dest` the shipped copy of the finished world `source` (built with `threads` torch threads: the
    bootstrap is deterministic for a seed and a thread count), with its manifest; returns the manifest."""
    import transformers

    found = _read(source / MARKER)
    if not _finished(source, found):
        raise ValueError(f"{source} holds no finished bootstrap ({MARKER})")
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    for part in shipped.PARTS:
        shutil.copytree(source / part, dest / part)
    _write(dest / MARKER, {k: v for k, v in found.items() if k != "policy_kept"})
    manifest = {
        "files": shipped.digests(dest),
        "built_with": {"torch": torch.__version__, "transformers": transformers.__version__, "threads": threads},
    }
    (dest / shipped.MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def unfinished(out: str | Path) -> dict[str, Any] | None:
    """The record of a bootstrap begun in `out` and never finished (its `seed` and `size`, when known), or None
    when `out` holds a finished world or no bootstrap at all: what `tlt-stream run` resumes before it starts."""
    out = Path(out)
    found = _read(out / MARKER)
    if _finished(out, found):
        return None
    if (out / STAGING).is_dir():
        return _read(out / STAGING / MARKER) or found
    return found or None


@contextlib.contextmanager
def _locked(out: Path) -> Iterator[None]:
    """One bootstrap at a time in `out`: under the lock, whatever is in the staging directory was left by a
    build that died."""
    fd = os.open(out, os.O_RDONLY)
    try:
        with contextlib.suppress(OSError):  # a filesystem without flock: builds are not serialised, no more
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _install(stage: Path, out: Path, part: str) -> None:
    """Rename the finished `stage/part` into `out/part`, replacing what was there."""
    old = stage / f"{part}.old"
    shutil.rmtree(old, ignore_errors=True)
    if (out / part).exists():
        (out / part).rename(old)
    (stage / part).rename(out / part)


def request(seed: int, size: str) -> dict[str, Any]:
    """What a bootstrap for `seed` and `size` builds: the fields its record must match to be found."""
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {', '.join(SIZES)}")
    return {"version": BOOTSTRAP_VERSION, "seed": seed, "size": size, "settings": asdict(SIZES[size])}


def ships(seed: int, size: str) -> bool:
    """Whether the package ships the world a bootstrap for `seed` and `size` builds (then it is copied)."""
    return shipped.matches(request(seed, size))


def bootstrap(
    out: str | Path, *, seed: int = 0, size: str = "default", progress: Progress = _silent, rebuild: bool = False
) -> dict:
    """Build (or find, or finish) the tiny world in `out`; returns what `out/bootstrap.json` records.

    A request the shipped world answers (`tasks/shipped.py`: the defaults) copies it instead of training,
    unless `rebuild`.

    Parts are built in `out/.bootstrap-partial` and renamed into place when complete, the marker last, so an
    interrupted build never passes for a finished one: the next call resumes it (a policy the staging
    directory's marker records is kept) or, when its settings differ, starts the staging directory afresh.
    """
    out = Path(out)
    wanted = request(seed, size)
    settings = SIZES[size]
    out.mkdir(parents=True, exist_ok=True)
    with _locked(out):
        stage = out / STAGING
        found = _read(out / MARKER)
        if rebuild and found.get("shipped"):
            found = {}  # a copy of the shipped world is nothing to keep when asked to train
        if _finished(out, found) and _same_policy(found, wanted) and found["settings"] == wanted["settings"]:
            shutil.rmtree(stage, ignore_errors=True)  # a leftover of an abandoned build for other settings
            return found
        if not rebuild and shipped.matches(wanted):
            shutil.rmtree(stage, ignore_errors=True)
            stage.mkdir()
            record = {**shipped.copy_into(stage), "shipped": True}
            (out / MARKER).unlink(missing_ok=True)
            for part in ("policy", "drafter"):
                _install(stage, out, part)
            _write(out / MARKER, record)
            shutil.rmtree(stage)
            progress("shipped world", 1, 1, {})
            return record
        started = time.perf_counter()
        record: dict[str, Any] = dict(wanted)
        staged = _read(stage / MARKER)
        if (out / "policy").is_dir() and _same_policy(found, wanted):  # only the drafter's settings changed
            shutil.rmtree(stage, ignore_errors=True)
            record["policy"], record["policy_seconds"] = found["policy"], found.get("policy_seconds")
            record["policy_kept"] = True
            policy = out / "policy"
        elif (stage / "policy").is_dir() and _same_policy(staged, wanted):  # an interrupted build's policy
            record["policy"], record["policy_seconds"] = staged["policy"], staged.get("policy_seconds")
            policy = stage / "policy"
        else:
            shutil.rmtree(stage, ignore_errors=True)
            stage.mkdir()
            policy = stage / "policy"
            record["policy"] = train_policy(settings, seed, policy, progress)
            record["policy_seconds"] = round(time.perf_counter() - started, 1)
            _write(stage / MARKER, record)
        shutil.rmtree(stage / "drafter", ignore_errors=True)
        stage.mkdir(exist_ok=True)
        windows = drafter_windows(policy, settings, seed, progress)
        record["drafter"] = train_drafter(policy, windows, settings, seed, stage / "drafter", progress)
        record["seconds"] = round(time.perf_counter() - started, 1)
        _write(stage / MARKER, record)
        if record.get("policy_kept"):  # the world keeps its policy but is unfinished until the new drafter is in
            _write(out / MARKER, {k: v for k, v in found.items() if k != "drafter"})
        else:
            (out / MARKER).unlink(missing_ok=True)
            _install(stage, out, "policy")
        _install(stage, out, "drafter")
        _write(out / MARKER, record)
        shutil.rmtree(stage)
    return record


if __name__ == "__main__":  # refresh the shipped world (tasks/shipped.py) from a finished one
    import sys

    if len(sys.argv) not in (2, 3):
        sys.exit("usage: python -m tlt_stream.tasks.bootstrap WORLD_DIR [THREADS]  (makes it the shipped world)")
    print(json.dumps(ship(Path(sys.argv[1]), threads=int(sys.argv[2]) if len(sys.argv) == 3 else 2)["built_with"]))
