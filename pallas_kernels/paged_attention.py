"""Ragged paged attention: prefill chunks and decodes in one call, K/V read through block tables.

Layout (the one place it is documented): k_cache and v_cache are
[num_blocks, block_size, num_kv_heads, head_dim]; slot s is page s // block_size, row
s % block_size. Page 0 is the null page: padded block-table entries point to it, never -1.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.paged_attention_xla import ragged_paged_attention_xla

IMPLS = ("pallas", "xla")


def _check_args(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, num_seqs, impl):
    """Trace-time checks of user input: a ValueError that names the fix."""
    if impl not in IMPLS:
        raise ValueError(f"{impl=} is not one of {IMPLS}; use 'pallas' on NVIDIA GPUs and 'xla' elsewhere")
    if q.ndim != 3:
        raise ValueError(f"q must be [num_tokens, num_q_heads, head_dim], got {q.shape=}")
    if k_cache.ndim != 4:
        raise ValueError(f"k_cache must be [num_blocks, block_size, num_kv_heads, head_dim], got {k_cache.shape=}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache must have k_cache's shape {k_cache.shape}, got {v_cache.shape=}")
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(
            f"q, k_cache and v_cache must share one dtype, got {q.dtype=}, {k_cache.dtype=}, {v_cache.dtype=}; "
            "cast q to the cache dtype"
        )
    if not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"attention needs a floating dtype, got {q.dtype=}")
    _, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim:
        raise ValueError(f"q's head_dim {head_dim} differs from the cache's {cache_head_dim}; they must match")
    if num_q_heads % num_kv_heads:
        raise ValueError(
            f"{num_q_heads=} must be a multiple of {num_kv_heads=} (MHA, GQA or MQA); change the model's head counts"
        )
    for name, arr, ndim in (("block_tables", block_tables, 2), ("seq_lens", seq_lens, 1),
                            ("query_start_loc", query_start_loc, 1)):
        if arr.dtype != jnp.int32:
            raise ValueError(f"{name} must be int32, got {arr.dtype}; build it with np.int32 / jnp.int32")
        if arr.ndim != ndim:
            raise ValueError(f"{name} must have {ndim} dimension(s), got shape {arr.shape}")
    max_num_seqs = block_tables.shape[0]
    if seq_lens.shape != (max_num_seqs,):
        raise ValueError(f"seq_lens must be i32[{max_num_seqs}] (one per block-table row), got {seq_lens.shape}")
    if query_start_loc.shape != (max_num_seqs + 1,):
        raise ValueError(f"query_start_loc must be i32[{max_num_seqs + 1}] (max_num_seqs + 1), got "
                         f"{query_start_loc.shape}")
    num_seqs = jnp.asarray(num_seqs)
    if num_seqs.dtype != jnp.int32 or num_seqs.shape not in ((), (1,)):
        raise ValueError(f"num_seqs must be an int32 scalar or i32[1], got {num_seqs.dtype}{num_seqs.shape}")
    if impl == "pallas":
        if block_size & (block_size - 1):
            raise ValueError(f"{block_size=} must be a power of two for impl='pallas' (Triton block dims); "
                             "pick 16 or 32, or use impl='xla'")
        if head_dim & (head_dim - 1) or head_dim < 16:
            raise ValueError(f"{head_dim=} must be a power of two >= 16 for impl='pallas' (tl.dot tiles); "
                             "pad head_dim or use impl='xla'")


@functools.partial(jax.jit, static_argnames=("sm_scale", "impl", "interpret"))
def ragged_paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, num_seqs, *,
                           sm_scale=None, impl="pallas", interpret=False):
    """Causal attention of a ragged batch of query tokens over paged K/V.

    Args:
      q: [num_tokens, num_q_heads, head_dim]; sequence i owns rows
        query_start_loc[i]:query_start_loc[i + 1]; rows past query_start_loc[num_seqs] are padding.
      k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], q's dtype.
      block_tables: i32[max_num_seqs, max_blocks_per_seq], padded with the null page 0.
      seq_lens: i32[max_num_seqs], context length INCLUDING this step's query tokens; 0 when padded.
      query_start_loc: i32[max_num_seqs + 1].
      num_seqs: i32 scalar or i32[1], the number of real sequences.
      sm_scale: softmax scale, default 1/sqrt(head_dim).
      impl: "pallas" (the Triton kernel for NVIDIA GPUs) or "xla" (gather-based; the CPU path).
      interpret: run the Pallas kernel in interpret mode (CPU tests).

    Returns:
      [num_tokens, num_q_heads, head_dim] in q.dtype. Query token j of a sequence with q_len
      tokens sits at position seq_len - q_len + j and attends to positions <= its own.
      Padding rows are finite and otherwise unspecified.
    """
    _check_args(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, num_seqs, impl)
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(q.shape[-1])
    num_seqs = jnp.reshape(num_seqs, ())
    if impl == "xla":
        return ragged_paged_attention_xla(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, num_seqs,
                                          sm_scale)
    raise NotImplementedError("the Pallas kernel lands in the next commit; use impl='xla'")


def ragged_paged_attention_reference(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, num_seqs, *,
                                     sm_scale=None, impl=None, interpret=False):
    """Dense per-sequence causal attention over K/V gathered from the pages (float32 softmax).

    Same arguments as `ragged_paged_attention` (impl and interpret are ignored); needs
    concrete arrays, not tracers. Padding rows of the output are zero.
    """
    del impl, interpret
    _check_args(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, num_seqs, "xla")
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    seq_lens, query_start_loc = np.asarray(seq_lens), np.asarray(query_start_loc)
    out = jnp.zeros(q.shape, jnp.float32)
    for i in range(int(np.asarray(num_seqs).reshape(()))):
        start, end, seq_len = int(query_start_loc[i]), int(query_start_loc[i + 1]), int(seq_lens[i])
        num_pages = -(-seq_len // block_size)
        pages = block_tables[i, :num_pages]
        k = k_cache[pages].reshape(-1, num_kv_heads, head_dim)[:seq_len].astype(jnp.float32)  # [L, K, D]
        v = v_cache[pages].reshape(-1, num_kv_heads, head_dim)[:seq_len].astype(jnp.float32)
        k, v = jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1)  # [L, H, D]
        qi = q[start:end].astype(jnp.float32)  # [Q, H, D]
        q_pos = seq_len - (end - start) + jnp.arange(end - start)
        scores = jnp.einsum("QHD,LHD->HQL", qi, k) * sm_scale  # Q = query token, L = key position, H = head
        causal = jnp.arange(seq_len)[None, :] <= q_pos[:, None]
        weights = jax.nn.softmax(jnp.where(causal[None], scores, -jnp.inf), axis=-1)
        out = out.at[start:end].set(jnp.einsum("HQL,LHD->QHD", weights, v))
    return out.astype(q.dtype)
