"""GPU check of the torch CUDA path (issue 25), run by bench/gpu_check.sh. Prints one JSON object on stdout.

UNVERIFIED until a GPU runs it: written and run end to end on the CPU (`--device cpu`), never on CUDA yet.

    python -m bench.gpu_check --work DIR [--device cuda] [--steps 3] [--new-tokens 256] [--deadline EPOCH_S]
                              [--no-run] [--vllm auto|off]

- `world`: the tiny world built in code on the CPU (the bootstrap recipe at a check size; no download);
- `greedy`: the torch rollout engine on the device, plain and with the EAGLE drafter (a chain and a tree arm),
  in float32 and bfloat16: greedy outputs compared token for token at batch 32 and batch 1;
- `tokens_per_s`: plain and SD at batch 1 and 32 in the rollouts' dtype on CUDA (bfloat16), each also with
  its decode and verify forwards replayed from CUDA graphs (`NAME+graphs`, `model.graphs`; greedy identity
  checked against eager plain too; `graphs`: captures, replays and seconds spent capturing); SD with EAGLE
  (a chain and a tree), with the group/history source alone (`group`: `group-d12v12`) and with both
  (`either`: `d6k1v6|g12`, per row the group's chain where the row follows it, else EAGLE's), the group
  source holding `HISTORY` responses per prompt sampled beforehand at T = 1 (an earlier epoch) and a fresh
  index per timed run (issue 23's CUDA figure);
- `rl`: `--steps` RL steps in this process: G = 8 samples of 4 prompts at T = 1 with SD, one GRPO update by
  the sharded learner (`rl/sharded.py`: FSDP2 over a one-rank process group, NCCL; fp32 masters, bf16
  compute), its checkpoint written and loaded into the engine in place, the engine's log-probs checked
  against the new weights (and shown to differ from the old ones);
- `run`: `tlt-stream run` on the same world with its embedded Redis and MQTT (the carried wheels), the learner
  and a rollout worker as processes sharing the GPU, a few steps;
- `vllm`: only where vLLM is importable (`bench.gpu_check_vllm`); else it says the vLLM backend stays unverified.

Several ranks (torchrun over several GPUs) are not part of it: the lent machines have one GPU.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

BATCH = 32
SINGLE = 8
"""Requests timed one at a time for batch 1."""
ARMS = {"chain": (4, 1, 4), "tree": (4, 2, 8)}
GROUP_ARMS = {"group": "group-d12v12", "either": "d6k1v6|g12"}
"""Arms that draft from the group/history source (issue 23), by name in the figures."""
HISTORY = 4
"""Responses per prompt the group source holds before a timed run: an earlier epoch's, sampled at T = 1."""
CARRIED = ("msgspec", "redis", "hiredis", "aiomqtt", "paho-mqtt", "fakeredis", "lupa", "amqtt", "math-verify")


def log(message: str) -> None:
    print(f"[gpu_check] {message}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", required=True, help="directory for the world, policies and the run")
    p.add_argument("--device", default="cuda", help="cuda (the check) or cpu (a rehearsal of the same code)")
    p.add_argument("--steps", type=int, default=3, help="RL steps in this process, and steps of the run")
    p.add_argument("--new-tokens", type=int, default=256, help="max new tokens per greedy request")
    p.add_argument("--deadline", type=float, default=0.0, help="epoch seconds by which to print (0: none)")
    p.add_argument("--no-run", action="store_true", help="skip the `tlt-stream run` phase")
    p.add_argument("--vllm", choices=["auto", "off"], default="auto", help="auto: the vLLM check when importable")
    p.add_argument("--world", help="the check world to use (built there when missing; default WORK/world)")
    p.add_argument("--world-only", action="store_true", help="build the world (on the CPU) and exit")
    return p.parse_args(argv)


def left(args: argparse.Namespace) -> float:
    return float("inf") if not args.deadline else args.deadline - time.time()


# ------------------------------------------------------------------------------------------------- shared


