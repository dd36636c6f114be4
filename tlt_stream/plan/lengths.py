"""Response-length distributions the simulator draws a step's rows from.

Three sources, one type (`LengthDist`, a sorted sample of lengths drawn from with replacement):

- a run directory: `metrics.jsonl`'s per-sample `response_lens` where the learner recorded them, else a
  log-normal fitted to each step's p50 and p90 and capped at the step's longest response;
- a short rollout: the lengths themselves (`from_lengths`);
- a named long-tailed law (`named`): `lognormal:MEDIAN:SIGMA[:CAP]`, `pareto:MIN:ALPHA[:CAP]`,
  `uniform:LOW:HIGH`, `const:N`.
"""

from __future__ import annotations

import json
import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["LengthDist", "from_lengths", "from_run", "named", "replay_groups", "run_rows", "trained_share"]

_Z90 = 1.2815515655446004
"""The standard normal's 0.9 quantile: a log-normal's p90 / p50 = exp(sigma * z90)."""


_MAX_TOKENS = 10_000_000
"""The longest response a length law may give: beyond it a law needs a CAP (no model generates so many)."""


class LengthError(ValueError):
    """A length input the planner cannot use (one line for the user)."""


@dataclass(frozen=True)
class LengthDist:
    """A finite sample of response lengths (tokens, >= 1) and where it came from."""

    lengths: tuple[int, ...]
    source: str

    def __post_init__(self) -> None:
        if not self.lengths or min(self.lengths) < 1:
            raise LengthError(f"{self.source}: lengths must be a non-empty list of positive token counts")

    def draw(self, n: int, rng: random.Random) -> list[int]:
        """`n` lengths drawn with replacement."""
        return [self.lengths[rng.randrange(len(self.lengths))] for _ in range(n)]

    def capped(self, cap: int) -> LengthDist:
        return LengthDist(tuple(min(x, cap) for x in self.lengths), f"{self.source}, capped at {cap}")

    def summary(self) -> dict[str, float]:
        ordered = sorted(self.lengths)
        q = statistics.quantiles(ordered, n=10, method="inclusive") if len(ordered) > 1 else [ordered[0]] * 9
        return {
            "mean": round(statistics.fmean(ordered), 1),
            "p50": round(q[4], 1),
            "p90": round(q[8], 1),
            "max": ordered[-1],
            "max_over_median": round(ordered[-1] / max(q[4], 1.0), 2),
        }


def _token_count(value: object) -> int | None:
    """A response length as a whole number of tokens; None for what is not a finite number."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return round(value)


def from_lengths(lengths: Sequence[int], source: str = "given lengths") -> LengthDist:
    if isinstance(lengths, str | bytes | dict) or not isinstance(lengths, Sequence):
        raise LengthError(f"{source}: give a JSON list of response lengths (token counts), e.g. [812, 95, 4031]")
    counts = [_token_count(x) for x in lengths]
    if bad := [x for x, n in zip(lengths, counts, strict=True) if n is None]:
        raise LengthError(f"{source}: response lengths must be finite numbers of tokens, got {bad[0]!r}")
    return LengthDist(tuple(counts), source)  # type: ignore[arg-type]


def run_rows(run_dir: str | Path) -> list[dict]:
    """The learner's per-step records in a run's `metrics.jsonl`, one per policy version in version order (a
    resumed run's repeats of a version keep the last line written; a row without a version keeps its place).
    Lines that are not a JSON object (one cut short by a killed writer) are left out; none: no such file."""
    return _read_rows(run_dir)[0]


def _read_rows(run_dir: str | Path) -> tuple[list[dict], int]:
    """`run_rows` and how many of the file's non-blank lines were left out (not a JSON object)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return [], 0
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        raise LengthError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    by_version: dict[object, dict] = {}
    damaged = 0
    for number, line in enumerate(text.splitlines()):
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, RecursionError):
            damaged += bool(line.strip())
            continue
        damaged += not isinstance(row, dict)
        if isinstance(row, dict):
            version = row.get("version")
            key = version if isinstance(version, int) and not isinstance(version, bool) else ("line", number)
            by_version.pop(key, None)
            by_version[key] = row
    ordered = sorted(by_version.items(), key=lambda kv: (0, kv[0], 0) if isinstance(kv[0], int) else (1, 0, kv[0][1]))
    return [row for _, row in ordered], damaged


