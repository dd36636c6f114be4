"""GPU check of the vLLM rollout backend (issue 10). Prints one JSON object. bench/gpu_check.sh runs it (from
bench.gpu_check) only where vLLM is importable: the device machines lent so far have none, and its wheel is too
large to carry there.

UNVERIFIED: written without a GPU; nothing here has run yet.

    python -m bench.gpu_check_vllm --work DIR [--size check|small|default] [--arm d4k1v4] [--steps 2]
                              [--dtype float32|bfloat16] [--eager] [--deadline EPOCH_S]

The tiny world is built in code on the CPU (the `tlt-stream bootstrap` recipe; no download), then each vLLM
engine runs in a child process of its own (its GPU memory is freed with the process):

- `plain`: vLLM without speculative decoding: greedy outputs of held-out prompts, tokens/s at batch 1
  (one request at a time) and batch 32 (32 at once);
- `sd`: vLLM with the world's EAGLE drafter (exported by the backend) and a fixed chain arm: the same
  greedy outputs and tokens/s, then `--steps` RL steps: G = 8 samples for each of 4 training prompts at
  T = 1 (behaviour log-probs, hidden states recomputed), one GRPO update on the GPU (`LearnerCore`; its
  `approx_kl_old` compares the learner's log-probs with vLLM's behaviour log-probs on the same weights),
  the new policy reloaded into vLLM in place (checked by comparing vLLM's greedy log-probs with this
  project's torch runtime on the new and on the old weights), a short drafter training pass on the
  recomputed hidden states and an in-place drafter swap.

`ok` is true when greedy output with and without SD is identical on every prompt, every reload gave
vLLM's log-probs the new weights' values, and every swap loaded the drafter.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.gpu_check import build_world, world_prompts

BATCH = 32
SINGLE = 8
"""Requests timed one at a time for batch 1."""


def log(message: str) -> None:
    print(f"[gpu_check_vllm] {message}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", required=True, help="directory for the world, exports, policies and phase files")
    p.add_argument("--phase", choices=["all", "plain", "sd"], default="all")
    p.add_argument(
        "--size",
        choices=["check", "small", "default"],
        default="check",
        help="world: check (head_dim 32, under a minute on 16 cores), or a `tlt-stream bootstrap` size",
    )
    p.add_argument("--arm", default="d4k1v4", help="EAGLE chain arm of the SD engine")
    p.add_argument("--steps", type=int, default=2, help="RL steps in the SD phase")
    p.add_argument("--new-tokens", type=int, default=256, help="max new tokens per greedy request")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="vLLM dtype")
    p.add_argument("--eager", action="store_true", help="no CUDA graphs / torch.compile (faster start)")
    p.add_argument("--deadline", type=float, default=0.0, help="epoch seconds by which to print (0: none)")
    return p.parse_args(argv)


def left(args: argparse.Namespace) -> float:
    return float("inf") if not args.deadline else args.deadline - time.time()


# ------------------------------------------------------------------------------------------------ shared


def build_engine(args: argparse.Namespace, world: Path, *, arm: str | None, temperature: float) -> Any:
    from tlt_stream.rollout.vllm.backend import VllmEngine, VllmSettings

    settings = VllmSettings(
        max_batch=BATCH,
        max_len=1408,
        temperature=temperature,
        arm=arm,
        dtype=args.dtype,
        enforce_eager=args.eager,
        gpu_memory_utilization=0.45,  # room for the torch policy, learner and drafter of the SD phase
        work_dir=str(Path(args.work) / "exports"),
    )
    return VllmEngine(world / "policy", settings=settings, drafter=world / "drafter" if arm else None)


def timed_greedy(engine: Any, prompts: list[list[int]], eos: int, new_tokens: int) -> dict[str, Any]:
    """Greedy outputs and tokens/s at batch 1 and batch 32 (after a warm-up request)."""
    engine.generate(prompts[:1], 8, 0.0, eos_ids=[eos])  # warm-up: first-step compilation and allocation
    single, tokens, start = [], 0, time.perf_counter()
    for p in prompts[:SINGLE]:
        (result,) = engine.generate([p], new_tokens, 0.0, eos_ids=[eos])
        single.append(result)
        tokens += len(result.token_ids)
    batch1 = tokens / (time.perf_counter() - start)
    start = time.perf_counter()
    batched = engine.generate(prompts[:BATCH], new_tokens, 0.0, eos_ids=[eos])
    batch32 = sum(len(r.token_ids) for r in batched) / (time.perf_counter() - start)

    def mean_accept(results: list[Any]) -> float | None:
        rounds = sum(len(r.accept_lengths) for r in results)
        return sum(sum(r.accept_lengths) for r in results) / rounds if rounds else None

    return {
        "tokens_per_s": {"batch_1": round(batch1, 1), "batch_32": round(batch32, 1)},
        "mean_accept_length": {"batch_1": mean_accept(single), "batch_32": mean_accept(batched)},
        "greedy": [r.token_ids for r in batched],
        "greedy_batch_1": [r.token_ids for r in single],
    }


def torch_logprobs(model: Any, prompt: list[int], tokens: list[int]) -> list[float]:
    """log softmax (T = 1) of this project's runtime for each of `tokens` after `prompt` (teacher forced)."""
    import torch

    sequence = prompt + tokens
    with torch.inference_mode():
        cache = model.new_cache(1, len(sequence))
        ids = torch.tensor([sequence[:-1]], device=model.device)
        hidden = model(ids, torch.arange(len(sequence) - 1, device=model.device)[None], cache)[0]
        logp = torch.log_softmax(model.logits(hidden).float(), dim=-1)[len(prompt) - 1 :]
        return logp.gather(1, torch.tensor(tokens, device=model.device)[:, None])[:, 0].tolist()


