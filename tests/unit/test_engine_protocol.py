"""Both rollout backends offer the one engine surface (`rollout/protocol.py`) with the same parameters: the
vLLM backend cannot run here (no GPU), so a drift between the two must fail on the CPU."""

from __future__ import annotations

import inspect

import pytest

from tlt_stream.rollout.engine import GenerationEngine
from tlt_stream.rollout.protocol import RolloutEngine
from tlt_stream.rollout.vllm.backend import VllmEngine

MEMBERS = [name for name in vars(RolloutEngine) if not name.startswith("_")]


def test_the_protocol_names_the_surface_the_roles_use() -> None:
    assert {"has_unfinished", "num_running", "add_request", "step", "load_policy", "load_drafter"} <= set(MEMBERS)
    assert {"tokens_generated", "rounds", "plain_steps", "arm"} <= set(RolloutEngine.__annotations__)


@pytest.mark.parametrize("backend", [GenerationEngine, VllmEngine], ids=lambda c: c.__name__)
def test_a_backend_has_every_member_with_the_same_parameters(backend: type) -> None:
    for name in MEMBERS:
        wanted = vars(RolloutEngine)[name]
        assert hasattr(backend, name), f"{backend.__name__} lacks {name}"
        found = inspect.getattr_static(backend, name)
        assert isinstance(found, property) == isinstance(wanted, property), f"{backend.__name__}.{name}"
        if callable(wanted) and not isinstance(wanted, property):
            params = [(p.name, p.kind, p.default) for p in inspect.signature(wanted).parameters.values()]
            have = [(p.name, p.kind, p.default) for p in inspect.signature(found).parameters.values()]
            assert have == params, f"{backend.__name__}.{name}{inspect.signature(found)}"
    source = inspect.getsource(backend.__init__)
    for name in RolloutEngine.__annotations__:  # attributes: set in __init__, or a property
        found = inspect.getattr_static(backend, name, None)
        assert isinstance(found, property) or f"self.{name} =" in source or f", self.{name} =" in source, (
            f"{backend.__name__} has no attribute {name}"
        )
