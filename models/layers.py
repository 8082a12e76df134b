"""Building blocks every family shares (Flax NNX): RMSNorm, rotate_half RoPE, the gated MLP
(SwiGLU, or Gemma's GELU-tanh), the causal (or sliding-window) mask, the pre-norm residual
block and the causal-LM stages the runner compiles.

A family's own attention and decoder layer live in its package (models/llama/model.py,
models/deepseek_v2/model.py) and are built from these. Weights are kept in einsum-friendly
layouts (HF stores linear weights [out, in]; a family's loader transposes once at load time),
or packed in a block format (models/packed_weight.py: `linear` takes either):

Einsum legend:
  B  batch                      T  query tokens
  S  key/value tokens           D  hidden (model) dim
  N  query heads                K  key/value heads
  G  query heads per kv head    H  head dim
  F  MLP hidden dim             V  vocabulary
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec

from models.config import Llama3RopeScaling
from models.packed_weight import embed_rows, linear, linear_group, logits

MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


def normal_param(rngs: nnx.Rngs, shape, fan_in: int, dtype: str) -> nnx.Param:
    """A random weight of variance 1/fan_in, stored in dtype."""
    # Variance 1/fan_in keeps activations O(1) through random models, so tests compare
    # logits that are far from zero rather than a sea of near-ties.
    w = jax.random.normal(rngs.params(), shape, jnp.float32) / math.sqrt(fan_in)
    return nnx.Param(w.astype(dtype))


class RMSNorm(nnx.Module):
    """x / rms(x) * weight, the mean square accumulated in float32 (HF LlamaRMSNorm numerics)."""

    def __init__(self, dim: int, eps: float, *, param_dtype: str, dtype: str):
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))  # [D]
        self.eps = eps
        self.dtype = dtype

    def _normalized(self, x):
        """f32 x / rms(x), before the weight (a family's norm scales it otherwise: Gemma's 1 + weight)."""
        x32 = x.astype(jnp.float32)
        return x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)

    def __call__(self, x):
        return self._normalized(x).astype(self.dtype) * self.weight[...].astype(self.dtype)


def causal_mask(num_tokens: int, sliding_window: int | None = None):
    """bool[T, T]: query t sees key s when s <= t and, with a window, t - s < sliding_window (the
    window's tokens, the query's own included, as the paged kernels and transformers count them)."""
    distance = jnp.arange(num_tokens)[:, None] - jnp.arange(num_tokens)[None, :]  # [T, S]
    visible = distance >= 0
    return visible if sliding_window is None else visible & (distance < sliding_window)


@functools.lru_cache(maxsize=None)
def rope_inv_freq(head_dim: int, rope_theta: float, rope_scaling: Llama3RopeScaling | None) -> np.ndarray:
    """f32[head_dim // 2] inverse frequencies, computed as transformers does (float32 base powers).

    Llama-3 scaling keeps high frequencies, divides low ones by factor and interpolates
    between, so the model extrapolates past original_max_position_embeddings.
    """
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv_freq = (np.float32(1.0) / (np.float32(rope_theta) ** exponents)).astype(np.float32)
    if rope_scaling is None:
        return inv_freq
    s = rope_scaling
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(is_medium, smoothed, scaled).astype(np.float32)


def apply_rope(x, positions, inv_freq):
    """Rotate x[..., T, heads, H] by its positions[..., T] in the non-interleaved layout.

    HF's rotate_half pairs dim i with dim i + H/2 (not 2i with 2i+1): the loader keeps
    checkpoint weights as they are, so the rotation has to match that layout.
    """
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [..., T, H/2]
    cos = jnp.cos(angles)[..., None, :]  # [..., T, 1, H/2]
    sin = jnp.sin(angles)[..., None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


# The gate's activation, by its config.json name: silu is SwiGLU (Llama), gelu_pytorch_tanh
# GELU's tanh approximation (Gemma's GeGLU, torch's gelu(approximate="tanh")).
ACTIVATIONS = {"silu": jax.nn.silu, "gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True)}


class MLP(nnx.Module):
    """Gated MLP: down(act(gate(x)) * up(x)); act silu is SwiGLU (Llama's MLP; DeepSeek-V2's dense
    layers and shared experts), gelu_pytorch_tanh Gemma's (ACTIVATIONS)."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, param_dtype: str, dtype: str, rngs: nnx.Rngs,
                 activation: str = "silu"):
        d, f = hidden_size, intermediate_size
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation={activation!r} must be one of {sorted(ACTIVATIONS)}")
        self.dtype = dtype
        self.activation = activation
        self.gate_proj = normal_param(rngs, (d, f), d, param_dtype)  # [D, F]
        self.up_proj = normal_param(rngs, (d, f), d, param_dtype)  # [D, F]
        self.down_proj = normal_param(rngs, (f, d), f, param_dtype)  # [F, D]

    def __call__(self, x):
        dt = self.dtype
        gate, up = linear_group(x, (self.gate_proj, self.up_proj), dt)  # [..., F] each
        return linear(ACTIVATIONS[self.activation](gate) * up, self.down_proj, dt)  # [..., D]


