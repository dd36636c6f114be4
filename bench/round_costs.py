"""Where a speculative round's time goes at batch 1 (issue 23 point 4: the round's own cost is the ceiling
once drafting is nearly free): per round, milliseconds in drafting (`proposer.propose`), the target's verify
forward, acceptance (`speculative._accept`), the rest of `verify_round` (ids, positions, the tree's mask and
depths, logits, log-probabilities, the KV commit, the emitted tokens and their logprobs) and the engine's
bookkeeping around it (appends, stop checks, observing the committed tokens, per-source counts), against one
plain decode step; then `verify_round` alone with the target's forward stubbed (its own work, in µs).

Timers wrap the engine's pieces from outside (nothing in the engine is changed for measuring), on the tiny
world's policy and drafter, the last row of a group (7 siblings finished, remembered by the group source),
T = 1, EOS stops, 4 long held-out prompts per arm. Times are the measuring thread's CPU time by default
(`--clock cpu`: on a shared machine wall time mostly measures the neighbours; run it with `--threads 1`, so
every op runs on that thread), or wall time (`--clock wall`), tokens/s included.

With `--graphs trace` the target's decode and verify forwards replay traces (`model/graphs.py`, the CPU
stand-in for CUDA graphs; captures count as forward time), and `--compare-graphs` alternates eager and traced
in fresh processes as `--baseline` does; `capture` is the part of the forward's time spent capturing
(each prompt's new engine captures its shapes again).

With `--baseline DIR` (another checkout, e.g. `git worktree add /tmp/rc-before HEAD~3`), the same timers run
on both trees in fresh processes, alternated `--repeats` times, and the medians of each phase are printed
side by side, with the median of the per-alternation ratios (current / baseline) of every phase: a
before/after measured in one run.

    python bench/round_costs.py [--world artifacts/world] [--prompts 4]
    python bench/round_costs.py --threads 1 --baseline /tmp/rc-before --repeats 5
    python bench/round_costs.py --threads 1 --compare-graphs --repeats 5

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def measure(args: argparse.Namespace) -> dict:
    """One pass over the three arms, then `stubbed_verify`, with the package imported from `args.src`."""
    sys.path.insert(0, str(Path(args.src).resolve()))
    import torch

    from tlt_stream.drafter.model import load_drafter
    from tlt_stream.model import load_model
    from tlt_stream.rollout import engine as engine_module
    from tlt_stream.rollout import speculative
    from tlt_stream.rollout.arms import Arm
    from tlt_stream.rollout.engine import GenerationEngine
    from tlt_stream.rollout.proposers import EagleProposer, GroupProposer
    from tlt_stream.tasks.repeated_add import RepeatedAddTask
    from tlt_stream.tasks.tokenizer import build_tokenizer

    torch.set_num_threads(args.threads)
    graphs = None if args.graphs == "off" else args.graphs
    world = Path(args.world)
    policy = load_model(world / "policy")
    drafter = load_drafter(world / "drafter", policy)
    tokenizer = build_tokenizer()
    problems = [q for q in RepeatedAddTask().problems(500, 7, heldout=True) if q.steps >= 12][: args.prompts]
    prompts = [tokenizer(q.prompt, add_special_tokens=False)["input_ids"] for q in problems]
    eos = [tokenizer.eos_token_id]
    spent: dict[str, float] = defaultdict(float)
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter

    inside: set[str] = set()

    def timed(name: str, fn):
        def wrapper(*a, **k):
            if name in inside:  # a timer of this phase already runs (a capture calls the model's forward)
                return fn(*a, **k)
            inside.add(name)
            started = clock()
            try:
                return fn(*a, **k)
            finally:
                spent[name] += clock() - started
                inside.discard(name)

        return wrapper

    forward = policy.forward
    speculative._accept = timed("accept", speculative._accept)
    engine_module.verify_round = timed("verify", engine_module.verify_round)
    out = {}
    for name, arm in (("plain", None), ("eagle", Arm.drafter(6, 1, 6)), ("group", Arm.group_source(12, 12))):
        spent.clear()
        rounds = tokens = 0
        elapsed = 0.0
        for i, prompt in enumerate(prompts):
            proposer = None
            if name == "eagle":
                proposer = EagleProposer(drafter)
            elif name == "group":
                proposer = GroupProposer()
                siblings = GenerationEngine(policy, 7, len(prompt) + 300)
                for r in siblings.generate([prompt] * 7, 256, 1.0, seed=100 + i, eos_ids=eos):
                    proposer.remember(prompt, r.token_ids)
            engine = GenerationEngine(
                policy, 1, len(prompt) + 300, proposer=proposer, arm=arm, max_draft_nodes=32, graphs=graphs
            )
            if engine.graphs is not None:  # the replayed forward is the target's forward, captures included
                engine.graphs._capture = timed("capture", engine.graphs._capture)  # ... and shown apart
                engine.graphs = timed("target_forward", engine.graphs)
            if proposer is not None:
                proposer.propose = timed("drafting", proposer.propose)
            policy.forward = timed("target_forward", forward)  # instance attribute: this model only
            started = clock()
            (result,) = engine.generate([prompt], 256, 1.0, seed=i, eos_ids=eos)
            elapsed += clock() - started
            del policy.forward
            rounds += engine.rounds + engine.plain_steps
            tokens += len(result.token_ids)
        ms = {k: 1e3 * v / rounds for k, v in spent.items()}
        total = 1e3 * elapsed / rounds
        per_round = {"total": total, "target_forward": ms["target_forward"]}
        if graphs is not None:  # of which capturing (a new engine per prompt captures its shapes again)
            per_round["capture"] = ms.pop("capture", 0.0)
        if name == "plain":
            per_round["other"] = total - ms["target_forward"]
        else:
            verify = ms.pop("verify")
            per_round |= {
                "drafting": ms["drafting"],
                "accept": ms["accept"],
                "verify_rest": verify - ms["target_forward"] - ms["accept"],
                "engine": total - verify - ms["drafting"],
            }
        out[name] = {
            "ms_per_round": {k: round(v, 3) for k, v in per_round.items()},
            "tokens_per_round": round(tokens / rounds, 2),
            "tokens_per_s": round(tokens / elapsed, 1),
        }
        print(f"[round_costs] {args.src} {name}: {out[name]}", file=sys.stderr, flush=True)
    return {"arms": out, "verify_round_stubbed_us": stubbed_verify(policy, torch)}


def stubbed_verify(policy, torch) -> dict[str, float]:
    """`verify_round`'s own work: µs per call (median of 5 x 300, wall clock) with the target's forward replaced
    by a fixed hidden state, for a group chain and a group tree of 12 nodes and EAGLE's sampled 6-chain."""
    from tlt_stream.rollout.acceptance import DraftTree
    from tlt_stream.rollout.proposers import Proposal, pad_trees
    from tlt_stream.rollout.speculative import verify_round

    cache = policy.new_cache(1, 600)
    vocab, hidden_size = policy.spec.vocab_size, policy.spec.hidden_size
    g = torch.Generator().manual_seed(0)
    states = {n: torch.randn(1, n, hidden_size, generator=g) * 0.3 for n in (7, 13)}
    policy.forward = lambda ids, positions, cache, **kw: states[ids.shape[1]]
    tokens = list(range(5, 17))
    q = torch.softmax(torch.randn(1, 6, vocab, generator=g), dim=-1)
    cases = {
        "group_chain": lambda: pad_trees([(tokens, list(range(12)))], [[2] * 12]),
        "group_tree": lambda: pad_trees([(tokens, [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 3])], [[2] * 12]),
        "eagle_chain": lambda: Proposal(DraftTree.chain(torch.tensor([tokens[:6]])), q),
    }
    out = {}
    for name, make in cases.items():
        medians = []
        for _ in range(5):
            times = []
            for _ in range(300):
                cache.lengths[0] = 100
                proposal = make()
                started = time.perf_counter()
                verify_round(policy, cache, proposal, torch.tensor([3]), torch.tensor([1.0]), [g])
                times.append(time.perf_counter() - started)
            medians.append(statistics.median(times))
        out[name] = round(1e6 * statistics.median(medians), 1)
    del policy.forward
    return out


