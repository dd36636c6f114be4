"""The requests a `VllmEngine` has in vLLM, and when each one ends (pure: no vllm import).

vLLM returns a request without stop strings once, finished (`FINAL_ONLY`). Stop strings are this project's
own rule (`rollout/stops.py`, applied token by token): vLLM would need a tokenizer to check them, and the
backend runs it in token-id mode. So a request with stop strings streams its new tokens (`DELTA`), the rule
runs on them after every engine step, and a request that completes a stop string is cut there and aborted in
vLLM: the sample is the one the torch engine returns, however many tokens one speculative step added past
the stop.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any

from tlt_stream.rollout.engine import GenerationResult
from tlt_stream.rollout.stops import StopStrings
from tlt_stream.rollout.vllm.outputs import to_generation_result

__all__ = ["Pending", "Requests"]


@dataclass
class Pending:
    """One request in vLLM: what was asked, and (stop strings only) what it returned so far."""

    request_id: Hashable
    prompt_ids: list[int]
    eos_ids: frozenset[int]
    return_hidden: bool
    stop: StopStrings | None = None
    token_ids: list[int] = field(default_factory=list)
    positions: list[Any] = field(default_factory=list)
    metrics: Any = None

    @property
    def streams(self) -> bool:
        """Whether vLLM sends its tokens step by step (DELTA) rather than once finished."""
        return self.stop is not None


def _completion(output: Any) -> Any:
    (completion,) = output.outputs
    return completion


class Requests:
    """The pending requests by vLLM request id; `collect` turns one engine step's outputs into results."""

    def __init__(self) -> None:
        self.pending: dict[str, Pending] = {}

    def __len__(self) -> int:
        return len(self.pending)

    def add(self, key: str, pending: Pending) -> None:
        self.pending[key] = pending

    def collect(self, outputs: Iterable[Any]) -> tuple[list[tuple[GenerationResult, Pending]], list[str]]:
        """(finished results with their requests, vLLM ids to abort: requests cut at a stop string)."""
        done: list[tuple[GenerationResult, Pending]] = []
        abort: list[str] = []
        for out in outputs:
            pending = self.pending.get(out.request_id)
            if pending is None:
                continue
            if not pending.streams:
                if out.finished:
                    del self.pending[out.request_id]
                    done.append((self._result(out, pending), pending))
                continue
            completion = _completion(out)
            pending.token_ids += [int(t) for t in completion.token_ids]
            logprobs = completion.logprobs
            pending.positions += [logprobs[i] for i in range(len(logprobs))] if logprobs is not None else []
            pending.metrics = getattr(completion, "spec_decode_metrics", None) or pending.metrics
            assert pending.stop is not None
            cut = pending.stop.first_stop(pending.token_ids)
            if cut is None and not out.finished:
                continue
            del self.pending[out.request_id]
            if cut is not None and not out.finished:
                abort.append(out.request_id)
            reason = "stop" if cut is not None else completion.finish_reason
            stop_reason = pending.stop.strings[0] if cut is not None else completion.stop_reason
            whole = {
                "finished": True,
                "prompt_token_ids": out.prompt_token_ids,
                "outputs": [
                    {
                        "token_ids": pending.token_ids,
                        "logprobs": pending.positions,
                        "finish_reason": reason,
                        "stop_reason": stop_reason,
                        "spec_decode_metrics": pending.metrics,
                    }
                ],
            }
            done.append((self._result(whole, pending), pending))
        return done, abort

    @staticmethod
    def _result(output: Any, pending: Pending) -> GenerationResult:
        return to_generation_result(
            output,
            request_id=pending.request_id,
            prompt_ids=pending.prompt_ids,
            eos_ids=pending.eos_ids,
            stop=pending.stop,
        )