def logprob_error(model: Any, results: list[Any]) -> float:
    """Largest |vLLM's greedy log-prob - this runtime's| over the tokens of `results`."""
    return max(
        abs(a - b)
        for r in results
        for a, b in zip(r.logprobs, torch_logprobs(model, r.prompt_ids, r.token_ids), strict=True)
    )


def on_device(batch: Any, weight: Any) -> Any:
    """A packed drafter batch (built on the CPU) on the drafter's device, features in its dtype."""
    import dataclasses

    moved = {f.name: getattr(batch, f.name).to(weight.device) for f in dataclasses.fields(batch)}
    moved["features"] = moved["features"].to(weight.dtype)
    moved["targets"] = moved["targets"].to(weight.dtype)
    return type(batch)(**moved)


# ------------------------------------------------------------------------------------------------- phases


def phase_plain(args: argparse.Namespace, world: Path) -> dict[str, Any]:
    prompts, _, eos = world_prompts(world, BATCH, heldout=True, seed=7)
    engine = build_engine(args, world, arm=None, temperature=0.0)
    try:
        return timed_greedy(engine, prompts, eos, args.new_tokens)
    finally:
        engine.close()


def rl_step(
    engine: Any,
    core: Any,
    tokenizer: Any,
    *,
    world: Path,
    work: Path,
    step: int,
    policy: Path,
    drafter_dir: Path,
    check_prompts: list[list[int]],
    eos: int,
    device: str,
) -> dict[str, Any]:
    """One RL step on `engine` (the backend's surface: generate, load_policy, load_drafter): G = 8 samples
    for 4 training prompts, one GRPO update, save, reload in place and check, drafter pass and swap."""
    import torch

    from tlt_stream.basics.messages import PromptGroup
    from tlt_stream.drafter.model import load_drafter, save_drafter
    from tlt_stream.drafter.train import DrafterTrainer, Window, batches
    from tlt_stream.model import load_model
    from tlt_stream.rl.groups import ReadyGroup
    from tlt_stream.rl.samples import make_sample
    from tlt_stream.tasks.repeated_add import reward

    train, answers, _ = world_prompts(world, 4, heldout=False, seed=100 + step)
    group_size = 8
    rows = [p for p in train for _ in range(group_size)]
    t0 = time.perf_counter()
    results = engine.generate(rows, 256, 1.0, seed=1000 * step, eos_ids=[eos], return_hidden=True)
    gen_s = time.perf_counter() - t0
    groups, windows = [], []
    for g, (prompt, answer) in enumerate(zip(train, answers, strict=True)):
        group = PromptGroup(
            task_id=f"s{step}/p{g}", prompt_id=f"p{g}", prompt_ids=prompt, answer=answer, group_size=group_size
        )
        samples = []
        for i in range(group_size):
            r = results[g * group_size + i]
            text = tokenizer.decode(r.token_ids, skip_special_tokens=True)
            sample = make_sample(
                r,
                group,
                i,
                # a length tie-breaker keeps groups from being degenerate (all rewards equal, no update),
                # so the reload check below sees weights that changed
                reward=reward(text, answer) - 1e-3 * len(r.token_ids),
                policy_version=step - 1,
                drafter_version=step - 1,
                worker_id="gpu-check",
                gen_seconds=gen_s,
            )
            samples.append(sample)
            states = torch.cat([r.prompt_hidden, r.hidden[: len(r.token_ids)]]).float().cpu()
            tokens = torch.tensor((r.prompt_ids + r.token_ids)[: states.shape[0]])
            windows.append(Window(tokens, states, len(r.prompt_ids)))
        groups.append(ReadyGroup(group.task_id, samples, []))
    metrics = core.step(groups)
    new_policy = work / f"policy-{step}"
    core.model.save_pretrained(new_policy, safe_serialization=True)
    tokenizer.save_pretrained(new_policy)

    t0 = time.perf_counter()
    engine.load_policy(new_policy)
    reload_s = time.perf_counter() - t0
    check = engine.generate(check_prompts[:4], 64, 0.0, eos_ids=[eos])
    new_model = load_model(new_policy, device=device)
    err_new = logprob_error(new_model, check)
    err_old = logprob_error(load_model(policy, device=device), check)

    drafter = load_drafter(drafter_dir, new_model)
    trainer = DrafterTrainer(drafter, lr=1e-3, total_steps=20, warmup=2, unroll=2)
    stream = batches(windows, row_tokens=512, rows_per_batch=2, seed=step)
    loss = [trainer.step(on_device(next(stream), drafter.fc.weight))["loss"] for _ in range(10)][-1]
    drafter.eval()
    new_drafter = work / f"drafter-{step}"
    save_drafter(drafter, new_drafter, metadata={"policy_version": step})
    t0 = time.perf_counter()
    swapped = engine.load_drafter(new_drafter)
    swap_s = time.perf_counter() - t0
    rounds = sum(len(r.accept_lengths) for r in results)
    return {
        "step": step,
        "policy": str(new_policy),
        "drafter": str(new_drafter),
        "reward_mean": metrics["reward_mean"],
        "approx_kl_old": metrics.get("approx_kl_old"),
        "grad_norm": metrics.get("grad_norm"),
        "generate_s": round(gen_s, 3),
        "reload_s": round(reload_s, 3),
        "policy_updated": bool(metrics.get("updated")),
        "reload_logprob_err_new": err_new,
        "reload_logprob_err_old": err_old,
        "drafter_loss": loss,
        "drafter_swap_tensors": swapped,
        "drafter_swap_s": round(swap_s, 3),
        "mean_accept_length": sum(sum(r.accept_lengths) for r in results) / rounds if rounds else None,
    }


