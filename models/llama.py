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
from models.layers import DecoderLayer, RMSNorm

__all__ = ["PRESETS", "Llama3RopeScaling", "LlamaConfig", "LlamaForCausalLM"]


class LlamaForCausalLM(nnx.Module):
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

    def _embed(self, token_ids):
        return jnp.take(self.embed_tokens[...], token_ids, axis=0).astype(self.config.dtype)

    def _logits(self, x):
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        x = self.norm(x)
        return jnp.einsum("...D,VD->...V", x, head[...].astype(self.config.dtype),
                          preferred_element_type=jnp.float32).astype(jnp.float32)

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

    def embed(self, token_ids):
        """The step's hidden states before the first layer: [T, D] from token_ids i32[T]."""
        return self._embed(token_ids)

    def compute_logits(self, x, inputs):
        """f32[S, V] logits of the rows inputs.logits_indices i32[S] selects from x [T, D]."""
        # Only the sampled rows reach lm_head: [S, D] @ [D, V] instead of [T, D] @ [D, V].
        return self._logits(jnp.take(x, inputs.logits_indices, axis=0))

    def __call__(self, inputs, kv_caches, attn_metadata, attention):
        """One engine step: embed, every layer, compute_logits.

        The runner runs the same three stages as separate programs, so that one compiled
        layer serves every layer (paged_jax/runner.py); this composition is their reference.

        Args:
          inputs: a paged_jax.core.step_inputs.ModelInputs: token_ids i32[T] (all scheduled
            tokens concatenated, padding included), positions i32[T], logits_indices i32[S].
          kv_caches: one cache per layer, as kv_cache_specs() lays it out.
          attn_metadata: a paged_jax.core.step_inputs.AttentionMetadata (read by `attention` only).
          attention: the runner's attention backend for these specs (static under jit).
        Returns:
          (f32[S, V] logits of the rows logits_indices selects, the updated kv_caches).
        """
        if len(kv_caches) != self.config.num_layers:
            raise ValueError(f"got {len(kv_caches)} layer caches for {self.config.num_layers} layers; "
                             "build them with models.kv_cache_spec.init_kv_caches(model.kv_cache_specs(), ...)")
        x = self.embed(inputs.token_ids)  # [T, D]
        new_caches = []
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, kv_cache = layer(x, inputs.positions, kv_cache, attn_metadata, attention)
            new_caches.append(kv_cache)
        return self.compute_logits(x, inputs), new_caches

    def dense_forward(self, token_ids):
        """Full causal forward with no cache: token_ids i32[B, S] -> f32[B, S, V] logits."""
        b, s = token_ids.shape
        positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
        x = self._embed(token_ids)  # [B, S, D]
        for layer in self.layers:
            x = layer.dense(x, positions)
        return self._logits(x)
