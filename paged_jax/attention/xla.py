"""Ragged paged attention in plain XLA: the fast CPU path (and a GPU fallback).

Same contract as the Pallas kernel (pallas_kernels/paged_attention.py), whose
`ragged_paged_attention_reference` is the reference of both.

The query tokens of every sequence are cut into query blocks, one sequence per block, so a
block gathers its sequence's pages once for all its rows and all query heads of a KV group.
Decoding sequences (one token) form blocks of one row; prefill chunks form blocks of
PREFILL_QUERY_BLOCK rows. (On a CPU with a float cache every query token is instead a row of
the native decode kernel, cpu_kernels/paged_attention.py, through token_rows; this loop serves
quantized caches there.) Both paths always run, but every loop trip count is dynamic:
an outer loop walks groups of real blocks only (padding blocks of the bucket cost nothing;
the last, partial group of prefill blocks is walked one block at a time) and an inner loop
walks the context in chunks of CONTEXT_CHUNK_TOKENS keys with an online softmax, up to the
longest context of the group rather than the block-table width. Decode rows are sorted
longest context first, so that a group's members need about as many chunks as its longest
one. Memory
is bounded by one group's chunk, group_blocks x chunk x num_kv_heads x head_dim.

With a sliding window (query p sees keys p - sliding_window < k <= p) each block's table is
shifted to start at the page holding its first row's oldest visible key
(ragged_batch.window_tables), so the chunk loop starts inside every block's window, walks at
most the pages a window spans, and never reads a page wholly before it; older keys of that
first page are masked per row.

Einsum legend: B = query block, Q = query row in the block, K = KV head, G = query head
within the KV group, D = head_dim, C = key position within the context chunk.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from cpu_kernels import paged_attention as cpu_attention
from pallas_kernels.kv_cache_write import get_format, pages_to_values
from pallas_kernels.ragged_batch import (cdiv, check_ragged_args, max_prefill_blocks, query_blocks, ragged_batch,
                                         split_decodes_and_prefills, window_first_key, window_pages, window_tables)

# Finite, so a row with every key masked (a padding row) gives a finite output, not NaN.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
DECODE_GROUP = 8  # decoding sequences per outer step
PREFILL_QUERY_BLOCK = 32  # query tokens per prefill block
PREFILL_GROUP = 8  # prefill blocks per outer step
CONTEXT_CHUNK_TOKENS = 128  # small chunks stay in cache and let causal blocks stop early (bench_attention.py)


def _attend_group(q, k_cache, v_cache, tables, q_pos0, num_rows, row_token, sm_scale, k_scale=None, v_scale=None,
                  fmt=None, sliding_window=None):
    """Attention of one group of query blocks over their pages, chunk by chunk (causal, and
    with sliding_window: query p sees keys p - sliding_window < k <= p only).

    Args:
      q: [num_tokens, num_q_heads, head_dim].
      k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], q's dtype or a
        quantized one (each chunk is converted to q's dtype as it is read).
      k_scale, v_scale: None or f32[num_blocks, block_size, num_kv_heads], per-token scales of
        a quantized cache: folded into the chunk's scores (K) and probabilities (V), so no
        dequantized copy of even a chunk is formed.
      tables: i32[B, W'], each block's sequence's block table, W' whole chunks of pages.
      q_pos0, num_rows: i32[B], first query position and real rows (0: padding block).
      row_token: i32[B, Q], the token row of each query row.
      sliding_window: None or a positive int, static: each block's chunks start at the page
        holding its first row's oldest visible key.

    Returns:
      f32[B, Q, num_q_heads, head_dim]; rows past num_rows are finite garbage.
    """
    num_blocks_g, block_q = row_token.shape
    _, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    chunk_pages = min(tables.shape[1], max(1, CONTEXT_CHUNK_TOKENS // block_size))
    chunk_len = chunk_pages * block_size
    q_blocks = q[row_token].reshape(num_blocks_g, block_q, num_kv_heads, group, head_dim)
    q_pos = q_pos0[:, None] + jnp.arange(block_q)[None, :]  # [B, Q]
    # Keys past the block's last query position are never visible to it.
    kv_end = q_pos0 + num_rows  # [B]
    if sliding_window is not None:
        # Column 0 of a block's shifted table holds key kv_start[b]: its window's first page.
        # Whole chunks of pages: a multiple of chunk_pages, at most the (whole-chunk) table width.
        width = cdiv(window_pages(sliding_window, block_q, block_size, tables.shape[1]), chunk_pages) * chunk_pages
        tables = window_tables(tables, q_pos0, sliding_window, block_size, width)
        kv_first = window_first_key(q_pos0, sliding_window)  # [B]
        kv_start = kv_first // block_size * block_size  # [B]

    def chunk_step(chunk, carry):
        m_prev, l_prev, acc_prev = carry  # [B, K, G, Q], [B, K, G, Q], [B, K, G, Q, D]
        pages = lax.dynamic_slice_in_dim(tables, chunk * chunk_pages, chunk_pages, axis=1)
        k = k_cache[pages].reshape(num_blocks_g, chunk_len, num_kv_heads, head_dim)
        v = v_cache[pages].reshape(num_blocks_g, chunk_len, num_kv_heads, head_dim)
        if fmt is not None:  # quantized pages: this chunk's bytes become values, then q's dtype
            k, v = pages_to_values(k, fmt), pages_to_values(v, fmt)
        k, v = k.astype(q.dtype), v.astype(q.dtype)
        key_pos = chunk * chunk_len + jnp.arange(chunk_len, dtype=jnp.int32)  # [C]
        if sliding_window is None:
            key_valid = key_pos[None, :] < kv_end[:, None]  # [B, C]
        else:  # per block: key_pos [B, C]; stale keys of the first page are masked, V included
            key_pos = kv_start[:, None] + key_pos[None, :]
            key_valid = (key_pos < kv_end[:, None]) & (key_pos >= kv_first[:, None])  # [B, C]
        # Slots past seq_len and pages of other sequences may hold NaN: a zero weight times
        # NaN is still NaN, so the values themselves are masked, not only the scores.
        v = jnp.where(key_valid[:, :, None, None], v, jnp.zeros((), v.dtype))
        scores = jnp.einsum("BQKGD,BCKD->BKGQC", q_blocks, k, preferred_element_type=jnp.float32)
        if k_scale is not None:
            # [B, C, K] -> [B, K, 1, 1, C]: q . (k * s) = (q . k) * s per key.
            scores = scores * k_scale[pages].reshape(num_blocks_g, chunk_len, num_kv_heads).transpose(
                0, 2, 1)[:, :, None, None, :]
        if sliding_window is None:
            visible = key_valid[:, None, :] & (key_pos[None, None, :] <= q_pos[:, :, None])  # [B, Q, C]
        else:
            offset = q_pos[:, :, None] - key_pos[:, None, :]  # [B, Q, C]: query minus key position
            visible = key_valid[:, None, :] & (offset >= 0) & (offset < sliding_window)
        scores = jnp.where(visible[:, None, None], scores * sm_scale, MASK_VALUE)
        m_next = jnp.maximum(m_prev, scores.max(axis=-1))
        correction = jnp.exp(m_prev - m_next)
        probs = jnp.exp(scores - m_next[..., None])
        l_next = l_prev * correction + probs.sum(axis=-1)
        if v_scale is not None:
            vs = v_scale[pages].reshape(num_blocks_g, chunk_len, num_kv_heads)
            vs = jnp.where(key_valid[:, :, None], vs, 0.0)  # unowned slots' scales may be NaN too
            probs = probs * vs.transpose(0, 2, 1)[:, :, None, None, :]  # sum_c p (v s) = sum_c (p s) v
        pv = jnp.einsum("BKGQC,BCKD->BKGQD", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return m_next, l_next, acc_prev * correction[..., None] + pv

    stat_shape = (num_blocks_g, num_kv_heads, group, block_q)
    carry = (jnp.full(stat_shape, MASK_VALUE, jnp.float32), jnp.zeros(stat_shape, jnp.float32),
             jnp.zeros((*stat_shape, head_dim), jnp.float32))
    # Stop at the longest context of the group, not at the table width (max_model_len).
    num_keys = jnp.max(kv_end) if sliding_window is None else jnp.max(kv_end - kv_start)
    num_chunks = jnp.minimum(cdiv(num_keys, chunk_len), tables.shape[1] // chunk_pages)
    _, l_final, acc = lax.fori_loop(0, num_chunks, chunk_step, carry)
    out = acc / jnp.maximum(l_final, 1e-30)[..., None]  # [B, K, G, Q, D]
    return out.transpose(0, 3, 1, 2, 4).reshape(num_blocks_g, block_q, num_q_heads, head_dim)


def attend_in_blocks(out, attend_group, block_tables, batch, q_lens, *, block_size, block_q, num_blocks,
                     group_blocks):
    """Attention for the tokens of `q_lens` (a subset of the batch), blocks of block_q rows,
    group_blocks blocks at a time (the walk both the GQA and the MLA XLA paths share).

    attend_group(tables [blocks, W], q_pos0 i32[blocks], num_rows i32[blocks], row_token
    i32[blocks, Q]) -> [blocks, Q, heads, dim] computes one group; its rows are scattered
    straight into `out` ([num_tokens, heads, dim]) at their token rows, so no block-layout
    buffer of the static worst case is kept.
    """
    num_tokens = out.shape[0]
    max_blocks_per_seq = block_tables.shape[1]
    num_groups = cdiv(num_blocks, group_blocks)
    blocks = query_blocks(batch, q_lens, num_groups * group_blocks, block_q)
    if block_q == 1:
        # Decoding sequences, longest context first: a group walks the context as far as its
        # longest member, so groups of similar lengths waste little (padding blocks go last).
        order = jnp.argsort(jnp.where(blocks.num_rows > 0, -batch.seq_lens[blocks.seq], 1))
        blocks = blocks._replace(seq=blocks.seq[order], row_token=blocks.row_token[order],
                                 q_pos0=blocks.q_pos0[order], num_rows=blocks.num_rows[order])
    # Rows without a query point past the end and are dropped by the scatter.
    valid = jnp.arange(block_q)[None, :] < blocks.num_rows[:, None]
    dest = jnp.where(valid, blocks.row_token, num_tokens)  # [blocks, Q]
    chunk_pages = min(max_blocks_per_seq, max(1, CONTEXT_CHUNK_TOKENS // block_size))
    # Pad the table width to whole chunks with the null page (never -1).
    tables = jnp.pad(block_tables, ((0, 0), (0, cdiv(max_blocks_per_seq, chunk_pages) * chunk_pages
                                             - max_blocks_per_seq)))

    def run_groups(out, first_block, num_groups, size):
        def group_step(g, out):
            take = functools.partial(lax.dynamic_slice_in_dim, start_index=first_block + g * size, slice_size=size)
            out_g = attend_group(tables[take(blocks.seq)], take(blocks.q_pos0), take(blocks.num_rows),
                                 take(blocks.row_token))
            return out.at[take(dest)].set(out_g.astype(out.dtype), mode="drop")

        return lax.fori_loop(0, num_groups, group_step, out)

    # Real blocks are packed first: walk only the groups that hold some.
    num_real_blocks = jnp.sum(cdiv(q_lens, block_q))
    if block_q == 1:
        # Sorted groups of 8 walk about as far as each member needs; groups of 32 walked every
        # row to the longest context of its half of a 64-slot step, which was slower
        # (scripts/ab_xla_attention.py measures it). A second loop of bigger groups was no
        # faster with DRAM-sized caches and cost megabytes of code per compiled shape.
        return run_groups(out, 0, cdiv(num_real_blocks, group_blocks), group_blocks)
    # Prefill blocks are 32 rows each: walk whole groups, then the rest one block at a time,
    # so a short chunk (a prefix-cache hit's 50-token question) computes no padding blocks.
    num_full_groups = num_real_blocks // group_blocks
    out = run_groups(out, 0, num_full_groups, group_blocks)
    return run_groups(out, num_full_groups * group_blocks, num_real_blocks % group_blocks, 1)


def _attend_blocks(out, q, k_cache, v_cache, block_tables, batch, q_lens, sm_scale, *, block_q, num_blocks,
                   group_blocks, k_scale=None, v_scale=None, fmt=None, sliding_window=None):
    """GQA attention for the tokens of `q_lens`, scattered into out [num_tokens, num_q_heads, head_dim]."""

    def attend_group(tables, q_pos0, num_rows, row_token):
        return _attend_group(q, k_cache, v_cache, tables, q_pos0, num_rows, row_token, sm_scale, k_scale, v_scale, fmt,
                             sliding_window)

    return attend_in_blocks(out, attend_group, block_tables, batch, q_lens, block_size=k_cache.shape[1],
                            block_q=block_q, num_blocks=num_blocks, group_blocks=group_blocks)


@functools.partial(jax.jit, static_argnames=("sm_scale", "kv_cache_dtype", "sliding_window"))
def ragged_paged_attention_xla(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, num_seqs, *,
                               sm_scale=None, k_scale=None, v_scale=None, kv_cache_dtype=None, sliding_window=None):
    """Causal (optionally sliding-window) attention of a ragged batch of query tokens over
    paged K/V, gather-based.

    Args and Returns: those of pallas_kernels.paged_attention.ragged_paged_attention (the
    contract both paths share, with every shape, quantized caches (kv_cache_dtype) and their
    per-token k_scale / v_scale, and sliding_window: None, or query p sees keys
    p - sliding_window < k <= p, included), without its interpret and config. Padding rows
    here are zero.
    """
    check_ragged_args(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, num_seqs, k_scale, v_scale,
                      kv_cache_dtype, sliding_window)
    if sm_scale is None:
        sm_scale = q.shape[-1] ** -0.5
    num_tokens = q.shape[0]
    max_num_seqs = block_tables.shape[0]
    batch = ragged_batch(seq_lens, query_start_loc, jnp.reshape(num_seqs, ()))
    split = split_decodes_and_prefills(batch)
    attend = functools.partial(_attend_blocks, q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
                               batch=batch, sm_scale=sm_scale, k_scale=k_scale, v_scale=v_scale,
                               fmt=get_format(kv_cache_dtype), sliding_window=sliding_window)
    # decode: one single-row block per decoding sequence (on a CPU, float caches: the native
    # kernel reads the pages in place, cpu_kernels/paged_attention.py); padding rows stay zero
    xla_decode = functools.partial(attend, q_lens=split.decode_q_lens, block_q=1, num_blocks=max_num_seqs,
                                   group_blocks=min(DECODE_GROUP, max_num_seqs))
    out = jnp.zeros(q.shape, q.dtype)

    def prefill(out):  # prefill chunks (two tokens or more), into the decodes' out
        if num_tokens < 2:
            return out
        block_q = min(PREFILL_QUERY_BLOCK, num_tokens)
        num_blocks = max_prefill_blocks(num_tokens, max_num_seqs, block_q)
        return attend(out, q_lens=split.prefill_q_lens, block_q=block_q, num_blocks=num_blocks,
                      group_blocks=min(PREFILL_GROUP, num_blocks))

    if get_format(kv_cache_dtype) is None and cpu_attention.usable(k_cache):
        native = functools.partial(cpu_attention.decode_attention, sm_scale=sm_scale, sliding_window=sliding_window)

        def cpu(*args):
            # Every query token is a native decode row of its own, prefill chunks included: the
            # kernel reads a row's keys in place and computes exactly its causal keys, where the
            # blocked loop gathers pages and walks a group of blocks to its longest member
            # (docs/BENCHMARKS.md section 18, eleventh pass).
            if num_tokens < 2:
                return native(*args).astype(q.dtype)
            return native(*args[:3], *token_rows(block_tables, batch, num_tokens)).astype(q.dtype)

        return lax.platform_dependent(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, num_seqs,
                                      cpu=lambda *args: cpu(*args), default=lambda *args: prefill(xla_decode(out)))
    return prefill(xla_decode(out))


def token_rows(block_tables, batch, num_tokens: int):
    """Decode-kernel arguments that make every query token a sequence of its own: token t of
    sequence s at position p attends to keys 0..p through s's block table (so a causal chunk
    of n tokens is n decode rows). Returns (block_tables [T, W], seq_lens [T], query_start_loc
    [T + 1], num_seqs): padding tokens come after the real ones and are left out."""
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(batch.token_end, t, side="right"), batch.seq_lens.shape[0] - 1)
    num_real = jnp.sum(batch.q_lens).astype(jnp.int32)
    position = batch.seq_lens[seq] - batch.q_lens[seq] + (t - batch.token_start[seq])
    lens = jnp.where(t < num_real, position + 1, 0).astype(jnp.int32)
    return block_tables[seq], lens, jnp.arange(num_tokens + 1, dtype=jnp.int32), num_real