def compare(args: argparse.Namespace) -> dict:
    """Both sides in fresh processes, alternated; medians of every figure per side. The sides: the baseline
    checkout and this one (`--baseline`), or this one eager and replaying traced forwards (`--compare-graphs`)."""
    runs: dict[str, list[dict]] = {"baseline": [], "current": []}
    stubbed: dict[str, list[dict]] = {"baseline": [], "current": []}
    command = [sys.executable, str(Path(__file__).resolve()), "--world", args.world, "--prompts", str(args.prompts)]
    command += ["--threads", str(args.threads), "--clock", args.clock]
    if args.compare_graphs:
        sides = (
            ("baseline", ["--src", str(ROOT), "--graphs", "off"]),
            ("current", ["--src", str(ROOT), "--graphs", "trace"]),
        )
    else:
        sides = (("baseline", ["--src", args.baseline]), ("current", ["--src", str(ROOT), "--graphs", args.graphs]))
    for _ in range(args.repeats):
        for label, extra in sides:
            done = subprocess.run([*command, *extra], check=True, capture_output=True, text=True)
            report = json.loads(done.stdout)
            runs[label].append(report["arms"])
            stubbed[label].append(report["verify_round_stubbed_us"])
            print(f"[round_costs] {label}: {runs[label][-1]}", file=sys.stderr, flush=True)
    medians: dict[str, dict] = {}
    for label, passes in runs.items():
        medians[label] = {}
        for arm in passes[0]:
            phases = passes[0][arm]["ms_per_round"]
            medians[label][arm] = {
                "ms_per_round": {
                    k: round(statistics.median(p[arm]["ms_per_round"][k] for p in passes), 3) for k in phases
                },
                "tokens_per_round": round(statistics.median(p[arm]["tokens_per_round"] for p in passes), 2),
                "tokens_per_s": round(statistics.median(p[arm]["tokens_per_s"] for p in passes), 1),
            }
    # Paired: each alternation's current / baseline, then the median (the machine's speed drifts between runs).
    pairs = list(zip(runs["baseline"], runs["current"], strict=True))
    medians["ratio"] = {}
    for arm, figures in runs["baseline"][0].items():
        medians["ratio"][arm] = {
            k: round(statistics.median(c[arm]["ms_per_round"][k] / b[arm]["ms_per_round"][k] for b, c in pairs), 3)
            for k in figures["ms_per_round"]
        }
    stubbed_medians = {
        label: {k: round(statistics.median(p[k] for p in passes), 1) for k in passes[0]}
        for label, passes in stubbed.items()
    }
    return {"arms": medians, "verify_round_stubbed_us": stubbed_medians}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", default=str(ROOT / "artifacts" / "world"))
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--clock",
        choices=["cpu", "wall"],
        default="cpu",
        help="cpu: this thread's CPU time (steady on a shared machine; with --threads 1 every op runs on it)",
    )
    p.add_argument("--src", default=str(ROOT), help="checkout whose tlt_stream is measured")
    p.add_argument("--baseline", help="another checkout to measure alternately with this one")
    p.add_argument("--repeats", type=int, default=3, help="alternations with --baseline (medians reported)")
    p.add_argument(
        "--graphs",
        choices=["off", "trace"],
        default="off",
        help="replay the target's decode and verify forwards from traces (model/graphs.py; CUDA graphs' stand-in)",
    )
    p.add_argument("--compare-graphs", action="store_true", help="alternate --graphs off and trace on this checkout")
    args = p.parse_args()
    report = {"benchmark": "round_costs", "batch": 1, "temperature": 1.0, "threads": args.threads, "clock": args.clock}
    report["machine"] = {"cpu": platform.processor() or platform.machine(), "python": platform.python_version()}
    if args.baseline or args.compare_graphs:
        report |= {"repeats": args.repeats, "baseline": args.baseline or "graphs off"} | compare(args)
    else:
        report |= measure(args)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
