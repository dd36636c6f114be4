"""The shape of a decoder-only Llama/Qwen/Mistral-family model, independent of any checkpoint format.

The runtime, the KV cache and the drafter size themselves from this one frozen record, so a checkpoint's
config is parsed (and rejected when unsupported) exactly once, in `loader.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

ARCHITECTURES = ("qwen2", "llama", "qwen3", "mistral")
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
POSITIVE_SIZES = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
)
"""The sizes a spec must hold at least 1 of."""


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Hyper-parameters of a pre-norm decoder with RoPE, grouped-query attention and a SwiGLU MLP."""

    architecture: str
    """`"qwen2"`, `"llama"`, `"qwen3"` or `"mistral"` (the weight layout: Qwen3 adds per-head q/k norms)."""
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
    qk_norm: bool = False
    """RMSNorm over each head of q and of k before RoPE (Qwen3's `q_norm`/`k_norm`)."""
    rope_type: str = "default"
    """How the RoPE frequencies are scaled: `default`, `linear`, `llama3` or `yarn` (transformers' names)."""
    rope_factor: float = 1.0
    """The scaling factor of linear, llama3 and YaRN RoPE."""
    rope_low_freq_factor: float = 1.0
    """llama3: wavelengths above `original / low_freq_factor` are divided by `rope_factor`."""
    rope_high_freq_factor: float = 4.0
    """llama3: wavelengths below `original / high_freq_factor` are kept; between the two they are blended."""
    rope_original_max_positions: int = 0
    """llama3 and YaRN: the context length of pre-training (0 for the other types)."""
    rope_beta_fast: float = 32.0
    """YaRN: rotations below which a dimension is interpolated fully."""
    rope_beta_slow: float = 1.0
    """YaRN: rotations above which a dimension is extrapolated (left as it is)."""
    rope_truncate: bool = True
    """YaRN: round the correction range to whole dimensions (transformers' `truncate`)."""
    rope_attention_factor: float = 1.0
    """Multiplies cos and sin (YaRN's attention scaling, 0.1 ln(factor) + 1 unless the checkpoint sets it)."""
    sliding_window: int | None = None
    """Mistral's attention window: runs only with a KV cache no longer than it (then it never slides)."""

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"architecture must be one of {ARCHITECTURES}, got {self.architecture!r}")
        for name in POSITIVE_SIZES:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_type must be one of {ROPE_TYPES}, got {self.rope_type!r}")
        if self.rope_type in ("llama3", "yarn") and self.rope_original_max_positions <= 0:
            raise ValueError(f"{self.rope_type} RoPE needs rope_original_max_positions > 0")
        if self.rope_factor <= 0 or self.rope_attention_factor <= 0:
            raise ValueError("rope_factor and rope_attention_factor must be positive")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    def check_window(self, max_len: int) -> None:
        """Raise ValueError unless sequences of `max_len` tokens stay inside the checkpoint's attention
        window, if it has one (then the window never slides and full attention is exact)."""
        if self.sliding_window is not None and max_len > self.sliding_window:
            raise ValueError(
                f"max_len {max_len} is longer than the checkpoint's {self.sliding_window}-token attention window: "
                f"a sliding window is not supported by the torch runtime (use max_len <= {self.sliding_window}); "
                'the vLLM backend (rollout.backend = "vllm") runs it'
            )

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
        per_layer = attn + mlp + 2 * h + 2 * self.head_dim * self.qk_norm
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embed + h
