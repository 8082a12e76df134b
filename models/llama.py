"""Llama/GQA decoder on the paged KV cache (Flax NNX).

Two forwards share one set of weights:
- `model(inputs, kv_caches, attn_metadata, attention)`: the engine's step over a ragged,
  padded batch (prefill chunks and decodes mixed). The caches are passed in and returned so
  the jitted step can donate them and XLA updates them in place; the model holds no state
  and never names an attention implementation (the runner's backend is an argument).
- `model.dense_forward(token_ids)`: full causal attention over [B, S] with no cache, the
  reference the paged path is tested against.

What the cache holds is declared by `kv_cache_specs` (models/kv_cache_spec.py documents the
layout).

One (k_cache, v_cache) pair per layer, and no lax.scan over stacked caches: a donated
buffer read inside a loop can get a full-size temporary copy (openxla/xla#45912). The
runner compiles a program of a few layers and calls it per group instead (paged_jax/runner.py
says why: a scan over stacked weights measured 30% slower steps on CPU).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from models.config import PRESETS, Llama3RopeScaling, LlamaConfig
from models.kv_cache_spec import FullAttentionSpec, KVCacheSpec, attention_spec
from models.layers import CausalLM, DecoderLayer, RMSNorm

__all__ = ["PRESETS", "Llama3RopeScaling", "LlamaConfig", "LlamaForCausalLM"]


class LlamaForCausalLM(CausalLM):
    """Embedding -> num_layers decoder layers -> final RMSNorm -> lm_head (or the tied embedding)."""

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
        c = config
        self.config = c
        self.embed_tokens = nnx.Param(  # [V, D]
            jax.random.normal(rngs.params(), (c.vocab_size, c.hidden_size), jnp.float32).astype(c.param_dtype))
        self.layers = nnx.List([DecoderLayer(c, rngs=rngs) for _ in range(c.num_layers)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, param_dtype=c.param_dtype, dtype=c.dtype)
        # Kept [V, D] like the embedding (and HF), so tied and untied heads share one einsum.
        self.lm_head = None if c.tie_word_embeddings else nnx.Param(
            (jax.random.normal(rngs.params(), (c.vocab_size, c.hidden_size), jnp.float32)
             / math.sqrt(c.hidden_size)).astype(c.param_dtype))

    def kv_cache_specs(self, dtype=None, kv_cache_dtype: str = "auto",
                       kv_cache_scaling: str = "per_token") -> tuple[KVCacheSpec, ...]:
        """One spec per layer: K and V per KV head (dtype defaults to the compute dtype).

        kv_cache_dtype "auto" stores them in dtype; "fp8" / "fp8_e4m3" / "fp8_e5m2" / "int8"
        in one byte per element, scaled per kv_cache_scaling (models/kv_cache_spec.py).
        """
        c = self.config
        if kv_cache_dtype == "auto":
            spec = FullAttentionSpec(c.num_kv_heads, c.head_dim, str(jnp.dtype(dtype or c.dtype)))
        else:
            spec = attention_spec(c.num_kv_heads, c.head_dim, c.dtype, kv_cache_dtype, kv_cache_scaling)
        return (spec,) * c.num_layers
