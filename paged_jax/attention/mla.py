"""Attention backends for the MLA latent pool (models/kv_cache_spec.py, MLAAttentionSpec).

The MLA model calls its backend once per layer with the pieces MLA attention needs:

    out, layer_cache = attention(q_nope, q_rope, c_kv, k_rope, layer_cache, attn_metadata,
                                 w_uk=..., w_uv=..., sm_scale=...)

The backend writes this step's latent and rope key into the pool, then attends over it
(decodes and prefill chunks in one ragged call). Decodes attend in latent space (absorbed);
on the XLA path prefill chunks decompress or not as PREFILL_FORM says (measured by
scripts/bench_mla.py: absorbed); the Pallas kernel is absorbed throughout. The two classes
are the MLAAttentionSpec rows of the table in registry.py.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from models.kv_cache_spec import MLAAttentionSpec
from paged_jax.attention.mla_xla import mla_paged_attention_xla
from paged_jax.attention.registry import KernelOptions, NoKernelOptions, register_backend
from pallas_kernels.mla_attention import MlaPallasConfig, mla_paged_attention

# Prefill chunks on the XLA path: absorbed measured faster on CPU, with and without cached
# context (scripts/bench_mla.py; docs/BENCHMARKS.md section 12). The XLA path decompresses the context once per 32-row query block, which
# costs L * N * (P + V) per key against 32 * N * (L + R + L) for attending in latent space.
PREFILL_FORM = "absorbed"


@jax.jit
def write_latent_cache(c_kv, k_rope, c_kv_cache, k_rope_cache, slot_mapping):
    """Store c_kv[t], k_rope[t] at slot slot_mapping[t] (in place when the caller donates the caches).

    Args:
      c_kv: [T, L]; k_rope: [T, R] (rotated), in the caches' dtype.
      c_kv_cache: [num_blocks, block_size, L]; k_rope_cache: [num_blocks, block_size, R].
      slot_mapping: i32[T]; padding points into the null page 0.
    Returns:
      (c_kv_cache, k_rope_cache) with the addressed slots overwritten.
    """

    def scatter(cache, new):
        flat = cache.reshape(-1, cache.shape[-1])
        return flat.at[slot_mapping].set(new, mode="drop").reshape(cache.shape)

    return scatter(c_kv_cache, c_kv), scatter(k_rope_cache, k_rope)


@dataclasses.dataclass(frozen=True)
class _MlaBackend:
    spec: MLAAttentionSpec

    name = "base"

    def __call__(self, q_nope, q_rope, c_kv, k_rope, kv_cache, attn_metadata, *, w_uk, w_uv, sm_scale: float):
        """Write c_kv, k_rope at attn_metadata.slot_mapping, then attend.

        Args:
          q_nope: [T, N, P]; q_rope: [T, N, R] (rotated); c_kv: [T, L] (normed latent);
            k_rope: [T, R] (rotated). Cast to the cache dtype.
          kv_cache: (c_kv_cache [num_blocks, block_size, L], k_rope_cache [num_blocks, block_size, R]).
          attn_metadata: a paged_jax.core.step_inputs.AttentionMetadata.
          w_uk: [L, N, P]; w_uv: [L, N, V] (the two halves of kv_b_proj).
          sm_scale: softmax scale.
        Returns:
          ([T, N, V] in the cache dtype, the updated (c_kv_cache, k_rope_cache)).
        """
        c_kv_cache, k_rope_cache = kv_cache
        md = attn_metadata
        dtype = c_kv_cache.dtype
        c_kv_cache, k_rope_cache = write_latent_cache(c_kv.astype(dtype), k_rope.astype(dtype), c_kv_cache,
                                                      k_rope_cache, md.slot_mapping)
        cast = lambda a: jnp.asarray(a).astype(dtype)  # noqa: E731
        out = self._attend(cast(q_nope), cast(q_rope), c_kv_cache, k_rope_cache, cast(w_uk), cast(w_uv),
                           md.block_tables, md.seq_lens, md.query_start_loc, md.num_seqs, sm_scale=sm_scale)
        return out, (c_kv_cache, k_rope_cache)


@register_backend(MLAAttentionSpec, "xla")
@dataclasses.dataclass(frozen=True)
class MlaXlaAttention(NoKernelOptions, _MlaBackend):
    """Gather-based MLA (paged_jax/attention/mla_xla.py): absorbed decodes, PREFILL_FORM prefill chunks."""

    prefill_form: str = PREFILL_FORM
    decode_form: str = "absorbed"  # "decompressed" only to measure what absorbing saves

    name = "xla"

    def _attend(self, *args, sm_scale):
        return mla_paged_attention_xla(*args, sm_scale=sm_scale, decode_form=self.decode_form,
                                       prefill_form=self.prefill_form)


@register_backend(MLAAttentionSpec, "triton")
@dataclasses.dataclass(frozen=True)
class MlaTritonAttention(KernelOptions, _MlaBackend):
    """The Pallas MLA kernel (pallas_kernels/mla_attention.py) through JAX's Triton backend;
    interpret=True runs it on CPU. Its pallas_config is an MlaPallasConfig."""

    interpret: bool = False
    config: MlaPallasConfig = MlaPallasConfig()

    name = "triton"

    def _attend(self, *args, sm_scale):
        return mla_paged_attention(*args, sm_scale=sm_scale, interpret=self.interpret, config=self.config)