class PreNormBlock(nnx.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x)).

    A family's layer builds input_layernorm, self_attn (its attention: called on the paged
    cache, and .dense for the no-cache reference), post_attention_layernorm and mlp.
    """

    def __call__(self, x, positions, kv_cache, attn_metadata, attention):
        attn, kv_cache = self.self_attn(self.input_layernorm(x), positions, kv_cache, attn_metadata, attention)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x)), kv_cache

    def dense(self, x, positions):
        x = x + self.self_attn.dense(self.input_layernorm(x), positions)
        return x + self.mlp(self.post_attention_layernorm(x))


class CausalLM(nnx.Module):
    """Embedding -> layers -> final norm -> lm_head (or the tied embedding): the stages the
    runner compiles, their composition and the no-cache reference, shared by the families.

    A family's model sets config (dtype, num_layers), embed_tokens [V, D], layers (each a
    PreNormBlock, or a block called as one: Gemma 3's), norm and lm_head ([V, D] or None when
    tied), its kv_cache_specs, and the class attribute param_partition_rules (parameter name ->
    PartitionSpec over the "tp" mesh axis; paged_jax/sharding.py places the weights by it, a
    name missing is replicated).
    """

    param_partition_rules: ClassVar[Mapping[str, PartitionSpec]]

    def _embed(self, token_ids):
        return embed_rows(self.embed_tokens, token_ids, self.config.dtype)

    def _logits(self, x):
        return logits(self.norm(x), self.embed_tokens if self.lm_head is None else self.lm_head)

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
        program serves every group of layers (paged_jax/runner.py); this composition is their
        reference.

        Args:
          inputs: a paged_jax.core.step_inputs.ModelInputs: token_ids i32[T] (all scheduled
            tokens concatenated, padding included), positions i32[T], logits_indices i32[S].
          kv_caches: one cache per layer, as kv_cache_specs() lays it out.
          attn_metadata: a paged_jax.core.step_inputs.AttentionMetadata (read by `attention` only).
          attention: the attention backend of these specs (static under jit), or one per layer
            (a sequence): a model whose layers differ in window (Gemma 3) needs one per layer,
            [make_attention_backend(spec, impl) for spec in model.kv_cache_specs()], since a
            backend applies its own spec's window.
        Returns:
          (f32[S, V] logits of the rows logits_indices selects, the updated kv_caches).
        """
        n = self.config.num_layers
        if len(kv_caches) != n:
            raise ValueError(f"got {len(kv_caches)} layer caches for {n} layers; "
                             "build them with models.kv_cache_spec.init_kv_caches(model.kv_cache_specs(), ...)")
        backends = tuple(attention) if isinstance(attention, (list, tuple)) else (attention,) * n
        windows = {getattr(getattr(layer, "self_attn", None), "sliding_window", None) for layer in self.layers}
        if len(backends) != n or (not isinstance(attention, (list, tuple)) and len(windows) > 1):
            raise ValueError(f"attention: got {len(backends)} backend(s) for {n} layers whose sliding windows are "
                             f"{sorted(windows, key=str)}; pass one backend per layer, built from its spec: "
                             "[make_attention_backend(spec, impl) for spec in model.kv_cache_specs()]")
        x = self.embed(inputs.token_ids)  # [T, D]
        new_caches = []
        for layer, kv_cache, backend in zip(self.layers, kv_caches, backends):
            x, kv_cache = layer(x, inputs.positions, kv_cache, attn_metadata, backend)
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
