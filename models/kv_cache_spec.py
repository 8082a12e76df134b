"""KV-cache specs: what one token of one layer stores, declared by the model.

A model says what its cache holds (`model.kv_cache_specs(dtype)`, one spec per layer, as
vLLM's AttentionSpec / KVCacheSpec do); the runner allocates the pool from the specs and
sizes it in bytes per token, and the runner's attention backend is chosen for the spec.
The block manager never sees a spec: it counts blocks, whatever a block holds.

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
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class FullAttentionSpec:
    """Per-head keys and values of every token (Llama-style GQA; MHA and MQA are cases of it).

    Attributes:
      num_kv_heads, head_dim: the shape one token stores per array.
      dtype: the cache dtype name ("float32", "bfloat16", ...).
    """

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


KVCacheSpec = FullAttentionSpec | MLAAttentionSpec  # grows with the cache formats (quantized pages)


def kv_cache_bytes_per_token(specs) -> int:
    """Bytes one token costs across all layers: the unit the engine sizes its pool in."""
    return sum(spec.bytes_per_token for spec in specs)


def init_kv_caches(specs, num_blocks: int, block_size: int) -> list:
    """One zeroed cache per layer, laid out as its spec says (separate buffers per layer, so
    each one is donated to the step and updated in place by the unrolled layer loop)."""
    assert num_blocks >= 2, f"{num_blocks=}: the pool needs the null block plus one (see CacheConfig)"
    return [spec.allocate(num_blocks, block_size) for spec in specs]
