"""Generation with continuous batching over the slot-addressed KV cache, plain or speculative.

A step admits waiting requests and prefills them as one padded batch, then runs one decode step for every
running row; finished rows leave at once and the tail rows move into their slots. Each algorithmic step is
its own method (`_prefill`, `_decode_step`, `_speculative_step`, `_emit`, `_finish`). With a proposer and
an SD arm set (`engine.arm`, changeable between any two steps), a step verifies a draft tree instead of
decoding one token; every committed (token, hidden state) pair reaches the proposer either way, so SD can
be switched on or off mid-sequence without disturbing in-flight rows.

Every request has its own seeded `torch.Generator`, drawn from once per emitted token, so a request's
sampled output does not depend on which other requests share its batch.

Partial rollouts: `load_policy(path, reverify=True)` loads a new policy with requests in flight and
re-verifies every one that holds tokens, losslessly (`rollout/reverify.py`); a request added with
`ahead_limit` is a draft for the next version, parked after that many tokens until it is re-verified.
"""

from __future__ import annotations

import itertools
import math
import secrets
from collections import Counter
from collections.abc import Hashable, Iterable
from collections.abc import Sequence as SequenceOf
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tlt_stream.basics.errors import CheckpointError
from tlt_stream.model.graphs import ForwardGraphs, GraphBackend
from tlt_stream.model.transformer import Transformer
from tlt_stream.rollout.arms import Arm
from tlt_stream.rollout.proposers.base import Proposer, count_sources
from tlt_stream.rollout.results import GenerationResult, generate_all
from tlt_stream.rollout.reverify import verify_rows
from tlt_stream.rollout.sampling import sample
from tlt_stream.rollout.scheduler import Scheduler, Sequence, StopRule
from tlt_stream.rollout.speculative import verify_round

if TYPE_CHECKING:
    from tlt_stream.store.weights import PolicyWeights

__all__ = ["GenerationEngine", "GenerationResult", "generate_all"]


"""The draft source of a one-source arm (`RolloutEngine.drafted_by`)."""