def build_world(world: Path, size: str = "check") -> None:
    """The tiny world, built in code on the CPU. `check`: the bootstrap recipe at a size chosen for the GPU
    checks (head_dim 32: vLLM's Triton attention takes head sizes >= 32; the `small` world's is 24), trained
    briefly; otherwise `tlt-stream bootstrap --size SIZE`."""
    from tlt_stream.tasks import bootstrap as boot

    def quiet(phase: str, done: int, total: int, metrics: dict[str, float]) -> None:
        return None

    if size != "check":
        boot.bootstrap(world, size=size)
        return
    settings = boot.BootstrapSettings(
        hidden_size=128,
        layers=2,
        heads=4,
        kv_heads=2,
        intermediate_size=256,
        sft_steps=150,
        sft_batch_tokens=4096,
        sft_lr=3e-3,
        drafter_samples=32,
        drafter_steps=80,
        drafter_lr=2e-3,
    )
    marker = world / "gpu_check_world.json"
    if marker.is_file() and (world / "policy").is_dir() and (world / "drafter").is_dir():
        return
    world.mkdir(parents=True, exist_ok=True)
    record = {"policy": boot.train_policy(settings, 0, world / "policy", quiet)}
    windows = boot.drafter_windows(world / "policy", settings, 0, quiet)
    record["drafter"] = boot.train_drafter(world / "policy", windows, settings, 0, world / "drafter", quiet)
    marker.write_text(json.dumps(record))


def world_prompts(world: Path, count: int, *, heldout: bool, seed: int) -> tuple[list[list[int]], list[str], int]:
    from transformers import AutoTokenizer

    from tlt_stream.tasks.repeated_add import RepeatedAddTask

    tokenizer = AutoTokenizer.from_pretrained(str(world / "policy"))
    problems = RepeatedAddTask().problems(count, seed, heldout=heldout)
    prompts = [tokenizer(p.prompt, add_special_tokens=False)["input_ids"] for p in problems]
    return prompts, [p.answer for p in problems], int(tokenizer.eos_token_id)


