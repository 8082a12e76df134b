"""KV-cache specs: what one token of one layer stores, declared by the model.

A model says what its cache holds (`model.kv_cache_specs(dtype)`, one spec per layer, as
vLLM's AttentionSpec / KVCacheSpec do); the runner allocates the pool from the specs and
sizes it in bytes per token, and an attention backend is chosen for each spec. Layers with
equal specs form one KV-cache group (kv_cache_group_specs) and share a block table. The
block manager never sees a spec: it counts blocks, whatever a block holds, and learns only
each group's attention type (every spec here is "full_attention").

Layouts (the one place they are written down):
- FullAttentionSpec (Llama / GQA / MQA): per layer a (k_cache, v_cache) pair, each
  [num_blocks, block_size, num_kv_heads, head_dim]. Slot s lives at page s // block_size,
  row s % block_size; page 0 is the null page that padding points into. One buffer pair per
  layer, never stacked [num_layers, ...]: the runner's layer program takes its layers' pairs
  as donated arguments and updates them in place (a stacked cache read inside a lax.scan can
  be copied whole, openxla/xla#45912).
- MLAAttentionSpec (DeepSeek-V2 multi-head latent attention): per layer a
  (c_kv_cache, k_rope_cache) pair, [num_blocks, block_size, kv_lora_rank] and
  [num_blocks, block_size, qk_rope_head_dim]: one latent and one rope key per token, shared
  by every head. Two arrays rather than one [.., kv_lora_rank + qk_rope_head_dim] row, so
  each is a power of two wide (512 and 64 at DeepSeek-V2 shapes) for the Triton kernel.
- QuantizedAttentionSpec (kv_cache_dtype fp8_e4m3 / fp8_e5m2 / int8, paged_jax/core/kv_quant.py):
  the same pages in one byte per element, k_pages and v_pages each
  [num_blocks, block_size, num_kv_heads, head_dim] (int8, or uint8 holding fp8 bit patterns),
  plus, with the default
  per-token scaling, k_scale and v_scale, each f32[num_blocks, block_size, num_kv_heads]: the
  scales are two more leaves of the same paged layout, so a block's scales move, are shared by
  prefix hits and are evicted with its pages. Slot s of a layer stands for the value
  v_pages[s] * v_scale[s][:, None] and the key (k_pages[s] * k_scale[s][:, None]) @ R.T +
  key_offset: keys are stored centered and rotated, (k - key_offset) @ R, with R =
  kv_quant.key_rotation(head_dim) (orthonormal) and key_offset the layer's
  f32[num_kv_heads, head_dim] (zeros unless calibrated), and attention reads them with q @ R
  (kv_quant.py says why). With per-tensor scaling the layer's cache is only (k_pages,
  v_pages). The static per-layer inputs, key offsets and per-tensor K and V scales (vLLM's
  k_scale / v_scale), are runtime inputs of the layer program (ModelRunner.layer_inputs),
  not leaves of the pool.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from paged_jax.core.config import KVCacheGroupSpec
from paged_jax.core.kv_quant import (FORMATS, SCALE_DTYPE, KVQuantFormat, check_kv_cache_scaling,
                                     get_kv_quant_format)


@dataclasses.dataclass(frozen=True)
class FullAttentionSpec:
    """Per-head keys and values of every token (Llama-style GQA; MHA and MQA are cases of it).

    Attributes:
      num_kv_heads, head_dim: the shape one token stores per array.
      dtype: the cache dtype name ("float32", "bfloat16", ...).
    """

    attention_type = "full_attention"  # the host's KVCacheGroupSpec.attention_type (not a field)

    num_kv_heads: int
    head_dim: int
    dtype: str

    @property
    def page_arrays(self) -> dict[str, tuple[int, ...]]:
        """Name -> per-token shape of each array a layer keeps (one page is block_size of them)."""
        shape = (self.num_kv_heads, self.head_dim)
        return {"k": shape, "v": shape}

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token costs in one layer."""
        itemsize = np.dtype(jnp.dtype(self.dtype)).itemsize
        return sum(int(np.prod(shape)) * itemsize for shape in self.page_arrays.values())

    def allocate(self, num_blocks: int, block_size: int):
        """A zeroed (k_cache, v_cache) pair, each [num_blocks, block_size, num_kv_heads, head_dim]."""
        shape = (num_blocks, block_size, self.num_kv_heads, self.head_dim)
        return jnp.zeros(shape, self.dtype), jnp.zeros(shape, self.dtype)


