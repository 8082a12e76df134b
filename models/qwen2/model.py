"""Qwen2 decoder (Flax NNX): Llama's GQA attention with a bias on q, k and v.

Everything else is Llama's (models/llama/model.py): the SwiGLU MLP, the pre-norm block, the
CausalLM stages, the KV-cache specs and the tensor-parallel layout. The biases are kept flat
([N * H], [K * H], as HF stores them) so models.packed_weight.pack_model, which packs every
weight of two or more axes, leaves them float; they split over a tensor-parallel mesh with
their heads (a contiguous 1/tp of N * H is N / tp whole heads). Where tp exceeds the KV heads
k_proj / v_proj stay whole while their flat biases may still split; XLA gathers them for the
add, so only the layout differs from the projections'.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from flax import nnx
from jax.sharding import PartitionSpec as P

from models.layers import normal_param
from models.llama.model import PARAM_PARTITION_RULES as LLAMA_RULES
from models.llama.model import Attention, DecoderLayer, LlamaForCausalLM
from models.qwen2.config import Qwen2Config
from paged_jax.sharding import TP_AXIS

__all__ = ["PARAM_PARTITION_RULES", "Qwen2Attention", "Qwen2DecoderLayer", "Qwen2ForCausalLM"]

# Llama's layout, and each bias split with its projection's heads.
PARAM_PARTITION_RULES: Mapping[str, P] = MappingProxyType({
    **LLAMA_RULES,
    "q_bias": P(TP_AXIS),  # [N * H]
    "k_bias": P(TP_AXIS),  # [K * H]
    "v_bias": P(TP_AXIS),  # [K * H]
})


class Qwen2Attention(Attention):
    """Grouped-query attention whose q, k and v projections add a bias before RoPE."""

    def __init__(self, config: Qwen2Config, *, rngs: nnx.Rngs):
        super().__init__(config, rngs=rngs)
        c = config
        d, n, k, h = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
        self.q_bias = normal_param(rngs, (n * h,), d, c.param_dtype)  # [N * H]
        self.k_bias = normal_param(rngs, (k * h,), d, c.param_dtype)  # [K * H]
        self.v_bias = normal_param(rngs, (k * h,), d, c.param_dtype)  # [K * H]

    def _project(self, x):
        c, dt = self.config, self.config.dtype
        q, k, v = super()._project(x)  # [..., N, H], [..., K, H], [..., K, H]
        return (q + self.q_bias[...].astype(dt).reshape(c.num_heads, c.head_dim),
                k + self.k_bias[...].astype(dt).reshape(c.num_kv_heads, c.head_dim),
                v + self.v_bias[...].astype(dt).reshape(c.num_kv_heads, c.head_dim))


class Qwen2DecoderLayer(DecoderLayer):
    """Llama's block with Qwen2's attention."""

    attention_class = Qwen2Attention


class Qwen2ForCausalLM(LlamaForCausalLM):
    """LlamaForCausalLM (stages, KV-cache specs) over Qwen2's layers."""

    param_partition_rules = PARAM_PARTITION_RULES
    layer_class = Qwen2DecoderLayer
