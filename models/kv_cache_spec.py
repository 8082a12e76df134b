"""KV-cache specs: what one token of one layer stores, declared by the model.

A model says what its cache holds (`model.kv_cache_specs(dtype)`, one spec per layer, as
vLLM's AttentionSpec / KVCacheSpec do); the runner allocates the pool from the specs and
sizes it in bytes per block, and an attention backend is chosen for each spec. Layers with
equal specs form KV-cache groups (kv_cache_group_specs, vLLM's grouping) that share a block
table. The block manager never sees a spec: it counts blocks, whatever a block holds, and
learns only each group's attention type ("full_attention", or "sliding_window" with its
window). A hybrid model's groups share the pool's arrays (kv_cache_tensors): array i holds
the i-th layer of every group, so a block costs the same bytes in any group.

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


def check_sliding_window(sliding_window) -> None:
    """ValueError unless sliding_window is None or an int >= 1."""
    if sliding_window is not None and (isinstance(sliding_window, bool) or not isinstance(sliding_window, int)
                                       or sliding_window < 1):
        raise ValueError(f"sliding_window={sliding_window!r} must be a positive int (the tokens a query sees, "
                         "itself included) or None (full attention)")


def attention_type_of(sliding_window: int | None) -> str:
    """"sliding_window" for a windowed spec, else "full_attention"."""
    return "full_attention" if sliding_window is None else "sliding_window"


@dataclasses.dataclass(frozen=True)
class FullAttentionSpec:
    """Per-head keys and values of every token (Llama-style GQA; MHA and MQA are cases of it).

    Attributes:
      num_kv_heads, head_dim: the shape one token stores per array.
      dtype: the cache dtype name ("float32", "bfloat16", ...).
      sliding_window: None (every earlier token is visible), or the number of latest tokens,
        itself included, a query sees (vLLM's SlidingWindowSpec; Gemma 3's local layers: 512).
        Its group's manager frees the blocks that slid out of the window.
    """

    num_kv_heads: int
    head_dim: int
    dtype: str
    sliding_window: int | None = None

    def __post_init__(self):
        check_sliding_window(self.sliding_window)

    @property
    def attention_type(self) -> str:
        """The host's KVCacheGroupSpec.attention_type: which manager keeps the group's blocks."""
        return attention_type_of(self.sliding_window)

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
      sliding_window: as FullAttentionSpec's.
    """

    num_kv_heads: int
    head_dim: int
    dtype: str
    kv_cache_dtype: str
    scaling: str = "per_token"
    sliding_window: int | None = None

    @property
    def attention_type(self) -> str:
        """The host's KVCacheGroupSpec.attention_type: which manager keeps the group's blocks."""
        return attention_type_of(self.sliding_window)

    def __post_init__(self):
        check_sliding_window(self.sliding_window)
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


def page_layout(spec):
    """The spec without its window: two layers whose specs have one page layout can keep their
    pages in one shared array (a window changes which tokens a layer reads, not what it stores)."""
    if getattr(spec, "sliding_window", None) is None:
        return spec
    return dataclasses.replace(spec, sliding_window=None)


def kv_cache_group_specs(specs) -> tuple[KVCacheGroupSpec, ...]:
    """The model's layers in KV-cache groups (layers of one group share a block table), as
    vLLM's KVCacheConfig groups them.

    Layers of equal specs go together, kinds in the order of their first layer. A model of one
    kind is one group (every Llama). A hybrid model whose kinds share a page layout (Gemma 3:
    15 sliding-window layers, 3 full ones) has each kind cut into groups of the same size
    (vLLM's _get_kv_cache_groups_uniform_page_size): group_size is the smallest kind's layer
    count (the largest's, when that is less than 1.25x the smallest), and a kind of n layers
    makes cdiv(n, group_size) groups, group i taking its layers[i::num_groups]. Equal group
    sizes are what let the pool keep one array per position in a group, shared by every group
    (kv_cache_tensors), so a block costs group_size layers' pages whichever group holds it.
    Gemma 3 270M: five sliding groups [0, 6, 12], [1, 7, 13], .., [4, 10, 16], then the full
    group [5, 11, 17].
    """
    kinds: dict = {}
    for layer_id, spec in enumerate(specs):
        kinds.setdefault(spec, []).append(layer_id)
    layer_lists = list(kinds.values())
    if len(kinds) > 1 and len({page_layout(spec) for spec in kinds}) == 1:
        sizes = [len(ids) for ids in layer_lists]
        group_size = max(sizes) if max(sizes) < min(sizes) * 1.25 else min(sizes)
        layer_lists = []
        for ids in kinds.values():
            num_groups = -(-len(ids) // group_size)
            layer_lists += [ids[i::num_groups] for i in range(num_groups)]
    groups = []
    for ids in layer_lists:
        spec = specs[ids[0]]
        window = getattr(spec, "sliding_window", None)
        extra = {} if window is None else {"sliding_window": window}
        groups.append(KVCacheGroupSpec(tuple(ids), spec.attention_type, **extra))
    return tuple(groups)


def kv_cache_tensors(groups, specs) -> list[tuple[int, ...]]:
    """The pool's arrays (vLLM's KVCacheTensor), each as the layers that share it.

    When every group's layers have one page layout (page_layout), array i holds the pages of
    the i-th layer of every group: a block belongs to one group at a time, so the layers of
    different groups never write the same page, and a block costs one page per array rather
    than one per layer. Otherwise (or for a lone group) every layer has an array of its own.
    `groups` as CacheConfig.kv_cache_groups (the default group of no layer ids: every layer).
    """
    layer_groups = [g.layer_ids for g in groups if g.layer_ids]
    if len(layer_groups) < 2 or len({page_layout(spec) for spec in specs}) != 1:
        return [(layer_id,) for layer_id in range(len(specs))]
    size = max(len(ids) for ids in layer_groups)
    return [tuple(ids[i] for ids in layer_groups if i < len(ids)) for i in range(size)]


def kv_cache_bytes_per_block(specs, groups, block_size: int) -> int:
    """Bytes one block costs in the pool: one page in each of kv_cache_tensors' arrays."""
    return sum(specs[layers[0]].bytes_per_token for layers in kv_cache_tensors(groups, specs)) * block_size


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
                   kv_cache_scaling: str = "per_token", sliding_window: int | None = None) -> KVCacheSpec:
    """The spec of a GQA layer for a kv_cache_dtype: FullAttentionSpec in `dtype` for "auto" (in
    bfloat16 for "bfloat16"), else a QuantizedAttentionSpec (ValueError for an unknown name,
    listing the choices); sliding_window: None, or the layer's window (tokens a query sees,
    itself included)."""
    fmt = get_kv_quant_format(kv_cache_dtype)
    check_kv_cache_scaling(kv_cache_scaling)
    if fmt is None:
        return FullAttentionSpec(num_kv_heads, head_dim, "bfloat16" if kv_cache_dtype == "bfloat16" else dtype,
                                 sliding_window)
    return QuantizedAttentionSpec(num_kv_heads, head_dim, dtype, fmt.name, kv_cache_scaling, sliding_window)


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