class GenerationEngine:
    """Continuous-batching generation on a `Transformer` with at most `max_batch` rows of `max_len` tokens."""

    def __init__(
        self,
        model: Transformer,
        max_batch: int,
        max_len: int,
        *,
        max_prefill_tokens: int | None = None,
        cache_dtype: torch.dtype | None = None,
        proposer: Proposer | None = None,
        arm: Arm | None = None,
        max_draft_nodes: int = 64,
        draft_rows: int | None = None,
        graphs: GraphBackend | None = None,
    ) -> None:
        """`cache_dtype` defaults to the weights' dtype; fp32 with bf16 weights speeds up CPU attention.

        With a `proposer`, steps are speculative whenever `arm` is set; caches get `max_draft_nodes + 1`
        entries of headroom for the uncommitted drafts (arms may verify at most that many nodes). Drafts of
        the next policy (partial rollouts) start only while fewer than `draft_rows` rows run (`Scheduler`).
        With `graphs`, decode steps and verify rounds replay the target's forward captured per shape
        (`model.graphs.ForwardGraphs`: "cuda" graphs, or the "trace" replay that stands in for them on a CPU);
        prefills and re-verifications run eagerly.
        """
        model.spec.check_window(max_len)
        self.model = model
        self.max_len = max_len
        self.scheduler = Scheduler(max_batch, max_prefill_tokens, draft_rows)
        self.proposer = proposer
        self.max_draft_nodes = max_draft_nodes
        headroom = max_draft_nodes + 1 if proposer is not None else 0
        self.cache = model.new_cache(max_batch, max_len + headroom, dtype=cache_dtype)
        if proposer is not None:
            proposer.allocate(max_batch, max_len + headroom)
        self.graphs = (
            ForwardGraphs(model, self.cache, graphs, max_tokens=max_draft_nodes + 1) if graphs is not None else None
        )
        """The captured forwards of decode steps and verify rounds (None: eager)."""
        self.arm = arm
        self.row_bytes: int | None = None
        """Bytes a row holds as its budget was sized (`model.sizing.engine_bytes_per_row`; set by
        `rollout.build`, None when built directly)."""
        self.rounds = 0
        """Speculative rounds run (one target forward each)."""
        self.plain_steps = 0
        """Plain decode steps run (one target forward each)."""
        self.tokens_generated = 0
        """Tokens emitted over all requests so far (a throughput counter)."""
        self.drafted_by: Counter[str] = Counter()
        """Draft nodes verified, per source (eagle, group, ngram, oracle; a node two sources proposed counts
        for both)."""
        self.accepted_by: Counter[str] = Counter()
        """Drafted tokens accepted and emitted, per source (as `drafted_by`)."""
        self.reverified = 0
        """Requests re-verified under a newly loaded policy (each time it happened to one)."""
        self.tokens_kept = self.tokens_discarded = 0
        """Tokens the re-verifications kept, and those they discarded."""
        self.reverify_passes = 0
        """Re-verification forwards of the new policy (batched like prefills)."""
        self.old_policy_rows = 0
        """Rows whose rejection needed the old policy's distribution (one old-policy forward per pass)."""
        self._generators: dict[Hashable, torch.Generator | None] = {}
        self._want_hidden: set[Hashable] = set()
        self._hidden: torch.Tensor | None = None
        """`[max_batch, max_len, H]` per-slot final-norm states at every input position of the row, prompt and
        generated tokens alike (`[slot, p]` is the state at position p), for the requests that asked for them
        (allocated on the first such request; slot moves are mirrored like the KV cache): one indexed write per
        step, no Python object per token and row, and a row's states take no memory beyond its slot's (what
        `model.sizing.engine_bytes_per_row` counts)."""
        self._prompt_hidden: dict[Hashable, torch.Tensor] = {}
        """Prompt states of requests finished in this call, until their results are built."""
        self._accepts: dict[Hashable, list[int]] = {}
        self._done: list[GenerationResult] = []
        """Requests a re-verification finished, returned by the next `step`."""
        self._ids = itertools.count()
        self._ones = torch.ones(max_batch, dtype=torch.long, device=model.device)

    @property
    def has_unfinished(self) -> bool:
        return not self.scheduler.is_idle or bool(self._done)

    @property
    def has_work(self) -> bool:
        """Whether `step` would do anything: rows waiting or running, or results a re-verification finished
        (parked drafts alone: nothing until the next `load_policy(..., reverify=True)`)."""
        return bool(self.scheduler.waiting or self.scheduler.running or self._done)

    @property
    def num_running(self) -> int:
        """Rows being decoded now."""
        return self.scheduler.num_running

    @property
    def num_parked(self) -> int:
        """Drafts that used their `ahead_limit` (or ended) and wait for `load_policy(..., reverify=True)`;
        `step()` does nothing for them, so a loop stepping while `has_unfinished` must also stop here."""
        return self.scheduler.num_parked

    def load_policy(self, path: str | Path, *, reverify: bool = False, weights: PolicyWeights | None = None) -> None:
        """Load another version of the policy (a checkpoint of the same architecture) into the engine's model
        in place: from `weights` when given (`path`'s contents, read once and verified by the caller,
        `store/weights.py`), else read from `path`. The caches stay allocated (rebuilding the engine per
        version cost 0.1-0.4 s of a ~4.5 s RL step on the tiny world), and a drafter bound to the model, which
        borrows its embedding and LM head, follows.

        Without `reverify`, only with nothing in flight: every sample must come from one policy version. With
        it, every request holding tokens (running, parked, queued to resume) is re-verified at once by the
        rule of `reverify`: batched prefills over prompt + tokens (which rebuild its KV cache), acceptance,
        the residual token at a rejection (one forward of the old weights, kept for this call only, over the
        rejecting T > 0 rows' prefixes). They go on under the new policy, in their slots or first in the
        queue; those it ended come from the next `step()`. Drafts become ordinary requests (not yet started
        ones too). Reported by `GenerationResult.reverifications/tokens_kept/tokens_discarded` and counters.
        """
        from tlt_stream.model.loader import load_model

        if self.has_unfinished and not reverify:
            raise RuntimeError("load_policy() with requests in flight; let them finish first (or reverify=True)")
        fresh = load_model(path, dtype=self.model.dtype, device=self.model.device, weights=weights)
        if fresh.spec != self.model.spec:
            raise CheckpointError(f"{path}: a different architecture than the engine's policy; build a new engine")
        rows = self.scheduler.new_version() if reverify else []
        keep_old = any(s.temperature > 0 for s in rows)
        with torch.no_grad():
            weights = fresh.state_dict()
            for name, tensor in self.model.state_dict().items():
                if keep_old:  # swap: `fresh` becomes the old policy, with no third copy of the weights
                    old = tensor.clone()
                    tensor.copy_(weights[name])
                    weights[name].copy_(old)
                else:
                    tensor.copy_(weights[name])
        if rows:
            self._reverify(rows, fresh if keep_old else None)

    def load_drafter(self, path: str | Path) -> None:
        """Swap the EAGLE drafter's weights in place (a drafter checkpoint that fits this engine's model);
        rows in flight keep going: speculative decoding is lossless whatever the drafter proposes. A drafter of
        another layout than the one drafting (another width or depth, made by hand or for another setting) is
        refused with `CheckpointError` in one line, before any weight changes."""
        from tlt_stream.basics.errors import CheckpointError
        from tlt_stream.drafter.model import layout_mismatch, load_drafter

        drafter = getattr(self.proposer, "drafter", None)
        if drafter is None:
            raise RuntimeError("this engine drafts without an EAGLE drafter; there is nothing to swap")
        state = load_drafter(path, self.model).state_dict()
        current = {name: tuple(t.shape) for name, t in drafter.state_dict().items()}
        if (why := layout_mismatch({name: tuple(t.shape) for name, t in state.items()}, current)) is not None:
            raise CheckpointError(f"{path}: not the layout of the drafter this engine drafts with: {why}")
        drafter.load_state_dict(state)

    @property
    def arm(self) -> Arm | None:
        """The SD arm the next steps use (None: plain decoding)."""
        return self._arm

    @arm.setter
    def arm(self, arm: Arm | None) -> None:
        if arm is not None:
            if self.proposer is None:
                raise ValueError("an SD arm needs a proposer (a drafter or the n-gram proposer)")
            if max(arm.nodes, arm.depth) > self.max_draft_nodes:
                raise ValueError(f"arm {arm.label} drafts more than max_draft_nodes={self.max_draft_nodes}")
        self._arm = arm

    def add_request(
        self,
        prompt_ids: SequenceOf[int],
        max_new_tokens: int,
        temperature: float = 0.0,
        seed: int | None = None,
        eos_ids: Iterable[int] = (),
        request_id: Hashable | None = None,
        *,
        stop: StopRule | None = None,
        return_hidden: bool = False,
        ahead_limit: int | None = None,
    ) -> Hashable:
        """Queue a request and return its id (a fresh int when `request_id` is None).

        `seed` fixes the sampling stream (random when None; unused at temperature 0). `stop` (e.g.
        `rollout.stops.StopStrings`) ends the response at the token it first returns True for. Requires
        `len(prompt_ids) + max_new_tokens <= max_len`. `ahead_limit` makes it a draft for the next policy
        version: after that many tokens, or when it ends before, it parks (holding no slot, `num_parked`)
        until `load_policy(..., reverify=True)` re-verifies it; then it runs on as an ordinary request.
        """
        prompt = [int(t) for t in prompt_ids]
        rid = next(self._ids) if request_id is None else request_id
        vocab = self.model.spec.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise ValueError(f"request {rid!r}: prompt token ids must lie in [0, {vocab})")
        if not math.isfinite(temperature) or temperature < 0:
            raise ValueError(f"request {rid!r}: temperature must be finite and >= 0, got {temperature}")
        if len(prompt) + max_new_tokens > self.max_len:
            raise ValueError(
                f"request {rid!r}: prompt ({len(prompt)}) + max_new_tokens ({max_new_tokens}) "
                f"exceeds max_len ({self.max_len})"
            )
        seq = Sequence(
            rid, prompt, max_new_tokens, frozenset(eos_ids), float(temperature), seed, stop, ahead_limit=ahead_limit
        )
        self.scheduler.add(seq)
        generator = None
        if temperature > 0:
            generator = torch.Generator(device=self.model.device)
            generator.manual_seed(secrets.randbits(63) if seed is None else seed)
        self._generators[rid] = generator
        self._accepts[rid] = []
        if return_hidden:
            if self._hidden is None:
                shape = (self.scheduler.max_batch, self.max_len, self.model.spec.hidden_size)
                self._hidden = torch.empty(shape, dtype=self.model.dtype, device=self.model.device)
            self._want_hidden.add(rid)
        return rid

    def step(self) -> list[GenerationResult]:
        """Admit and prefill new requests, decode one token for every running row; return what finished
        (with what the last re-verification finished)."""
        finished, self._done = self._done, []
        admitted = self.scheduler.admit()
        if admitted:
            self._prefill(admitted)
            finished += self._finish()
        if self.scheduler.running:
            if self._arm is not None:
                self._speculative_step(self.scheduler.running, self._arm)
            else:
                self._decode_step(self.scheduler.running)
            finished += self._finish()
        return finished

    def generate(
        self,
        prompts: SequenceOf[SequenceOf[int]],
        max_new_tokens: int,
        temperature: float = 0.0,
        seed: int | None = None,
        eos_ids: Iterable[int] = (),
        *,
        stop: StopRule | None = None,
        return_hidden: bool = False,
    ) -> list[GenerationResult]:
        """Generate for every prompt (prompt i seeded with `seed + i`) and return results in input order."""
        return generate_all(
            self, prompts, max_new_tokens, temperature, seed, eos_ids, stop=stop, return_hidden=return_hidden
        )

    @torch.inference_mode()
    def _prefill(self, seqs: list[Sequence]) -> None:
        """Run the prompts of `seqs` (contiguous slots) as one right-padded batch; emit their first tokens.
        A request resumed after a re-verification runs its prompt and tokens but the last, and emits none."""
        first = seqs[0].slot
        assert first is not None
        lens = [s.num_prefill_tokens for s in seqs]
        t = max(lens)
        device = self.model.device
        ids = torch.zeros(len(seqs), t, dtype=torch.long)
        for b, s in enumerate(seqs):
            ids[b, : lens[b]] = torch.tensor([*s.prompt_ids, *s.token_ids[:-1]])
        num_new = torch.tensor(lens, device=device)  # [B]
        self.cache.lengths[first : first + len(seqs)] = 0
        positions = torch.arange(t, device=device).expand(len(seqs), t)
        hidden = self.model(
            ids.to(device),
            positions,
            self.cache,
            num_new=None if min(lens) == t else num_new,
            first_slot=first,
        )  # [B, T, H]
        self.cache.advance(num_new, first_slot=first)
        last = hidden[torch.arange(len(seqs), device=device), num_new - 1]  # [B, H]
        fresh = [b for b, s in enumerate(seqs) if not s.token_ids]
        for b, s in enumerate(seqs):
            if s.request_id in self._want_hidden:  # the prompt's states (and a resumed row's tokens')
                assert self._hidden is not None and s.slot is not None
                self._hidden[s.slot, : lens[b]] = hidden[b, : lens[b]]
        if len(fresh) == len(seqs):
            self._emit(seqs, last)
        elif fresh:
            self._emit([seqs[b] for b in fresh], last[torch.tensor(fresh, device=device)])
        if self.proposer is not None:
            for b, s in enumerate(seqs):
                self._observe_prefix(s, first + b, hidden[b])

    def _observe_prefix(self, s: Sequence, slot: int, hidden: torch.Tensor) -> None:
        """The proposer starts `slot` afresh and observes every committed (token, state) pair of its row:
        pairs (x_{t+1}, h_t) over the prompt and the generated tokens, from its states `hidden [T, H]`."""
        assert self.proposer is not None
        self.proposer.reset_slot(slot, s.prompt_ids)
        if s.is_running:
            self.proposer.observe(slot, s.prompt_ids[1:] + s.token_ids, hidden[: s.num_tokens - 1])

    @torch.inference_mode()
    def _reverify(self, rows: list[Sequence], q_model: Transformer | None) -> None:
        """Re-verify `rows` (every sequence with tokens, out of their slots) under the freshly loaded policy.

        The first `max_batch` are verified in place into slots 0.. and stay there; the rest are verified in
        slot 0.. first (scratch: the kept rows' entries are built afterwards) and queued to resume.
        """
        keep, overflow = rows[: self.scheduler.max_batch], rows[self.scheduler.max_batch :]
        finished: list[GenerationResult] = []
        for batch in self.scheduler.passes(overflow):
            states = self._verify(batch, 0, q_model, in_place=False)
            finished += [self._result(s, states.get(s.request_id)) for s in batch if s.is_finished]
        first = 0
        for batch in self.scheduler.passes(keep):
            self._verify(batch, first, q_model, in_place=True)
            first += len(batch)
        self.scheduler.place(keep)
        self.scheduler.forget([s for s in overflow if s.is_finished])
        self.scheduler.requeue([s for s in overflow if not s.is_finished])
        self._done += finished + self._finish()

    @torch.inference_mode()
    def _verify(
        self, seqs: list[Sequence], first_slot: int, q_model: Transformer | None, *, in_place: bool
    ) -> dict[Hashable, torch.Tensor]:
        """One re-verification pass over `seqs` in slots `first_slot ..`; apply its outcome to the sequences.
        In place: commit the kept entries, the proposer re-observes, hidden states go to the per-slot buffer.
        Returns the hidden states of the requests it finished out of place that asked for them."""
        out = verify_rows(
            self.model,
            self.cache,
            first_slot,
            [s.prompt_ids for s in seqs],
            [s.token_ids for s in seqs],
            [s.logprobs for s in seqs],
            [s.temperature for s in seqs],
            [self._generators[s.request_id] for s in seqs],
            q_model,
        )
        self.reverify_passes += 1
        self.old_policy_rows += out.rejected_rows
        states: dict[Hashable, torch.Tensor] = {}
        for b, s in enumerate(seqs):
            total = s.num_generated
            if not s.reverified(out.kept_logprobs[b]):
                s.append(out.next_tokens[b], out.next_logprobs[b])
                self.tokens_generated += 1
            self.reverified += 1
            self.tokens_kept += out.kept[b]
            self.tokens_discarded += total - out.kept[b]
            n, m = s.num_prompt_tokens, s.num_generated
            if s.request_id in self._want_hidden:
                if in_place:
                    assert self._hidden is not None
                    self._hidden[first_slot + b, : n - 1 + m] = out.hidden[b, : n - 1 + m]
                elif s.is_finished:  # out of place and queued to resume: its prefill computes them again
                    self._prompt_hidden[s.request_id] = out.hidden[b, : n - 1].clone()
                    states[s.request_id] = out.hidden[b, n - 1 : n - 1 + m].clone()
                    self._want_hidden.discard(s.request_id)
            if in_place:
                self.cache.lengths[first_slot + b] = n + m - 1  # prompt and tokens but the last (fed next)
                if self.proposer is not None:
                    self._observe_prefix(s, first_slot + b, out.hidden[b])
        return states

    @torch.inference_mode()
    def _decode_step(self, seqs: list[Sequence]) -> None:
        """Feed each running row its last token (slots 0..B-1) and emit one token per row."""
        b = len(seqs)
        device = self.model.device
        ids = torch.tensor([s.last_token for s in seqs], device=device)[:, None]  # [B, 1]
        positions = self.cache.lengths[:b, None].clone()  # [B, 1]
        if self.graphs is not None:  # the graphs' buffer, which the next call overwrites: the proposer keeps these
            hidden = self.graphs(ids, positions).clone()  # [B, 1, H]
        else:
            hidden = self.model(ids, positions, self.cache)  # [B, 1, H]
        self.cache.advance(self._ones[:b])
        self._emit(seqs, hidden[:, 0])
        self.plain_steps += 1
        if self.proposer is not None:
            rows = [row for row, s in enumerate(seqs) if s.is_running]
            self.proposer.observe_step(rows, [seqs[row].token_ids[-1] for row in rows], hidden[:, 0])

    @torch.inference_mode()
    def _speculative_step(self, seqs: list[Sequence], arm: Arm) -> None:
        """Draft with the proposer, verify in one target forward, emit each row's accepted tokens."""
        assert self.proposer is not None
        b = len(seqs)
        temperatures = torch.tensor([s.temperature for s in seqs])
        generators = [self._generators[s.request_id] for s in seqs]
        proposal = self.proposer.propose(b, arm, temperatures, generators)
        last = torch.tensor([s.last_token for s in seqs])
        outcome = verify_round(self.model, self.cache, proposal, last, temperatures, generators, forward=self.graphs)
        self.rounds += 1
        used = []
        for row, s in enumerate(seqs):
            emitted, start = 0, s.num_prompt_tokens - 1 + s.num_generated
            for token, logprob in zip(outcome.tokens[row], outcome.logprobs[row], strict=True):
                emitted += 1
                if s.append(token, logprob):
                    break
            used.append(min(emitted, len(outcome.path[row])))  # drafted tokens emitted (not cut by a stop)
            self.tokens_generated += emitted
            self._accepts[s.request_id].append(emitted)
            if s.request_id in self._want_hidden:
                assert self._hidden is not None and s.slot is not None
                self._hidden[s.slot, start : start + emitted] = outcome.hidden[row, :emitted]
            if s.is_running:  # not finished, not parked
                self.proposer.observe(row, outcome.tokens[row], outcome.hidden[row, :emitted])
        fallback = type(self.proposer).__name__.removesuffix("Proposer").lower()
        count_sources(self.drafted_by, self.accepted_by, proposal, arm, (outcome.path, used), fallback)

    def _emit(self, seqs: list[Sequence], hidden: torch.Tensor) -> None:
        """Sample one token per row from `hidden [B, H]` and append it (with its logprob) to each sequence."""
        logits = self.model.logits(hidden)  # [B, V]
        temperatures = torch.tensor([s.temperature for s in seqs])
        tokens, logprobs = sample(logits, temperatures, [self._generators[s.request_id] for s in seqs])
        if self._want_hidden:
            keep = [b for b, s in enumerate(seqs) if s.request_id in self._want_hidden]
            if keep:  # hidden[b] produced the token about to become seqs[b]'s next generated one
                assert self._hidden is not None
                slots = torch.tensor([seqs[b].slot for b in keep], device=hidden.device)
                at = torch.tensor(
                    [seqs[b].num_prompt_tokens - 1 + seqs[b].num_generated for b in keep], device=hidden.device
                )
                rows = hidden if len(keep) == len(seqs) else hidden[torch.tensor(keep, device=hidden.device)]
                self._hidden[slots, at] = rows
        for s, token, logprob in zip(seqs, tokens.tolist(), logprobs.tolist(), strict=True):
            s.append(token, logprob)
        self.tokens_generated += len(seqs)

    def _finish(self) -> list[GenerationResult]:
        """Retire finished sequences, mirror the scheduler's slot moves in the cache, build the results."""
        states: dict[Hashable, torch.Tensor] = {}
        if self._want_hidden:  # copied out before retire() frees the slots and moves others into them
            for s in self.scheduler.running:
                if s.is_finished and s.request_id in self._want_hidden:
                    assert self._hidden is not None and s.slot is not None
                    n = s.num_prompt_tokens - 1
                    self._prompt_hidden[s.request_id] = self._hidden[s.slot, :n].clone()
                    states[s.request_id] = self._hidden[s.slot, n : n + s.num_generated].clone()
                    self._want_hidden.discard(s.request_id)
        finished, moves = self.scheduler.retire()
        for move in moves:
            self.cache.move_slot(move.src, move.dst)
            if self.proposer is not None:
                self.proposer.move_slot(move.src, move.dst)
            if self._want_hidden:
                assert self._hidden is not None
                moved = self.scheduler.running[move.dst]  # the moved sequence, now at dst
                n = moved.num_prompt_tokens - 1 + moved.num_generated
                self._hidden[move.dst, :n] = self._hidden[move.src, :n]
        return [self._result(s, states.get(s.request_id)) for s in finished]

    def _result(self, s: Sequence, hidden: torch.Tensor | None) -> GenerationResult:
        """The result of a finished request; its per-request state is dropped."""
        assert s.finish_reason is not None
        self._generators.pop(s.request_id)
        return GenerationResult(
            s.request_id,
            s.prompt_ids,
            s.token_ids,
            s.logprobs,
            s.finish_reason,
            hidden,
            self._accepts.pop(s.request_id),
            self._prompt_hidden.pop(s.request_id, None),
            s.reverifications,
            s.tokens_kept,
            s.tokens_discarded,
        )