@dataclasses.dataclass(frozen=True)
class MLAAttentionSpec:
    """One latent c_kv and one rope key per token (DeepSeek-V2 MLA), as vLLM's MLAAttentionSpec.

    Attributes:
      kv_lora_rank: latent width (512 in DeepSeek-V2).
      qk_rope_head_dim: rope key width (64).
      dtype: the cache dtype name.
    """

    attention_type = "full_attention"  # the host's KVCacheGroupSpec.attention_type (not a field)

    kv_lora_rank: int
    qk_rope_head_dim: int
    dtype: str

    @property
    def page_arrays(self) -> dict[str, tuple[int, ...]]:
        """Name -> per-token shape of each array a layer keeps."""
        return {"c_kv": (self.kv_lora_rank,), "k_rope": (self.qk_rope_head_dim,)}

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token costs in one layer."""
        itemsize = np.dtype(jnp.dtype(self.dtype)).itemsize
        return sum(int(np.prod(shape)) * itemsize for shape in self.page_arrays.values())

    def allocate(self, num_blocks: int, block_size: int):
        """A zeroed (c_kv_cache, k_rope_cache) pair, [num_blocks, block_size, kv_lora_rank / qk_rope_head_dim]."""
        return tuple(jnp.zeros((num_blocks, block_size, *shape), self.dtype) for shape in self.page_arrays.values())


@dataclasses.dataclass(frozen=True)
class QuantizedAttentionSpec:
    """FullAttentionSpec's keys and values stored in one byte per element (quantized on write).

    Attributes:
      num_kv_heads, head_dim: the shape one token stores per page array.
      dtype: the model's compute dtype (queries and the attention output stay in it).
      kv_cache_dtype: "fp8_e4m3", "fp8_e5m2" or "int8" (paged_jax/core/kv_quant.py FORMATS).
      scaling: "per_token" (scales beside the pages) or "per_tensor" (one static scale a layer).
    """

    attention_type = "full_attention"  # the host's KVCacheGroupSpec.attention_type (not a field)

    num_kv_heads: int
    head_dim: int
    dtype: str
    kv_cache_dtype: str
    scaling: str = "per_token"

    def __post_init__(self):
        if self.kv_cache_dtype not in FORMATS:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} must be one of {tuple(FORMATS)} "
                             "(get_kv_quant_format resolves aliases)")
        check_kv_cache_scaling(self.scaling)

    @property
    def format(self) -> KVQuantFormat:
        return FORMATS[self.kv_cache_dtype]

    @property
    def per_token_scales(self) -> bool:
        return self.scaling == "per_token"

    @property
    def page_arrays(self) -> dict[str, tuple[int, ...]]:
        """Name -> per-token shape of each array a layer keeps, in the order of its cache tuple."""
        shape = (self.num_kv_heads, self.head_dim)
        arrays = {"k": shape, "v": shape}
        if self.per_token_scales:
            arrays |= {"k_scale": (self.num_kv_heads,), "v_scale": (self.num_kv_heads,)}
        return arrays

    @property
    def page_dtypes(self) -> dict[str, str]:
        """Name -> dtype of each array in page_arrays."""
        return {name: SCALE_DTYPE if name.endswith("_scale") else self.format.page_dtype
                for name in self.page_arrays}

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token costs in one layer, scales included."""
        return sum(int(np.prod(shape)) * np.dtype(self.page_dtypes[name]).itemsize
                   for name, shape in self.page_arrays.items())

    def allocate(self, num_blocks: int, block_size: int):
        """The zeroed cache tuple, one array per page_arrays entry, each [num_blocks, block_size, ...]."""
        dtypes = self.page_dtypes
        return tuple(jnp.zeros((num_blocks, block_size, *shape), dtypes[name])
                     for name, shape in self.page_arrays.items())


