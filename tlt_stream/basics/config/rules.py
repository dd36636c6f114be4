"""Rules between sections of the configuration: what one section's value forbids or needs in another's.

A field's own range is its `Meta` constraint and a section's own consistency its `__post_init__`; a rule that
spans sections has its home here, and is checked once, on the whole tree, after every layer is applied
(`load_config`, `override`). Each broken rule is a `ConfigError` naming the key to change, so a wrong setting
stops a service at start-up with one line, never inside a running loop.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from tlt_stream.basics.errors import ConfigError

if TYPE_CHECKING:
    from tlt_stream.basics.config.tree import Config

__all__ = ["check_rules", "draft_source", "problems", "trains_drafter"]


def trains_drafter(config: Config) -> bool:
    """Whether rollout workers train the drafter online: asked for, a state directory to train into, and an
    EAGLE drafter to start from (prompt lookup has nothing to train)."""
    own = config.drafter
    return own.train and own.state_dir is not None and config.sd.drafter not in (None, "ngram")


def draft_source(config: Config) -> str | None:
    """The rollout workers' draft source: `sd.drafter` when set; otherwise the one `tlt-stream run` fills in
    from `launch.sd` ("eagle": the world's or launch.drafter's drafter, "ngram", or None for off). A service
    started on its own with no `sd.drafter` has none; its engine build refuses group drafts without one."""
    if config.sd.drafter is not None:
        return config.sd.drafter
    return None if config.launch.sd == "off" else config.launch.sd


def problems(config: Config) -> list[tuple[str, str]]:
    """(key, why) for every rule `config` breaks, in the order of the sections."""
    from tlt_stream.basics.config.tree import RUN_PATTERN

    found: list[tuple[str, str]] = []
    if re.fullmatch(RUN_PATTERN, config.run) is None:
        # The field's own pattern lets a trailing newline through (`$` matches before one): such a run's topics
        # are refused by the broker, so its services would never connect.
        found.append(("run", f"{config.run!r} does not match {RUN_PATTERN}: use letters, digits, '_', '.' and '-'"))
    rollout, sd, policy = config.rollout, config.sd, config.policy
    source = draft_source(config)
    if sd.drafter is not None and sd.arm == "plain":
        found.append(("sd.arm", "is plain but sd.drafter is set: name a drafting arm, or leave sd.drafter unset"))
    if sd.group and source is None:
        found.append(("sd.group", "drafts beside a draft source: set sd.drafter (a drafter, or ngram)"))
    if rollout.backend == "vllm":
        if sd.adaptive and sd.group:
            found.append(
                (
                    "sd.adaptive",
                    "vLLM's custom proposer drafts group chains at one depth, so the vllm backend cannot tune "
                    "them: use --fixed-sd with group drafts (docs/vllm.md)",
                )
            )
        if sd.group and sd.drafter not in (None, "ngram"):
            found.append(
                (
                    "sd.group",
                    "the vllm backend runs one draft source per engine, so group drafts do not merge with an EAGLE "
                    "drafter: use --drafter ngram with group drafts (group/history drafts alone), or the torch backend",
                )
            )
        if policy.partial_rollouts and policy.ahead_rows:
            found.append(
                (
                    "policy.ahead_rows",
                    "vLLM schedules its own batch, so the vllm backend starts drafts in any free slot: use 0, or "
                    "the torch backend",
                )
            )
        if rollout.graphs in ("cuda", "trace"):
            found.append(("rollout.graphs", "is the torch engine's (vLLM captures its own CUDA graphs): use off"))
    window = policy.prompts_per_step * (policy.max_staleness + 1)
    if config.groups_per_step > window:
        found.append(
            (
                "learner.groups_per_step",
                f"is {config.groups_per_step}, more than the {window} groups policy.prompts_per_step x "
                "(policy.max_staleness + 1) lets out before the next version: the first update would wait for "
                "ever; use at most that",
            )
        )
    own = config.drafter
    if own.train and own.state_dir is not None and sd.drafter in (None, "ngram"):
        found.append(
            (
                "drafter.state_dir",
                "online drafter training needs an EAGLE drafter to start from: set sd.drafter DIR, or "
                "drafter.train false",
            )
        )
    return found


def check_rules(config: Config) -> Config:
    """`config`, when it breaks no rule between sections; else a `ConfigError` naming every key to change."""
    found = problems(config)
    if found:
        raise ConfigError("; ".join(f"{key}: {why}" for key, why in found))
    return config
