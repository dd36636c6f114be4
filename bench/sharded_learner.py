"""Learner step time and memory, one process vs 2 gloo ranks (issue 25 point 1), on CPU.

For each model (the tiny world's policy architecture, random weights; a random ~100M-parameter Llama), the
same fixed groups are trained by `Trainer` on 1 process and on 2 ranks (each rank its own process, started
as torchrun starts it, 1 torch thread each): a warm-up update, then timed updates (rank 0's wall time of
`LearnerCore.step`), then one checkpoint (rank 0's wall time of `Trainer.save`: the gather, the consolidated
policy, RNG, ledger, meta and `LATEST`, and a CPU copy of the rank's optimizer piece; the pieces are written
in the background behind it and waited for, untimed, when the trainer stops). Memory: rank 0's RSS after
the updates (before the save), again after `malloc_trim` (what is live: glibc keeps freed activations
otherwise), and per rank the peak RSS (`ru_maxrss`, the save's gather included) and the RSS at the end.

    python bench/sharded_learner.py [--models tiny,100m] [--steps N]

Prints one JSON object. On a 2-core machine the 2 ranks share the cores the one process had to itself
(plus gloo's threads), so their time is no speed-up figure: it is what sharding costs where it cannot pay.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODELS = {
    # The tiny world's policy ("default" bootstrap size) with the character tokenizer's vocabulary.
    "tiny": {"hidden": 128, "layers": 4, "heads": 4, "kv": 2, "inter": 384, "vocab": None, "groups": 16, "group": 8,
             "prompt": 16, "response": (24, 56), "steps": 3},
    # ~110M parameters: GPT-2-small-like widths, a 32k vocabulary, tied embeddings.
    "100m": {"hidden": 768, "layers": 12, "heads": 12, "kv": 12, "inter": 2048, "vocab": 32000, "groups": 2,
             "group": 4, "prompt": 16, "response": (24, 72), "steps": 1},
}  # fmt: skip


def make_policy(name: str, out: Path) -> int:
    """A random Llama of model `name` saved in `out`; returns its parameter count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tlt_stream.tasks.tokenizer import build_tokenizer

    m = MODELS[name]
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=m["vocab"] or len(build_tokenizer()),
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
    return sum(p.numel() for p in model.parameters())


def groups(name: str, update: int, vocab: int) -> list:
    from tlt_stream.basics.messages import Sample, Tensor
    from tlt_stream.rl.groups import ReadyGroup

    m = MODELS[name]
    low, high = m["response"]
    out = []
    for g in range(m["groups"]):
        task = f"u{update}g{g}"
        samples = []
        for i in range(m["group"]):
            n = low + (g * 7 + i * 13 + update) % (high - low + 1)
            samples.append(
                Sample(
                    sample_id=f"{task}/{i}",
                    task_id=task,
                    prompt_id=task,
                    index=i,
                    group_size=m["group"],
                    prompt_ids=[(3 + g + j) % vocab for j in range(m["prompt"])],
                    token_ids=Tensor.from_values([(5 + g * 3 + i * 11 + j * 7) % vocab for j in range(n)], "int32"),
                    logprobs=Tensor.from_values([-2.0] * n, "float32"),
                    policy_version=update,
                    drafter_version=-1,
                    reward=float(i % 2),
                    finish_reason="eos",
                    worker_id="bench",
                )
            )
        out.append(ReadyGroup(task, samples, [f"{update}-{g}-{i}" for i in range(m["group"])]))
    return out


