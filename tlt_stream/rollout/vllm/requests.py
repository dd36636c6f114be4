"""The requests a `VllmEngine` has in vLLM, and when each one ends (pure: no vllm import).

vLLM returns a request without stop strings once, finished (`FINAL_ONLY`). Stop strings are this project's
own rule (`rollout/stops.py`, applied token by token): vLLM would need a tokenizer to check them, and the
backend runs it in token-id mode. So a request with stop strings streams its new tokens (`DELTA`), the rule
runs on them after every engine step, and a request that completes a stop string is cut there and aborted in
vLLM: the sample is the one the torch engine returns, however many tokens one speculative step added past
the stop.

With partial rollouts (`partial.py`) every request streams: its tokens and behaviour log-probs so far are what
a new policy version re-verifies. A request then lives through several vLLM requests: after a re-verification
it is added again with prompt + the tokens it kept (and the resampled one) as vLLM's prompt, so `Pending`
holds the whole response, `base` of its tokens being part of the current vLLM request's prompt. A draft
(`ahead_limit`) that vLLM ended (at its limit, or at an end of its own) parks here (`Requests.parked`) until
the next version.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any

from tlt_stream.rollout.engine import GenerationResult
from tlt_stream.rollout.scheduler import FinishReason, keep_prefix
from tlt_stream.rollout.stops import StopStrings
from tlt_stream.rollout.vllm.outputs import FINISH_REASONS, accept_lengths, sampled_logprobs, to_generation_result

__all__ = ["Pending", "Requests"]


@dataclass
class Pending:
    """One request: what was asked, and (streaming requests) what it returned so far."""

    request_id: Hashable
    prompt_ids: list[int]
    eos_ids: frozenset[int]
    return_hidden: bool
    stop: StopStrings | None = None
    stream: bool = False
    """Stream every step's tokens (partial rollouts), stop strings or not."""
    max_new_tokens: int = 0
    temperature: float = field(default=0.0, kw_only=True)  # greedy unless given (the engine always gives it)
    seed: int | None = None
    ahead_limit: int | None = None
    """A draft for the next policy version: it parks after this many tokens, or when it ends before."""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    metrics: Any = None
    """vLLM's per-request SD metrics of the current vLLM request."""
    base: int = 0
    """Response tokens sent to vLLM as part of the current request's prompt (after a re-verification)."""
    rounds: list[int] = field(default_factory=list)
    """Accept lengths of the earlier vLLM requests of this one (before its re-verifications)."""
    finish: FinishReason | None = None
    """Why a parked draft ended (None: it reached its `ahead_limit`), and after a re-verification why it did."""
    reverifications: int = 0
    tokens_kept: int = 0
    tokens_discarded: int = 0

    @property
    def streams(self) -> bool:
        """Whether vLLM sends its tokens step by step (DELTA) rather than once finished."""
        return self.stream or self.stop is not None

    def ends(self) -> FinishReason | None:
        """Why the response ends after its last token (`scheduler.Sequence.append`'s rule), or None."""
        if self.token_ids and self.token_ids[-1] in self.eos_ids:
            return "eos"
        if self.stop is not None and self.token_ids and self.stop(self.token_ids):
            return "stop"
        if len(self.token_ids) >= self.max_new_tokens:
            return "length"
        return None

    def left_engine(self) -> None:
        """Its vLLM request is over (aborted for a re-verification, or parked): fold its rounds in."""
        self.rounds += accept_lengths(self.metrics, len(self.token_ids) - self.base)
        self.metrics = None

    def reverified(self, kept_logprobs: list[float], next_token: int, next_logprob: float) -> bool:
        """A new policy kept the first `len(kept_logprobs)` tokens (with its log-probs): the rest are dropped,
        and unless it kept all of a response that had ended, `next_token` follows. True: it has ended."""
        if keep_prefix(self, kept_logprobs):
            self.finish = None
        if self.finish is None:
            self.token_ids.append(int(next_token))
            self.logprobs.append(float(next_logprob))
            self.finish = self.ends()
        return self.finish is not None

    def output(self, reason: str, stop_reason: Any = None, prompt_ids: Any = None) -> dict[str, Any]:
        """A finished vLLM output (as `outputs.to_generation_result` reads it) for the whole response."""
        return {
            "finished": True,
            "prompt_token_ids": self.prompt_ids if prompt_ids is None else prompt_ids,
            "outputs": [
                {
                    "token_ids": self.token_ids,
                    "logprobs": [{t: lp} for t, lp in zip(self.token_ids, self.logprobs, strict=True)],
                    "finish_reason": reason,
                    "stop_reason": stop_reason,
                    "spec_decode_metrics": self.metrics,
                }
            ],
        }

    def finished_output(self) -> dict[str, Any]:
        """The output of a response that ended here (`finish`), not in vLLM."""
        assert self.finish is not None
        if self.finish == "stop":
            assert self.stop is not None
            return self.output("stop", self.stop.strings[0])
        return self.output("stop" if self.finish == "eos" else "length")


