"""The engine cost model's surface, and the CPU model: formulas with named constants fitted on
microbenchmarks (`bench/plan_fit.py`), never on the end-to-end runs they are checked against.

Every model answers, in seconds:

- `decode_s(b, ctx)`: one plain decode step of `b` rows whose mean context is `ctx` tokens;
- `round_s(b, arm, ctx, accepted)`: one speculative round of `b` rows: the arm's drafting plus the verify
  forward of its nodes (and the round's own bookkeeping), its rows accepting `accepted` draft tokens each on
  average;
- `switch_s(b, arm, ctx, plain_run, repeat)`: what steps of `arm` cost beyond `round_s` for following steps of
  the other kind (a plain step after a round, a round after plain steps);
- `prefill_s(tokens)`: prefilling that many prompt tokens;
- `catch_up_s(pairs)`: the drafter's forward over what a prefill or re-verification left it, at the first drafter
  round after it: per row of the round, the (token, state) pairs it holds unseen (0 for most);
- `reverify_s(held, prompt_len)`: a partial rollout's re-verification under a new version of rows holding
  `held` response tokens each (beyond the plain `load_s`);
- `learn_s(tokens, ctx)`: the learner's forward and backward over that many response tokens;
- `optimizer_s`, `publish_s` (checkpoint written and announced), `load_s` (a worker verifies and loads it);
- `hop_s`, `finish_s`, `group_s`, `window_s`: the rollout worker's own loop beside its engine: its poll for new
  tasks after every hop of engine steps, the rows in flight published after a hop in which rows finished, a
  finished group's output (decoded, scored, its samples and a report sent, the task acked), and where the drafter
  trains, a finished row's hidden-state window built and sent (for the share of rows whose states are streamed).

CPU formulas (b rows, n verified nodes, ctx tokens of context: the batch's longest row's, since the torch
engine attends every row over the longest, depth d, top-k w):

    decode_s  = step_s + row_s * b + ctx_s * b * ctx + ragged_s * [b > 1]
    round_s   = step_s + round_s_fixed + round_row_s * b + row_s * b * (1 + node_frac * n)
                + ctx_s * b * ctx * (1 + node_ctx_frac * n)
                + d * (draft_step_s + draft_row_s * b * w + draft_ctx_s * b * w * ctx)
                + accept_s * b * a      (drafter arms; a: draft tokens a row accepts a round, on average)
                (a round's own work per row: its tree, acceptance and commit, and the drafter catching up on the
                row's tokens; a verified node attends the whole context, as the drafter's candidates do theirs: a
                round deep in a response costs more than one near its start; the drafter's catch-up forward runs
                over the tokens the rows accepted since its last one, so a round of a drafter that is accepted
                more costs more: the fit's own drafter accepts what it accepts, a run's online-trained one more)
    prefill_s = prefill_step_s + prefill_token_s * tokens
    catch_up_s = catch_up_token_s * b * max(pairs)
                (the engine's prefill, and a re-verification, leave every row's prompt (and held tokens) to the
                drafter's next forward, which runs over all b rows of the round padded to the longest)
    reverify_s = reverify_step_s + reverify_token_s * rows * (prompt_len + max(held))
                (the new policy's forward over every row's prompt and tokens, padded to the longest, the old
                policy's over the rows it rejects, the weights swapped; without those constants,
                prefill_s of the held tokens)
    switch_s  = after_round_frac * after_round_decay^(j - 1) * decode_s
                (the j-th plain step after a speculative round: the round's working set, the drafter, its tree
                and the verify's wider attention, has displaced the target's weights and KV lines from this CPU's
                caches, and the plain steps after it pay to bring them back, most right after the round)
              = after_k * round_s, after_k = after_one_plain_frac at k = 1 plain step before the round, rising
                linearly to after_plain_frac at k = after_plain_steps and beyond (the round's own working set
                displaced by the plain steps before it); 0 for a round after a round, or before any round
    learn_s   = tokens / learn_tokens_per_s   (a fit without the micro-batch constants), else, over the update's
                rows as the learner batches them (longest first, each micro-batch `micro_batch_tokens // W` rows
                padded to its longest, W tokens of prompt and response):
              = sum over micro-batches of B * W * (learn_token_s + learn_attn_s * W)

Contention (`slowdown`): work of `t` threads started while `u` cores are busy with other work (the other
modelled processes' busy threads, plus the run's `background_cores`: services, Redis, the machine's
neighbours) takes longer by

    slowdown  = 1 + k_t * u + w_t * u * f     k_t: `engine_k[t-1]` for decode steps and rounds, `learner_k[t-1]`
                                               for updates; w_t: `engine_wait_s[t-1]`, seconds a target or
                                               drafter forward waits per busy core (its threads' barriers
                                               wait for a thread the others hold); f: the work's forwards
                                               per second unslowed (0 for the learner)

(constants from `bench/plan_contention.py`); where the contention bench's measured curve is given instead
(`engine_curve`, `learner_curve`: per thread count, the slowdown measured at each load, (u, factor) points),
by that curve interpolated linearly in u (extended from its last two points); for a model with neither, by the
proportional share max(1, (t + u) / cores).
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Sequence
from dataclasses import MISSING, asdict, dataclass, fields, replace
from pathlib import Path
from typing import Protocol

from tlt_stream.basics.config import DEFAULTS
from tlt_stream.rl.shapes import split_by_width
from tlt_stream.rollout.arms import Arm

__all__ = ["CpuCosts", "EngineCosts", "FixedCosts", "micro_batches", "slowdown"]


class EngineCosts(Protocol):
    optimizer_s: float
    publish_s: float
    load_s: float
    hop_s: float
    """The worker's loop after each hop of engine steps (`rollout.steps_per_hop`, fewer when a row finishes):
    its poll for new tasks."""
    finish_s: float
    """After a hop in which rows finished: the rows in flight written to the worker's registry record."""
    group_s: float
    """A finished group's output: its responses decoded and scored, its samples and a report sent, the task
    acked (on the worker, before its next hop; the learner sees the group after it)."""
    window_s: float
    """A finished row's hidden-state window built and sent to `hidden` (where the drafter trains, for the rows
    whose states are streamed, `Setup.hidden_share` of them; on the worker, before its next hop)."""
    cores: float
    """Cores the processes share (inf: each process has its own device)."""
    learner_beside_training: float
    """The update's slowdown beside the drafter's idle training that gets no core (`CpuCosts`; 1: none)."""
    padded: bool
    """True: a forward attends every row over the batch's longest context (the torch engine pads its rows to
    the longest one, `model/layers.py`), so `context` is the longest row's; False: each row over its own
    (paged KV caches), so `context` is the rows' mean."""

    def decode_s(self, batch: int, context: float) -> float: ...
    def round_s(self, batch: int, arm: Arm, context: float, accepted: float = 0.0) -> float:
        """One step of `arm`; `accepted`: the draft tokens each row accepts in a round of it, on average (a
        plain step, whatever it is given, accepts none)."""
        ...

    def switch_s(
        self, batch: int, arm: Arm, context: float, plain_run: int | None, repeat: int = 1, accepted: float = 0.0
    ) -> float:
        """Seconds that `repeat` steps of `arm` (more than one: plain steps only) cost beyond `round_s` when
        the worker has run `plain_run` plain steps since its last speculative round or since it began (0: the
        step before was a round; None: plain steps before any round): switching between the two kinds of
        step."""
        ...

    def prefill_s(self, tokens: int) -> float: ...
    def catch_up_s(self, pairs: Sequence[float]) -> float:
        """The first drafter round after a prefill or re-verification: its drafter's extra forward over the
        (token, state) pairs the engine left it, `pairs` per row of the round (a new row's prompt, a re-verified
        row's prompt and held tokens; 0 for a row the drafter has seen)."""
        ...

    def reverify_s(self, held: Sequence[float], prompt_len: float) -> float: ...
    def learn_s(self, tokens: int, context: float) -> float: ...
    def learn_rows_s(self, lengths: Sequence[float], prompt_len: float) -> float | None:
        """The forward and backward over rows of these response lengths, micro-batched as the learner does;
        None where the model has no such curve (the simulator then charges `learn_s` per token)."""
        ...

    def describe(self) -> dict[str, object]: ...


