"""Write this step's K/V into their slots of the paged caches.

The write is an XLA scatter over the caches viewed as [num_blocks * block_size, ...] (a
free reshape): with the caches donated to the enclosing jit, XLA updates them in place, so
a step costs num_tokens rows of traffic, not a cache-sized copy. A Pallas kernel would
need input_output_aliases for the same effect and gains nothing here; this file is where
quantize-on-write would go.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _check_args(k, v, k_cache, v_cache, slot_mapping):
    """Trace-time checks of user input: a ValueError that names the fix."""
    if k_cache.ndim != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], "
                         f"got {k_cache.shape=} and {v_cache.shape=}")
    num_kv_heads, head_dim = k_cache.shape[2:]
    if k.ndim != 3 or k.shape != v.shape or k.shape[1:] != (num_kv_heads, head_dim):
        raise ValueError(f"k and v must both be [num_tokens, {num_kv_heads}, {head_dim}] to match the cache, "
                         f"got {k.shape=} and {v.shape=}")
    if k.dtype != k_cache.dtype or v.dtype != v_cache.dtype:
        raise ValueError(f"k/v dtypes {k.dtype}/{v.dtype} must equal the cache dtypes "
                         f"{k_cache.dtype}/{v_cache.dtype}; cast k and v before writing")
    if slot_mapping.dtype != jnp.int32 or slot_mapping.shape != (k.shape[0],):
        raise ValueError(f"slot_mapping must be i32[{k.shape[0]}] (one slot per token), "
                         f"got {slot_mapping.dtype}{slot_mapping.shape}")


@jax.jit
def write_kv_cache(k, v, k_cache, v_cache, slot_mapping):
    """Store k[t], v[t] at slot slot_mapping[t] of the caches.

    Args:
      k, v: [num_tokens, num_kv_heads, head_dim].
      k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]. Updated in place when
        the caller's jit donates them (the engine step does); called on its own, this returns
        new arrays and leaves the inputs alive (wrap it in jax.jit(..., donate_argnums=(2, 3))
        to update in place).
      slot_mapping: i32[num_tokens]; slot s is page s // block_size, row s % block_size.
        Padded tokens point into the null page 0 (never -1); which padded write wins there
        is unspecified, and nothing reads the null page unmasked.

    Returns:
      (k_cache, v_cache) with the addressed slots overwritten and every other slot unchanged.
    """
    _check_args(k, v, k_cache, v_cache, slot_mapping)
    num_slots = k_cache.shape[0] * k_cache.shape[1]

    def scatter(cache, new):
        flat = cache.reshape(num_slots, *cache.shape[2:])
        # Out-of-range slots are dropped rather than clamped onto a live slot.
        return flat.at[slot_mapping].set(new, mode="drop").reshape(cache.shape)

    return scatter(k_cache, k), scatter(v_cache, v)


def write_kv_cache_reference(k, v, k_cache, v_cache, slot_mapping):
    """Same contract as `write_kv_cache`, written as a one-hot select (no scatter).

    For padded tokens that share a slot the last one wins, one of the outcomes that
    `write_kv_cache` allows.
    """
    _check_args(k, v, k_cache, v_cache, slot_mapping)
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    hits = slot_mapping[:, None] == jnp.arange(num_slots)[None, :]  # [T, num_slots]
    written = hits.any(axis=0)
    # The last token addressing a slot wins.
    last_token = (k.shape[0] - 1) - jnp.argmax(hits[::-1], axis=0)

    def select(cache, new):
        flat = cache.reshape(num_slots, *cache.shape[2:])
        return jnp.where(written[:, None, None], new[last_token], flat).reshape(cache.shape)

    return select(k_cache, k), select(v_cache, v)
