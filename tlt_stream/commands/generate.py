"""`tlt-stream generate`: batch generation from a JSONL file with the rollout engine (plain or speculative).

Input rows are `{"prompt_ids": [...]}` or `{"prompt": "..."}` (tokenised with the checkpoint's tokenizer);
output rows, in input order, are `{"token_ids", "logprobs", "finish_reason", "accept_lengths"}`. A bad row, a
prompt that leaves the model's context no room for a response, or an `--output` that cannot be written stops
the command before the model loads, in one line; a response that would run past the context is cut at it, as
a rollout worker's is, with a warning. `--backend vllm` runs the same rows on vLLM (`rollout/vllm/backend.py`;
EAGLE chains and n-gram only), refused in one line when vLLM is not installed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tlt_stream.commands.args import EXIT_CONFIG, positive

if TYPE_CHECKING:
    from tlt_stream.rollout.arms import Arm

__all__ = ["SEED_RANGE", "InputError", "handle", "read_prompts", "register", "run_generate", "seed"]

SEED_RANGE = (-(2**63), 2**63 - 1)
"""What a `torch.Generator` seed may be (a 64-bit signed integer); row i samples with seed + i."""


def seed(text: str) -> int:
    """An argparse type: an integer seed inside `SEED_RANGE`."""
    value = int(text)
    if not SEED_RANGE[0] <= value <= SEED_RANGE[1]:
        raise argparse.ArgumentTypeError(f"must be a 64-bit integer (from -2**63 to 2**63 - 1), got {value}")
    return value


class InputError(Exception):
    """The input file or one of its rows is unusable, or `--output` cannot be written; the message names the
    file (and line)."""


@dataclass(frozen=True)
class GenerateOptions:
    model: Path
    input: Path
    output: Path
    drafter: str | None = None
    depth: int = 4
    topk: int = 1
    verify: int | None = None
    temperature: float = 0.0
    max_new_tokens: int = 256
    seed: int = 0
    batch_size: int = 32
    dtype: str = "float32"
    backend: str = "torch"
    """"torch" (this project's engine) or "vllm"."""


def read_prompts(path: Path, tokenizer_dir: Path, vocab_size: int, context: int | None = None) -> list[list[int]]:
    """Token ids of every input row, validated; with `context` (the model's positions), each prompt leaves
    room for one response token at least."""
    from tlt_stream.model.loader import prompt_encoder
    from tlt_stream.rl.datasets import jsonl_lines

    encode = None
    prompts: list[list[int]] = []
    for number, line in jsonl_lines(path, InputError, lambda n: f"{path}:{n}"):
        where = f"{path}:{number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InputError(f"{where}: not valid JSON ({exc.msg})") from None
        if not isinstance(row, dict):
            raise InputError(f"{where}: expected an object with 'prompt_ids' or 'prompt'")
        if "prompt_ids" in row:
            ids = row["prompt_ids"]
            if (
                not isinstance(ids, list)
                or not ids
                or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids)
            ):
                raise InputError(f"{where}: 'prompt_ids' must be a non-empty list of integers")
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise InputError(f"{where}: token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
            prompts.append(ids)
        elif "prompt" in row:
            if not isinstance(row["prompt"], str) or not row["prompt"].strip():
                raise InputError(f"{where}: 'prompt' must be a non-empty string (not only whitespace)")
            try:
                row["prompt"].encode("utf-8")
            except UnicodeEncodeError as exc:
                raise InputError(
                    f"{where}: 'prompt' holds an unpaired surrogate escape ({row['prompt'][exc.start]!r}); "
                    "write the character itself or its surrogate pair"
                ) from None
            if encode is None:
                encode = prompt_encoder(_tokenizer(tokenizer_dir, where))
            ids = encode(row["prompt"])
            if not ids:
                raise InputError(f"{where}: the prompt tokenises to nothing")
            if max(ids) >= vocab_size:  # a tokenizer that is not the model's: the model embeds no such id
                raise InputError(
                    f"{where}: the prompt tokenises to id {max(ids)}, outside the model's vocabulary "
                    f"[0, {vocab_size}): the tokenizer in {tokenizer_dir} is not the model's"
                )
            prompts.append(list(ids))
        else:
            raise InputError(f"{where}: expected 'prompt_ids' or 'prompt', got keys {sorted(row)}")
        if context is not None and len(prompts[-1]) >= context:
            raise InputError(
                f"{where}: the prompt is {len(prompts[-1])} tokens and the model's context {context} "
                "(max_position_embeddings): no room for a response"
            )
    if not prompts:
        raise InputError(f"{path}: no prompts")
    return prompts


def _tokenizer(directory: Path, where: str) -> Any:
    from tlt_stream.model import CheckpointError, load_tokenizer

    try:
        return load_tokenizer(directory)
    except CheckpointError as exc:
        raise InputError(
            f"{where}: a text prompt needs the checkpoint's tokenizer, which failed to load ({exc})"
        ) from None


def _check_output(path: Path) -> None:
    """Refuse an `--output` that cannot be written before any work is done, rather than lose the results: a
    file is made (and removed) in its folder, where `_write_output` will write."""
    import tempfile

    from tlt_stream.drafter.export import file_in_the_way

    if path.is_dir():
        raise InputError(f"--output {path}: is a directory; name a file")
    if (blocker := file_in_the_way(path)) is not None:
        raise InputError(f"--output {path}: {blocker} is a file, not a folder; name another --output")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(f"--output {path}: cannot make its folder ({exc.strerror or exc})") from None
    if path.exists() and not path.is_file():  # a stream (/dev/stdout, a pipe): written to as it is
        if not os.access(path, os.W_OK):
            raise InputError(f"--output {path}: not writable")
        return
    if path.exists() and not os.access(path, os.W_OK):
        raise InputError(f"--output {path}: not writable")
    try:
        fd, probe = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.resolve().parent)
    except OSError as exc:
        raise InputError(f"--output {path}: not writable ({exc.strerror or exc})") from None
    os.close(fd)
    os.unlink(probe)