@dataclass(frozen=True)
class FixedCosts:
    """Hand-computable costs for tests and what-ifs: a decode step costs `decode` whatever the batch, a round
    `round`, and everything else what its field says."""

    decode: float = 1.0
    round: float = 1.0
    prefill: float = 0.0
    learn_per_token: float = 0.0
    optimizer_s: float = 0.0
    publish_s: float = 0.0
    load_s: float = 0.0
    hop_s: float = 0.0
    finish_s: float = 0.0
    group_s: float = 0.0
    window_s: float = 0.0
    cores: float = float("inf")
    learner_beside_training: float = 1.0
    padded: bool = False

    def decode_s(self, batch: int, context: float) -> float:
        return self.decode

    def round_s(self, batch: int, arm: Arm, context: float, accepted: float = 0.0) -> float:
        return self.decode if arm.kind == "plain" else self.round

    def switch_s(
        self, batch: int, arm: Arm, context: float, plain_run: int | None, repeat: int = 1, accepted: float = 0.0
    ) -> float:
        return 0.0

    def prefill_s(self, tokens: int) -> float:
        return self.prefill if tokens else 0.0

    def catch_up_s(self, pairs: Sequence[float]) -> float:
        return 0.0

    def reverify_s(self, held: Sequence[float], prompt_len: float) -> float:
        return self.prefill_s(int(sum(x for x in held if x > 0)))

    def learn_s(self, tokens: int, context: float) -> float:
        return self.learn_per_token * tokens

    def learn_rows_s(self, lengths: Sequence[float], prompt_len: float) -> float | None:
        return None

    def describe(self) -> dict[str, object]:
        return {"model": "fixed", **asdict(self)}