def synchronize(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def teacher_forced_logprobs(model: Any, prompt: list[int], tokens: list[int]) -> list[float]:
    """log softmax (T = 1) of `model` (this project's runtime) for each of `tokens` after `prompt`."""
    import torch

    sequence = prompt + tokens
    with torch.inference_mode():
        cache = model.new_cache(1, len(sequence))
        ids = torch.tensor([sequence[:-1]], device=model.device)
        hidden = model(ids, torch.arange(len(sequence) - 1, device=model.device)[None], cache)[0]
        logp = torch.log_softmax(model.logits(hidden).float(), dim=-1)[len(prompt) - 1 :]
        return logp.gather(1, torch.tensor(tokens, device=model.device)[:, None])[:, 0].tolist()


def logprob_error(policy: Path, results: list[Any], device: str) -> float:
    """Largest |an engine's greedy log-prob - `policy`'s, teacher forced| over the tokens of `results`."""
    import torch

    from tlt_stream.model import load_model

    model = load_model(policy, dtype=torch.float32, device=device)
    return max(
        abs(a - b)
        for r in results
        for a, b in zip(r.logprobs, teacher_forced_logprobs(model, r.prompt_ids, r.token_ids), strict=True)
    )


# ------------------------------------------------------------------------------------------------- phases


def engines(policy: Any, drafter: Any, max_len: int, batch: int, graphs: str | None = None) -> dict[str, Any]:
    from tlt_stream.rollout.arms import Arm
    from tlt_stream.rollout.engine import GenerationEngine
    from tlt_stream.rollout.proposers import EagleProposer

    built = {"plain": GenerationEngine(policy, batch, max_len, graphs=graphs)}
    for name, arm in ARMS.items():
        built[name] = GenerationEngine(
            policy,
            batch,
            max_len,
            proposer=EagleProposer(drafter),
            arm=Arm.drafter(*arm),
            max_draft_nodes=32,
            graphs=graphs,
        )
    return built


def group_engine(
    policy: Any, drafter: Any, max_len: int, batch: int, label: str, history: dict, graphs: str | None = None
) -> Any:
    """An engine drafting with `label` from a new group index that holds `history` (prompt -> responses)."""
    from tlt_stream.rollout.arms import Arm
    from tlt_stream.rollout.engine import GenerationEngine
    from tlt_stream.rollout.proposers import EagleProposer, GroupProposer, MixedProposer

    group = GroupProposer()
    for prompt, responses in history.items():
        for response in responses:
            group.remember(prompt, response)
    arm = Arm.from_label(label)
    proposer = group if arm.kind == "group" else MixedProposer(EagleProposer(drafter), group)
    return GenerationEngine(policy, batch, max_len, proposer=proposer, arm=arm, max_draft_nodes=32, graphs=graphs)


GRAPH_COUNTS = {
    "capture_s": "capture_seconds",
    "captures": "captures",
    "replays": "replays",
    "eager_calls": "eager",
    "dropped": "dropped",
    "failed": "failed",
}
"""The `graphs` figures per timed run (JSON key: `ForwardGraphs` counter)."""


def graph_counts(engine: Any) -> list[float]:
    """An engine's `GRAPH_COUNTS` so far (zeros without graphs)."""
    return [getattr(engine.graphs, attr) if engine.graphs is not None else 0 for attr in GRAPH_COUNTS.values()]


def timed(engine: Any, prompts: list[list[int]], n: int, eos: int, device: str) -> tuple[float, list[Any]]:
    synchronize(device)
    start = time.perf_counter()
    out = engine.generate(prompts, n, 0.0, eos_ids=[eos])
    synchronize(device)
    return time.perf_counter() - start, out


def phase_greedy(args: argparse.Namespace, world: Path, dtype_name: str) -> dict[str, Any]:
    """Greedy outputs of plain and SD engines at batch 32 and 1 (identical, SD being lossless), their tokens/s
    and mean accept lengths, in one dtype."""
    import torch

    from tlt_stream.drafter.model import load_drafter
    from tlt_stream.model import load_model

    dtype = getattr(torch, dtype_name)
    prompts, _, eos = world_prompts(world, BATCH, heldout=True, seed=7)
    policy = load_model(world / "policy", dtype=dtype, device=args.device)
    drafter = load_drafter(world / "drafter", policy)
    max_len = max(len(p) for p in prompts) + args.new_tokens
    backend = "cuda" if args.device.startswith("cuda") else "trace"  # trace: the CPU rehearsal's stand-in
    built = engines(policy, drafter, max_len, BATCH)
    built |= {f"{name}+graphs": engine for name, engine in engines(policy, drafter, max_len, BATCH, backend).items()}
    # An earlier epoch's responses to the same prompts, for the group/history source (sampled, not greedy: the
    # greedy output itself would be a perfect draft).
    repeated = [p for p in prompts for _ in range(HISTORY)]
    sampled = built["plain"].generate(repeated, args.new_tokens, 1.0, seed=11, eos_ids=[eos])
    history: dict[tuple[int, ...], list[list[int]]] = {}
    for prompt, result in zip(repeated, sampled, strict=True):
        history.setdefault(tuple(prompt), []).append(result.token_ids)
    out: dict[str, Any] = {"tokens_per_s": {}, "mean_accept_length": {}, "acceptance_by_source": {}, "graphs": {}}
    outputs: dict[str, dict[str, list[list[int]]]] = {}
    logprobs: dict[str, list[list[float]]] = {}

    def first_difference(a: list[int], b: list[int]) -> int:
        return next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))

    group_names = [*GROUP_ARMS, *(f"{name}+graphs" for name in GROUP_ARMS)]
    for name in [*built, *group_names]:
        # Group arms: a new index (the history only) for each timed run, so no run drafts from an earlier
        # run's output of the same prompt. "+graphs": the same engine replaying captured forwards
        # (`model.graphs`; CUDA graphs on CUDA); tokens/s "steady" leaves out the seconds spent capturing.
        def fresh(batch: int, name: str = name) -> Any:
            if name in built:
                return built[name]
            arm = GROUP_ARMS[name.removesuffix("+graphs")]
            graphs = backend if name.endswith("+graphs") else None
            return group_engine(policy, drafter, max_len, batch, arm, history, graphs)

        fresh(BATCH).generate(prompts[:2], 8, 0.0, eos_ids=[eos])  # warm-up: allocation, kernels, autotuning
        counted = (fresh(BATCH), fresh(1))  # the batch-32 run's engine and the batch-1 runs'

        before32 = graph_counts(counted[0])  # the two may be one engine: each run's own share is a difference
        wall32, batched = timed(counted[0], prompts, args.new_tokens, eos, args.device)
        after32, before1 = graph_counts(counted[0]), graph_counts(counted[1])
        wall1, single, tokens1 = 0.0, [], 0
        for prompt in prompts[:SINGLE]:
            wall, (result,) = timed(counted[1], [prompt], args.new_tokens, eos, args.device)
            wall1, tokens1 = wall1 + wall, tokens1 + len(result.token_ids)
            single.append(result)
        after1 = graph_counts(counted[1])
        shares = [
            [b - a for a, b in zip(start, end, strict=True)] for start, end in ((before32, after32), (before1, after1))
        ]
        if name.removesuffix("+graphs") in GROUP_ARMS:
            out["acceptance_by_source"][name] = {
                source: round(sum(e.accepted_by[source] for e in counted) / drafted, 3)
                for source in ("eagle", "group")
                if (drafted := sum(e.drafted_by[source] for e in counted))
            }
        tokens32 = sum(len(r.token_ids) for r in batched)
        out["tokens_per_s"][name] = {"batch_1": round(tokens1 / wall1, 1), "batch_32": round(tokens32 / wall32, 1)}
        if counted[0].graphs is not None:  # per run [batch 32, batch 1]: capture seconds, captures, replays, eager
            out["tokens_per_s"][name] |= {
                "batch_1_steady": round(tokens1 / max(wall1 - shares[1][0], 1e-9), 1),
                "batch_32_steady": round(tokens32 / max(wall32 - shares[0][0], 1e-9), 1),
            }
            out["graphs"][name] = {
                field: [round(share[i], 3) for share in shares] for i, field in enumerate(GRAPH_COUNTS)
            }
        rounds = [a for r in [*batched, *single] for a in r.accept_lengths]
        out["mean_accept_length"][name] = round(sum(rounds) / len(rounds), 3) if rounds else None
        outputs[name] = {"batch_32": [r.token_ids for r in batched], "batch_1": [r.token_ids for r in single]}
        logprobs[name] = [r.logprobs for r in [*batched, *single]]
        if name.endswith("+graphs"):  # the graphs' numerics against the same arm eager, over the shared prefixes
            eager = name.removesuffix("+graphs")
            same = [*outputs[eager]["batch_32"], *outputs[eager]["batch_1"]]
            mine = [*outputs[name]["batch_32"], *outputs[name]["batch_1"]]
            diffs = [
                abs(x - y)
                for a, b, la, lb in zip(same, mine, logprobs[eager], logprobs[name], strict=True)
                for (x, y), _ in zip(zip(la, lb, strict=False), range(first_difference(a, b)), strict=False)
            ]
            out["graphs"][name]["max_logprob_diff_vs_eager"] = round(max(diffs, default=0.0), 6)
    plain = outputs["plain"]
    mismatched = {
        f"{name}/{size}": [i for i, (a, b) in enumerate(zip(plain[size], got[size], strict=True)) if a != b]
        for name, got in outputs.items()
        if name != "plain"
        for size in ("batch_32", "batch_1")
    }
    out["identical"] = not any(mismatched.values())
    out["compared_rows"] = sum(len(rows) for got in outputs.values() for rows in got.values()) - BATCH - SINGLE
    out["mismatched_rows"] = {k: v for k, v in mismatched.items() if v}

    out["first_divergence"] = {  # token position of the first difference, per mismatched row
        key: {i: first_difference(plain[key.split("/")[1]][i], outputs[key.split("/")[0]][key.split("/")[1]][i])
              for i in rows}
        for key, rows in out["mismatched_rows"].items()
    }  # fmt: skip
    out["tokens"] = sum(len(r) for r in plain["batch_32"])
    return out


