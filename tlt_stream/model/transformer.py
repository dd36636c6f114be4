"""The decoder-only runtime: one forward contract for prefill, decode and tree verification.

Plain decoding, padded prefill and speculative verification of a token tree are all the same call: row b
appends T new tokens after its committed cache entries, RoPE uses explicit `positions` (tree nodes at the
same depth share one), and `tree_mask` says which new tokens each new token sees. Nothing is committed
here; the caller advances or compacts the cache, which keeps rollback after a rejected draft free.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tlt_stream.model.cache import KVCache
from tlt_stream.model.layers import DecoderLayer, RMSNorm, attention_context, rope_inv_freq
from tlt_stream.model.spec import ModelSpec


class Transformer(nn.Module):
    """A Llama/Qwen/Mistral-family causal LM. Build with `loader.load_model`, or directly for random weights."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec) for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        if spec.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(spec), persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """`[V, H]`; the embedding matrix itself when embeddings are tied."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def new_cache(self, max_batch: int, max_len: int, *, dtype: torch.dtype | None = None) -> KVCache:
        """A cache sized for this model; `dtype` defaults to the weights' dtype."""
        return KVCache.for_model(self.spec, max_batch, max_len, dtype=dtype or self.dtype, device=self.device)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """`ids [...]` -> `[..., H]`."""
        return self.embed_tokens(ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head: `hidden [..., H]` (the final-norm output) -> `[..., V]`."""
        return F.linear(hidden, self.lm_head_weight)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        *,
        num_new: torch.Tensor | None = None,
        tree_mask: torch.Tensor | None = None,
        first_slot: int = 0,
        spec_offset: int = 0,
        static_len: int | None = None,
    ) -> torch.Tensor:
        """Run `input_ids [B, T]` at `positions [B, T]` against cache slots `first_slot .. first_slot+B-1`.

        Row b's new K/V are written at storage indices `cache.lengths[slot] + spec_offset + arange(T)`.
        Query t sees the committed entries `[0, lengths[slot])` and the uncommitted entries j (storage
        `lengths[slot] + j`, `j < spec_offset + T`: earlier draft levels, then this call's tokens) with
        `tree_mask[b, t, j]` (`[B, T, spec_offset + T]` bool; None means all earlier uncommitted entries and
        causal among the new ones). `num_new [B]` marks the first `num_new[b]` new tokens of row b as real
        and the rest as padding: no real query sees padding, and padding queries see themselves so they
        stay finite. The caller guarantees `lengths[slot] + spec_offset + T <= cache.max_len`. Lengths are
        not advanced. With `static_len` S, attention reads S cache entries (S >= every row's length + T, the
        caller's guarantee) with the rest masked, and nothing is read back to the host: the shapes are
        fixed by (B, T, S) and the forward can be captured in a graph (`graphs`).

        Returns the final-norm hidden states `[B, T, H]` (what `logits` and an EAGLE drafter consume).
        """
        ctx = attention_context(
            positions,
            cache,
            self.inv_freq,
            self.dtype,
            num_new=num_new,
            tree_mask=tree_mask,
            first_slot=first_slot,
            spec_offset=spec_offset,
            static_len=static_len,
            rope_scale=self.spec.rope_attention_factor,
        )
        if input_ids.shape != positions.shape:
            raise ValueError(f"input_ids {tuple(input_ids.shape)} and positions {tuple(positions.shape)} differ")
        x = self.embed_tokens(input_ids)  # [B, T, H]
        for i, layer in enumerate(self.layers):
            x = layer(x, cache.k[i], cache.v[i], ctx)
        return self.norm(x)
