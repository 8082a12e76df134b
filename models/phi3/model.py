"""Phi-3 decoder (Flax NNX): Llama's attention and MLP with Phi-3's RoPE.

The checkpoint fuses qkv_proj and gate_up_proj; the loader splits them (models/phi3/hf.py),
so the weights, the KV-cache specs and the tensor-parallel layout are Llama's. Only the
rotation differs (models/phi3/config.py): the first rotary_dim dims of each head rotate
(rotate_half), the rest pass through, and with LongRoPE the frequencies are divided by the
load's rescale factors and cos / sin multiplied by its attention factor.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from types import MappingProxyType

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from models.layers import MLP, PreNormBlock, RMSNorm, normal_param
from models.llama.model import PARAM_PARTITION_RULES as LLAMA_RULES
from models.llama.model import Attention, LlamaForCausalLM
from models.packed_weight import linear
from models.phi3.config import Phi3Config

__all__ = ["PARAM_PARTITION_RULES", "Phi3Attention", "Phi3ForCausalLM", "apply_partial_rope", "rope_tables"]

PARAM_PARTITION_RULES: Mapping[str, P] = MappingProxyType(dict(LLAMA_RULES))


@functools.lru_cache(maxsize=None)
def rope_tables(config: Phi3Config) -> tuple[np.ndarray, float]:
    """(f32[rotary_dim // 2] inverse frequencies, cos / sin factor), float32 as transformers computes them."""
    c = config
    exponents = np.arange(0, c.rotary_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(c.rotary_dim)
    base = np.float32(c.rope_theta) ** exponents
    if c.long_rope is None:
        return (np.float32(1.0) / base).astype(np.float32), 1.0
    factors = np.asarray(c.long_rope.rescale_factors, np.float32)
    return (np.float32(1.0) / (factors * base)).astype(np.float32), c.long_rope.attention_factor


def apply_partial_rope(x, positions, inv_freq, factor: float):
    """Rotate the first 2 * len(inv_freq) dims of x[..., T, heads, H] by positions[..., T] (rotate_half
    layout, cos / sin times factor); the other dims pass through."""
    rotary_dim = 2 * inv_freq.shape[0]
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [..., T, R/2]
    cos = (jnp.cos(angles) * factor)[..., None, :]  # [..., T, 1, R/2]
    sin = (jnp.sin(angles) * factor)[..., None, :]
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32[..., :rotary_dim], 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x32[..., rotary_dim:]], axis=-1)
    return out.astype(x.dtype)


class Phi3Attention(Attention):
    """Grouped-query attention with Phi-3's rotation (partial rotary dims, LongRoPE)."""

    def _qkv(self, x, positions):
        dt = self.config.dtype
        inv_freq, factor = rope_tables(self.config)
        q = linear(x, self.q_proj, dt)  # [..., N, H]
        k = linear(x, self.k_proj, dt)  # [..., K, H]
        v = linear(x, self.v_proj, dt)
        return apply_partial_rope(q, positions, inv_freq, factor), apply_partial_rope(k, positions, inv_freq, factor), v


class Phi3DecoderLayer(PreNormBlock):
    """Llama's block with Phi-3's attention."""

    def __init__(self, config: Phi3Config, *, rngs: nnx.Rngs):
        c = config
        norm = functools.partial(RMSNorm, c.hidden_size, c.rms_norm_eps, param_dtype=c.param_dtype, dtype=c.dtype)
        self.input_layernorm = norm()
        self.self_attn = Phi3Attention(c, rngs=rngs)
        self.post_attention_layernorm = norm()
        self.mlp = MLP(c.hidden_size, c.intermediate_size, param_dtype=c.param_dtype, dtype=c.dtype, rngs=rngs)


class Phi3ForCausalLM(LlamaForCausalLM):
    """LlamaForCausalLM (stages, KV-cache specs) over Phi-3's layers."""

    param_partition_rules = PARAM_PARTITION_RULES

    def __init__(self, config: Phi3Config, *, rngs: nnx.Rngs):
        c = config
        self.config = c
        self.embed_tokens = nnx.Param(  # [V, D]
            jax.random.normal(rngs.params(), (c.vocab_size, c.hidden_size), jnp.float32).astype(c.param_dtype))
        self.layers = nnx.List([Phi3DecoderLayer(c, rngs=rngs) for _ in range(c.num_layers)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, param_dtype=c.param_dtype, dtype=c.dtype)
        self.lm_head = None if c.tie_word_embeddings else normal_param(
            rngs, (c.vocab_size, c.hidden_size), c.hidden_size, c.param_dtype)  # [V, D]
