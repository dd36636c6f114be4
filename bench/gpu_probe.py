"""Environment probe of bench/gpu_check.sh: can the torch CUDA check run here? Writes one JSON verdict to the
file named by argv[1] (not stdout, which carries the check's one object): `{"error": ...}` or what was found.

    python bench/gpu_probe.py VERDICT.json [cuda|cpu]
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
from typing import Any, NoReturn

NEEDED = ("msgspec", "redis", "aiomqtt", "fakeredis", "amqtt", "math_verify", "transformers", "safetensors")
"""What the check imports beside torch: the first six are what the lent machines lack (the carried wheels)."""


def verdict(path: str, **fields: Any) -> NoReturn:
    with open(path, "w") as f:
        json.dump(fields, f)
    raise SystemExit(0)


def main(path: str, device: str) -> NoReturn:
    try:
        import torch
    except ImportError as exc:
        verdict(path, error=f"torch is not installed: {exc}")
    missing = []
    for name in NEEDED:
        try:
            importlib.import_module(name)
        except Exception as exc:  # ImportError, or a wheel built for another Python
            missing.append(f"{name} ({type(exc).__name__}: {exc})")
    if missing:
        verdict(path, error=f"not importable: {'; '.join(missing)}; carry them: bash bench/gpu_wheels.sh")
    if device == "cuda" and not torch.cuda.is_available():
        verdict(path, error=f"torch {torch.__version__} sees no CUDA device")
    try:
        import tlt_stream.basics.config  # noqa: F401
    except ImportError as exc:
        verdict(path, error=f"tlt_stream is not importable: {exc}")
    gpu = torch.cuda.get_device_name(0) if device == "cuda" else None
    verdict(path, torch=torch.__version__, gpu=gpu, vllm=importlib.util.find_spec("vllm") is not None)


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        sys.exit("usage: python bench/gpu_probe.py VERDICT.json [cuda|cpu]")
    main(sys.argv[1], sys.argv[2] if len(sys.argv) == 3 else "cuda")