KVCacheSpec = FullAttentionSpec | MLAAttentionSpec | QuantizedAttentionSpec


def kv_cache_group_specs(specs) -> tuple[KVCacheGroupSpec, ...]:
    """The model's layers grouped by cache spec (equal specs share a group and so a block
    table), groups in the order of their first layer (vLLM's KVCacheConfig.kv_cache_groups)."""
    layers: dict = {}
    for layer_id, spec in enumerate(specs):
        layers.setdefault(spec, []).append(layer_id)
    return tuple(KVCacheGroupSpec(tuple(ids), spec.attention_type) for spec, ids in layers.items())


def check_kv_cache_groups(groups, specs) -> None:
    """ValueError unless `groups` (CacheConfig.kv_cache_groups) put every layer in exactly one
    group, each group's layers share one spec, and each group has its spec's attention type.
    The default one group with no layer ids stands for every layer (host-only configs)."""
    if groups == (KVCacheGroupSpec(),):
        groups = (KVCacheGroupSpec(tuple(range(len(specs))), specs[0].attention_type),)
    layer_ids = sorted(i for g in groups for i in g.layer_ids)
    if layer_ids != list(range(len(specs))):
        raise ValueError(f"kv_cache_groups cover layers {layer_ids}, but the model has {len(specs)}; put each layer "
                         "in one group (models.kv_cache_spec.kv_cache_group_specs groups them by spec)")
    for g in groups:
        group_specs = {specs[i] for i in g.layer_ids}
        if len(group_specs) != 1:
            raise ValueError(f"KV-cache group of layers {g.layer_ids} mixes cache specs {group_specs}; a group shares "
                             "one block table, so its layers need one spec (kv_cache_group_specs)")
        if next(iter(group_specs)).attention_type != g.attention_type:
            raise ValueError(f"KV-cache group of layers {g.layer_ids} says {g.attention_type!r}, its layers' spec "
                             f"{next(iter(group_specs)).attention_type!r}")


def attention_spec(num_kv_heads: int, head_dim: int, dtype: str, kv_cache_dtype: str = "auto",
                   kv_cache_scaling: str = "per_token") -> KVCacheSpec:
    """The spec of a GQA layer for a kv_cache_dtype: FullAttentionSpec in `dtype` for "auto",
    else a QuantizedAttentionSpec (ValueError for an unknown name, listing the choices)."""
    fmt = get_kv_quant_format(kv_cache_dtype)
    check_kv_cache_scaling(kv_cache_scaling)
    if fmt is None:
        return FullAttentionSpec(num_kv_heads, head_dim, dtype)
    return QuantizedAttentionSpec(num_kv_heads, head_dim, dtype, fmt.name, kv_cache_scaling)


def kv_cache_bytes_per_token(specs, kv_cache_dtype: str | None = None, kv_cache_scaling: str = "per_token") -> int:
    """Bytes one token costs across all layers: the unit the engine sizes its pool in.

    Args:
      specs: the model's per-layer cache specs; or a Llama-family config (num_layers,
        num_kv_heads, head_dim, dtype) together with a kv_cache_dtype ("auto" = config.dtype).
      kv_cache_dtype, kv_cache_scaling: only with a config.
    """
    if kv_cache_dtype is not None:
        c = specs
        spec = attention_spec(c.num_kv_heads, c.head_dim, c.dtype, kv_cache_dtype, kv_cache_scaling)
        specs = (spec,) * c.num_layers
    return sum(spec.bytes_per_token for spec in specs)


def init_kv_caches(specs, num_blocks: int, block_size: int) -> list:
    """One zeroed cache per layer, laid out as its spec says (separate buffers per layer, so
    each one is donated to the step and updated in place by the unrolled layer loop)."""
    assert num_blocks >= 2, f"{num_blocks=}: the pool needs the null block plus one (see CacheConfig)"
    return [spec.allocate(num_blocks, block_size) for spec in specs]
