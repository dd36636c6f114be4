"""Where one batch-1 decode step's time goes, ours against transformers, on a family's ~100M model: the
operators' own CPU time under `torch.profiler`, the matrix products apart (both sides must do them), and the
wall time per token unprofiled. The share of the GEMMs in transformers' step bounds the ratio any runtime
reaches at the same arithmetic: 1 / (that share) if everything else went to zero.

Prints progress to stderr and one JSON object to stdout. Run from the repository root:
`python -m bench.decode_profile [--family qwen3] [--tokens 48]`.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

GEMMS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::mv", "aten::dot"}
"""Operators whose own time is a matrix product (wrappers such as `aten::linear` and `aten::matmul` are not:
their own time is dispatch)."""


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--family", default="qwen3")
    p.add_argument("--size", default="100m")
    p.add_argument("--tokens", type=int, default=48, help="decode steps profiled per side")
    p.add_argument("--batch", type=int, default=1, help="rows decoded together (16-token prompts)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--top", type=int, default=12, help="operators listed per side")
    return p.parse_args()


def summary(prof: Any, steps: int, top: int) -> dict[str, Any]:
    own: Counter[str] = Counter()
    for e in prof.key_averages():
        own[e.key] += e.self_cpu_time_total
    total = sum(own.values())
    gemm = sum(v for k, v in own.items() if k in GEMMS)
    return {
        "op_ms_per_step": round(total / steps / 1e3, 3),
        "gemm_ms_per_step": round(gemm / steps / 1e3, 3),
        "gemm_share_of_ops": round(gemm / total, 3),
        "top_ops_ms_per_step": {k: round(v / steps / 1e3, 3) for k, v in own.most_common(top)},
    }


def main() -> None:
    args = parse_args()
    import torch
    from torch.profiler import ProfilerActivity, profile

    from bench.families import build
    from tlt_stream.rollout.engine import GenerationEngine

    torch.set_num_threads(args.threads)
    settings = argparse.Namespace(device="cpu", dtype="float32")
    with tempfile.TemporaryDirectory(prefix="tlt-profile-") as tmp:
        hf, ours = build(Path(tmp), args.family, args.size, 256, settings)
    n = args.tokens
    prompt = torch.randint(1, ours.spec.vocab_size, (args.batch, 16), generator=torch.Generator().manual_seed(1))
    engine = GenerationEngine(ours, args.batch, 16 + n + 2)
    kwargs = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)

    def ours_steps(profiler: Any = None) -> float:
        """Wall seconds of the decode steps alone (the prefill step runs before)."""
        for row in prompt.tolist():
            engine.add_request(row, n + 2)  # the first step emits two tokens a row
        engine.step()
        t0 = time.perf_counter()
        if profiler is not None:
            profiler.start()
        while engine.has_unfinished:
            engine.step()
        if profiler is not None:
            profiler.stop()
        return time.perf_counter() - t0

    class Steps:
        """A streamer that notes each token's time and runs `profiler` from the first decoded token on."""

        def __init__(self, profiler: Any) -> None:
            self.times: list[float] = []
            self.profiler = profiler

        def put(self, value: Any) -> None:
            self.times.append(time.perf_counter())
            if len(self.times) == 2 and self.profiler is not None:
                self.profiler.start()

        def end(self) -> None:
            if self.profiler is not None:
                self.profiler.stop()

    def hf_steps(profiler: Any = None) -> float:
        """Wall seconds of `generate`'s decode steps: from its first decoded token to its last."""
        steps = Steps(profiler)
        with torch.inference_mode():
            hf.generate(prompt, attention_mask=torch.ones_like(prompt), streamer=steps, **kwargs)
        return steps.times[-1] - steps.times[1]

    ours_steps(), hf_steps()  # warm-up
    walls: dict[str, list[float]] = {"ours": [], "hf": []}
    for _ in range(3):
        walls["ours"].append(ours_steps() / n)
        walls["hf"].append(hf_steps() / (n - 1))
    result: dict[str, Any] = {"bench": "decode_profile", "family": args.family, "size": args.size, "steps": n}
    result["batch"] = args.batch
    result["wall_ms_per_step"] = {k: round(1e3 * sorted(v)[1], 2) for k, v in walls.items()}
    for side, run in (("ours", ours_steps), ("hf", hf_steps)):
        prof = profile(activities=[ProfilerActivity.CPU])
        run(prof)
        result[side] = summary(prof, n if side == "ours" else n - 1, args.top)
        print(f"[profile] {side}: {json.dumps(result[side])}", file=sys.stderr, flush=True)
    hf_gemm = result["hf"]["gemm_ms_per_step"]
    result["hf_gemm_share_of_wall"] = round(hf_gemm / result["wall_ms_per_step"]["hf"], 3)
    result["ratio_if_ours_were_only_gemms"] = round(
        result["wall_ms_per_step"]["hf"] / result["ours"]["gemm_ms_per_step"], 3
    )
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