def _write_output(path: Path, rows: list[str]) -> None:
    """Write `rows` to `path` whole or not at all: a regular file is written next to itself and renamed over
    it (an earlier output stays as it was on failure); a stream is written to directly."""
    import tempfile

    if path.exists() and not path.is_file():
        with path.open("w") as out:
            out.writelines(rows)
        return
    target = path.resolve()  # through a symlink: replace the file it names, not the link
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with os.fdopen(fd, "w") as out:
            out.writelines(rows)
        if target.exists():
            os.chmod(tmp, target.stat().st_mode & 0o7777)
        else:
            os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _check_sampling(opts: GenerateOptions) -> None:
    """Refuse sampling options the engine cannot honour, naming the flag, before anything loads."""
    if not math.isfinite(opts.temperature) or opts.temperature < 0:
        raise InputError(f"--temperature must be a finite number >= 0 (0 for greedy), got {opts.temperature}")
    if not SEED_RANGE[0] <= opts.seed <= SEED_RANGE[1]:
        raise InputError(f"--seed {opts.seed}: must be a 64-bit integer (from -2**63 to 2**63 - 1)")


def _response_budgets(prompts: list[list[int]], max_new_tokens: int, context: int | None) -> list[int]:
    """Each prompt's response budget: `max_new_tokens`, cut where prompt + response would pass `context` (the
    worker's rule for rollouts); a warning on stderr says how many were cut."""
    if context is None:
        return [max_new_tokens] * len(prompts)
    budgets = [min(max_new_tokens, context - len(p)) for p in prompts]
    if cut := sum(b < max_new_tokens for b in budgets):
        print(
            f"tlt-stream generate: warning: {cut} of {len(prompts)} prompts + --max-new-tokens {max_new_tokens} "
            f"pass the model's context {context} (max_position_embeddings): their responses stop at it",
            file=sys.stderr,
        )
    return budgets