def _number(value: object) -> float | None:
    """A finite number from a record, else None."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def _lognormal_quantiles(p50: float, p90: float, cap: float, n: int) -> list[int]:
    """`n` evenly spaced quantiles of a log-normal with this p50 and p90, capped at `cap`."""
    sigma = max(math.log(max(p90, p50 + 1e-9) / max(p50, 1.0)) / _Z90, 1e-6)
    mu = math.log(max(p50, 1.0))
    out = []
    for i in range(n):
        z = statistics.NormalDist().inv_cdf((i + 0.5) / n)
        out.append(max(1, min(int(cap), round(math.exp(mu + sigma * z)))))
    return out


def from_run(run_dir: str | Path, *, skip_first: bool = True) -> LengthDist:
    """The response lengths a run's learner recorded in `metrics.jsonl` (every step but the first, which
    ran under the untrained policy, unless it is the only one). Steps whose lengths are not numbers are left out."""
    path = Path(run_dir) / "metrics.jsonl"
    if Path(run_dir).exists() and not Path(run_dir).is_dir():
        raise LengthError(f"{run_dir}: not a directory; give a run directory (the --out of `tlt-stream run`)")
    if not path.is_file():
        raise LengthError(f"{run_dir}: no metrics.jsonl (not a run directory, or no step finished)")
    records, damaged = _read_rows(run_dir)
    left_out = f"{damaged} line{'s' * (damaged != 1)} not a JSON record (cut short?) left out" if damaged else ""
    rows = []
    for r in records:
        exact = r.get("response_lens")
        counts = [_token_count(x) for x in exact] if isinstance(exact, list) else []
        if counts and all(n is not None and n >= 0 for n in counts):
            rows.append({"lens": [max(1, n) for n in counts]})  # type: ignore[type-var]
            continue
        p50, p90, top = (_number(r.get(k)) for k in ("response_len_p50", "response_len_p90", "response_len_max"))
        if p50 is not None and p90 is not None and top is not None:
            samples = _number(r.get("samples", r.get("rollout_samples")))
            rows.append({"fit": (p50, p90, top), "n": int(samples) if samples and samples >= 1 else 128})
    if not rows:
        raise LengthError(
            f"{path}: no step records response lengths (response_lens, or response_len_p50/p90/max)"
            f"{'; ' + left_out if left_out else ''}; give --lengths LAW or --lengths-file FILE instead"
        )
    if skip_first and len(rows) > 1:
        rows = rows[1:]
    lengths: list[int] = []
    exact = all("lens" in r for r in rows)
    for r in rows:
        if "lens" in r:
            lengths += r["lens"] if exact else _lognormal_quantiles(*_p50_p90_max(r["lens"]), len(r["lens"]))
        else:
            lengths += _lognormal_quantiles(*r["fit"], min(r["n"], 4096))
    how = "per-sample lengths" if exact else "log-normal fitted to each step's p50/p90, capped at its max"
    return LengthDist(tuple(lengths), f"{run_dir} ({len(rows)} steps, {how}{'; ' + left_out if left_out else ''})")


def _p50_p90_max(lengths: Sequence[int]) -> tuple[float, float, float]:
    ordered = sorted(lengths)
    q = statistics.quantiles(ordered, n=10, method="inclusive") if len(ordered) > 1 else [ordered[0]] * 9
    return q[4], q[8], ordered[-1]


def named(spec: str, *, samples: int = 4096) -> LengthDist:
    """A named law as `NAME:ARG:...`, tabulated at `samples` evenly spaced quantiles (no randomness)."""
    name, *raw = spec.split(":")
    name = name.strip().lower()
    try:
        args = [float(x) for x in raw]
    except ValueError:
        raise LengthError(f"length law {spec!r}: arguments must be numbers") from None
    if not all(math.isfinite(a) and a > 0 for a in args):
        raise LengthError(f"length law {spec!r}: arguments must be positive finite numbers")
    qs = [(i + 0.5) / samples for i in range(samples)]
    if name == "lognormal" and len(args) in (2, 3):
        median, sigma, *cap = args
        norm = statistics.NormalDist()
        values = [math.exp(min(math.log(median) + sigma * norm.inv_cdf(q), 700.0)) for q in qs]
    elif name == "pareto" and len(args) in (2, 3):
        low, alpha, *cap = args
        values = [math.exp(min(math.log(low) - math.log1p(-q) / alpha, 700.0)) for q in qs]
    elif name == "uniform" and len(args) == 2:
        low, high = args
        if low > high:
            raise LengthError(f"length law {spec!r}: uniform:LOW:HIGH needs LOW <= HIGH")
        cap = []
        values = [low + (high - low) * q for q in qs]
    elif name == "const" and len(args) == 1:
        cap = []
        values = [args[0]] * samples
    else:
        raise LengthError(
            f"unknown length law {spec!r}: lognormal:MEDIAN:SIGMA[:CAP], pareto:MIN:ALPHA[:CAP], uniform:LOW:HIGH, "
            "const:N"
        )
    top = cap[0] if cap else _MAX_TOKENS
    if max(values) > _MAX_TOKENS and not (cap and cap[0] <= _MAX_TOKENS):
        raise LengthError(
            f"length law {spec!r}: responses reach {max(values):.3g} tokens; give a CAP of at most {_MAX_TOKENS:,} "
            f"(e.g. {name}:{':'.join(raw[:2])}:32768)"
        )
    return LengthDist(tuple(max(1, round(min(v, top))) for v in values), f"law {spec}")


def trained_share(rows: Sequence[dict]) -> float:
    """The share of groups an update trained on over `metrics.jsonl` rows: groups whose rewards were all equal
    (`degenerate_groups`) carry no advantage and are left out of the update (1.0 when no row says)."""
    counted = [
        (len(r["trained_groups"]), _number(r.get("degenerate_groups")))
        for r in rows
        if isinstance(r.get("trained_groups"), list) and r["trained_groups"]
    ]
    counted = [(n, d) for n, d in counted if d is not None and d >= 0]  # rows that say, in numbers
    groups = sum(n for n, _ in counted)
    degenerate = sum(min(d, n) for n, d in counted)
    return max(0.0, 1.0 - degenerate / groups) if groups else 1.0


def _dispatch_key(task_id: str, seen: int) -> tuple:
    """The policy service's order of a group (`s{step:06d}-{index:04d}`); an id of another form keeps its place."""
    head, _, index = task_id.partition("-")
    if head[:1] == "s" and head[1:].isdigit() and index.isdigit():
        return (0, int(head[1:]), int(index), seen)
    return (1, 0, 0, seen)


