"""A preallocated, slot-addressed KV cache.

One fixed block per layer, `[max_batch, kv_heads, max_len, head_dim]`, so a step never allocates or
concatenates. Active sequences live in slots `0..B-1` (the scheduler keeps them contiguous), which lets
attention read the view `k[layer, :B, :, :S]` instead of gathering rows. Each slot has its own committed
length; the model writes new entries after it but never moves it: the caller commits with `advance`, or
with `compact` after a tree verification keeps only the accepted path.
"""

from __future__ import annotations

import torch

from tlt_stream.model.spec import ModelSpec


def kv_bytes_per_row(spec: ModelSpec, max_len: int, dtype: torch.dtype) -> int:
    """Bytes of K and V one row of `max_len` entries takes: 2 * layers * kv_heads * head_dim * max_len * size."""
    size = torch.empty((), dtype=dtype).element_size()
    return 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * max_len * size


class KVCache:
    """K and V of shape `[layers, max_batch, kv_heads, max_len, head_dim]` and `lengths: LongTensor[max_batch]`."""

    def __init__(
        self,
        num_layers: int,
        max_batch: int,
        num_kv_heads: int,
        max_len: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if max_batch <= 0 or max_len <= 0:
            raise ValueError(f"max_batch and max_len must be positive, got {max_batch} and {max_len}")
        shape = (num_layers, max_batch, num_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = torch.zeros(max_batch, dtype=torch.long, device=device)

    @classmethod
    def for_model(
        cls,
        spec: ModelSpec,
        max_batch: int,
        max_len: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> KVCache:
        return cls(
            spec.num_layers,
            max_batch,
            spec.num_kv_heads,
            max_len,
            spec.head_dim,
            dtype=dtype,
            device=device,
        )

    @property
    def max_batch(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    def advance(self, n: torch.Tensor, *, first_slot: int = 0) -> None:
        """Commit `n[b]` more entries (`n: LongTensor[B]`) for slots `first_slot .. first_slot+B-1`."""
        self.lengths[first_slot : first_slot + n.shape[0]] += n.to(self.lengths.device)

    def reset_slot(self, slot: int) -> None:
        """Forget a slot's sequence; its stale entries are never read again."""
        self.lengths[slot] = 0

    def move_slot(self, src: int, dst: int) -> None:
        """Copy slot `src`'s committed K/V and length into slot `dst` (keeps active slots contiguous)."""
        if src == dst:
            return
        n = int(self.lengths[src])
        self.k[:, dst, :, :n] = self.k[:, src, :, :n]
        self.v[:, dst, :, :n] = self.v[:, src, :, :n]
        self.lengths[dst] = n

    def compact(self, rows: torch.Tensor | int, src_idx: torch.Tensor, count: torch.Tensor) -> None:
        """Keep only selected uncommitted entries per row, packed right after the committed ones.

        `rows` is a LongTensor `[B]` of slots, or an int `B` for slots `0..B-1`. For each row `b`, the entries
        at storage indices `lengths[b] + src_idx[b, :count[b]]` move to `lengths[b] + arange(count[b])` and
        `lengths[b]` grows by `count[b]`: the commit after a tree verification accepted a path. `src_idx`
        `[B, A]` entries past `count[b]` are ignored.
        """
        device = self.lengths.device
        if isinstance(rows, int):
            rows = torch.arange(rows, device=device)
        rows = rows.to(device)
        src_idx = src_idx.to(device)
        count = count.to(device)
        a = torch.arange(src_idx.shape[1], device=device)
        keep = a[None, :] < count[:, None]  # [B, A]
        b_sel, a_sel = keep.nonzero(as_tuple=True)  # [N], [N]
        slot = rows[b_sel]
        base = self.lengths[slot]
        src = base + src_idx[b_sel, a_sel]
        dst = base + a_sel
        k_t, v_t = self.k.transpose(2, 3), self.v.transpose(2, 3)  # [L, max_batch, max_len, kv_heads, D]
        k_sel = k_t[:, slot, src]  # [L, N, kv_heads, D]
        v_sel = v_t[:, slot, src]
        k_t[:, slot, dst] = k_sel
        v_t[:, slot, dst] = v_sel
        self.lengths.index_add_(0, rows, count)
