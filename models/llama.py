"""Llama/GQA decoder on the paged KV cache (Flax NNX), plus the KV-cache allocation helpers.

Two forwards share one set of weights:
- `model(token_ids, positions, kv_caches, attn_metadata)`: the engine's step over a ragged,
  padded batch (prefill chunks and decodes mixed). The caches are passed in and returned so
  the jitted step can donate them and XLA updates them in place; the model holds no state.
- `model.dense_forward(token_ids)`: full causal attention over [B, S] with no cache, the
  reference the paged path is tested against and the engine's dense generate loop.

The layer loop is unrolled in Python with one (k_cache, v_cache) pair per layer, not a
lax.scan over stacked caches: a donated buffer read inside a loop can get a full-size
temporary copy (openxla/xla#45912), which would double the KV memory.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.config import PRESETS, Llama3RopeScaling, LlamaConfig
from models.layers import DecoderLayer, RMSNorm

__all__ = ["PRESETS", "Llama3RopeScaling", "LlamaConfig", "LlamaForCausalLM", "init_kv_caches",
           "kv_cache_bytes_per_block"]

KVCaches = list  # list[tuple[k_cache, v_cache]], one pair per layer, each [num_blocks, block_size, K, H]


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

    def __call__(self, token_ids, positions, kv_caches: KVCaches, attn_metadata, *,
                 impl: str = "xla", interpret: bool = False):
        """One engine step.

        Args:
          token_ids: i32[T], all scheduled tokens concatenated (padding included).
          positions: i32[T].
          kv_caches: list of num_layers (k_cache, v_cache), each [num_blocks, block_size, K, H].
          attn_metadata: any object with slot_mapping i32[T], block_tables i32[S, W],
            seq_lens i32[S], query_start_loc i32[S + 1], num_seqs i32[1], logits_indices i32[S]
            (paged_jax.batch.StepInputs).
          impl: "xla" (gather-based; the CPU path) or "pallas" (the GPU kernel). Static.
          interpret: run the Pallas kernel in interpret mode (CPU tests). Static.
        Returns:
          (f32[S, V] logits of the rows logits_indices selects, the updated kv_caches).
        """
        if len(kv_caches) != self.config.num_layers:
            raise ValueError(f"got {len(kv_caches)} kv cache pairs for {self.config.num_layers} layers; "
                             "build them with init_kv_caches(config, ...)")
        x = self._embed(token_ids)  # [T, D]
        new_caches = []
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, kv_cache = layer(x, positions, kv_cache, attn_metadata, impl=impl, interpret=interpret)
            new_caches.append(kv_cache)
        # Only the sampled rows reach lm_head: [S, D] @ [D, V] instead of [T, D] @ [D, V].
        x = jnp.take(x, attn_metadata.logits_indices, axis=0)  # [S, D]
        return self._logits(x), new_caches

    def dense_forward(self, token_ids):
        """Full causal forward with no cache: token_ids i32[B, S] -> f32[B, S, V] logits."""
        b, s = token_ids.shape
        positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
        x = self._embed(token_ids)  # [B, S, D]
        for layer in self.layers:
            x = layer.dense(x, positions)
        return self._logits(x)


def kv_cache_bytes_per_block(config: LlamaConfig, block_size: int, dtype=None) -> int:
    """Bytes one block costs across all layers (K and V): the unit the engine sizes its pool in."""
    itemsize = np.dtype(jnp.dtype(dtype or config.dtype)).itemsize
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * itemsize


def init_kv_caches(config: LlamaConfig, num_blocks: int, block_size: int, dtype=None) -> KVCaches:
    """Zeroed caches: num_layers pairs of [num_blocks, block_size, K, H] arrays (dtype defaults to config.dtype).

    Separate buffers per layer (not one stacked array) so each can be donated and updated in
    place by the unrolled layer loop.
    """
    if num_blocks < 2:
        raise ValueError(f"{num_blocks=} must be >= 2 (block 0 is the null block padding points into)")
    if block_size <= 0:
        raise ValueError(f"{block_size=} must be positive")
    shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
    dt = jnp.dtype(dtype or config.dtype)
    return [(jnp.zeros(shape, dt), jnp.zeros(shape, dt)) for _ in range(config.num_layers)]