def _completion(output: Any) -> Any:
    (completion,) = output.outputs
    return completion


class Requests:
    """The pending requests by vLLM request id; `collect` turns one engine step's outputs into results."""

    def __init__(self) -> None:
        self.pending: dict[str, Pending] = {}
        """In vLLM."""
        self.parked: list[Pending] = []
        """Drafts vLLM ended, waiting for the next policy version (in the order they parked)."""

    def __len__(self) -> int:
        return len(self.pending)

    def add(self, key: str, pending: Pending) -> None:
        self.pending[key] = pending

    def take_all(self) -> tuple[list[str], list[Pending]]:
        """Every request, out of here: (the vLLM ids to abort, the requests: those in vLLM, then the parked
        ones)."""
        keys, rows = list(self.pending), [*self.pending.values(), *self.parked]
        for pending in self.pending.values():
            pending.left_engine()
        self.pending, self.parked = {}, []
        return keys, rows

    def collect(self, outputs: Iterable[Any]) -> tuple[list[tuple[GenerationResult, Pending]], list[str]]:
        """(finished results with their requests, vLLM ids to abort: requests cut at a stop string). Drafts
        that vLLM ended go to `parked`."""
        done: list[tuple[GenerationResult, Pending]] = []
        abort: list[str] = []
        for out in outputs:
            pending = self.pending.get(out.request_id)
            if pending is None:
                continue
            if not pending.streams:
                if out.finished:
                    del self.pending[out.request_id]
                    done.append((self.result(out, pending), pending))
                continue
            completion = _completion(out)
            new = [int(t) for t in completion.token_ids]
            pending.token_ids += new
            pending.logprobs += sampled_logprobs(new, completion.logprobs) if new else []
            pending.metrics = getattr(completion, "spec_decode_metrics", None) or pending.metrics
            cut = pending.stop.first_stop(pending.token_ids) if pending.stop is not None else None  # > base
            if cut is None and not out.finished:
                continue
            del self.pending[out.request_id]
            if cut is not None and not out.finished:
                abort.append(out.request_id)
            reason, stop_reason = completion.finish_reason, completion.stop_reason
            if cut is not None:
                del pending.token_ids[cut:], pending.logprobs[cut:]
                reason, stop_reason = "stop", pending.stop.strings[0]  # type: ignore[union-attr]
            if pending.ahead_limit is not None:  # a draft: it waits for the next version, ended or not
                self._park(pending, reason, stop_reason)
                continue
            done.append((self.result(pending.output(reason, stop_reason), pending), pending))
        return done, abort

    def _park(self, pending: Pending, reason: str, stop_reason: Any) -> None:
        finish = "stop" if isinstance(stop_reason, str) else FINISH_REASONS.get(str(reason))
        if finish is None:
            raise ValueError(
                f"request {pending.request_id!r}: vLLM finished it with {reason!r}, which yields no sample"
            )
        if finish == "length" and len(pending.token_ids) < pending.max_new_tokens:
            finish = None  # at its ahead_limit, not at its end
        pending.finish = finish
        pending.left_engine()
        self.parked.append(pending)

    @staticmethod
    def result(output: Any, pending: Pending) -> GenerationResult:
        """`output` (finished) as the request's result, with its re-verification counts."""
        result = to_generation_result(
            output,
            request_id=pending.request_id,
            prompt_ids=pending.prompt_ids,
            eos_ids=pending.eos_ids,
            stop=pending.stop,
        )
        if pending.reverifications or pending.rounds:
            result.accept_lengths = pending.rounds + accept_lengths(
                pending.metrics, len(result.token_ids) - pending.base
            )
        result.reverifications = pending.reverifications
        result.tokens_kept, result.tokens_discarded = pending.tokens_kept, pending.tokens_discarded
        return result
