"""Bookkeeping of a ragged batch, shared by both attention impls.

A ragged batch packs the query tokens of every sequence back to back. Both impls cut each
sequence's tokens into query blocks of `block_q` rows, one sequence per block, so that a
block reads its sequence's pages once for all its rows. These helpers map sequences to
blocks and back to tokens with fixed-shape int32 arithmetic (everything runs under jit).
Under a sliding window, both impls shift each block's table to its window's first page
(window_tables), so neither reads a page wholly before a window.
"""

from __future__ import annotations

import numbers
from typing import NamedTuple

import jax.numpy as jnp

from paged_jax.core.kv_quant import FORMATS

# Sequence counts are small (<= a few hundred): one fused compare beats a log-depth loop of
# tiny kernels on a GPU, and costs little on a CPU.
SEARCH = "compare_all"


class RaggedBatch(NamedTuple):
    """Per-sequence view of a batch; padded sequences (index >= num_seqs) have q_len 0."""

    q_lens: jnp.ndarray  # i32[max_num_seqs]: query tokens this step
    seq_lens: jnp.ndarray  # i32[max_num_seqs]: context length including the query tokens
    token_start: jnp.ndarray  # i32[max_num_seqs]: first token row, query_start_loc[:-1]
    token_end: jnp.ndarray  # i32[max_num_seqs]: query_start_loc[1:]; int32 max when padded


class BatchSplit(NamedTuple):
    """Which sequences decode (one query token) and which prefill a chunk (two or more)."""

    decode_q_lens: jnp.ndarray  # i32[max_num_seqs]: 1 for a decoding sequence, else 0
    prefill_q_lens: jnp.ndarray  # i32[max_num_seqs]: q_len of a prefilling sequence, else 0


class QueryBlocks(NamedTuple):
    """Query blocks of one block size; blocks past the real ones have num_rows 0."""

    seq: jnp.ndarray  # i32[num_blocks]: owning sequence (clamped for padding blocks)
    row_token: jnp.ndarray  # i32[num_blocks, block_q]: token row of each query row (0 if none)
    q_pos0: jnp.ndarray  # i32[num_blocks]: position of the block's first query row
    num_rows: jnp.ndarray  # i32[num_blocks]: real query rows, 0 for padding blocks
    first_block: jnp.ndarray  # i32[max_num_seqs]: index of each sequence's first block


def cdiv(a, b):
    return (a + b - 1) // b


def ragged_batch(seq_lens, query_start_loc, num_seqs):
    """Zero out padded sequences so that nothing downstream depends on their contents."""
    real_seq = jnp.arange(seq_lens.shape[0]) < jnp.reshape(num_seqs, ())
    q_lens = jnp.where(real_seq, query_start_loc[1:] - query_start_loc[:-1], 0)
    # Padded sequences end past every token, so token -> sequence searches land on real ones.
    token_end = jnp.where(real_seq, query_start_loc[1:], jnp.iinfo(jnp.int32).max)
    return RaggedBatch(q_lens.astype(jnp.int32), jnp.where(real_seq, seq_lens, 0).astype(jnp.int32),
                       query_start_loc[:-1].astype(jnp.int32), token_end.astype(jnp.int32))


def split_decodes_and_prefills(batch) -> BatchSplit:
    """The one place a batch is split: decodes get blocks of one row, prefill chunks blocks
    of block_q rows (each impl picks block_q)."""
    return BatchSplit(jnp.where(batch.q_lens == 1, 1, 0).astype(jnp.int32),
                      jnp.where(batch.q_lens >= 2, batch.q_lens, 0).astype(jnp.int32))


