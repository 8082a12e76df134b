"""Attention backends of the GQA pools: write this step's K/V into the pool, then attend
through block tables.

A backend is a frozen, hashable object (so it is static under jit) built once by the runner
for the model's cache spec. The model calls it once per layer:

    out, layer_cache = attention(q, k, v, layer_cache, attn_metadata, sm_scale=...)

One class per (cache spec type, implementation) row of the table in registry.py
(FullAttentionSpec and QuantizedAttentionSpec here, MLAAttentionSpec in mla.py); a new cache
format adds a spec in models/kv_cache_spec.py and its registered classes.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from models.kv_cache_spec import FullAttentionSpec, QuantizedAttentionSpec
from paged_jax.attention.registry import KernelOptions, NoKernelOptions, register_backend
from paged_jax.attention.xla import ragged_paged_attention_xla
from paged_jax.core.kv_quant import key_rotation
from pallas_kernels.kv_cache_write import write_kv_cache
from pallas_kernels.paged_attention import PallasConfig, ragged_paged_attention


class _SlidingWindow:
    """The window of a backend's spec, passed to every implementation as sliding_window."""

    @property
    def sliding_window(self) -> int | None:
        """The spec's window (query p sees keys p - sliding_window < k <= p); None: full causal.
        getattr: a spec type without the field is a full-attention one."""
        return getattr(self.spec, "sliding_window", None)


@dataclasses.dataclass(frozen=True)
class _FullAttentionBackend(_SlidingWindow):
    """Shared body of the GQA backends: the KV write, then `_attend` over the updated pages."""

    spec: FullAttentionSpec

    name = "base"

    def __call__(self, q, k, v, kv_cache, attn_metadata, *, sm_scale: float):
        """Write k, v at attn_metadata.slot_mapping, then attend (over spec.sliding_window keys
        per query when the spec has a window).

        Args:
          q: [T, num_q_heads, head_dim]; k, v: [T, num_kv_heads, head_dim] (any float dtype;
            cast to the cache dtype, so a bf16 cache under an f32 model reads bf16 queries).
          kv_cache: (k_cache, v_cache), each [num_blocks, block_size, num_kv_heads, head_dim].
          attn_metadata: a paged_jax.core.step_inputs.AttentionMetadata.
          sm_scale: softmax scale.
        Returns:
          ([T, num_q_heads, head_dim] in the cache dtype, the updated (k_cache, v_cache)).
        """
        k_cache, v_cache = kv_cache
        md = attn_metadata
        k_cache, v_cache = write_kv_cache(k.astype(k_cache.dtype), v.astype(v_cache.dtype), k_cache, v_cache,
                                          md.slot_mapping)
        out = self._attend(q.astype(k_cache.dtype), k_cache, v_cache, md.block_tables, md.seq_lens,
                           md.query_start_loc, md.num_seqs, sm_scale=sm_scale)
        return out, (k_cache, v_cache)


@register_backend(FullAttentionSpec, "xla")
@dataclasses.dataclass(frozen=True)
class XlaAttention(NoKernelOptions, _FullAttentionBackend):
    """Gather-based attention (paged_jax/attention/xla.py)."""

    name = "xla"

    def _attend(self, *args, sm_scale):
        return ragged_paged_attention_xla(*args, sm_scale=sm_scale, sliding_window=self.sliding_window)


@register_backend(FullAttentionSpec, "triton")
@dataclasses.dataclass(frozen=True)
class TritonAttention(KernelOptions, _FullAttentionBackend):
    """The Pallas kernel (pallas_kernels/paged_attention.py) through JAX's Triton backend;
    interpret=True runs it on CPU."""

    interpret: bool = False
    config: PallasConfig = PallasConfig()

    name = "triton"

    def _attend(self, *args, sm_scale):
        return ragged_paged_attention(*args, sm_scale=sm_scale, interpret=self.interpret, config=self.config,
                                      sliding_window=self.sliding_window)


