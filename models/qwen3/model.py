"""Qwen3 decoder (Flax NNX): Llama's GQA attention with an RMSNorm over each q and k head
before RoPE (q_norm, k_norm: one [H] weight each, shared by the heads).

Everything else is Llama's (models/llama/model.py). The norms are vectors, so
models.packed_weight.pack_model leaves them float, and they are replicated on a mesh.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import ClassVar

from flax import nnx
from jax.sharding import PartitionSpec as P

from models.layers import RMSNorm
from models.llama.model import PARAM_PARTITION_RULES as LLAMA_RULES
from models.llama.model import Attention, DecoderLayer, LlamaForCausalLM
from models.qwen3.config import Qwen3Config

__all__ = ["PARAM_PARTITION_RULES", "Qwen3Attention", "Qwen3DecoderLayer", "Qwen3ForCausalLM"]

# Llama's layout; q_norm / k_norm (named "weight" inside their RMSNorm) are replicated.
PARAM_PARTITION_RULES: Mapping[str, P] = MappingProxyType(dict(LLAMA_RULES))


class Qwen3Attention(Attention):
    """Grouped-query attention whose q and k heads are RMS-normed before RoPE (norm_class: Gemma 3's own)."""

    norm_class: ClassVar[type[RMSNorm]] = RMSNorm

    def __init__(self, config: Qwen3Config, *, rngs: nnx.Rngs):
        super().__init__(config, rngs=rngs)
        c = config
        self.q_norm = self.norm_class(c.head_dim, c.rms_norm_eps, param_dtype=c.param_dtype, dtype=c.dtype)  # [H]
        self.k_norm = self.norm_class(c.head_dim, c.rms_norm_eps, param_dtype=c.param_dtype, dtype=c.dtype)  # [H]

    def _project(self, x):
        q, k, v = super()._project(x)  # [..., N, H], [..., K, H], [..., K, H]
        return self.q_norm(q), self.k_norm(k), v


class Qwen3DecoderLayer(DecoderLayer):
    """Llama's block with Qwen3's attention (mlp: Llama's SwiGLU MLP unless given; Qwen3-MoE passes its experts)."""

    attention_class = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    """LlamaForCausalLM (stages, KV-cache specs) over Qwen3's layers."""

    param_partition_rules = PARAM_PARTITION_RULES
    layer_class = Qwen3DecoderLayer