@dataclass(frozen=True)
class CpuCosts:
    """This machine's engine, the formulas of the module docstring; every constant named, in seconds."""

    step_s: float
    """Fixed cost of one target forward (Python and operator overhead), whatever the batch."""
    row_s: float
    """Cost per row and query token of a target forward (the part that grows with the batch)."""
    ctx_s: float = 0.0
    """Attention's cost per row per context token."""
    ragged_s: float = 0.0
    """A decode step's extra cost when its rows' contexts differ, as a run's always do beyond one row (prompts
    differ, rows join and finish at different times): the torch engine then builds an attention mask
    (`model/layers.py`; rows of one context need none). A speculative round builds its tree mask whatever the
    rows, inside `round_s_fixed`."""
    node_frac: float = 1.0
    """A verified draft node's cost relative to the row's one decode token (the verify-cost curve's slope)."""
    node_ctx_frac: float = 0.0
    """A verified node's attention over the context relative to the decode token's (`ctx_s`): the verify-cost
    curve's growth with the context."""
    round_s_fixed: float = 0.0
    """A speculative round's own bookkeeping beyond its forwards (tree mask, acceptance, KV commit)."""
    round_row_s: float = 0.0
    """Its cost per row beyond the row's decode token and verified nodes, whatever the arm's nodes: the row's
    tree, acceptance and KV commit, and the drafter's forward over its newest token (over the tokens it
    accepted: `accept_s`)."""
    draft_step_s: float = 0.0
    """Fixed cost of one drafter forward (one tree level)."""
    draft_row_s: float = 0.0
    """Cost per row and drafted candidate of one drafter forward."""
    draft_ctx_s: float = 0.0
    """Its attention's part: per row, drafted candidate and context token."""
    accept_s: float = 0.0
    """A drafter round's cost per row and draft token the row accepts: the drafter's catch-up forward over the
    tokens accepted since its last one, and their commit (the fit measures rounds of its drafter and of one
    whose drafts are seldom accepted, so that the other constants are those of a round that accepts none)."""
    after_round_frac: float = 0.0
    """A plain step right after a speculative round costs this share of `decode_s` more (this CPU's caches:
    the round's working set displaced the target's)."""
    after_round_decay: float = 0.0
    """The share of that extra left at each further plain step: the j-th plain step after a round pays
    `after_round_frac * after_round_decay ** (j - 1)`."""
    after_one_plain_frac: float = 0.0
    """A speculative round right after one plain step costs this share of `round_s` more (rounds back to back
    cost `round_s`)."""
    after_plain_frac: float = 0.0
    """... right after `after_plain_steps` plain steps or more; between one and those, linear in the steps."""
    after_plain_steps: int = 8
    prefill_step_s: float = 0.0
    prefill_token_s: float = 0.0
    catch_up_token_s: float = 0.0
    """The first drafter round after a prefill or re-verification costs this more per row of the round and
    (token, state) pair of the row holding most the drafter has not seen (`catch_up_s`)."""
    reverify_step_s: float = 0.0
    """A re-verification's fixed cost beyond a plain load (the old weights kept aside, the passes' own work)."""
    reverify_token_s: float = 0.0
    """Its cost per padded token of the rows re-verified (0: `prefill_s` of the held tokens instead)."""
    learn_tokens_per_s: float = 1e9
    """The learner's response tokens per second (forward + backward, its own process)."""
    learn_token_s: float = 0.0
    """The learner's forward and backward per padded token of a micro-batch (0: `learn_tokens_per_s` instead)."""
    learn_attn_s: float = 0.0
    """Its attention's part: per padded token per token of the micro-batch's width."""
    micro_batch_tokens: int = DEFAULTS.learner.micro_batch_tokens
    """Padded tokens per micro-batch (`learner.micro_batch_tokens`)."""
    optimizer_s: float = 0.0
    publish_s: float = 0.0
    """From the update's end to the new version announced (checkpoint written, hashed)."""
    load_s: float = 0.0
    """From announced to generating with it on a worker (read, verified, loaded)."""
    hop_s: float = 0.0
    """The worker's poll for new tasks after a hop of engine steps (one read of the prompts stream, right after
    the engine's threads ran)."""
    finish_s: float = 0.0
    """The rows in flight published after a hop in which rows finished (`EngineCosts.finish_s`)."""
    group_s: float = 0.0
    """A finished group's output on the worker (`EngineCosts.group_s`)."""
    window_s: float = 0.0
    """A finished row's hidden-state window built and sent (`EngineCosts.window_s`; 0 in fits made before it was
    measured)."""
    cores: float = 2.0
    engine_k: tuple[float, ...] = ()
    """Contention: an engine step's extra time per core busy with other work, per thread count (1, 2, ...;
    beyond the last, the last); empty: the proportional share."""
    engine_wait_s: tuple[float, ...] = ()
    """Contention: seconds each forward of a step waits per core busy with other work, per thread count."""
    learner_k: tuple[float, ...] = ()
    """The learner's update's extra time per core busy with other work, per thread count."""
    engine_curve: tuple[tuple[tuple[float, float], ...], ...] = ()
    """Contention as measured: per thread count, (cores busy with other work, slowdown) points of an engine
    step (`bench/plan_contention.py`); takes precedence over `engine_k`."""
    learner_curve: tuple[tuple[tuple[float, float], ...], ...] = ()
    """The same for the learner's update."""
    learner_beside_training: float = 1.0
    """Contention: the learner's update's slowdown beside a worker's idle period spent training the drafter,
    where the update's threads leave the training no core (`bench/plan_beside.py`: a real worker's idle
    training, its drain of the step's hidden-state windows, lease and commits, beside the update, against the
    update alone); the simulator scales its extra down linearly as the update leaves the training a core
    (`Simulation.slowdown`)."""
    padded: bool = True
    """The torch engine's forward attends every row over the batch's longest context (`EngineCosts.padded`)."""
    source: str = "given"

    def decode_s(self, batch: int, context: float) -> float:
        ragged = self.ragged_s if batch > 1 else 0.0
        return self.step_s + self.row_s * batch + self.ctx_s * batch * context + ragged

    def round_s(self, batch: int, arm: Arm, context: float, accepted: float = 0.0) -> float:
        if arm.kind == "plain":
            return self.decode_s(batch, context)
        verify = self.step_s + self.round_s_fixed + self.round_row_s * batch
        verify += self.row_s * batch * (1 + self.node_frac * arm.nodes)
        verify += self.ctx_s * batch * context * (1 + self.node_ctx_frac * arm.nodes)
        width = max(arm.topk, 1)
        if not arm.uses_drafter:  # an n-gram or group-source round: no drafter forward
            return verify
        drafting = self.draft_step_s + batch * width * (self.draft_row_s + self.draft_ctx_s * context)
        return verify + arm.depth * drafting + self.accept_s * batch * max(0.0, accepted)

    def switch_s(
        self, batch: int, arm: Arm, context: float, plain_run: int | None, repeat: int = 1, accepted: float = 0.0
    ) -> float:
        if plain_run is None:
            return 0.0
        if arm.kind == "plain":  # the steps are the (plain_run + 1)-th ... after the last round
            share = sum(self.after_round_decay ** (plain_run + i) for i in range(repeat))
            return self.after_round_frac * share * self.decode_s(batch, context)
        if plain_run == 0:
            return 0.0
        span = self.after_plain_steps
        if plain_run >= span:  # (below it, span >= 2: plain_run is at least 1 here)
            frac = self.after_plain_frac
        else:
            frac = self.after_one_plain_frac + (self.after_plain_frac - self.after_one_plain_frac) * (
                (plain_run - 1) / (span - 1)
            )
        return repeat * frac * self.round_s(batch, arm, context, accepted)

    def prefill_s(self, tokens: int) -> float:
        return self.prefill_step_s + self.prefill_token_s * tokens if tokens else 0.0

    def catch_up_s(self, pairs: Sequence[float]) -> float:
        return self.catch_up_token_s * len(pairs) * max(pairs, default=0.0)

    def reverify_s(self, held: Sequence[float], prompt_len: float) -> float:
        rows = [x for x in held if x > 0]
        if not rows:
            return 0.0
        if not self.reverify_token_s:
            return self.prefill_s(int(sum(rows)))
        return self.reverify_step_s + self.reverify_token_s * len(rows) * (prompt_len + max(rows))

    def learn_s(self, tokens: int, context: float) -> float:
        return tokens / self.learn_tokens_per_s

    def learn_rows_s(self, lengths: Sequence[float], prompt_len: float) -> float:
        """The forward and backward over rows of these response lengths, each after `prompt_len` prompt tokens,
        micro-batched as the learner does (`rl/batches.py`)."""
        if not self.learn_token_s:
            return sum(lengths) / self.learn_tokens_per_s
        return sum(
            b * w * (self.learn_token_s + self.learn_attn_s * w)
            for b, w in micro_batches(lengths, prompt_len, self.micro_batch_tokens)
        )

    def describe(self) -> dict[str, object]:
        return {"model": "cpu", **asdict(self)}

    def without_background(self, engine_u: float, learner_u: float, threads: int) -> CpuCosts:
        """The constants a fit at `threads` threads would have given on a quiet machine, where `engine_u` and
        `learner_u` cores were busy with other work while the engine's and the learner's were measured: the
        measured curve's slowdown divided out where given, else the contention law inverted (per forward: minus
        the wait, over 1 + k u; per row, token or context: over 1 + k u; the learner's rate times 1 + k u).
        Publication and loading are kept as measured."""
        if self.engine_curve and self.learner_curve:
            return self._scaled(
                slowdown(self, "engine", threads, engine_u), 0.0, slowdown(self, "learner", threads, learner_u)
            )
        if not self.engine_k or not self.learner_k:
            raise ValueError("no contention constants: set engine_k and learner_k (bench/plan_contention.py)")
        wait = _at(self.engine_wait_s, threads) if self.engine_wait_s else 0.0
        scale, waited = 1 + _at(self.engine_k, threads) * max(0.0, engine_u), wait * max(0.0, engine_u)
        learner = 1 + _at(self.learner_k, threads) * max(0.0, learner_u)
        return self._scaled(scale, waited, learner)

    def slower(self, factor: float) -> CpuCosts:
        """The constants on a machine `factor` times slower (faster below 1): every engine and learner cost
        times it; publication and loading as measured."""
        if not factor > 0:
            raise ValueError(f"factor must be > 0, got {factor}")
        return self._scaled(1 / factor, 0.0, 1 / factor)

    def engine_slower(self, factor: float) -> CpuCosts:
        """The constants with the engine `factor` times slower (faster below 1): its steps, drafts, prefill and
        re-verification; the learner, publication and loading as measured."""
        if not factor > 0:
            raise ValueError(f"factor must be > 0, got {factor}")
        return self._scaled(1 / factor, 0.0, 1.0)

    def _scaled(self, scale: float, waited: float, learner: float) -> CpuCosts:
        return replace(
            self,
            step_s=max(0.0, self.step_s - waited) / scale,
            row_s=self.row_s / scale,
            ctx_s=self.ctx_s / scale,
            ragged_s=self.ragged_s / scale,
            round_s_fixed=self.round_s_fixed / scale,
            round_row_s=self.round_row_s / scale,
            draft_step_s=max(0.0, self.draft_step_s - waited) / scale,
            draft_row_s=self.draft_row_s / scale,
            draft_ctx_s=self.draft_ctx_s / scale,
            accept_s=self.accept_s / scale,
            prefill_step_s=max(0.0, self.prefill_step_s - waited) / scale,
            prefill_token_s=self.prefill_token_s / scale,
            catch_up_token_s=self.catch_up_token_s / scale,
            reverify_step_s=self.reverify_step_s / scale,
            reverify_token_s=self.reverify_token_s / scale,
            learn_tokens_per_s=self.learn_tokens_per_s * learner,
            learn_token_s=self.learn_token_s / learner,
            learn_attn_s=self.learn_attn_s / learner,
            optimizer_s=self.optimizer_s / learner,
        )

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.describe(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> CpuCosts:
        """A fitted model written by `bench/plan_fit.py` (`save`)."""
        hint = "fit one with bench/plan_fit.py"
        try:
            raw = json.loads(Path(path).read_text())
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
            raise ValueError(f"{path}: not a CPU cost model, not JSON ({exc}); {hint}") from None
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: not a CPU cost model (a JSON {type(raw).__name__}, not an object); {hint}")
        kinds = {f.name: str(f.type) for f in fields(cls)}
        unknown = set(raw) - set(kinds) - {"model", "fit"}
        if raw.get("model") != "cpu" or unknown:
            raise ValueError(f"{path}: not a CPU cost model (unknown keys {sorted(unknown)}); {hint}")
        if missing := [f.name for f in fields(cls) if f.default is MISSING and f.name not in raw]:
            raise ValueError(f"{path}: not a CPU cost model (no {', '.join(missing)}); {hint}")
        for key, value in raw.items():
            if key in kinds and not _of_kind(value, kinds[key]):
                raise ValueError(f"{path}: {key} is {value!r}, not a {kinds[key].split('[')[0]}; {hint}")
        values = {k: _tuples(v) if isinstance(v, list) else v for k, v in raw.items() if k in kinds}
        costs = cls(**values)
        if problem := costs._unusable():
            raise ValueError(f"{path}: {problem}; {hint}")
        return costs

    def _unusable(self) -> str | None:
        """Why the simulator cannot run on these constants (a rate or count that is not positive, a measured
        time below zero, a decode step or a configured arm's round of no time or less), else None; a fit's
        intercepts may be negative so long as the steps they add up to are not."""
        for name in ("learn_tokens_per_s", "cores", "micro_batch_tokens"):
            if not getattr(self, name) > 0:
                return f"{name} is {getattr(self, name)!r}, not a positive number"
        if not self.learner_beside_training >= 1:
            return f"learner_beside_training is {self.learner_beside_training!r}, below 1 (a slowdown)"
        measured = ("optimizer_s", "publish_s", "load_s", "hop_s", "finish_s", "group_s", "window_s", "prefill_step_s")
        for name in (*measured, "prefill_token_s", "catch_up_token_s", "reverify_step_s", "reverify_token_s"):
            if getattr(self, name) < 0:
                return f"{name} is {getattr(self, name)!r}, a time below zero"
        if self.accept_s < 0:
            return f"accept_s is {self.accept_s!r}: a round would cost less the more of its draft it accepted"
        if not 0.0 <= self.after_round_decay < 1.0:
            return f"after_round_decay is {self.after_round_decay!r}, not a share in [0, 1)"
        for name in ("after_round_frac", "after_one_plain_frac", "after_plain_frac"):
            if not getattr(self, name) > -1.0:
                return f"{name} is {getattr(self, name)!r}: a step after a switch would take no time"
        if self.after_plain_steps < 1:
            return f"after_plain_steps is {self.after_plain_steps!r}, not a positive count"
        for name in ("engine_k", "engine_wait_s", "learner_k"):
            if any(k < 0 for k in getattr(self, name)):
                return f"{name} is {list(getattr(self, name))!r}: contention does not speed work up"
        arms = [Arm.from_label(label) for label in DEFAULTS.sd.arms]
        for batch, context in itertools.product((1, 2, 8, 64, 256), (1, 1024, 32768)):
            for arm in arms:
                if not (seconds := self.round_s(batch, arm, context)) > 0:
                    what = "a decode step" if arm.kind == "plain" else f"a {arm.label} round"
                    return f"{what} of {batch} rows at {context} tokens of context takes {seconds:.3g} s"
        if not self.learn_rows_s([128.0] * 8, 32.0) > 0:
            return "the learner's update takes no time"
        return None


def micro_batches(lengths: Sequence[float], prompt_len: float, tokens: int) -> list[tuple[int, float]]:
    """(rows, width) of each micro-batch the learner makes of rows of these response lengths after `prompt_len`
    prompt tokens, by the learner's own rule (`rl.shapes.split_by_width`)."""
    widths = [prompt_len + x for x in lengths]
    return [(len(batch), widths[batch[0]]) for batch in split_by_width(widths, tokens)]


def _at(per_threads: tuple, threads: int):
    """A per-thread-count constant's value at `threads` (beyond the last, the last)."""
    return per_threads[min(threads, len(per_threads)) - 1]


def _of_kind(value: object, kind: str) -> bool:
    """Whether a loaded JSON value fits a field annotated `kind` (a number: finite)."""
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "str":
        return isinstance(value, str)
    if kind.startswith("tuple"):
        return isinstance(value, list) and all(_of_kind(v, "tuple" if isinstance(v, list) else "float") for v in value)
    if kind in ("float", "int"):
        return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    return True


def _tuples(value: object) -> object:
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def _interpolate(points: tuple[tuple[float, float], ...], u: float) -> float:
    """The piecewise-linear curve through `points` (sorted by u) at `u`, extended from its last two points."""
    if len(points) == 1:
        return points[0][1]
    for (u0, f0), (u1, f1) in itertools.pairwise(points):
        if u <= u1 or (u1, f1) == points[-1]:
            return f0 + (f1 - f0) * (u - u0) / (u1 - u0) if u1 > u0 else f1
    return points[-1][1]


def slowdown(costs: EngineCosts, kind: str, threads: int, other: float, forwards_per_s: float = 0.0) -> float:
    """How much longer work of `kind` ("engine" or "learner") on `threads` threads takes while `other` cores
    are busy with other work, for work of `forwards_per_s` forwards per (unslowed) second (the module
    docstring's law); 1 where processes have their own devices."""
    if costs.cores == float("inf"):
        return 1.0
    curves = getattr(costs, "engine_curve" if kind == "engine" else "learner_curve", ())
    if curves:
        return max(1.0, _interpolate(_at(curves, threads), max(0.0, other)))
    fitted = getattr(costs, "engine_k" if kind == "engine" else "learner_k", ())
    if not fitted:
        return max(1.0, (threads + other) / costs.cores)
    u = max(0.0, other)
    waits = getattr(costs, "engine_wait_s", ()) if kind == "engine" else ()
    wait = _at(waits, threads) if waits else 0.0
    return 1.0 + _at(fitted, threads) * u + wait * u * forwards_per_s
