"""Publish-to-loaded latency against model size (issue 25 point 3), on CPU, one process per side in turn.

For each random Llama size, what stands between an update's end and a worker generating with its weights,
measured two ways in the same run (contenders on the same model, one after the other):

- **inline** (the previous release's shape): the optimizer state written inside the checkpoint, on the
  critical path; the worker's `verify_directory` (a read) then the engine's `load_policy(path)` (another);
- **now**: `Trainer.save` as the learner runs it: the policy hashed from the bytes it writes (v2), the
  optimizer snapshot written in the background (its write time is reported, off the critical path); the
  worker's `read_weights` (each file read once, hashed, parsed) and `load_policy(path, weights=...)`.

Both write the policy with today's hashing writer, so the previous release's second digest pass over the
policy is not in "inline": run this script at that release for its own figures (docs/benchmarks.md).

The announcement itself (one retained MQTT message) is milliseconds and left out.

    python bench/publish_latency.py [--sizes tiny,25m,100m]

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SIZES = {
    "tiny": {"hidden": 128, "layers": 4, "heads": 4, "kv": 2, "inter": 384, "vocab": None},
    "25m": {"hidden": 512, "layers": 8, "heads": 8, "kv": 8, "inter": 1408, "vocab": 8000},
    "100m": {"hidden": 768, "layers": 12, "heads": 12, "kv": 12, "inter": 2048, "vocab": 32000},
}


def make_policy(size: str, out: Path) -> int:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tlt_stream.tasks.tokenizer import build_tokenizer

    m = SIZES[size]
    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=m["vocab"] or len(tokenizer),
        hidden_size=m["hidden"],
        intermediate_size=m["inter"],
        num_hidden_layers=m["layers"],
        num_attention_heads=m["heads"],
        num_key_value_heads=m["kv"],
        tie_word_embeddings=True,
        max_position_embeddings=256,
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)  # a worker builds its tokenizer from the policy directory
    return sum(p.numel() for p in model.parameters())


def one_group(vocab: int) -> list:
    from tlt_stream.basics.messages import Sample, Tensor
    from tlt_stream.rl.groups import ReadyGroup

    samples = [
        Sample(
            sample_id=f"t/{i}",
            task_id="t",
            prompt_id="t",
            index=i,
            group_size=2,
            prompt_ids=[3, 4, 5],
            token_ids=Tensor.from_values([(7 + i + j) % vocab for j in range(8)], "int32"),
            logprobs=Tensor.from_values([-2.0] * 8, "float32"),
            policy_version=0,
            drafter_version=-1,
            reward=float(i),
            finish_reason="eos",
            worker_id="bench",
        )
        for i in range(2)
    ]
    return [ReadyGroup("t", samples, ["0-0", "0-1"])]


def timed(fn: Any) -> tuple[Any, float]:
    started = time.perf_counter()
    out = fn()
    return out, round(time.perf_counter() - started, 3)


def measure(size: str, tmp: Path) -> dict:
    import torch

    from tlt_stream.basics.config import DEFAULTS, override
    from tlt_stream.rl.checkpoint import save_checkpoint
    from tlt_stream.rl.learner import LearnerSettings
    from tlt_stream.rl.sharded import Trainer
    from tlt_stream.rollout.build import build_engine
    from tlt_stream.store.digest import directory_sha256, verify_directory
    from tlt_stream.store.weights import read_weights

    params = make_policy(size, tmp / size)
    trainer = Trainer(LearnerSettings(lr=1e-5), "cpu")
    core = trainer.build(tmp / size)
    root = tmp / f"ckpt-{size}"
    common = {"extra": {}, "tokenizer": None, "keep": 3, "publish_dtype": torch.float32}
    first = trainer.save(root, step=0, ledger=set(), **common)
    trainer.wait_for_writes()
    core.step(one_group(int(core.model.get_input_embeddings().weight.shape[0])))  # AdamW state exists now
    config = override(DEFAULTS, {"rollout.max_batch": 1, "rollout.max_len": 64, "rollout.temperature": 1.0})
    engine, _ = build_engine(str(first.policy_dir), config)

    # inline: the optimizer state written inside the checkpoint; verify, then load from the path
    inline, save_i = timed(
        lambda: save_checkpoint(root, step=1, model=core.model, optimizer=core.optimizer, ledger={"t/0"}, **common)
    )
    v1 = directory_sha256(inline.policy_dir)  # what a v1 announcement would carry (not timed)
    _, verify_i = timed(lambda: verify_directory(inline.policy_dir, v1))
    _, load_i = timed(lambda: engine.load_policy(str(inline.policy_dir)))

    # now: what the learner and the worker run
    info, save_n = timed(lambda: trainer.save(root, step=2, ledger={"t/0", "t/1"}, **common))
    trainer.wait_for_writes()  # not on the path: the next update runs meanwhile
    weights, read_n = timed(lambda: read_weights(info.policy_dir, info.policy_sha256, scheme=info.digest))
    _, load_n = timed(lambda: engine.load_policy(str(info.policy_dir), weights=weights))
    written = trainer.optimizer_writes.last
    assert written is not None and written.error is None
    policy_mb = sum(p.stat().st_size for p in info.policy_dir.iterdir()) / 2**20
    inline_s, now_s = save_i + verify_i + load_i, save_n + read_n + load_n
    return {
        "params": params,
        "policy_mb": round(policy_mb, 1),
        "inline": {
            "learner_save_s": save_i,
            "worker_verify_s": verify_i,
            "worker_load_s": load_i,
            "publish_to_loaded_s": round(inline_s, 3),
        },
        "now": {
            "learner_save_s": save_n,
            "background_optimizer_write_s": round(written.seconds, 3),
            "worker_read_verified_s": read_n,
            "worker_load_s": load_n,
            "publish_to_loaded_s": round(now_s, 3),
        },
        "now_over_inline": round(now_s / inline_s, 3),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="tiny,25m,100m")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    result: dict = {"machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "platform": platform.platform()}}
    with tempfile.TemporaryDirectory() as tmp:
        result["sizes"] = {size: measure(size, Path(tmp)) for size in args.sizes.split(",")}
    result["wall_s"] = round(time.perf_counter() - started, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
