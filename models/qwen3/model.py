"""Qwen3 decoder (Flax NNX): Llama's GQA attention with an RMSNorm over each q and k head
before RoPE (q_norm, k_norm: one [H] weight each, shared by the heads).

Everything else is Llama's (models/llama/model.py). The norms are vectors, so
models.packed_weight.pack_model leaves them float, and they are replicated on a mesh.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from types import MappingProxyType

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from models.layers import MLP, PreNormBlock, RMSNorm, apply_rope, normal_param, rope_inv_freq
from models.llama.model import PARAM_PARTITION_RULES as LLAMA_RULES
from models.llama.model import Attention, LlamaForCausalLM
from models.packed_weight import linear
from models.qwen3.config import Qwen3Config

__all__ = ["PARAM_PARTITION_RULES", "Qwen3Attention", "Qwen3DecoderLayer", "Qwen3ForCausalLM"]

# Llama's layout; q_norm / k_norm (named "weight" inside their RMSNorm) are replicated.
PARAM_PARTITION_RULES: Mapping[str, P] = MappingProxyType(dict(LLAMA_RULES))


class Qwen3Attention(Attention):
    """Grouped-query attention whose q and k heads are RMS-normed before RoPE."""

    def __init__(self, config: Qwen3Config, *, rngs: nnx.Rngs):
        super().__init__(config, rngs=rngs)
        c = config
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, param_dtype=c.param_dtype, dtype=c.dtype)  # [H]
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, param_dtype=c.param_dtype, dtype=c.dtype)  # [H]

    def _qkv(self, x, positions):
        c, dt = self.config, self.config.dtype
        inv_freq = rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling)
        q = self.q_norm(linear(x, self.q_proj, dt))  # [..., N, H]
        k = self.k_norm(linear(x, self.k_proj, dt))  # [..., K, H]
        v = linear(x, self.v_proj, dt)
        return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v


class Qwen3DecoderLayer(PreNormBlock):
    """Llama's block with Qwen3's attention; mlp defaults to Llama's SwiGLU MLP (Qwen3-MoE passes its experts)."""

    def __init__(self, config: Qwen3Config, *, rngs: nnx.Rngs, mlp: nnx.Module | None = None):
        c = config
        norm = functools.partial(RMSNorm, c.hidden_size, c.rms_norm_eps, param_dtype=c.param_dtype, dtype=c.dtype)
        self.input_layernorm = norm()
        self.self_attn = Qwen3Attention(c, rngs=rngs)
        self.post_attention_layernorm = norm()
        self.mlp = mlp if mlp is not None else MLP(c.hidden_size, c.intermediate_size, param_dtype=c.param_dtype,
                                                   dtype=c.dtype, rngs=rngs)


class Qwen3ForCausalLM(LlamaForCausalLM):
    """LlamaForCausalLM (stages, KV-cache specs) over Qwen3's layers."""

    param_partition_rules = PARAM_PARTITION_RULES

    def __init__(self, config: Qwen3Config, *, rngs: nnx.Rngs):
        c = config
        self.config = c
        self.embed_tokens = nnx.Param(  # [V, D]
            jax.random.normal(rngs.params(), (c.vocab_size, c.hidden_size), jnp.float32).astype(c.param_dtype))
        self.layers = nnx.List([self.make_layer(c, i, rngs=rngs) for i in range(c.num_layers)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, param_dtype=c.param_dtype, dtype=c.dtype)
        self.lm_head = None if c.tie_word_embeddings else normal_param(
            rngs, (c.vocab_size, c.hidden_size), c.hidden_size, c.param_dtype)  # [V, D]

    @staticmethod
    def make_layer(config: Qwen3Config, layer_id: int, *, rngs: nnx.Rngs) -> PreNormBlock:
        """Decoder layer layer_id (Qwen3-MoE's model overrides it: dense or MoE layers)."""
        return Qwen3DecoderLayer(config, rngs=rngs)