def one_rank_link(device: str, work: Path) -> Any:
    """A process group of one rank (NCCL on CUDA, gloo on the CPU) and its `RankLink`: the sharded learner's
    code path (FSDP2, `rl/sharded.py`) on a single device."""
    import torch
    import torch.distributed as dist

    from tlt_stream.rl.ranks import RankLink

    on_cuda = device.startswith("cuda")
    if not dist.is_initialized():
        dist.init_process_group(
            "nccl" if on_cuda else "gloo", init_method=f"file://{work / 'process-group'}", rank=0, world_size=1
        )
    return RankLink(rank=0, world=1, device=torch.device("cuda", 0) if on_cuda else torch.device("cpu"))


def rl_steps(args: argparse.Namespace, world: Path) -> dict[str, Any]:
    """`--steps` RL steps: SD rollouts at T = 1 on the device, a GRPO update by the sharded learner (FSDP2 over
    one rank: fp32 masters, bf16 compute on CUDA), its checkpoint loaded into the engine in place."""
    import torch
    from transformers import AutoTokenizer

    from tlt_stream.basics.messages import PromptGroup
    from tlt_stream.drafter.model import load_drafter
    from tlt_stream.model import load_model
    from tlt_stream.rl.groups import ReadyGroup
    from tlt_stream.rl.learner import LearnerSettings
    from tlt_stream.rl.samples import make_sample
    from tlt_stream.rl.sharded import Trainer
    from tlt_stream.rollout.arms import Arm
    from tlt_stream.rollout.engine import GenerationEngine
    from tlt_stream.rollout.proposers import EagleProposer
    from tlt_stream.tasks.repeated_add import reward

    work = Path(args.work)
    tokenizer = AutoTokenizer.from_pretrained(str(world / "policy"))
    policy = load_model(world / "policy", dtype=torch.float32, device=args.device)
    proposer = EagleProposer(load_drafter(world / "drafter", policy))
    engine = GenerationEngine(policy, BATCH, 1408, proposer=proposer, arm=Arm.drafter(*ARMS["chain"]))
    trainer = Trainer(LearnerSettings(lr=1e-3), args.device, one_rank_link(args.device, work))
    core = trainer.build(world / "policy")
    sharded = type(core.model).__name__  # FSDP2 wraps the class: FSDP<name>
    check_prompts, _, eos = world_prompts(world, 4, heldout=True, seed=7)
    steps, previous, ledger = [], world / "policy", set()
    for step in range(1, args.steps + 1):
        if left(args) < 90:
            log(f"RL steps stopped at {step - 1}: under 90 s left")
            break
        train, answers, _ = world_prompts(world, 4, heldout=False, seed=100 + step)
        group_size = 8
        t0 = time.perf_counter()
        rows = [p for p in train for _ in range(group_size)]
        results = engine.generate(rows, 256, 1.0, seed=1000 * step, eos_ids=[eos])
        synchronize(args.device)
        generate_s = time.perf_counter() - t0
        groups = []
        for g, (prompt, answer) in enumerate(zip(train, answers, strict=True)):
            group = PromptGroup(
                task_id=f"s{step}/p{g}", prompt_id=f"p{g}", prompt_ids=prompt, answer=answer, group_size=group_size
            )
            samples = [
                make_sample(
                    r,
                    group,
                    i,
                    # a length tie-breaker keeps groups from being degenerate, so every step changes the weights
                    reward=reward(tokenizer.decode(r.token_ids, skip_special_tokens=True), answer)
                    - 1e-3 * len(r.token_ids),
                    policy_version=step - 1,
                    drafter_version=0,
                    worker_id="gpu-check",
                    gen_seconds=generate_s,
                )
                for i, r in enumerate(results[g * group_size : (g + 1) * group_size])
            ]
            ledger |= {s.sample_id for s in samples}
            groups.append(ReadyGroup(group.task_id, samples, []))
        synchronize(args.device)
        t0 = time.perf_counter()
        metrics = core.step(groups)
        synchronize(args.device)
        learn_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        info = trainer.save(work / "checkpoints", step=step, ledger=ledger, extra={}, tokenizer=tokenizer, keep=2,
                            publish_dtype=torch.float32)  # fmt: skip
        save_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        engine.load_policy(info.policy_dir)
        reload_s = time.perf_counter() - t0
        check = engine.generate(check_prompts, 64, 0.0, eos_ids=[eos])
        rounds = [a for r in results for a in r.accept_lengths]
        steps.append(
            {
                "step": step,
                "reward_mean": round(metrics["reward_mean"], 4),
                "approx_kl_old": metrics.get("approx_kl_old"),
                "logprob_mismatch_max": metrics.get("logprob_mismatch_max"),
                "grad_norm": metrics.get("grad_norm"),
                "samples": len(results),
                "tokens": sum(len(r.token_ids) for r in results),
                "generate_s": round(generate_s, 3),
                "learn_s": round(learn_s, 3),
                "save_s": round(save_s, 3),
                "reload_s": round(reload_s, 3),
                "mean_accept_length": round(sum(rounds) / len(rounds), 3) if rounds else None,
                "reload_logprob_err_new": logprob_error(info.policy_dir, check, args.device),
                "reload_logprob_err_old": logprob_error(previous, check, args.device),
            }
        )
        previous = info.policy_dir
    trainer.stop()
    reloaded = all(s["reload_logprob_err_new"] < 1e-3 < s["reload_logprob_err_old"] for s in steps)
    peak = torch.cuda.max_memory_allocated() / 2**20 if args.device.startswith("cuda") else None
    return {
        "learner": f"FSDP2 over one rank (rl/sharded.py Trainer, {sharded})",
        "steps": steps,
        "reload_ok": bool(steps) and reloaded,
        "peak_cuda_mib": round(peak, 1) if peak is not None else None,
    }


