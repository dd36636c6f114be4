"""The configuration tree: one frozen msgspec Struct per section, every setting once, with its one default and
its one docstring (the `Meta` description `tlt-stream config describe` prints).

Sections: `bus` (Redis and MQTT), `policy` (the policy service and the run's RL shape), `rollout` (a rollout
worker), `sd` (speculative decoding), `drafter` (online drafter training), `learner` (the GRPO learner) and
`launch` (what `tlt-stream run` starts), each declared in `services.py`, `rollout.py` or `learner.py`. The
role loops and the cores take these sections (or the whole tree) as their settings; no other place writes a
default again, which `tests/unit/test_config_tree.py` checks. Rules between sections live in `rules.py`.

A recipe that belongs to one workload is a named preset (`PRESETS`), applied under whatever the file, the
environment and the flags say: `preset = "tiny-world"`.
"""

from __future__ import annotations

from typing import Annotated, Any

from msgspec import Struct, field

from tlt_stream.basics.config.fields import doc
from tlt_stream.basics.config.learner import LearnerConfig
from tlt_stream.basics.config.rollout import DrafterConfig, RolloutConfig, SdConfig
from tlt_stream.basics.config.services import BusConfig, DataConfig, LaunchConfig, PolicyConfig

__all__ = [
    "DEFAULTS",
    "PRESETS",
    "BusConfig",
    "Config",
    "DataConfig",
    "DrafterConfig",
    "LaunchConfig",
    "LearnerConfig",
    "PolicyConfig",
    "RolloutConfig",
    "SdConfig",
]


RUN_MAX_CHARS = 64
"""The longest run name the configuration takes."""
RUN_PATTERN = rf"^[A-Za-z0-9][A-Za-z0-9_.-]{{0,{RUN_MAX_CHARS - 1}}}$"


class Config(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The whole configuration of a tlt-stream run; one TOML file, one table per section."""

    run: Annotated[
        str,
        doc("Run name: every Redis key is prefixed `tlt:{run}:`, every MQTT topic `tlt/{run}/`.", pattern=RUN_PATTERN),
    ] = "default"
    preset: Annotated[
        str | None,
        doc(
            "A workload's recipe (`tlt-stream config describe` lists them), applied under every value given "
            'explicitly. `tlt-stream run` on the tiny world uses tiny-world unless told otherwise ("none").'
        ),
    ] = None
    bus: Annotated[BusConfig, doc("Redis streams and MQTT.")] = field(default_factory=BusConfig)
    policy: Annotated[PolicyConfig, doc("The policy service and the run's step shape.")] = field(
        default_factory=PolicyConfig
    )
    data: Annotated[DataConfig, doc("Prompts and datasets.")] = field(default_factory=DataConfig)
    rollout: Annotated[RolloutConfig, doc("Rollout workers.")] = field(default_factory=RolloutConfig)
    sd: Annotated[SdConfig, doc("Speculative decoding.")] = field(default_factory=SdConfig)
    drafter: Annotated[DrafterConfig, doc("Online drafter training.")] = field(default_factory=DrafterConfig)
    learner: Annotated[LearnerConfig, doc("The GRPO learner.")] = field(default_factory=LearnerConfig)
    launch: Annotated[LaunchConfig, doc("`tlt-stream run`.")] = field(default_factory=LaunchConfig)

    @property
    def topic_prefix(self) -> str:
        return f"tlt/{self.run}/"

    def expand(self, path: str) -> str:
        """A path setting with `{run}` replaced by the run name (compose: `/data/runs/{run}`)."""
        return path.replace("{run}", self.run)

    @property
    def groups_per_step(self) -> int:
        """The learner's groups per update: its own setting, else the policy's prompts per step."""
        return self.learner.groups_per_step or self.policy.prompts_per_step

    @property
    def until_version(self) -> int:
        """The policy version the learner stops at."""
        return self.learner.until_version or self.policy.steps


DEFAULTS = Config()
"""Every default, for the cores' own settings dataclasses to read (never to write a second time)."""


PRESETS: dict[str, dict[str, Any]] = {
    "tiny-world": {
        "learner": {"lr": 2.5e-5, "warmup_steps": 20, "final_norm_lr_scale": 800.0},
    },
}
"""Named recipes. tiny-world: the tiny world's policy learns mostly by sharpening, which the final norm's gain
does fastest (here at lr 2e-2), while a low lr on the matrices damages least what supervised training taught;
20 warm-up updates keep the first Adam steps from undoing it."""
