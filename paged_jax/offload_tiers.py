"""Builds an engine's offload tiers from its config, its KV pool's pages and its model.

The tiers' bookkeeping is host-side (paged_jax/core/offload.py, host_tier.py, disk_tier.py);
this module only reads what they need from the device side: the page layout of the
pool's caches (for the PageCodec) and a fingerprint of the model's weights (a disk
directory belongs to one model).
"""

from __future__ import annotations

import hashlib

import jax
import numpy as np
from flax import nnx

from paged_jax.core.disk_tier import DiskKVTier
from paged_jax.core.hashing import get_hash_fn_by_name, make_none_hash
from paged_jax.core.offload import OffloadManager
from paged_jax.core.page_codec import PageCodec, PageLeaf

# Elements sampled from each weight array for the fingerprint (evenly strided).
_FINGERPRINT_SAMPLES = 1 << 14


def model_fingerprint(model) -> str:
    """sha256 over the model's config and an evenly strided sample of every weight array:
    equal for the same checkpoint, different for other weights (a random 'tiny' of another
    seed, a fine-tune) with overwhelming probability."""
    digest = hashlib.sha256(repr(model.config).encode())
    for leaf in jax.tree.leaves(nnx.state(model)):
        flat = np.asarray(leaf).reshape(-1)
        digest.update(str((leaf.shape, str(leaf.dtype))).encode())
        digest.update(np.ascontiguousarray(flat[:: max(1, flat.size // _FINGERPRINT_SAMPLES)]).tobytes())
    return digest.hexdigest()


def build_offload_manager(config, cache_config, pool, model, kv_events=None) -> OffloadManager | None:
    """The OffloadManager an EngineConfig asks for (None when offload_host_bytes is 0).

    Args:
      config: the EngineConfig (its resolved `offload_config`, an OffloadConfig or None).
      cache_config: the resolved CacheConfig (block_size).
      pool: the KVPool (paged_jax/kv_pool.py) whose caches the pages come from.
      model: the loaded model (fingerprinted for the disk tier).
    """
    offload = config.offload_config
    if offload is None:
        return None
    codec = PageCodec([PageLeaf(shape, dtype) for shape, dtype in pool.page_leaves()], offload.storage_dtype)
    disk = None
    if offload.disk_dir is not None:
        hash_fn = get_hash_fn_by_name(cache_config.hash_algo)
        offsets = pool.layer_inputs.get("key_offset")  # a quantized pool's keys are stored less these
        digest = None if offsets is None else hashlib.sha256(np.asarray(offsets).tobytes()).hexdigest()
        meta = {"model": model_fingerprint(model), "block_size": cache_config.block_size, **codec.describe(),
                "kv_key_offsets": digest,
                "hash_algo": cache_config.hash_algo,
                "chain_root": make_none_hash(hash_fn, cache_config.hash_seed).hex()}
        disk = DiskKVTier(offload.disk_dir, meta, codec.nbytes, offload.disk_bytes, kv_events)
    return OffloadManager(offload, codec, cache_config.block_size, disk, kv_events,
                          sliding_windows=tuple(g.sliding_window for g in cache_config.kv_cache_groups))
