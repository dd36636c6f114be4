"""The shape of a decoder-only Llama/Qwen2-family model, independent of any checkpoint format.

The runtime, the KV cache and the drafter size themselves from this one frozen record, so a checkpoint's
config is parsed (and rejected when unsupported) exactly once, in `loader.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

ARCHITECTURES = ("qwen2", "llama")


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Hyper-parameters of a pre-norm decoder with RoPE, grouped-query attention and a SwiGLU MLP."""

    architecture: str
    """`"qwen2"` or `"llama"`."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000.0
    max_position_embeddings: int = 32_768
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    """Bias on the q/k/v projections (always on for Qwen2; `attention_bias` for Llama)."""
    o_bias: bool = False
    """Bias on the output projection (Llama's `attention_bias` also covers it)."""
    mlp_bias: bool = False

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"architecture must be one of {ARCHITECTURES}, got {self.architecture!r}")
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_parameters(self) -> int:
        """Parameter count with tied weights counted once."""
        h, i = self.hidden_size, self.intermediate_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        attn += (self.q_size + 2 * self.kv_size) * self.qkv_bias + h * self.o_bias
        mlp = 3 * h * i + (2 * i + h) * self.mlp_bias
        per_layer = attn + mlp + 2 * h
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embed + h
