"""Building blocks of a Llama/Qwen/Mistral decoder layer, written for few, large operators.

On CPU a small model's decode step is largely per-operator overhead, so q/k/v are one Linear, gate/up are
one Linear, RoPE is applied to q and k together in three kernels, the MLP works in place (large fresh
buffers cost page faults in prefill), and everything a step shares across layers (RoPE tables, write
indices, the attention mask) is computed once into `AttentionContext`. The maths follows the Hugging Face
reference implementations so their logits are a tight oracle.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tlt_stream.model.cache import KVCache
from tlt_stream.model.spec import ModelSpec


@dataclass(slots=True)
class AttentionContext:
    """Everything one forward's layers share: RoPE factors, where new K/V go, what each query may see."""

    cos: torch.Tensor
    """`[B, T, 1, D]` cos(position * inv_freq), duplicated over both halves of the head."""
    sin: torch.Tensor
    """`[B, T, 1, D]` sin(position * inv_freq) with the first half negated (folds rotate_half's sign)."""
    write_slot: torch.Tensor
    """`[B, T]` cache slot of each new token."""
    write_pos: torch.Tensor
    """`[B, T]` cache storage index of each new token (`lengths[b] + spec_offset + t`)."""
    first_slot: int
    kv_len: int
    """S: number of leading cache entries attention reads."""
    mask: torch.Tensor | None
    """`[B, 1, T, S]` additive mask (0 or -inf), or None when every query may see all S entries."""
    is_causal: bool = False
    """Plain causal attention over a fresh prefill (S == T)."""


def attention_context(
    positions: torch.Tensor,
    cache: KVCache,
    inv_freq: torch.Tensor,
    dtype: torch.dtype,
    *,
    num_new: torch.Tensor | None = None,
    tree_mask: torch.Tensor | None = None,
    first_slot: int = 0,
    spec_offset: int = 0,
    static_len: int | None = None,
    rope_scale: float = 1.0,
) -> AttentionContext:
    """Build one forward's `AttentionContext`; the semantics are `Transformer.forward`'s. `rope_scale`
    multiplies cos and sin (YaRN's attention factor)."""
    b, t = positions.shape
    device = positions.device
    u = spec_offset + t  # uncommitted entries visible to this call
    if spec_offset < 0:
        raise ValueError(f"spec_offset must be >= 0, got {spec_offset}")
    if tree_mask is not None and (tree_mask.shape != (b, t, u) or tree_mask.dtype != torch.bool):
        raise ValueError(f"tree_mask must be bool {(b, t, u)}, got {tree_mask.dtype} {tuple(tree_mask.shape)}")
    if num_new is not None and num_new.shape != (b,):
        raise ValueError(f"num_new must have shape {(b,)}, got {tuple(num_new.shape)}")
    lengths = cache.lengths[first_slot : first_slot + b]  # [B]
    if static_len is None:
        lo, hi = (int(v) for v in torch.aminmax(lengths))
        kv_len = hi + u
    else:  # no host read: S is the caller's, the mask does the rest (`graphs`)
        lo, hi, kv_len = 0, static_len - u, static_len
    if first_slot + b > cache.max_batch or kv_len > cache.max_len:
        raise ValueError(
            f"forward over slots {first_slot}..{first_slot + b - 1} with {u} uncommitted tokens after up to "
            f"{hi} cached ones exceeds the cache ({cache.max_batch} slots x {cache.max_len} entries)"
        )
    cos, sin = rope_tables(positions, inv_freq, dtype, rope_scale)
    query = spec_offset + torch.arange(t, device=device)  # [T] uncommitted index of each new token
    write_slot = torch.arange(first_slot, first_slot + b, device=device)[:, None].expand(b, t)
    write_pos = lengths[:, None] + query  # [B, T]
    if static_len is not None:  # padded rows of a captured batch (idle slots) may run past the cache
        write_pos = write_pos.clamp(max=cache.max_len - 1)
    plain = num_new is None and tree_mask is None
    if plain and static_len is None and lo == hi and (u == 1 or (hi == 0 and spec_offset == 0)):
        return AttentionContext(cos, sin, write_slot, write_pos, first_slot, kv_len, None, t > 1)
    rel = torch.arange(kv_len, device=device)[None, None, :] - lengths[:, None, None]  # [B, 1, S]
    query = query[None, :, None]  # [1, T, 1]
    sees = (  # [B, T, S]
        rel <= query if tree_mask is None else tree_mask.gather(2, rel.clamp(0, u - 1).expand(b, t, kv_len))
    )
    if num_new is not None:
        sees = sees & ((rel < spec_offset + num_new[:, None, None]) | (rel == query))
    allowed = (rel < 0) | ((rel < u) & sees)  # [B, T, S]
    mask = torch.zeros(allowed.shape, dtype=cache.k.dtype, device=device)
    mask.masked_fill_(~allowed, float("-inf"))
    return AttentionContext(cos, sin, write_slot, write_pos, first_slot, kv_len, mask.unsqueeze(1))