def phase_run(args: argparse.Namespace, world: Path) -> dict[str, Any]:
    """`tlt-stream run` on the world: embedded servers, the policy service, a worker and the learner as processes
    on the device (one GPU: shared), a few steps; read back from the run directory it leaves."""
    out = Path(args.work) / "run"
    line = [
        sys.executable,
        "-m",
        "tlt_stream.commands.cli",
        "run",
        "--world",
        str(world),
        "--out",
        str(out),
        "--run",
        "gpucheck",
    ]
    line += ["--steps", str(args.steps), "--eval", "16", "--device", args.device, "--prompts-per-step", "4"]
    line += ["--group-size", "8", "--max-len", "512"]
    budget = max(30.0, left(args) - 60) if args.deadline else None
    start = time.perf_counter()
    logfile = Path(args.work) / "run.log"
    with logfile.open("w") as log_out:
        try:
            done = subprocess.run(line, stdout=log_out, stderr=subprocess.STDOUT, timeout=budget, check=False)
            code: int | None = done.returncode
        except subprocess.TimeoutExpired:
            code = None
    text = logfile.read_text(errors="replace")
    metrics = out / "metrics.jsonl"
    rows = [json.loads(r) for r in metrics.read_text().splitlines() if r.strip()] if metrics.is_file() else []
    evals = out / "eval.jsonl"
    return {
        "exit_code": code,
        "timed_out": code is None,
        "seconds": round(time.perf_counter() - start, 1),
        "steps_done": len(rows),
        "reward_mean": [round(r["reward_mean"], 4) for r in rows],
        "learn_seconds": [round(r["learn_seconds"], 3) for r in rows],
        "rollout_tokens_per_s": [round(r.get("rollout_tokens_per_s", 0.0), 1) for r in rows],
        "placement": next(
            (s.split("GPUs (CUDA_VISIBLE_DEVICES): ", 1)[1] for s in text.splitlines() if "GPUs (CUDA" in s), None
        ),
        "evals": [json.loads(r) for r in evals.read_text().splitlines()] if evals.is_file() else [],
        "log_tail": text.splitlines()[-8:] if code != 0 else [],
    }


