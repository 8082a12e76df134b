"""Paged attention of decoding sequences on the CPU: a native kernel (paged_attention.cc).

The XLA path (paged_jax/attention/xla.py) walks the context in chunks inside a while loop;
each chunk gathers its pages into a new array, and on XLA:CPU the gathers and the loop's
thunks cost ~0.2 ms per layer of a one-token decode, whatever the context (docs/BENCHMARKS.md
section 18). This kernel reads each live key and value once, through the block table, with
no copy: a decode step's attention then costs about its bytes.

It computes the rows of sequences with exactly one query token (decodes) and leaves every
other row zero, for the XLA path to fill (prefill chunks); f32 or bf16 caches (quantized
pools keep the XLA path). `decode_attention` is CPU-only and falls back to nothing: callers
choose it with `usable` and lax.platform_dependent.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from cpu_kernels import native

__all__ = ["decode_attention", "native_available", "usable"]

_SOURCE = os.path.join(os.path.dirname(__file__), "paged_attention.cc")
_TARGETS = {"float32": "pj_paged_decode_attention_f32", "bfloat16": "pj_paged_decode_attention_bf16"}


@functools.lru_cache(maxsize=None)
def native_available() -> bool:
    """Whether the kernel is built (or cached) and registered with XLA."""
    if not native.enabled():
        return False
    path = native.build(_SOURCE)
    if path is None:
        return False
    native.register(path, {target: target for target in _TARGETS.values()})
    return True


def usable(k_cache) -> bool:
    """Whether the kernel can serve a cache of this dtype here (the caller still routes GPUs
    to the XLA path with lax.platform_dependent)."""
    return jnp.dtype(k_cache.dtype).name in _TARGETS and native_available()


def decode_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, num_seqs, *, sm_scale: float):
    """f32[T, Hq, D]: the attention of every decoding sequence's token (its one query row
    over its seq_lens[s] keys, through its block table); zero for every other row.

    Args: those of ragged_paged_attention_xla (paged_jax/attention/xla.py) for a float cache.
    """
    out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    return jax.ffi.ffi_call(_TARGETS[jnp.dtype(k_cache.dtype).name], out)(
        q.astype(jnp.float32), k_cache, v_cache, block_tables.astype(jnp.int32), seq_lens.astype(jnp.int32),
        query_start_loc.astype(jnp.int32), jnp.reshape(num_seqs, (1,)).astype(jnp.int32),
        sm_scale=np.float32(sm_scale))