def replay_groups(rows: Sequence[dict]) -> tuple[tuple[tuple[int, ...], float], ...]:
    """A run's workload group by group, in the order the policy service dispatched the groups, from its
    `metrics.jsonl` rows (every update's, the first's included): each group's response lengths and the share
    of its tokens the update trained on (`Setup.replay`). A row's samples are its groups' in `trained_groups`'
    order; a group whose recorded `rewards` are all equal trained nothing, and the row's other groups share its
    `trained_tokens` (what the overlong mask or an empty response took out is spread over them); a row without
    rewards gives each of its groups its `trained_tokens` over its response tokens. Rows whose samples do not
    split evenly into their groups are left out; empty: nothing to replay."""
    out: list[tuple[tuple, tuple[tuple[int, ...], float]]] = []
    for r in rows:
        ids, lens = r.get("trained_groups") or [], [max(1, int(x)) for x in r.get("response_lens") or []]
        if not ids or not lens or len(lens) % len(ids):
            continue
        size = len(lens) // len(ids)
        groups = [tuple(lens[i * size : (i + 1) * size]) for i in range(len(ids))]
        rewards = r.get("rewards")
        if rewards is not None and len(rewards) == len(lens):
            signal = [len(set(rewards[i * size : (i + 1) * size])) > 1 for i in range(len(ids))]
        else:
            signal = [True] * len(ids)
        flagged = sum(sum(g) for g, s in zip(groups, signal, strict=True) if s)
        trained = float(r.get("trained_tokens", flagged))
        share = min(1.0, trained / flagged) if flagged else 0.0
        for task_id, g, s in zip(ids, groups, signal, strict=True):
            out.append((_dispatch_key(str(task_id), len(out)), (g, share if s else 0.0)))
    out.sort(key=lambda pair: pair[0])
    return tuple(group for _, group in out)
