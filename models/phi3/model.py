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

import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from models.llama.model import PARAM_PARTITION_RULES as LLAMA_RULES
from models.llama.model import Attention, DecoderLayer, LlamaForCausalLM
from models.phi3.config import Phi3Config

__all__ = ["PARAM_PARTITION_RULES", "Phi3Attention", "Phi3DecoderLayer", "Phi3ForCausalLM", "apply_partial_rope",
           "rope_tables"]

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

    def _rotate(self, q, k, positions):
        inv_freq, factor = rope_tables(self.config)
        return apply_partial_rope(q, positions, inv_freq, factor), apply_partial_rope(k, positions, inv_freq, factor)


class Phi3DecoderLayer(DecoderLayer):
    """Llama's block with Phi-3's attention."""

    attention_class = Phi3Attention


class Phi3ForCausalLM(LlamaForCausalLM):
    """LlamaForCausalLM (stages, KV-cache specs) over Phi-3's layers."""

    param_partition_rules = PARAM_PARTITION_RULES
    layer_class = Phi3DecoderLayer