def phase_sd(args: argparse.Namespace, world: Path) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tlt_stream.rl.learner import LearnerCore, LearnerSettings

    prompts, _, eos = world_prompts(world, BATCH, heldout=True, seed=7)
    engine = build_engine(args, world, arm=args.arm, temperature=1.0)
    try:
        out = timed_greedy(engine, prompts, eos, args.new_tokens)
        tokenizer = AutoTokenizer.from_pretrained(str(world / "policy"))
        learner_model = AutoModelForCausalLM.from_pretrained(str(world / "policy"), dtype=torch.float32).cuda()
        core = LearnerCore(learner_model, LearnerSettings(lr=1e-3))
        policy, drafter_dir = world / "policy", world / "drafter"
        out["rl"] = []
        for step in range(1, args.steps + 1):
            if left(args) < 60:
                log(f"stopping RL steps at {step - 1}: under a minute left")
                break
            record = rl_step(
                engine,
                core,
                tokenizer,
                world=world,
                work=Path(args.work),
                step=step,
                policy=policy,
                drafter_dir=drafter_dir,
                check_prompts=prompts,
                eos=eos,
                device="cuda",
            )
            out["rl"].append(record)
            policy, drafter_dir = Path(record["policy"]), Path(record["drafter"])
        return out
    finally:
        engine.close()


# ----------------------------------------------------------------------------------------------- driver


