"""Llama/GQA decoder on the paged KV cache (Flax NNX).

Two forwards share one set of weights:
- `model(inputs, kv_caches, attn_metadata, attention)`: the engine's step over a ragged,
  padded batch (prefill chunks and decodes mixed). The caches are passed in and returned so
  the jitted step can donate them and XLA updates them in place; the model holds no state
  and never names an attention implementation (the runner's backend is an argument).
- `model.dense_forward(token_ids)`: full causal attention over [B, S] with no cache, the
  reference the paged path is tested against.

What the cache holds is declared by `kv_cache_specs` (models/kv_cache_spec.py documents the
layout), how the weights split over a tensor-parallel mesh by PARAM_PARTITION_RULES (the
model's `param_partition_rules`).

One (k_cache, v_cache) pair per layer, and no lax.scan over stacked caches: a donated
buffer read inside a loop can get a full-size temporary copy (openxla/xla#45912). The
runner compiles a program of a few layers and calls it per group instead (paged_jax/runner.py
says why: a scan over stacked weights copied each layer's weights out of the stack on XLA:CPU).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from cpu_kernels import decoder_layer
from cpu_kernels.quant_matmul import TILED
from models.kv_cache_spec import KVCacheSpec, attention_spec
from models.packed_weight import PackedWeight, linear, linear_group
from models.layers import (MASK_VALUE, MLP, CausalLM, PreNormBlock, RMSNorm, apply_rope, causal_mask, normal_param,
                           rope_inv_freq)
from models.llama.config import LlamaConfig
from paged_jax.sharding import TP_AXIS

__all__ = ["PARAM_PARTITION_RULES", "Attention", "DecoderLayer", "LlamaForCausalLM"]

# Tensor parallelism (Megatron layout, paged_jax/sharding.py): parameter name (the last key of
# its state path) -> how it splits over the "tp" mesh axis. A name missing here is replicated
# (the norms), and so is a parameter whose split axis tp does not divide (k_proj / v_proj when
# tp exceeds the KV heads: the KV heads are then replicated, paged_jax.sharding.kv_head_replicas).
PARAM_PARTITION_RULES: Mapping[str, P] = MappingProxyType({
    "q_proj": P(None, TP_AXIS, None),  # [D, N, H]: query heads
    "k_proj": P(None, TP_AXIS, None),  # [D, K, H]: KV heads
    "v_proj": P(None, TP_AXIS, None),  # [D, K, H]
    "o_proj": P(TP_AXIS, None, None),  # [N, H, D]: row-parallel, its matmul ends in an all-reduce
    "gate_proj": P(None, TP_AXIS),  # [D, F]: column-parallel
    "up_proj": P(None, TP_AXIS),  # [D, F]
    "down_proj": P(TP_AXIS, None),  # [F, D]: row-parallel
    "embed_tokens": P(TP_AXIS, None),  # [V, D]: vocab-parallel
    "lm_head": P(TP_AXIS, None),  # [V, D]
})


class Attention(nnx.Module):
    """Grouped-query attention: N query heads share K kv heads in groups of G = N / K.

    sliding_window (config.sliding_window: None for Llama, every earlier key) is how many latest
    keys, the query's own included, a query sees; a family with windowed layers sets it per
    layer (Gemma 3), and the
    model's kv_cache_specs carry it to the paged backends. sm_scale is the softmax scale.
    """

    sliding_window: int | None = None

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
        c = config
        d, n, k, h = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
        self.config = c
        self.sliding_window = c.sliding_window
        self.q_proj = normal_param(rngs, (d, n, h), d, c.param_dtype)  # [D, N, H]
        self.k_proj = normal_param(rngs, (d, k, h), d, c.param_dtype)  # [D, K, H]
        self.v_proj = normal_param(rngs, (d, k, h), d, c.param_dtype)  # [D, K, H]
        self.o_proj = normal_param(rngs, (n, h, d), n * h, c.param_dtype)  # [N, H, D]

    def _project(self, x):
        """q [..., N, H], k [..., K, H], v [..., K, H] of x [..., D], before RoPE: where a family
        adds to the projections (Qwen2's biases, Qwen3's per-head norms)."""
        return linear_group(x, (self.q_proj, self.k_proj, self.v_proj), self.config.dtype)

    def _rotate(self, q, k, positions):
        """q and k rotated by positions (rotate_half RoPE): where a family rotates otherwise (Phi-3)."""
        c = self.config
        inv_freq = rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling)
        return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)

    def _qkv(self, x, positions):
        q, k, v = self._project(x)
        q, k = self._rotate(q, k, positions)
        return q, k, v

    @property
    def sm_scale(self) -> float:
        """The softmax scale of q.k: head_dim ** -0.5 (Gemma 3: query_pre_attn_scalar ** -0.5)."""
        return self.config.head_dim ** -0.5

    def _out(self, attn):
        # One [T, N*H] x [N*H, D] matmul. As a contraction over two axes, XLA on CPU laid the
        # attention output out head-minor and so transposed the weight on every step (a
        # noticeable share of a decode step in bench_throughput's model).
        return linear(attn, self.o_proj, self.config.dtype, num_in=2)

    def __call__(self, x, positions, kv_cache, attn_metadata, attention):
        """Paged attention over a ragged batch.

        Args:
          x: [T, D] hidden states of this step's tokens (all sequences concatenated).
          positions: i32[T].
          kv_cache: this layer's cache, laid out as its spec says (FullAttentionSpec:
            (k_cache, v_cache), each [num_blocks, block_size, K, H]).
          attn_metadata: a paged_jax.core.step_inputs.AttentionMetadata.
          attention: the runner's backend (paged_jax.attention): writes k/v, then attends.
        Returns:
          ([T, D], kv_cache) with this step's keys and values written into the cache.
        """
        q, k, v = self._qkv(x, positions)  # [T, N, H], [T, K, H], [T, K, H]
        attn, kv_cache = attention(q, k, v, kv_cache, attn_metadata, sm_scale=self.sm_scale)
        return self._out(attn.astype(self.config.dtype)), kv_cache

    def dense(self, x, positions):
        """Full causal attention without a cache: x [B, T, D], positions i32[B, T] -> [B, T, D]."""
        c = self.config
        q, k, v = self._qkv(x, positions)  # [B, T, N, H], [B, S, K, H], [B, S, K, H] (S = T)
        b, t = q.shape[:2]
        q = q.reshape(b, t, c.num_kv_heads, c.num_queries_per_kv, c.head_dim)  # [B, T, K, G, H]
        scores = jnp.einsum("BTKGH,BSKH->BKGTS", q, k, preferred_element_type=jnp.float32)
        scores = scores * self.sm_scale
        scores = jnp.where(causal_mask(t, self.sliding_window), scores, MASK_VALUE)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        attn = jnp.einsum("BKGTS,BSKH->BTKGH", probs, v)
        return self._out(attn.reshape(b, t, c.num_heads, c.head_dim))


class DecoderLayer(PreNormBlock):
    """Llama's block: GQA attention and a SwiGLU MLP.

    A family's layer names its attention in attention_class (built as attention_class(config,
    rngs=...)); mlp, when given, replaces the SwiGLU MLP (Qwen3-MoE's experts).
    """

    attention_class: ClassVar[type[nnx.Module]] = Attention

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs, mlp: nnx.Module | None = None):
        c = config
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, param_dtype=c.param_dtype, dtype=c.dtype)
        self.self_attn = self.attention_class(c, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps,
                                                param_dtype=c.param_dtype, dtype=c.dtype)
        self.mlp = mlp if mlp is not None else MLP(c.hidden_size, c.intermediate_size, param_dtype=c.param_dtype,
                                                   dtype=c.dtype, rngs=rngs)

    def native_weights(self, kv_cache) -> tuple[decoder_layer.LayerWeights, str] | None:
        """(weights, activations) of the layer as one native call (cpu_kernels/decoder_layer.py)
        with this kv_cache (arrays or their shapes: only dtypes are read), or None where it
        cannot be one: a plain Llama layer (a family that changes its attention, MLP or norms
        keeps its own path), f32 compute, packed weights whose tiled ones share one activations
        mode, a float (k_cache, v_cache)."""
        attn, mlp = self.self_attn, self.mlp
        if (type(attn) is not Attention or type(mlp) is not MLP or mlp.activation != "silu"
                or type(self.input_layernorm) is not RMSNorm or type(self.post_attention_layernorm) is not RMSNorm
                or jnp.dtype(attn.config.dtype) != jnp.float32 or not isinstance(kv_cache, (tuple, list))
                or len(kv_cache) != 2):
            return None
        packed = [p.get_value() for p in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj,
                                          mlp.up_proj, mlp.down_proj)]
        if not all(isinstance(w, PackedWeight) for w in packed):
            return None
        activations = {w.activations for w in packed if w.format in TILED} or {"float32"}
        weights = decoder_layer.LayerWeights(self.input_layernorm.weight[...], *(decoder_layer.Weight(
            w.data, w.format) for w in packed[:4]), self.post_attention_layernorm.weight[...],
            *(decoder_layer.Weight(w.data, w.format) for w in packed[4:]))
        if len(activations) != 1 or not decoder_layer.usable(weights, kv_cache[0], *activations):
            return None
        return weights, activations.pop()

    def native_call(self, x, positions, kv_cache, attn_metadata, rows, next_layer=None):
        """The layer as one native call where native_weights says it can be one, else None (the
        caller runs it as usual). rows: the step's token rows (paged_jax/attention/xla.py
        token_rows); next_layer: the layer that runs next, or None: where it can be a native
        call of the same shapes, this call fetches its first weights ahead (decoder_layer's
        next_weights). Returns (x [T, D], kv_cache) as __call__."""
        native = self.native_weights(kv_cache)
        if native is None:
            return None
        weights, activations = native
        following = None if next_layer is None else getattr(next_layer, "native_weights", lambda cache: None)(kv_cache)
        attn, c = self.self_attn, self.self_attn.config
        next_weights = None
        if following is not None and decoder_layer.can_fetch_ahead(following[0], c.hidden_size, c.num_heads,
                                                                    c.num_kv_heads, c.head_dim):
            next_weights = following[0]
        angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(
            rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling))  # [T, H/2]
        out, k_cache, v_cache = decoder_layer.decoder_layer(
            x, weights, jnp.cos(angles), jnp.sin(angles), *kv_cache, attn_metadata.slot_mapping, rows,
            eps=self.input_layernorm.eps, sm_scale=attn.sm_scale, num_heads=c.num_heads,
            intermediate_size=c.intermediate_size, sliding_window=attn.sliding_window, activations=activations,
            next_weights=next_weights)
        return out.astype(x.dtype), (k_cache, v_cache)


class LlamaForCausalLM(CausalLM):
    """Embedding -> num_layers decoder layers -> final RMSNorm -> lm_head (or the tied embedding).

    A family built on it sets layer_class (its DecoderLayer) and param_partition_rules, or
    overrides make_layer when its layers differ from one another (Qwen3-MoE).
    """

    param_partition_rules = PARAM_PARTITION_RULES
    layer_class: ClassVar[type[DecoderLayer]] = DecoderLayer

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
        c = config
        self.config = c
        self.embed_tokens = nnx.Param(  # [V, D]
            jax.random.normal(rngs.params(), (c.vocab_size, c.hidden_size), jnp.float32).astype(c.param_dtype))
        self.layers = nnx.List([self.make_layer(c, i, rngs=rngs) for i in range(c.num_layers)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, param_dtype=c.param_dtype, dtype=c.dtype)
        # Kept [V, D] like the embedding (and HF), so tied and untied heads share one einsum.
        self.lm_head = None if c.tie_word_embeddings else nnx.Param(
            (jax.random.normal(rngs.params(), (c.vocab_size, c.hidden_size), jnp.float32)
             / math.sqrt(c.hidden_size)).astype(c.param_dtype))

    @classmethod
    def make_layer(cls, config: LlamaConfig, layer_id: int, *, rngs: nnx.Rngs) -> PreNormBlock:
        """Decoder layer layer_id: a layer_class."""
        return cls.layer_class(config, rngs=rngs)

    def kv_cache_specs(self, dtype=None, kv_cache_dtype: str = "auto",
                       kv_cache_scaling: str = "per_token") -> tuple[KVCacheSpec, ...]:
        """One spec per layer: K and V per KV head (dtype defaults to the compute dtype), with
        the layer's attention's sliding_window (None for every Llama layer).

        kv_cache_dtype "auto" stores them in dtype, "bfloat16" in bfloat16; "fp8" / "fp8_e4m3" /
        "fp8_e5m2" / "int8" in one byte per element, scaled per kv_cache_scaling
        (models/kv_cache_spec.py).
        """
        c = self.config
        dtype = str(jnp.dtype(dtype or c.dtype)) if kv_cache_dtype == "auto" else c.dtype
        return tuple(attention_spec(c.num_kv_heads, c.head_dim, dtype, kv_cache_dtype, kv_cache_scaling,
                                    sliding_window=layer.self_attn.sliding_window) for layer in self.layers)