def rope_inv_freq(spec: ModelSpec) -> torch.Tensor:
    """theta_i = base^(-2i/D) for i < D/2, in fp32, then scaled as `spec.rope_type` says; each formula is
    transformers' (`modeling_rope_utils`), so its cos/sin tables are reproduced to the bit."""
    d = spec.head_dim
    exponents = torch.arange(0, d, 2, dtype=torch.float) / d  # [D/2]
    if spec.rope_type == "yarn":
        return _yarn_inv_freq(spec, spec.rope_theta**exponents)
    inv_freq = 1.0 / (spec.rope_theta**exponents)  # [D/2]
    if spec.rope_type == "linear":
        return inv_freq / spec.rope_factor
    if spec.rope_type == "llama3":
        return _llama3_inv_freq(spec, inv_freq)
    return inv_freq


def _llama3_inv_freq(spec: ModelSpec, inv_freq: torch.Tensor) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by the factor, short ones kept, a smooth blend between."""
    factor, low, high = spec.rope_factor, spec.rope_low_freq_factor, spec.rope_high_freq_factor
    old_context = spec.rope_original_max_positions
    low_freq_wavelen, high_freq_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_inv_freq(spec: ModelSpec, pos_freqs: torch.Tensor) -> torch.Tensor:
    """YaRN: dimensions that rotate fewer than `beta_slow` times over the original context are interpolated
    (divided by the factor), those above `beta_fast` extrapolated, a linear ramp between."""
    d, base, factor = spec.head_dim, spec.rope_theta, spec.rope_factor
    original = spec.rope_original_max_positions

    def correction_dim(rotations: float) -> float:
        return (d * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(spec.rope_beta_fast), correction_dim(spec.rope_beta_slow)
    if spec.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def rope_tables(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype, scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sign-folded sin for `positions [B, T]`, each `[B, T, 1, D]`, times `scale` (YaRN)."""
    freqs = positions[..., None].float() * inv_freq  # [B, T, D/2]
    cos_half, sin_half = freqs.cos(), freqs.sin()
    if scale != 1.0:
        cos_half, sin_half = cos_half * scale, sin_half * scale
    cos = torch.cat((cos_half, cos_half), dim=-1)
    sin = torch.cat((-sin_half, sin_half), dim=-1)
    return cos.unsqueeze(2).to(dtype), sin.unsqueeze(2).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, with rotate_half(x) * sin == roll(x, D/2) * sin_signed."""
    return (x * cos).addcmul_(x.roll(x.shape[-1] // 2, dims=-1), sin)  # [B, T, heads, D]


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * w."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        y = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
        return self.weight * y.to(x.dtype)


class Attention(nn.Module):
    """Grouped-query self-attention over the slot-addressed KV cache, with a fused q/k/v projection.

    Attention runs in the cache's dtype, which may be wider than the weights' (bf16 weights with an fp32
    cache: CPU attention kernels are much faster in fp32, and the cast of K/V is exact).
    """

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.num_heads = spec.num_heads
        self.num_kv_heads = spec.num_kv_heads
        self.head_dim = spec.head_dim
        self.scale = spec.head_dim**-0.5
        self.qkv_proj = nn.Linear(spec.hidden_size, spec.q_size + 2 * spec.kv_size, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(spec.q_size, spec.hidden_size, bias=spec.o_bias)
        if spec.qk_norm:
            self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)
            self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)
        self.qk_norm = spec.qk_norm

    def _rotated_qk(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """`qkv [B, T, h + 2hk, D]` -> q and k with RoPE applied, `[B, T, h + hk, D]` (Qwen3: each head
        RMS-normalised first)."""
        h = self.num_heads
        if self.qk_norm:
            qk = torch.cat((self.q_norm(qkv[:, :, :h]), self.k_norm(qkv[:, :, h : h + self.num_kv_heads])), dim=2)
        else:
            qk = qkv[:, :, : h + self.num_kv_heads]
        return apply_rope(qk, cos, sin)

    def forward(
        self, x: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        """`x [B, T, H]`; `k_cache`, `v_cache` are this layer's `[max_batch, kv_heads, max_len, D]`."""
        b, t, _ = x.shape
        h, hk = self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x).view(b, t, h + 2 * hk, self.head_dim)  # [B, T, h + 2hk, D]
        qk = self._rotated_qk(qkv, ctx.cos, ctx.sin).to(k_cache.dtype)  # [B, T, h + hk, D]
        q, k, v = qk[:, :, :h], qk[:, :, h:], qkv[:, :, h + hk :].to(k_cache.dtype)
        k_cache.transpose(1, 2).index_put_((ctx.write_slot, ctx.write_pos), k)
        v_cache.transpose(1, 2).index_put_((ctx.write_slot, ctx.write_pos), v)
        rows = slice(ctx.first_slot, ctx.first_slot + b)
        keys = k_cache[rows, :, : ctx.kv_len]  # [B, hk, S, D]
        values = v_cache[rows, :, : ctx.kv_len]
        if t == 1 and b > 1 and keys.dtype == torch.float32:
            out = self._decode_attention(q, keys, values, ctx.mask)  # [B, 1, h, D]
        else:
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2),  # [B, h, T, D]
                keys,
                values,
                attn_mask=ctx.mask,
                is_causal=ctx.is_causal,
                scale=self.scale,
                enable_gqa=h != hk,
            ).transpose(1, 2)  # [B, T, h, D]
        return self.o_proj(out.reshape(b, t, h * self.head_dim).to(x.dtype))

    def dense(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Cache-free self-attention among the T tokens of `x [B, T, H]` (training: autograd-friendly).

        `mask [B, 1, T, T]` bool (True: may attend), e.g. block-diagonal causal for packed sequences.
        """
        b, t, _ = x.shape
        h, hk = self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x).view(b, t, h + 2 * hk, self.head_dim)
        qk = self._rotated_qk(qkv, cos, sin)
        q, k, v = qk[:, :, :h], qk[:, :, h:], qkv[:, :, h + hk :]
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=mask,
            scale=self.scale,
            enable_gqa=h != hk,
        ).transpose(1, 2)  # [B, T, h, D]
        return self.o_proj(out.reshape(b, t, h * self.head_dim))

    def _decode_attention(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """softmax(q k^T / sqrt(D) + mask) v for one query per row, the query heads of each KV group folded
        into one matmul; on CPU in fp32 this beats SDPA's flash kernel for single-token batches."""
        b, _, h, d = q.shape
        hk = self.num_kv_heads
        q = q.reshape(b, hk, h // hk, d)  # [B, hk, h/hk, D]
        scores = torch.matmul(q, keys.transpose(-1, -2)).mul_(self.scale)  # [B, hk, h/hk, S]
        if mask is not None:
            scores.add_(mask)  # mask [B, 1, 1, S]
        probs = torch.softmax(scores, dim=-1)
        return torch.matmul(probs, values).view(b, 1, h, d)  # [B, 1, h, D]


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), with gate and up fused into one Linear."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.intermediate_size = spec.intermediate_size
        self.gate_up_proj = nn.Linear(spec.hidden_size, 2 * spec.intermediate_size, bias=spec.mlp_bias)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=spec.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [B, T, 2I]
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        if torch.is_grad_enabled():  # training (the drafter): autograd needs the inputs intact
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(gate, inplace=True).mul_(up))  # in place: no new [B, T, I] buffers


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec)

    def forward(
        self, x: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), k_cache, v_cache, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))

    def dense(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The same block without a KV cache (see `Attention.dense`)."""
        x = x + self.self_attn.dense(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))