def rank_worker(spec: dict) -> None:
    """One rank (or the one process): build, warm up, time the updates and one save; write its figures."""
    import ctypes
    import gc
    import resource

    import psutil
    import torch

    from tlt_stream.rl.learner import LearnerSettings
    from tlt_stream.rl.ranks import join_ranks, leave_ranks
    from tlt_stream.rl.sharded import Trainer, follow

    torch.set_num_threads(1)
    link = join_ranks("cpu", timeout_s=600)
    rank = 0 if link is None else link.rank
    trainer = Trainer(LearnerSettings(lr=1e-5, micro_batch_tokens=2048), "cpu", link)
    root, policy = Path(spec["root"]), Path(spec["policy"])
    figures: dict = {}
    if rank == 0:
        core = trainer.build(policy)
        vocab = int(core.model.get_input_embeddings().weight.shape[0])
        core.step(groups(spec["model"], 0, vocab))
        times = []
        for update in range(1, spec["steps"] + 1):
            started = time.perf_counter()
            metrics = core.step(groups(spec["model"], update, vocab))
            times.append(time.perf_counter() - started)
        figures["rss_updates_mb"] = psutil.Process().memory_info().rss / 2**20
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # what is live, not what glibc keeps of freed activations
        figures["rss_live_mb"] = psutil.Process().memory_info().rss / 2**20
        started = time.perf_counter()
        trainer.save(
            root, step=core.updates, ledger=set(), extra={}, tokenizer=None, keep=1, publish_dtype=torch.float32
        )
        figures.update(step_s=times, tokens_per_step=metrics["trained_tokens"], save_s=time.perf_counter() - started)
        trainer.stop()
    else:
        follow(trainer, root=root, init_policy=policy)
    figures["rss_peak_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    figures["rss_end_mb"] = psutil.Process().memory_info().rss / 2**20
    Path(spec["out"]).with_suffix(f".rank{rank}.json").write_text(json.dumps(figures))
    leave_ranks(link)


def run(model: str, world: int, policy: Path, tmp: Path, steps: int) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp / f"{model}-{world}"
    spec = {"model": model, "root": str(tmp / f"ckpt-{model}-{world}"), "policy": str(policy), "steps": steps}
    spec["out"] = str(out)
    processes = []
    for rank in range(world):
        env = {**os.environ, "WORLD_SIZE": str(world), "RANK": str(rank), "LOCAL_RANK": str(rank)}
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        command = [sys.executable, __file__, "--rank-worker", json.dumps(spec)]
        processes.append(subprocess.Popen(command, env=env, stderr=subprocess.PIPE))
    for rank, p in enumerate(processes):
        _, err = p.communicate()
        if p.returncode != 0:
            raise RuntimeError(f"{model} rank {rank}/{world} failed:\n{err.decode()[-3000:]}")
    ranks = [json.loads(out.with_suffix(f".rank{r}.json").read_text()) for r in range(world)]
    first = ranks[0]
    return {
        "step_s_mean": sum(first["step_s"]) / len(first["step_s"]),
        "step_s": [round(t, 3) for t in first["step_s"]],
        "save_s": round(first["save_s"], 3),
        "tokens_per_step": first["tokens_per_step"],
        "rss_after_updates_mb_rank0": round(first["rss_updates_mb"]),
        "rss_live_after_updates_mb_rank0": round(first["rss_live_mb"]),
        "rss_peak_mb": [round(r["rss_peak_mb"]) for r in ranks],
        "rss_end_mb": [round(r["rss_end_mb"]) for r in ranks],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="tiny,100m")
    p.add_argument("--steps", type=int, help="timed updates after one warm-up update (default: per model)")
    p.add_argument("--rank-worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank_worker:
        rank_worker(json.loads(args.rank_worker))
        return
    import torch

    started = time.perf_counter()
    result: dict = {
        "machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "platform": platform.platform()},
        "threads_per_rank": 1,
        "backend": "gloo",
        "models": {},
    }
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        for model in args.models.split(","):
            params = make_policy(model, tmp / model)
            steps = args.steps or MODELS[model]["steps"]
            figures = {world: run(model, world, tmp / model, tmp, steps) for world in (1, 2)}
            result["models"][model] = {
                "params": params,
                "ranks_1": figures[1],
                "ranks_2": figures[2],
                "step_time_2_over_1": round(figures[2]["step_s_mean"] / figures[1]["step_s_mean"], 3),
                "peak_rss_per_rank_2_over_1": round(max(figures[2]["rss_peak_mb"]) / figures[1]["rss_peak_mb"][0], 3),
                "live_rss_rank0_2_over_1": round(
                    figures[2]["rss_live_after_updates_mb_rank0"] / figures[1]["rss_live_after_updates_mb_rank0"], 3
                ),
            }
    result["wall_s"] = round(time.perf_counter() - started, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