def max_prefill_blocks(num_tokens: int, max_num_seqs: int, block_q: int) -> int:
    """Static bound on the prefill query blocks of a bucket: each prefilling sequence (>= 2
    tokens) wastes at most one partial block."""
    return cdiv(num_tokens, block_q) + min(max_num_seqs, num_tokens // 2)


def query_blocks(batch, q_lens, num_blocks, block_q):
    """Cut the `q_lens` tokens of each sequence (a subset of batch.q_lens) into blocks.

    Blocks are packed: the real ones first, in sequence order. `num_blocks` must be at
    least sum(cdiv(q_lens, block_q)) (the caller's static bound).
    """
    max_num_seqs = q_lens.shape[0]
    blocks_per_seq = cdiv(q_lens, block_q)
    blocks_end = jnp.cumsum(blocks_per_seq)
    first_block = blocks_end - blocks_per_seq
    block_ids = jnp.arange(num_blocks, dtype=jnp.int32)
    seq = jnp.searchsorted(blocks_end, block_ids, side="right", method=SEARCH)
    seq = jnp.minimum(seq, max_num_seqs - 1).astype(jnp.int32)
    real = block_ids < blocks_end[-1]
    row0 = (block_ids - first_block[seq]) * block_q  # first query row of the block within its sequence
    num_rows = jnp.where(real, jnp.clip(q_lens[seq] - row0, 0, block_q), 0)
    rows = jnp.arange(block_q, dtype=jnp.int32)[None, :]
    row_token = jnp.where(rows < num_rows[:, None], batch.token_start[seq][:, None] + row0[:, None] + rows, 0)
    # Query row j of a sequence with q_len rows sits at position seq_len - q_len + j.
    q_pos0 = jnp.where(real, batch.seq_lens[seq] - q_lens[seq] + row0, 0)
    return QueryBlocks(seq, row_token, q_pos0.astype(jnp.int32), num_rows.astype(jnp.int32),
                       first_block.astype(jnp.int32))


def window_pages(sliding_window: int, block_q: int, block_size: int, max_blocks_per_seq: int) -> int:
    """Static bound on the pages a query block of block_q tokens reads under a sliding window:
    its keys span sliding_window + block_q - 1 positions (the first row's window to the last
    row), so they touch at most cdiv(sliding_window + block_q - 2, block_size) + 1 pages."""
    return min(max_blocks_per_seq, cdiv(sliding_window + block_q - 2, block_size) + 1)


def window_first_key(q_pos0, sliding_window: int):
    """Position of the oldest key any row of a block sees: the first key of the window of the
    block's first query row (position q_pos0 sees q_pos0 - sliding_window < k <= q_pos0)."""
    return jnp.maximum(q_pos0 - sliding_window + 1, 0)


def window_tables(tables, q_pos0, sliding_window: int, block_size: int, width: int):
    """tables i32[B, W] -> i32[B, width]: each block's table shifted left to start at the page
    holding window_first_key(q_pos0), padded with the null page, so a block's loop over its
    pages starts inside its window and never reads a page wholly before it. Key position
    window_first_key // block_size * block_size sits at column 0."""
    first_page = window_first_key(q_pos0, sliding_window) // block_size  # [B]
    padded = jnp.pad(tables, ((0, 0), (0, width)))
    columns = first_page[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :]  # [B, width]
    return jnp.take_along_axis(padded, columns, axis=1, mode="clip")


def token_sequence(batch, num_tokens):
    """i32[num_tokens]: the sequence owning each token row (clamped for padding tokens)."""
    token_ids = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.searchsorted(batch.token_end, token_ids, side="right", method=SEARCH)
    return jnp.minimum(seq, batch.q_lens.shape[0] - 1).astype(jnp.int32)


def token_block_rows(batch, blocks, token_seq, block_q):
    """i32[num_tokens]: each token's row in the flattened [num_blocks * block_q] block layout."""
    num_rows_total = blocks.seq.shape[0] * block_q
    offset = jnp.arange(token_seq.shape[0], dtype=jnp.int32) - batch.token_start[token_seq]
    flat = (blocks.first_block[token_seq] + offset // block_q) * block_q + offset % block_q
    return jnp.clip(flat, 0, num_rows_total - 1)


def _check_quantized_cache(q, k_cache, v_cache, k_scale, v_scale, kv_cache_dtype):
    """A quantized cache: one-byte pages of its format's page dtype, q in a float dtype, scales
    both or neither."""
    if kv_cache_dtype not in FORMATS:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} must be None (a float cache) or one of {tuple(FORMATS)}")
    page_dtype = FORMATS[kv_cache_dtype].page_dtype
    if k_cache.dtype != page_dtype or v_cache.dtype != page_dtype:
        raise ValueError(f"a {kv_cache_dtype} cache holds {page_dtype} pages, got {k_cache.dtype=}, {v_cache.dtype=}")
    if not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"attention needs a floating q, got {q.dtype=}")
    if (k_scale is None) != (v_scale is None):
        raise ValueError("give both k_scale and v_scale (per-token scales) or neither (scale 1.0)")
    for name, arr in (("k_scale", k_scale), ("v_scale", v_scale)):
        if arr is not None and (arr.dtype != jnp.float32 or arr.shape != k_cache.shape[:3]):
            raise ValueError(f"{name} must be f32{list(k_cache.shape[:3])} ([num_blocks, block_size, num_kv_heads]), "
                             f"got {arr.dtype}{arr.shape}")


def check_ragged_args(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, num_seqs, k_scale=None,
                      v_scale=None, kv_cache_dtype=None, sliding_window=None):
    """Trace-time checks of a ragged paged-attention call (both impls): a ValueError that names the fix."""
    if sliding_window is not None and (isinstance(sliding_window, bool) or not isinstance(
            sliding_window, numbers.Integral) or sliding_window < 1):
        raise ValueError(f"sliding_window={sliding_window!r} must be a positive int (the keys each query sees, "
                         "itself included) or None (full causal attention)")
    if q.ndim != 3:
        raise ValueError(f"q must be [num_tokens, num_q_heads, head_dim], got {q.shape=}")
    if k_cache.ndim != 4:
        raise ValueError(f"k_cache must be [num_blocks, block_size, num_kv_heads, head_dim], got {k_cache.shape=}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache must have k_cache's shape {k_cache.shape}, got {v_cache.shape=}")
    if kv_cache_dtype is not None:
        _check_quantized_cache(q, k_cache, v_cache, k_scale, v_scale, kv_cache_dtype)
    elif k_scale is not None or v_scale is not None:
        raise ValueError(f"k_scale / v_scale apply to quantized caches (kv_cache_dtype one of {tuple(FORMATS)})")
    elif not (q.dtype == k_cache.dtype == v_cache.dtype):
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
