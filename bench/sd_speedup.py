"""Speculative decoding on a policy that has learned something: the bootstrapped policy and its drafter.

For batch sizes 1..32, in one run: plain decoding tokens/s and SD tokens/s for a small sweep of arms
(chains and trees), with the mean acceptance length (tokens emitted per target forward) per arm; the best
arm per batch and the crossover batch size above which SD loses. Plain and SD alternate rep by rep on the
same prompts and the speedup is the median of the per-rep ratios (this machine's speed drifts by 20-50%
between minutes, more than the effects measured). Prompts are long held-out problems and
every row generates the same number of tokens, so the batch stays full for the whole measurement. At
batch 1 it also times transformers' own prompt-lookup decoding on the same policy (the peer a user would
reach for), and the per-call costs (target forward for 1 and k tokens, one drafter step) and the ceiling
they imply at the measured acceptance. Prints progress to stderr and one JSON object to stdout.

    python -m bench.sd_speedup [--quick] [--world DIR] [--temperature 1.0]
    python -m bench.sd_speedup --only-group [--eagle-arm d6k1v6]   # EAGLE vs group vs both at batch 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ARMS_FULL = [(2, 1, 2), (4, 1, 4), (6, 1, 6), (8, 1, 8), (4, 2, 8), (6, 2, 12), (6, 4, 16), (8, 4, 24)]
ARMS_QUICK = [(4, 1, 4), (6, 1, 6), (6, 2, 12)]


def log(message: str) -> None:
    print(f"[sd_speedup] {message}", file=sys.stderr, flush=True)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer batches, arms and tokens (under a minute)")
    p.add_argument("--world", default="artifacts/world", help="bootstrap directory (built if missing)")
    p.add_argument("--size", default="default", choices=["small", "default"], help="bootstrap size if building")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (RL rollouts use 1.0)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--only-group",
        action="store_true",
        help="only the group/history section at batch 1 (EAGLE's arm from --eagle-arm, no sweep)",
    )
    p.add_argument("--eagle-arm", default="d6k1v6", help="EAGLE's arm in the group section with --only-group")
    args = p.parse_args()
    args.batches = [1, 4, 16] if args.quick else [1, 2, 4, 8, 16, 32]
    args.arms = ARMS_QUICK if args.quick else ARMS_FULL
    args.new_tokens = 96 if args.quick else 256
    args.reps = 1 if args.quick else 3
    return args


def timed(fn, *args, **kwargs) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return time.perf_counter() - t0, out


def main() -> None:
    args = parse_args()
    import torch

    from tlt_stream.drafter.model import load_drafter
    from tlt_stream.model import load_model
    from tlt_stream.rollout.arms import Arm
    from tlt_stream.rollout.engine import GenerationEngine
    from tlt_stream.rollout.proposers import EagleProposer, NgramProposer
    from tlt_stream.tasks.bootstrap import bootstrap
    from tlt_stream.tasks.evaluate import evaluate
    from tlt_stream.tasks.repeated_add import RepeatedAddTask
    from tlt_stream.tasks.tokenizer import build_tokenizer

    torch.set_num_threads(args.threads)
    world = Path(args.world)
    log(f"world {world} (bootstrapping if needed)")
    record = bootstrap(world, seed=args.seed, size=args.size)
    policy = load_model(world / "policy")
    drafter = load_drafter(world / "drafter", policy)
    tokenizer = build_tokenizer()
    task = RepeatedAddTask()
    long_problems = [p for p in task.problems(2000, args.seed + 7, heldout=True) if p.steps >= 12]
    prompts = [tokenizer(p.prompt, add_special_tokens=False)["input_ids"] for p in long_problems]
    n = args.new_tokens
    max_len = max(len(p) for p in prompts) + n
    if args.only_group:
        log(f"group and history drafts at batch 1 only (EAGLE arm {args.eagle_arm})")
        fake = {"batches": {"1": {"best_arm": args.eagle_arm}}}
        section = group_sources(torch, policy, drafter, prompts, tokenizer, fake, args)
        print(json.dumps({"benchmark": "sd_speedup", "section": "group_sources", "quick": args.quick,
                          "temperature": args.temperature, "new_tokens": n, "reps": args.reps,
                          "group_sources": section}))  # fmt: skip
        return

    def engine_for(batch: int, arm: tuple[int, int, int] | None, proposer_kind: str = "eagle") -> Any:
        proposer = None
        if arm is not None:
            proposer = EagleProposer(drafter) if proposer_kind == "eagle" else NgramProposer()
        return GenerationEngine(
            policy, batch, max_len, proposer=proposer, arm=Arm.drafter(*arm) if arm else None, max_draft_nodes=32
        )

    def once(engine: Any, batch: int, rep: int) -> tuple[float, int, list[int]]:
        chosen = prompts[rep * batch : (rep + 1) * batch] or prompts[:batch]
        wall, out = timed(engine.generate, chosen, n, args.temperature, seed=args.seed + rep)  # no EOS stop
        return wall, sum(len(r.token_ids) for r in out), [a for r in out for a in r.accept_lengths]

    def versus_plain(batch: int, arm: tuple[int, int, int], proposer_kind: str = "eagle") -> dict[str, Any]:
        """Plain and SD on the same prompts, alternating rep by rep; the speedup is the median of the
        per-rep time ratios, so a noisy stretch of the machine hits both sides of a ratio."""
        plain_engine, sd_engine = engine_for(batch, None), engine_for(batch, arm, proposer_kind)
        ratios, plain_rates, sd_rates, accepts = [], [], [], []
        for rep in range(args.reps):
            plain_wall, tokens, _ = once(plain_engine, batch, rep)
            sd_wall, _, rounds = once(sd_engine, batch, rep)
            ratios.append(plain_wall / sd_wall)
            plain_rates.append(tokens / plain_wall)
            sd_rates.append(tokens / sd_wall)
            accepts += rounds
        return {
            "tok_s": round(statistics.median(sd_rates), 1),
            "plain_tok_s": round(statistics.median(plain_rates), 1),
            "speedup": round(statistics.median(ratios), 3),
            "mean_accept_length": round(statistics.fmean(accepts), 3) if accepts else 1.0,
        }

    results: dict[str, Any] = {"batches": {}}
    for batch in args.batches:
        entry: dict[str, Any] = {"arms": {}}
        for arm in args.arms:
            label = Arm.drafter(*arm).label
            entry["arms"][label] = versus_plain(batch, arm)
            log(f"batch {batch}: {label} {entry['arms'][label]}")
        entry["plain_tok_s"] = statistics.median(a["plain_tok_s"] for a in entry["arms"].values())
        best = max(entry["arms"], key=lambda k: entry["arms"][k]["speedup"])
        entry["best_arm"] = best
        entry["best_speedup"] = entry["arms"][best]["speedup"]
        if batch == 1:
            entry["ngram_d6_speedup"] = versus_plain(1, (6, 1, 6), "ngram")["speedup"]
        results["batches"][str(batch)] = entry

    # The crossover: the smallest batch from which SD loses at every larger batch measured (one noisy
    # point below 1.0 between two wins is not a crossover).
    losing = [b for b in args.batches if results["batches"][str(b)]["best_speedup"] < 1.0]
    results["batches_where_sd_loses"] = losing
    crossover = None
    for b in reversed(args.batches):
        if b not in losing:
            break
        crossover = b
    results["crossover_batch"] = crossover
    results["speedup_at_batch_1"] = results["batches"]["1"]["best_speedup"]

    log("group and history drafts at batch 1 (the tail of a group)")
    results["group_sources"] = group_sources(torch, policy, drafter, prompts, tokenizer, results, args)
    log("per-call costs at batch 1")
    results["costs_ms"], results["ceiling"] = per_call_costs(torch, policy, drafter, prompts[0], results, args)
    log("transformers prompt lookup at batch 1")
    results["hf_prompt_lookup"] = hf_prompt_lookup(torch, world, prompts[:2], n)
    log("rollout share of a synchronous RL step")
    results["rl_step"] = rl_step_share(torch, world, policy, tokenizer, task, args)
    log("long tail and accuracy of the policy")
    report = evaluate(world / "policy", n=100 if args.quick else 300, temperature=1.0, seed=args.seed)
    results["policy"] = {
        "accuracy_T1": report["accuracy"],
        "length": report["length"],
        "truncated": report["truncated"],
    }
    results.update(
        benchmark="sd_speedup",
        quick=args.quick,
        temperature=args.temperature,
        new_tokens=n,
        world={"dir": str(world), "size": record["size"], "seed": record["seed"]},
        goal={"speedup_at_batch_1": 2.0, "aim": 2.5},
        machine={"cpus": os.cpu_count(), "threads": args.threads, "torch": torch.__version__},
    )
    print(json.dumps(results))


def group_sources(torch, policy, drafter, prompts: list[list[int]], tokenizer, results: dict, args) -> dict:
    """The last response of a group at batch 1, its G - 1 siblings finished: plain decoding against EAGLE
    alone, the group/history source alone and both merged in one tree, per prompt and rep alternating (the
    speedup is the median of per-run time ratios), with tokens per round and each source's acceptance.

    Two workloads: `natural`, siblings sampled like the row (T = 1; the tiny world's siblings share their
    step count, so they agree a lot), and `differ`, siblings sampled at T = 1.6, which disagree with each
    other and with the row, so the figure says what the source does and not only how deterministic the task
    is. Responses stop at EOS; rates are response tokens over wall time. `oracle` is the machinery's
    ceiling at T = 0: a proposer that always knows the greedy continuation (depth 8 chain)."""
    from tlt_stream.rollout.arms import Arm
    from tlt_stream.rollout.engine import GenerationEngine
    from tlt_stream.rollout.proposers import EagleProposer, GroupProposer, MixedProposer, OracleProposer

    group_size, n = 8, args.new_tokens
    chosen = prompts[: 3 if args.quick else 8]
    eos = [tokenizer.eos_token_id]
    max_len = max(len(p) for p in chosen) + n
    eagle_label = results["batches"]["1"]["best_arm"]
    e = Arm.from_label(eagle_label)
    arms = {
        "plain": None,
        "eagle": e,
        "group": Arm.group_source(12, 12),
        "group_tree": Arm.group_source(8, 20),
        "mixed": Arm.mixed(e.depth, max(2, e.topk), max(e.verify, 4), 12),
        "either": Arm.either(e.depth, 12),
    }
    out: dict[str, Any] = {}
    for workload, sibling_t in (("natural", 1.0), ("differ", 1.6)):
        siblings_engine = GenerationEngine(policy, group_size - 1, max_len)
        histories = []
        for i, prompt in enumerate(chosen):
            done = siblings_engine.generate([prompt] * (group_size - 1), n, sibling_t, seed=10_000 + i, eos_ids=eos)
            histories.append([r.token_ids for r in done])
        rates: dict[str, list[float]] = {name: [] for name in arms}
        ratios: dict[str, list[float]] = {name: [] for name in arms if name != "plain"}
        accepts: dict[str, list[float]] = {name: [] for name in arms}
        sources: dict[str, dict[str, list[int]]] = {}
        for rep in range(args.reps):
            for i, prompt in enumerate(chosen):
                walls: dict[str, float] = {}
                for name, arm in arms.items():
                    group = GroupProposer()
                    for response in histories[i]:
                        group.remember(prompt, response)
                    proposer = {
                        "plain": None,
                        "eagle": EagleProposer(drafter),
                        "group": group,
                        "group_tree": group,
                        "mixed": MixedProposer(EagleProposer(drafter), group),
                        "either": MixedProposer(EagleProposer(drafter), group),
                    }[name]
                    engine = GenerationEngine(policy, 1, max_len, proposer=proposer, arm=arm, max_draft_nodes=32)
                    wall, (result,) = timed(engine.generate, [prompt], n, args.temperature, seed=rep, eos_ids=eos)
                    walls[name] = wall
                    rates[name].append(len(result.token_ids) / wall)
                    if arm is not None:
                        accepts[name].append(len(result.token_ids) / max(1, engine.rounds + engine.plain_steps))
                        mine = sources.setdefault(name, {"drafted": [0, 0], "accepted": [0, 0]})
                        for j, source in enumerate(("eagle", "group")):
                            mine["drafted"][j] += engine.drafted_by[source]
                            mine["accepted"][j] += engine.accepted_by[source]
                for name in ratios:  # tokens/s ratio: the rows' lengths differ between runs at T > 0
                    ratios[name].append(rates[name][-1] / rates["plain"][-1])
        entry = {}
        for name in arms:
            row: dict[str, Any] = {
                "arm": arms[name].label if arms[name] else "plain",
                "tok_s": round(statistics.median(rates[name]), 1),
            }
            if name != "plain":
                row["speedup"] = round(statistics.median(ratios[name]), 3)
                row["tokens_per_round"] = round(statistics.median(accepts[name]), 3)
                drafted, accepted = sources[name]["drafted"], sources[name]["accepted"]
                row["acceptance_by_source"] = {
                    source: round(accepted[j] / drafted[j], 3) if drafted[j] else None
                    for j, source in enumerate(("eagle", "group"))
                }
            entry[name] = row
            log(f"group sources, {workload}: {name} {row}")
        out[workload] = entry

    # The ceiling of the round's machinery: an always-right chain at T = 0.
    references = {}
    plain = GenerationEngine(policy, 1, max_len)
    for prompt in chosen[:2]:
        (r,) = plain.generate([prompt], n, 0.0)
        references[tuple(prompt[1:])] = r.token_ids
    walls = {"plain": [], "oracle": []}
    for _ in range(max(1, args.reps)):
        for prompt in chosen[:2]:
            walls["plain"].append(timed(plain.generate, [prompt], n, 0.0)[0])
            engine = GenerationEngine(
                policy,
                1,
                max_len,
                proposer=OracleProposer(references, policy.spec.vocab_size),
                arm=Arm.drafter(8, 1, 8),
            )
            walls["oracle"].append(timed(engine.generate, [prompt], n, 0.0)[0])
    out["oracle_T0_depth8"] = {
        "speedup": round(statistics.median(p / o for p, o in zip(walls["plain"], walls["oracle"], strict=True)), 3),
        "tokens_per_round": 9.0,
    }
    log(f"group sources: oracle {out['oracle_T0_depth8']}")
    out["goal_speedup_at_batch_1"] = 2.5
    return out


def per_call_costs(torch, policy, drafter, prompt: list[int], results: dict, args) -> tuple[dict, dict]:
    """Median times of the pieces of a round at batch 1, and the speedup ceiling they imply."""
    context = len(prompt) + args.new_tokens // 2
    reps = 30

    def forward(k: int) -> float:
        cache = policy.new_cache(1, context + k + 1)
        cache.lengths.fill_(context)
        ids = torch.zeros(1, k, dtype=torch.long)
        positions = (context + torch.arange(k))[None]
        mask = torch.ones(k, k, dtype=torch.bool).tril()[None]
        with torch.inference_mode():
            policy.logits(policy(ids, positions, cache, tree_mask=mask))
            return statistics.median(
                timed(lambda: policy.logits(policy(ids, positions, cache, tree_mask=mask)))[0] for _ in range(reps)
            )

    def drafter_step() -> float:
        cache = drafter.new_cache(1, context + 4)
        cache.lengths.fill_(context)
        token = torch.zeros(1, 1, dtype=torch.long)
        feature = torch.zeros(1, 1, policy.spec.hidden_size)
        positions = torch.full((1, 1), context)
        with torch.inference_mode():
            return statistics.median(
                timed(lambda: drafter.logits(drafter(token, feature, positions, cache)))[0] for _ in range(reps)
            )

    best = results["batches"]["1"]["best_arm"]
    arm = results["batches"]["1"]["arms"][best]
    depth = int(best.split("k")[0][1:])
    verify = int(best.split("v")[1])
    costs = {"target_1": forward(1) * 1e3, f"target_{verify + 1}": forward(verify + 1) * 1e3}
    costs["drafter_step"] = drafter_step() * 1e3
    plain_step = costs["target_1"]
    round_ideal = costs[f"target_{verify + 1}"] + depth * costs["drafter_step"]
    measured_round = arm["mean_accept_length"] / (arm["tok_s"] / 1e3)  # ms per round at the measured rate
    costs["rest_of_round"] = max(0.0, measured_round - round_ideal)
    ceiling = {
        "arm": best,
        "mean_accept_length": arm["mean_accept_length"],
        "speedup_ceiling": arm["mean_accept_length"] * plain_step / round_ideal,
        "speedup_measured": arm["speedup"],
    }
    return {k: round(v, 3) for k, v in costs.items()}, ceiling


def rl_step_share(torch, world: Path, policy, tokenizer, task, args) -> dict[str, Any]:
    """Rollout's share of one synchronous GRPO step with the default settings.

    Rollout: 8 training prompts x 8 samples at T=1 with EOS stops, plain decoding at batch 64 (the batch
    waits for its longest sample, as in a synchronous step). Learning: the learner's own update
    (`LearnerCore.step`, default settings) over exactly those scored samples; groups whose rewards are all
    equal carry no signal and are left out, as the learner does.
    """
    from transformers import AutoModelForCausalLM

    from tlt_stream.basics.messages import PromptGroup
    from tlt_stream.rl.groups import ReadyGroup
    from tlt_stream.rl.learner import LearnerCore, LearnerSettings
    from tlt_stream.rl.samples import make_sample
    from tlt_stream.rollout.engine import GenerationEngine
    from tlt_stream.tasks.repeated_add import reward

    group, prompts_per_step = 8, 2 if args.quick else 8
    problems = task.problems(prompts_per_step, args.seed + 11, heldout=False)
    prompts = [tokenizer(p.prompt, add_special_tokens=False)["input_ids"] for p in problems for _ in range(group)]
    budget = policy.spec.max_position_embeddings - max(len(p) for p in prompts)
    engine = GenerationEngine(policy, len(prompts), policy.spec.max_position_embeddings)
    rollout_s, results = timed(engine.generate, prompts, budget, 1.0, seed=args.seed, eos_ids=[tokenizer.eos_token_id])
    groups = []
    for i, problem in enumerate(problems):
        chunk = results[i * group : (i + 1) * group]
        task = PromptGroup(
            task_id=f"t{i}",
            prompt_id=problem.prompt_id,
            prompt_ids=chunk[0].prompt_ids,
            answer=problem.answer,
            group_size=group,
        )
        samples = [
            make_sample(
                r,
                task,
                g,
                reward=reward(tokenizer.decode(r.token_ids, skip_special_tokens=True), problem.answer),
                policy_version=0,
                drafter_version=-1,
                worker_id="bench",
                gen_seconds=0.0,
            )
            for g, r in enumerate(chunk)
        ]
        groups.append(ReadyGroup(f"t{i}", samples, []))
    core = LearnerCore(AutoModelForCausalLM.from_pretrained(world / "policy"), LearnerSettings())
    train_s, metrics = timed(core.step, groups)
    lengths = [len(r.token_ids) for r in results]
    return {
        "samples": len(prompts),
        "response_tokens": sum(lengths),
        "trained_tokens": int(metrics["trained_tokens"]),
        "degenerate_groups": int(metrics["degenerate_groups"]),
        "max_over_median_length": round(max(lengths) / max(1.0, statistics.median(lengths)), 2),
        "rollout_s": round(rollout_s, 2),
        "train_s": round(train_s, 2),
        "rollout_share": round(rollout_s / (rollout_s + train_s), 3),
    }


def hf_prompt_lookup(torch, world: Path, prompts: list[list[int]], n: int) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(world / "policy").eval()
    out: dict[str, Any] = {}
    for name, extra in (("plain", {}), ("prompt_lookup_10", {"prompt_lookup_num_tokens": 10})):
        walls = []
        for prompt in prompts:
            ids = torch.tensor([prompt])
            with torch.inference_mode():
                wall, _ = timed(
                    hf.generate,
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=n,
                    min_new_tokens=n,
                    do_sample=False,
                    **extra,
                )
            walls.append(wall)
        out[f"{name}_tok_s"] = round(n / statistics.median(walls), 1)
    out["speedup"] = round(out["prompt_lookup_10_tok_s"] / out["plain_tok_s"], 3)
    return out


if __name__ == "__main__":
    main()
