"""Environment probe of bench/gpu_check.sh: can the vLLM backend run here? Writes one JSON verdict to the
file named by argv[1] (not stdout: importing vLLM may log there): `{"error": ...}` or the versions found.

    python bench/gpu_probe.py VERDICT.json
"""

from __future__ import annotations

import json
import sys
from typing import Any, NoReturn


def verdict(path: str, **fields: Any) -> NoReturn:
    with open(path, "w") as f:
        json.dump(fields, f)
    raise SystemExit(0)


def main(path: str) -> NoReturn:
    try:
        import torch
    except ImportError as exc:
        verdict(path, error=f"torch is not installed: {exc}")
    try:
        import vllm
    except Exception as exc:  # ImportError, or a vLLM built for another torch or CUDA
        verdict(
            path,
            error=f"vLLM is not importable ({type(exc).__name__}: {exc}); install it with "
            "pip install 'tlt-stream[vllm]' (without a network: a wheelhouse in TLT_WHEELHOUSE)",
        )
    if not torch.cuda.is_available():
        verdict(path, error=f"torch {torch.__version__} sees no CUDA device")
    try:
        import tlt_stream  # noqa: F401
    except ImportError as exc:
        verdict(path, error=f"tlt_stream is not importable: {exc}")
    verdict(path, vllm=vllm.__version__, torch=torch.__version__, gpu=torch.cuda.get_device_name(0))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python bench/gpu_probe.py VERDICT.json")
    main(sys.argv[1])
