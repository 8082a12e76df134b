"""Attention backends: write this step's K/V into the pool, then attend through block tables.

A backend is a frozen, hashable object (so it is static under jit) built once by the runner
for the model's cache spec. The model calls it once per layer:

    out, layer_cache = attention(q, k, v, layer_cache, attn_metadata, sm_scale=...)

One backend per (cache spec, implementation) pair; a new cache format (quantized pages,
an MLA latent) adds a spec in models/kv_cache_spec.py and its backends here.
"""

from __future__ import annotations

import dataclasses

import jax

from models.kv_cache_spec import FullAttentionSpec, MLAAttentionSpec
from paged_jax.attention.xla import ragged_paged_attention_xla
from pallas_kernels.kv_cache_write import write_kv_cache
from pallas_kernels.paged_attention import PallasConfig, ragged_paged_attention

ATTENTION_IMPLS = ("xla", "pallas")


def default_attention_impl() -> str:
    """"pallas" on GPUs (the Triton kernel), "xla" elsewhere (the gather path is the fast CPU one)."""
    return "pallas" if jax.default_backend() == "gpu" else "xla"


@dataclasses.dataclass(frozen=True)
class _FullAttentionBackend:
    """Shared body of the GQA backends: the KV write, then `_attend` over the updated pages."""

    spec: FullAttentionSpec

    name = "base"

    def __call__(self, q, k, v, kv_cache, attn_metadata, *, sm_scale: float):
        """Write k, v at attn_metadata.slot_mapping, then attend.

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


@dataclasses.dataclass(frozen=True)
class XlaAttention(_FullAttentionBackend):
    """Gather-based attention (paged_jax/attention/xla.py)."""

    name = "xla"

    def _attend(self, *args, sm_scale):
        return ragged_paged_attention_xla(*args, sm_scale=sm_scale)


@dataclasses.dataclass(frozen=True)
class PallasAttention(_FullAttentionBackend):
    """The Pallas/Triton kernel (pallas_kernels/paged_attention.py); interpret=True runs it on CPU."""

    interpret: bool = False
    config: PallasConfig = PallasConfig()

    name = "pallas"

    def _attend(self, *args, sm_scale):
        return ragged_paged_attention(*args, sm_scale=sm_scale, interpret=self.interpret, config=self.config)


AttentionBackend = XlaAttention | PallasAttention


def make_attention_backend(spec, impl: str | None = None, *, interpret: bool = False,
                           pallas_config: PallasConfig | None = None) -> AttentionBackend:
    """The backend for a cache spec (the one place an implementation is chosen and checked).

    Args:
      spec: the model's per-layer cache spec (models.kv_cache_spec).
      impl: "xla", "pallas" or None (default_attention_impl()).
      interpret: run the Pallas kernel in interpret mode (CPU tests of the kernel path).
      pallas_config: launch parameters of the Pallas kernel.
    """
    impl = impl or default_attention_impl()
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention_impl={impl!r} must be one of {ATTENTION_IMPLS} (or None: pallas on GPU, "
                         "xla elsewhere)")
    if isinstance(spec, MLAAttentionSpec):
        from paged_jax.attention.mla import MlaPallasAttention, MlaXlaAttention

        if impl == "xla":
            if interpret or pallas_config is not None:
                raise ValueError("interpret and pallas_config apply to attention_impl='pallas' only")
            return MlaXlaAttention(spec)
        if pallas_config is not None:
            raise ValueError("pallas_config is a GQA PallasConfig; the MLA kernel takes its own MlaPallasConfig")
        return MlaPallasAttention(spec, interpret)
    if not isinstance(spec, FullAttentionSpec):
        raise ValueError(f"no attention backend for a {type(spec).__name__}; this build knows FullAttentionSpec "
                         "and MLAAttentionSpec")
    if impl == "xla":
        if interpret or pallas_config is not None:
            raise ValueError("interpret and pallas_config apply to attention_impl='pallas' only")
        return XlaAttention(spec)
    return PallasAttention(spec, interpret, pallas_config or PallasConfig())