def _generate_with_progress(
    engine: Any, prompts: list[list[int]], budgets: list[int], opts: GenerateOptions, eos: list[int]
) -> list:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    ids = [
        engine.add_request(p, budget, opts.temperature, opts.seed + i, eos)
        for i, (p, budget) in enumerate(zip(prompts, budgets, strict=True))
    ]
    done: dict[Any, Any] = {}
    columns = (TextColumn("generating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, transient=True, console=_stderr_console()) as progress:
        task = progress.add_task("generate", total=len(ids))
        while engine.has_unfinished:
            for result in engine.step():
                done[result.request_id] = result
                progress.advance(task)
    return [done[i] for i in ids]


def _stderr_console() -> Any:
    from rich.console import Console

    return Console(stderr=True)


def _fitting_rows(opts: GenerateOptions, spec: Any, max_len: int, draft_nodes: int | None) -> int:
    """Rows decoded together: at most `--batch-size`, and as many as half the free memory holds (the
    services' default budget), each with its KV cache over the longest prompt and budget plus the draft
    nodes one round verifies; an `InputError` with the numbers when not even one row fits."""
    import torch

    from tlt_stream.model.sizing import engine_bytes_per_row, free_memory

    headroom = draft_nodes + 1 if draft_nodes is not None else 0
    per_row = engine_bytes_per_row(spec, max_len, getattr(torch, opts.dtype), headroom=headroom)
    budget = free_memory("cpu") // 2
    if per_row > budget:
        drafts = f" and {headroom - 1} draft nodes (--depth/--topk/--verify)" if draft_nodes is not None else ""
        raise InputError(
            f"one row of {max_len} tokens{drafts} needs {per_row / 2**30:.2f} GiB of KV cache and half the free "
            f"memory is {budget / 2**30:.2f} GiB; lower --max-new-tokens, --depth or --verify"
        )
    return min(opts.batch_size, budget // per_row)


def _vllm_engine(opts: GenerateOptions, max_len: int, arm: Any) -> Any:
    from tlt_stream.rollout.vllm.backend import VllmEngine, VllmSettings

    label = None
    if arm is not None:
        label = f"ngram-d{arm.depth}" if opts.drafter == "ngram" else arm.label
    settings = VllmSettings(
        max_batch=opts.batch_size,
        max_len=max_len,
        temperature=opts.temperature,
        arm=label,
        dtype=opts.dtype,
        hidden="none",
    )
    return VllmEngine(opts.model, settings=settings, drafter=None if opts.drafter == "ngram" else opts.drafter)


def _check_drafter(path: Path, spec: Any) -> None:
    """Refuse, before the model loads, a drafter checkpoint that is unreadable or made for another policy's
    shape (its weights are read when the proposer is built)."""
    from tlt_stream.drafter.model import check_drafter_fits, read_drafter_spec

    drafter = read_drafter_spec(path)
    check_drafter_fits(
        (drafter.hidden_size, drafter.vocab_size),
        (spec.hidden_size, spec.vocab_size),
        named=f"--drafter {path}",
        fits="this one",
    )


def _arm(opts: GenerateOptions) -> Arm | None:
    """The drafter arm of --depth, --topk and --verify (None without --drafter); what `Arm` refuses, in one line
    naming the flag."""
    from tlt_stream.rollout.arms import MAX_DRAFT_DEPTH, Arm, ArmTooDeep

    if opts.drafter is None:
        return None
    verify = opts.verify or opts.depth * opts.topk
    try:
        return Arm.drafter(opts.depth, opts.topk, verify)
    except ArmTooDeep:
        raise InputError(f"--depth {opts.depth}: a draft is at most {MAX_DRAFT_DEPTH} levels deep") from None
    except ValueError:
        if verify <= opts.depth * opts.topk**2:
            raise
        raise InputError(
            f"--verify {verify}: a tree of --depth {opts.depth} and --topk {opts.topk} offers at most "
            f"{opts.depth * opts.topk**2} nodes to verify; lower --verify or raise --depth/--topk"
        ) from None


def run_generate(opts: GenerateOptions) -> dict[str, Any]:
    import torch
    from safetensors import SafetensorError

    from tlt_stream.model import CheckpointError, load_model, load_spec, stop_token_ids
    from tlt_stream.model.loader import check_checkpoint, checkpoint_positions
    from tlt_stream.rollout.engine import GenerationEngine
    from tlt_stream.rollout.proposers import build_proposer

    if opts.backend not in ("torch", "vllm"):
        raise ValueError(f"unknown backend {opts.backend!r} (torch, vllm)")
    if opts.backend == "vllm":
        from tlt_stream.rollout.vllm.backend import require_vllm

        require_vllm()  # before reading anything: one line when it is missing
    _check_sampling(opts)
    _check_output(opts.output)
    arm = _arm(opts)  # before anything loads
    if not opts.model.is_dir():
        raise CheckpointError(f"{opts.model}: checkpoint directory does not exist")
    spec = load_spec(opts.model)
    context = checkpoint_positions(opts.model)
    if opts.drafter is not None and opts.drafter != "ngram":
        _check_drafter(Path(opts.drafter), spec)
        if opts.topk > spec.vocab_size:
            raise InputError(
                f"--topk {opts.topk} is more than the model's {spec.vocab_size} tokens; use --topk <= {spec.vocab_size}"
            )
    prompts = read_prompts(opts.input, opts.model, spec.vocab_size, context)
    if opts.seed + len(prompts) - 1 > SEED_RANGE[1]:
        raise InputError(
            f"--seed {opts.seed}: row i samples with seed + i, which passes 2**63 - 1 for {len(prompts)} rows; "
            "use a smaller --seed"
        )
    if opts.backend == "torch":  # its safetensors headers and every tensor the runtime reads, before any load
        try:
            check_checkpoint(opts.model)
        except SafetensorError as exc:  # a truncated or foreign weights file
            raise CheckpointError(f"{opts.model}: unreadable safetensors ({exc})") from None
    budgets = _response_budgets(prompts, opts.max_new_tokens, context)
    max_len = max(len(p) + b for p, b in zip(prompts, budgets, strict=True))
    if opts.backend == "vllm":
        engine = _vllm_engine(opts, max_len, arm)
    else:
        nodes = max(64, arm.nodes if arm else 0)
        rows = _fitting_rows(opts, spec, max_len, nodes if arm else None)
        model = load_model(opts.model, dtype=getattr(torch, opts.dtype))
        proposer = build_proposer(opts.drafter, model) if opts.drafter is not None else None
        engine = GenerationEngine(model, rows, max_len, proposer=proposer, arm=arm, max_draft_nodes=nodes)
    start = time.perf_counter()
    results = _generate_with_progress(engine, prompts, budgets, opts, stop_token_ids(opts.model))
    seconds = time.perf_counter() - start
    keys = ("token_ids", "logprobs", "finish_reason", "accept_lengths")
    try:
        _write_output(opts.output, [json.dumps({k: getattr(r, k) for k in keys}) + "\n" for r in results])
    except OSError as exc:
        raise InputError(f"--output {opts.output}: cannot write ({exc.strerror or exc})") from None
    tokens = sum(len(r.token_ids) for r in results)
    rounds = sum(len(r.accept_lengths) for r in results)
    summary = {
        "prompts": len(results),
        "tokens": tokens,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 1) if seconds else None,
        "sd": arm.label if arm else "off",
        "mean_accept_length": round(sum(sum(r.accept_lengths) for r in results) / rounds, 3) if rounds else None,
        "output": str(opts.output),
        "backend": opts.backend,
    }
    if opts.backend == "vllm":
        engine.close()
    print(json.dumps(summary), file=sys.stderr)
    return summary


def register(commands: Any) -> None:
    gen = commands.add_parser(
        "generate",
        help="generate from a JSONL file of prompts with the rollout engine (plain or speculative)",
        description='Rows {"prompt_ids": [...]} or {"prompt": "..."} in; rows {token_ids, logprobs, '
        "finish_reason, accept_lengths} out, in input order.",
    )
    gen.add_argument(
        "--model", required=True, help="Hugging Face checkpoint directory (Llama, Qwen2, Qwen3, Mistral, Ministral)"
    )
    gen.add_argument("--drafter", help="drafter checkpoint directory, or 'ngram' for prompt lookup")
    gen.add_argument("--sd", choices=["off", "on"], help="speculative decoding (default: on with --drafter)")
    gen.add_argument("--depth", type=positive, default=4, help="draft depth (levels)")
    gen.add_argument("--topk", type=positive, default=1, help="children per drafted node (1: a chain)")
    gen.add_argument("--verify", type=positive, help="nodes verified per round (default depth x topk)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 for greedy")
    gen.add_argument("--max-new-tokens", type=positive, default=256)
    gen.add_argument("--seed", type=seed, default=0, help="row i samples with seed + i")
    gen.add_argument("--batch-size", type=positive, default=32, help="rows decoded together at most")
    gen.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    gen.add_argument(
        "--backend",
        choices=["torch", "vllm"],
        default="torch",
        help="torch: this project's engine; vllm: vLLM on a GPU (pip install 'tlt-stream[vllm]'; EAGLE chains)",
    )
    gen.add_argument("--input", required=True, help="JSONL prompts")
    gen.add_argument("--output", required=True, help="JSONL results")
    gen.add_argument("-v", "--verbose", action="count", default=0)
    gen.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:

    from tlt_stream.model import CheckpointError
    from tlt_stream.rollout.vllm.backend import BackendUnavailable

    sd = args.sd or ("on" if args.drafter else "off")
    if sd == "on" and not args.drafter:
        print("tlt-stream generate: --sd on needs --drafter DIR or --drafter ngram", file=sys.stderr)
        return EXIT_CONFIG
    options = GenerateOptions(
        model=Path(args.model),
        input=Path(args.input),
        output=Path(args.output),
        drafter=args.drafter if sd == "on" else None,
        depth=args.depth,
        topk=args.topk,
        verify=args.verify,
        temperature=args.temperature,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        batch_size=args.batch_size,
        dtype=args.dtype,
        backend=args.backend,
    )
    try:
        run_generate(options)
    except (InputError, CheckpointError, ValueError, BackendUnavailable) as exc:
        print(f"tlt-stream generate: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    return 0
