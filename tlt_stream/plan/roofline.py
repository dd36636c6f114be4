"""The GPU cost model: a roofline per forward, from vendors' published figures and stated achieved fractions.

One engine spans `tp` GPUs (tensor parallel). For a forward of `b` rows, `q` query tokens each (1 to decode,
nodes + 1 to verify), `ctx` tokens of context, a model of P parameters (bf16, 2 bytes each), L layers, KV
of `kv_bytes` per token:

    bytes  = 2 P + b ctx kv_bytes                       (weights once, every row's KV once)
    flops  = 2 P b q + 4 L (heads head_dim) b q ctx     (matmuls, attention's QK^T and PV)
    t      = max(bytes / (tp BW bw_frac), flops / (tp PEAK flop_frac)) + step_overhead_s
             + (tp > 1) 2 L allreduce_s

The drafter (EAGLE: one decoder layer, the 2H -> H fc and the target's LM head) is the same formula with its
own parameters, once per tree level, `topk` candidates per row. The learner: response tokens x
`learn_flops_per_param` P (old logprobs 2, reference 2, forward + backward 6, recomputation 2) plus its
attention, over learner_gpus x PEAK x `mfu`. Publication: the bf16 weights over `sync_bytes_per_s` plus
`sync_fixed_s`.

GPU figures are the datasheets' dense BF16 tensor-core peaks and HBM bandwidths (SXM parts). The achieved
fractions, the learner's MFU, the overheads and the sync bandwidth are assumptions, named here, printed
with every projection, and varied by `tlt-stream plan --vary`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from tlt_stream.basics.config import DEFAULTS
from tlt_stream.rollout.arms import Arm

__all__ = ["GPUS", "MODELS", "Gpu", "GpuCosts", "ModelShape"]


@dataclass(frozen=True)
class Gpu:
    name: str
    bf16_flops: float
    """Dense BF16 tensor-core peak, FLOP/s."""
    hbm_bytes_per_s: float
    memory_bytes: float
    source: str


GPUS: dict[str, Gpu] = {
    "h100": Gpu("H100 SXM5 80GB", 989.4e12, 3.35e12, 80e9, "NVIDIA H100 Tensor Core GPU datasheet (SXM5)"),
    "h200": Gpu("H200 SXM 141GB", 989.4e12, 4.8e12, 141e9, "NVIDIA H200 Tensor Core GPU datasheet (SXM)"),
    "a100": Gpu("A100 SXM4 80GB", 312e12, 2.039e12, 80e9, "NVIDIA A100 Tensor Core GPU datasheet (80GB SXM)"),
}


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    @property
    def layer_params(self) -> float:
        attn = 2 * self.hidden * self.heads * self.head_dim + 2 * self.hidden * self.kv_heads * self.head_dim
        return attn + 3 * self.hidden * self.intermediate

    @property
    def params(self) -> float:
        """Weights a forward reads: the layers, the embedding row (negligible) and the untied LM head."""
        return self.layers * self.layer_params + self.vocab * self.hidden

    @property
    def total_params(self) -> float:
        return self.params + self.vocab * self.hidden

    @property
    def kv_bytes(self) -> float:
        """bf16 K and V per token over every layer."""
        return 2 * self.layers * self.kv_heads * self.head_dim * 2

    @property
    def drafter_params(self) -> float:
        """An EAGLE drafter's forward: one layer, the 2H -> H fc, the target's LM head."""
        return self.layer_params + 2 * self.hidden * self.hidden + self.vocab * self.hidden


MODELS: dict[str, ModelShape] = {  # the checkpoints' config.json
    "7B": ModelShape("Qwen2.5-7B", 28, 3584, 28, 4, 128, 18944, 152064),
    "14B": ModelShape("Qwen2.5-14B", 48, 5120, 40, 8, 128, 13824, 152064),
    "32B": ModelShape("Qwen2.5-32B", 64, 5120, 40, 8, 128, 27648, 152064),
}


@dataclass(frozen=True)
class GpuCosts:
    """The roofline above for one model on one GPU type; every assumption a named field."""

    gpu: Gpu
    model: ModelShape
    tp: int = 1
    learner_gpus: int = DEFAULTS.launch.learner_gpus or 1
    bw_frac: float = 0.8
    """Achieved share of HBM bandwidth in decode (assumption)."""
    flop_frac: float = 0.6
    """Achieved share of peak FLOP/s in inference matmuls (assumption)."""
    mfu: float = 0.35
    """The learner's model FLOPs utilisation (assumption)."""
    step_overhead_s: float = 0.002
    """Per target forward: scheduling, sampling, launches with CUDA graphs (assumption)."""
    draft_overhead_s: float = 0.0005
    """Per drafter forward (one tree level) beyond its roofline (assumption)."""
    round_overhead_s: float = 0.001
    """Per speculative round: tree mask, acceptance, KV commit (assumption)."""
    allreduce_s: float = 15e-6
    """One tensor-parallel all-reduce of a decode step's activations (assumption)."""
    learn_flops_per_param: float = 12.0
    """Per response token: old logprobs 2, reference 2, forward + backward 6, recomputation 2."""
    sync_bytes_per_s: float = 10e9
    """Weight publication: bf16 weights moved to the rollout engines per second (assumption)."""
    sync_fixed_s: float = 2.0
    """Weight publication's fixed part: engines paused, caches flushed, resumed (assumption)."""
    mem_util: float = 0.8
    """Share of each rollout GPU's memory the engine may use (weights + KV cache)."""
    optimizer_s: float = 0.0
    load_s: float = 0.0
    hop_s: float = 0.0
    """The worker's loop beside its engine (`EngineCosts.hop_s`, `finish_s`, `group_s`, `window_s`): not
    modelled on a GPU node, where a hop of engine steps takes far longer than a poll of Redis or a group's
    output."""
    finish_s: float = 0.0
    group_s: float = 0.0
    window_s: float = 0.0
    cores: float = float("inf")
    learner_beside_training: float = 1.0
    """The learner has devices of its own: the drafter's training beside it costs it nothing."""
    padded: bool = False
    """A GPU engine's paged KV cache: each row reads its own context (`EngineCosts.padded`)."""

    def _forward(self, params: float, batch: int, q: int, context: float, layers: int) -> float:
        m = self.model
        bytes_ = 2 * params + batch * context * m.kv_bytes * layers / m.layers
        flops = 2 * params * batch * q + 4 * layers * m.heads * m.head_dim * batch * q * context
        t_mem = bytes_ / (self.tp * self.gpu.hbm_bytes_per_s * self.bw_frac)
        t_flop = flops / (self.tp * self.gpu.bf16_flops * self.flop_frac)
        return max(t_mem, t_flop)

    def _comm(self, layers: int) -> float:
        return 2 * layers * self.allreduce_s if self.tp > 1 else 0.0

    def decode_s(self, batch: int, context: float) -> float:
        m = self.model
        return self._forward(m.params, batch, 1, context, m.layers) + self.step_overhead_s + self._comm(m.layers)

    def round_s(self, batch: int, arm: Arm, context: float, accepted: float = 0.0) -> float:
        """`accepted` changes nothing here: the drafter's catch-up over a row's accepted tokens widens one forward
        of a one-layer drafter by a few tokens, whose weights it streams once whatever their number."""
        if arm.kind == "plain":
            return self.decode_s(batch, context)
        m = self.model
        verify = self._forward(m.params, batch, arm.nodes + 1, context, m.layers)
        verify += self.step_overhead_s + self.round_overhead_s + self._comm(m.layers)
        if arm.kind in ("ngram", "group"):
            return verify
        level = self._forward(m.drafter_params, batch, max(arm.topk, 1), context, 1)
        return verify + arm.depth * (level + self.draft_overhead_s + self._comm(1))

    def switch_s(
        self, batch: int, arm: Arm, context: float, plain_run: int | None, repeat: int = 1, accepted: float = 0.0
    ) -> float:
        """Nothing: a GPU forward streams its weights from HBM every step, whatever the step before it (the
        CPU's cost of switching, `CpuCosts.switch_s`, is a cost of caches that hold the weights between steps)."""
        return 0.0

    def prefill_s(self, tokens: int) -> float:
        if not tokens:
            return 0.0
        return 2 * self.model.params * tokens / (self.tp * self.gpu.bf16_flops * self.flop_frac)

    def catch_up_s(self, pairs: Sequence[float]) -> float:
        """The drafter's prefill over the pairs it has not seen, as `prefill_s` the target's: its FLOPs over
        achieved peak (paged: each row's own pairs, no padding)."""
        tokens = sum(pairs)
        if not tokens:
            return 0.0
        return 2 * self.model.drafter_params * tokens / (self.tp * self.gpu.bf16_flops * self.flop_frac)

    def reverify_s(self, held: Sequence[float], prompt_len: float) -> float:
        """A prefill of the held tokens: paged, no padding, the prompts' KV kept (a prefix cache); the old
        policy's forward over a rejecting row's prefix left out, as a real update keeps ~99% of the tokens."""
        return self.prefill_s(int(sum(x for x in held if x > 0)))

    def learn_s(self, tokens: int, context: float) -> float:
        m = self.model
        attention = 4 * m.layers * m.heads * m.head_dim * context / 2  # causal: half the square
        flops = tokens * self.learn_flops_per_param / 2 * (2 * m.total_params + attention)
        return flops / (self.learner_gpus * self.gpu.bf16_flops * self.mfu)

    def learn_rows_s(self, lengths: Sequence[float], prompt_len: float) -> float | None:
        """None: a GPU learner's cost is its FLOPs per token (`learn_s`); no micro-batch padding curve."""
        return None

    @property
    def publish_s(self) -> float:
        return 2 * self.model.total_params / self.sync_bytes_per_s + self.sync_fixed_s

    @property
    def kv_capacity_tokens(self) -> int:
        """KV-cache tokens one engine holds once its weights are in place."""
        free = self.tp * self.gpu.memory_bytes * self.mem_util - 2 * self.model.total_params
        return max(0, int(free / self.model.kv_bytes))

    def replace(self, **changes: object) -> GpuCosts:
        return dataclasses.replace(self, **changes)

    def describe(self) -> dict[str, object]:
        out = {k: v for k, v in asdict(self).items() if k not in ("gpu", "model")}
        return {
            "model": "gpu-roofline",
            "gpu": self.gpu.name,
            "gpu_source": self.gpu.source,
            "checkpoint": self.model.name,
            "params_b": round(self.model.total_params / 1e9, 2),
            "kv_capacity_tokens_per_engine": self.kv_capacity_tokens,
            **out,
        }
