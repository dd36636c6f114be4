"""The torch runtime: a Llama/Qwen/Mistral-family decoder, its slot-addressed KV cache, and checkpoint loading
(`families.py` says which checkpoints run)."""

from tlt_stream.model.cache import KVCache
from tlt_stream.model.loader import (
    CheckpointError,
    load_model,
    load_spec,
    load_tokenizer,
    resolve_device,
    resolve_dtype,
    spec_from_hf_config,
    stop_token_ids,
)
from tlt_stream.model.spec import ModelSpec
from tlt_stream.model.transformer import Transformer

__all__ = [
    "CheckpointError",
    "KVCache",
    "ModelSpec",
    "Transformer",
    "load_model",
    "load_spec",
    "load_tokenizer",
    "resolve_device",
    "resolve_dtype",
    "spec_from_hf_config",
    "stop_token_ids",
]
