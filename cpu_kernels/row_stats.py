"""Each row's first argmax and log-sum-exp on the CPU: a native kernel (row_stats.cc).

What greedy sampling and its logprobs read from the logits (paged_jax/sampler.py). As XLA ops
on the CPU these are four passes over the vocabulary, each a loop of its own (~0.2 ms of a
SmolLM2 decode step); the kernel reads each row three times from cache. Elsewhere (a GPU, a
CPU without a C++ compiler, PAGED_JAX_NATIVE_KERNELS=0) `argmax_logsumexp` is XLA's reductions,
`argmax_logsumexp_reference`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from cpu_kernels import native

__all__ = ["argmax_logsumexp", "argmax_logsumexp_reference", "native_available"]

_TARGET = "pj_argmax_logsumexp"


def build_and_register(extra_flags=(), prefix: str = _TARGET) -> bool:
    """Builds the kernels (cpu_kernels/native.py) with extra_flags and registers this one's
    handler with XLA as `prefix`. False (with a warning) when it cannot be built."""
    return native.build_and_register(extra_flags, {prefix: _TARGET})


@functools.lru_cache(maxsize=None)
def native_available() -> bool:
    """Whether the kernel is built (or cached) and registered with XLA."""
    return native.enabled() and build_and_register()


def argmax_logsumexp_reference(logits):
    """(i32[...] the first index of each row's maximum, f32[...] its log-sum-exp) over the last
    axis of f32 logits, as XLA's reductions: the row max, the first index holding it (a row
    holding a NaN matches nothing and gives the last id), max + log(sum(exp(x - max)))."""
    vocab = logits.shape[-1]
    row_max = logits.max(axis=-1, keepdims=True)
    first_max = jnp.where(logits == row_max, jnp.arange(vocab, dtype=jnp.int32), vocab).min(axis=-1)
    log_norm = row_max[..., 0] + jnp.log(jnp.exp(logits - row_max).sum(axis=-1))
    return jnp.minimum(first_max, vocab - 1), log_norm


def _native(logits, prefix: str):
    rows = logits.reshape(-1, logits.shape[-1])
    out = (jax.ShapeDtypeStruct(rows.shape[:1], jnp.int32), jax.ShapeDtypeStruct(rows.shape[:1], jnp.float32))
    argmax, lse = jax.ffi.ffi_call(prefix, out)(rows)
    return argmax.reshape(logits.shape[:-1]), lse.reshape(logits.shape[:-1])


def argmax_logsumexp(logits, *, native: str | None = _TARGET):
    """argmax_logsumexp_reference's results, from the native kernel on a CPU where it is built
    (the log-sum-exp then differs from XLA's in the last bits: its exp is a polynomial, its
    sum in another order).

    Args:
      logits: f32[..., V] (other float dtypes are cast to f32), V >= 1.
      native: the registered handler to call (build_and_register's prefix; tests build
        others), or None for XLA's reductions.
    Returns:
      (argmax i32[...], log-sum-exp f32[...]).
    """
    logits = logits.astype(jnp.float32)
    if native is None or (native == _TARGET and not native_available()):
        return argmax_logsumexp_reference(logits)
    return jax.lax.platform_dependent(logits, cpu=functools.partial(_native, prefix=native),
                                      default=argmax_logsumexp_reference)