@dataclasses.dataclass(frozen=True)
class _QuantizedAttentionBackend(_SlidingWindow):
    """Shared body of the quantized backends (QuantizedAttentionSpec): quantize on write, then
    attend over the one-byte pages, dequantized per tile inside the implementation.

    Keys are stored centered and rotated, (k - key_offset) @ R with R = key_rotation(head_dim)
    (paged_jax/core/kv_quant.py says why), and the queries are rotated alike, so both
    implementations see plain pages and q @ R; the kernels never know.
    """

    spec: QuantizedAttentionSpec

    name = "base"

    def bind(self, *, kv_scales=None, key_offset=None):
        """This backend with one layer's static inputs: kv_scales, f32[2] (k_scale, v_scale) of
        per-tensor scaling; key_offset, f32[num_kv_heads, head_dim] subtracted from every key
        before it is stored. The runner binds each layer's as runtime inputs of its layer program."""
        return functools.partial(self, kv_scales=kv_scales, key_offset=key_offset)

    def __call__(self, q, k, v, kv_cache, attn_metadata, *, sm_scale: float, kv_scales=None, key_offset=None):
        """Quantize k, v into the pages at attn_metadata.slot_mapping, then attend (over
        spec.sliding_window keys per query when the spec has a window).

        Args:
          q: [T, num_q_heads, head_dim]; k, v: [T, num_kv_heads, head_dim] (any float dtype;
            q is cast to spec.dtype, the model's compute dtype).
          kv_cache: per-token scaling: (k_pages, v_pages, k_scale, v_scale), pages
            [num_blocks, block_size, num_kv_heads, head_dim] in the storage dtype and scales
            f32[num_blocks, block_size, num_kv_heads]; per-tensor scaling: (k_pages, v_pages).
          attn_metadata: a paged_jax.core.step_inputs.AttentionMetadata.
          sm_scale: softmax scale.
          kv_scales: f32[2] static (k_scale, v_scale) of this layer (per-tensor scaling; None: 1.0).
          key_offset: f32[num_kv_heads, head_dim], this layer's key offset (None: zeros).
        Returns:
          ([T, num_q_heads, head_dim] in spec.dtype, the updated cache tuple).
        """
        md = attn_metadata
        rotation = jnp.asarray(key_rotation(self.spec.head_dim))
        k = k.astype(jnp.float32)
        if key_offset is not None:
            k = k - jnp.asarray(key_offset, jnp.float32)
        # HIGHEST: a GPU's default f32 matmul rounds through TF32
        k = jnp.matmul(k, rotation, precision=jax.lax.Precision.HIGHEST)
        q = jnp.matmul(q.astype(jnp.float32), rotation, precision=jax.lax.Precision.HIGHEST)
        attend = functools.partial(self._attend, block_tables=md.block_tables, seq_lens=md.seq_lens,
                                   query_start_loc=md.query_start_loc, num_seqs=md.num_seqs, sm_scale=sm_scale)
        if self.spec.per_token_scales:
            if kv_scales is not None:
                raise ValueError("static kv_scales apply to kv_cache_scaling='per_tensor' only")
            q = q.astype(self.spec.dtype)
            kv_cache = write_kv_cache(k, v, *kv_cache[:2], md.slot_mapping, *kv_cache[2:],
                                      kv_cache_dtype=self.spec.kv_cache_dtype)
            k_pages, v_pages, k_scale, v_scale = kv_cache
            return attend(q, k_pages, v_pages, k_scale=k_scale, v_scale=v_scale), kv_cache
        kv_scales = jnp.ones(2, jnp.float32) if kv_scales is None else jnp.asarray(kv_scales, jnp.float32)
        kv_cache = write_kv_cache(k, v, *kv_cache, md.slot_mapping, tensor_scales=kv_scales,
                                  kv_cache_dtype=self.spec.kv_cache_dtype)
        # One scale for the whole tensor: fold K's into the queries (in f32), V's into the output.
        out = attend((q * kv_scales[0]).astype(self.spec.dtype), *kv_cache)
        return (out.astype(jnp.float32) * kv_scales[1]).astype(self.spec.dtype), kv_cache


@register_backend(QuantizedAttentionSpec, "xla")
@dataclasses.dataclass(frozen=True)
class QuantizedXlaAttention(NoKernelOptions, _QuantizedAttentionBackend):
    """Gather-based attention over quantized pages (paged_jax/attention/xla.py, per chunk)."""

    name = "xla"

    def _attend(self, q, k_cache, v_cache, *, k_scale=None, v_scale=None, sm_scale, **md):
        return ragged_paged_attention_xla(q, k_cache, v_cache, md["block_tables"], md["seq_lens"],
                                          md["query_start_loc"], md["num_seqs"], sm_scale=sm_scale,
                                          k_scale=k_scale, v_scale=v_scale, kv_cache_dtype=self.spec.kv_cache_dtype,
                                          sliding_window=self.sliding_window)


@register_backend(QuantizedAttentionSpec, "triton")
@dataclasses.dataclass(frozen=True)
class QuantizedTritonAttention(KernelOptions, _QuantizedAttentionBackend):
    """The Pallas kernel over quantized pages (per tile), through the Triton backend;
    interpret=True runs it on CPU."""

    interpret: bool = False
    config: PallasConfig = PallasConfig()

    name = "triton"

    def _attend(self, q, k_cache, v_cache, *, k_scale=None, v_scale=None, sm_scale, **md):
        return ragged_paged_attention(q, k_cache, v_cache, md["block_tables"], md["seq_lens"],
                                      md["query_start_loc"], md["num_seqs"], sm_scale=sm_scale,
                                      interpret=self.interpret, config=self.config, k_scale=k_scale, v_scale=v_scale,
                                      kv_cache_dtype=self.spec.kv_cache_dtype, sliding_window=self.sliding_window)


def bind_layer(attention, layer_inputs: dict, i: int):
    """`attention` with layer i's static inputs bound (layer_inputs: backend keyword -> array
    with a leading layer axis, as ModelRunner.layer_inputs); `attention` itself when there are none."""
    return attention.bind(**{name: a[i] for name, a in layer_inputs.items()}) if layer_inputs else attention