def phase_vllm(args: argparse.Namespace) -> dict[str, Any]:
    if args.vllm == "off" or importlib.util.find_spec("vllm") is None:
        return {
            "verified": False,
            "reason": "vLLM is not installed here: its wheel and CUDA libraries (GBs) are far over the 64 MiB a "
            "device check carries, so the vLLM rollout backend stays unverified (bench/vllm_cpu_check.sh checks "
            "what needs no GPU)",
        }
    work = Path(args.work) / "vllm"
    line = [sys.executable, "-m", "bench.gpu_check_vllm", "--work", str(work), "--deadline", str(args.deadline)]
    try:
        done = subprocess.run(line, capture_output=True, text=True, timeout=max(30.0, left(args) - 10), check=False)
    except subprocess.TimeoutExpired:
        return {"verified": False, "reason": "the vLLM check ran out of time"}
    found = [s for s in done.stdout.splitlines() if s.startswith("{")]
    return (
        json.loads(found[-1])
        if found
        else {"verified": False, "reason": f"exit {done.returncode}", "stderr": done.stderr[-2000:]}
    )


def guarded(name: str, fn: Any, *fn_args: Any) -> tuple[dict[str, Any], float]:
    """A phase's record (or its error) and its seconds: one failing phase must not cost the others' figures."""
    log(f"phase {name}")
    start = time.perf_counter()
    try:
        record = fn(*fn_args)
    except Exception as exc:  # the JSON says what broke; the traceback goes to the log
        import traceback

        traceback.print_exc()
        record = {"error": f"{type(exc).__name__}: {exc}"}
    return record, round(time.perf_counter() - start, 1)


