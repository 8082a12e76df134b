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

import jax
import jax.numpy as jnp
import numpy as np

from cpu_kernels import native

__all__ = ["decode_attention", "native_available", "usable"]

_PREFIX = "pj_paged_decode_attention"
_SUFFIXES = {"float32": "f32", "bfloat16": "bf16"}  # cache dtype -> handler symbol suffix


def build_and_register(extra_flags=(), prefix: str = _PREFIX) -> bool:
    """Builds paged_attention.cc (cpu_kernels/native.py) with extra_flags and registers its
    handlers with XLA as prefix_<f32|bf16>. False (with a warning) when it cannot be built."""
    return native.build_and_register(extra_flags, {f"{prefix}_{suffix}": f"{_PREFIX}_{suffix}"
                                                   for suffix in _SUFFIXES.values()})


@functools.lru_cache(maxsize=None)
def native_available() -> bool:
    """Whether the kernel is built (or cached) and registered with XLA."""
    return native.enabled() and build_and_register()


def usable(k_cache) -> bool:
    """Whether the kernel can serve a cache of this dtype here (the caller still routes GPUs
    to the XLA path with lax.platform_dependent)."""
    return jnp.dtype(k_cache.dtype).name in _SUFFIXES and native_available()


def decode_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, num_seqs, *, sm_scale: float,
                     sliding_window: int | None = None, prefix: str = _PREFIX):
    """f32[T, Hq, D]: the attention of every decoding sequence's token (its one query row
    over its seq_lens[s] keys, through its block table; with sliding_window, over its last
    sliding_window keys only, and the kernel's key loops start there); zero for every other row.

    Args: those of ragged_paged_attention_xla (paged_jax/attention/xla.py) for a float cache;
    prefix names the registered build (build_and_register).
    """
    if sliding_window is not None and not 0 < sliding_window < 2**31:
        raise ValueError(f"{sliding_window=} must be None or a positive int32 (the keys each query sees)")
    out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    return jax.ffi.ffi_call(f"{prefix}_{_SUFFIXES[jnp.dtype(k_cache.dtype).name]}", out)(
        q.astype(jnp.float32), k_cache, v_cache, block_tables.astype(jnp.int32), seq_lens.astype(jnp.int32),
        query_start_loc.astype(jnp.int32), jnp.reshape(num_seqs, (1,)).astype(jnp.int32),
        sm_scale=np.float32(sm_scale), sliding_window=np.int32(sliding_window or 0))