def run_phase(args: argparse.Namespace, phase: str) -> dict[str, Any]:
    """`phase` in a child process; its JSON file, or an error record."""
    work = Path(args.work)
    out = work / f"{phase}.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "bench.gpu_check_vllm", "--phase", phase, "--work", str(work), "--size", args.size]
    cmd += ["--arm", args.arm, "--steps", str(args.steps), "--new-tokens", str(args.new_tokens)]
    cmd += ["--dtype", args.dtype, "--deadline", str(args.deadline)] + (["--eager"] if args.eager else [])
    timeout = max(10.0, left(args) - 5) if args.deadline else None
    start = time.time()
    try:
        done = subprocess.run(cmd, timeout=timeout, stdout=sys.stderr)  # vLLM logs to stdout: keep ours clean
    except subprocess.TimeoutExpired:
        return {"error": f"phase {phase} ran out of time", "seconds": round(time.time() - start, 1)}
    if done.returncode != 0 or not out.is_file():
        seconds = round(time.time() - start, 1)
        return {"error": f"phase {phase} exited {done.returncode} (see stderr)", "seconds": seconds}
    record = json.loads(out.read_text())
    record["seconds"] = round(time.time() - start, 1)
    return record


def summarize(world_s: float, plain: dict[str, Any], sd: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    import torch

    result: dict[str, Any] = {"check": "vllm-backend", "arm": args.arm, "dtype": args.dtype, "world": args.size}
    try:  # not `import vllm`: it may log to stdout, which carries this check's one JSON object
        result["vllm"] = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        result["vllm"] = None
    result["torch"] = torch.__version__
    result["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    result["seconds"] = {"world": round(world_s, 1), "plain": plain.get("seconds"), "sd": sd.get("seconds")}
    errors = [r["error"] for r in (plain, sd) if "error" in r]
    if errors:
        result.update(ok=False, errors=errors)
        return result
    mismatched = [i for i, (a, b) in enumerate(zip(plain["greedy"], sd["greedy"], strict=True)) if a != b]
    mismatched_1 = [
        i for i, (a, b) in enumerate(zip(plain["greedy_batch_1"], sd["greedy_batch_1"], strict=True)) if a != b
    ]
    divergence = {}
    for i in mismatched[:3]:
        a, b = plain["greedy"][i], sd["greedy"][i]
        divergence[i] = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    tps = {
        size: {
            "plain": plain["tokens_per_s"][size],
            "sd": sd["tokens_per_s"][size],
            "speedup": round(sd["tokens_per_s"][size] / plain["tokens_per_s"][size], 3),
        }
        for size in ("batch_1", "batch_32")
    }
    rl = sd.get("rl", [])
    tolerance = 1e-3 if args.dtype == "float32" else 5e-2

    def reloaded(step: dict[str, Any]) -> bool:
        """vLLM's log-probs are the new weights' (and, when the update changed them, not the old ones')."""
        new, old = step["reload_logprob_err_new"], step["reload_logprob_err_old"]
        return new < tolerance and (not step["policy_updated"] or new < old)

    reload_ok = all(reloaded(step) for step in rl)
    swap_ok = all(step["drafter_swap_tensors"] > 0 for step in rl)
    result.update(
        greedy_identical=not mismatched and not mismatched_1,
        greedy_compared=len(plain["greedy"]) + len(plain["greedy_batch_1"]),
        greedy_mismatched_rows={"batch_32": mismatched, "batch_1": mismatched_1, "first_divergence": divergence},
        tokens_per_s=tps,
        mean_accept_length=sd["mean_accept_length"],
        rl_steps=rl,
        reload_ok=reload_ok,
        drafter_swap_ok=swap_ok,
    )
    result["ok"] = bool(result["greedy_identical"] and rl and reload_ok and swap_ok)
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    world = work / "world"
    if args.phase != "all":
        record = phase_plain(args, world) if args.phase == "plain" else phase_sd(args, world)
        (work / f"{args.phase}.json").write_text(json.dumps(record))
        return 0
    import torch

    start = time.time()
    log(f"building the {args.size} world in {world} (no download)")
    torch.set_num_threads(max(1, min(16, os.cpu_count() or 1)))
    build_world(world, args.size)
    world_s = time.time() - start
    log("phase plain")
    plain = run_phase(args, "plain")
    log("phase sd")
    sd = run_phase(args, "sd")
    print(json.dumps(summarize(world_s, plain, sd, args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