def machine(device: str) -> dict[str, Any]:
    import platform

    import torch

    info: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    info["device"] = torch.cuda.get_device_name(0) if device.startswith("cuda") else platform.processor() or "cpu"
    info["cpus"] = os.cpu_count()
    info["carried"] = os.environ.get("TLT_GPU_CHECK_CARRIED")  # set by gpu_check.sh
    for name in ("transformers", *CARRIED):
        try:
            info[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            info[name] = None
    return info


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    world = Path(args.world) if args.world else work / "world"
    torch.set_num_threads(max(1, min(16, os.cpu_count() or 1)))
    if args.world_only:
        build_world(world)
        return 0
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(json.dumps({"check": "gpu", "ok": False, "error": f"torch {torch.__version__} sees no CUDA device"}))
        return 3
    result: dict[str, Any] = {"check": "gpu", "machine": machine(args.device), "seconds": {}}
    built, result["seconds"]["world"] = guarded("world", build_world, world)
    if built is not None:  # an error record: without a world nothing else can run
        print(json.dumps({**result, "world": built, "ok": False}))
        return 0
    for dtype in ("float32", "bfloat16"):
        result[f"greedy_{dtype}"], result["seconds"][f"greedy_{dtype}"] = guarded(
            f"greedy {dtype}", phase_greedy, args, world, dtype
        )
    result["rl"], result["seconds"]["rl"] = guarded("rl", rl_steps, args, world)
    if not args.no_run:
        result["run"], result["seconds"]["run"] = guarded("run", phase_run, args, world)
    result["vllm"], result["seconds"]["vllm"] = guarded("vllm", phase_vllm, args)
    run = result.get("run", {})
    result["ok"] = bool(
        result["greedy_float32"].get("identical")
        and result["rl"].get("reload_ok")
        and (args.no_run or (run.get("exit_code") == 0 and run.get("steps_done") == args.steps))
    )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
