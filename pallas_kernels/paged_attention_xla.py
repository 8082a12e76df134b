"""Ragged paged attention in plain XLA (impl="xla"): the fast CPU path.

The query tokens of every sequence are cut into query blocks of `block_q` rows; a query
block belongs to exactly one sequence, so it gathers that sequence's pages once and all
its rows (and all query heads of a KV group) share them. The context is walked in chunks
of CONTEXT_CHUNK_TOKENS keys with an online softmax, which bounds memory at
num_query_blocks x chunk x num_kv_heads x head_dim whatever max_model_len is, and the walk
stops at the longest sequence of the batch rather than at the block-table width.

Two block sizes are compiled, and a lax.cond picks one per call: block_q = 1 when every
sequence decodes (one query token each: no padded rows at all), PREFILL_QUERY_BLOCK
otherwise (prefill chunks amortise each gathered page over up to 16 query rows).

Einsum legend: B = query block, Q = query row in the block, K = KV head, G = query head
within the KV group, D = head_dim, C = key position within the context chunk.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# Finite, so a row with every key masked (a padding row) gives a finite output, not NaN.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
PREFILL_QUERY_BLOCK = 16
CONTEXT_CHUNK_TOKENS = 512


def _cdiv(a, b):
    return (a + b - 1) // b


def _attend_query_blocks(q, k_cache, v_cache, block_tables, seq_lens, token_start, token_end, q_lens, sm_scale, *, block_q):
    """Attention for all query tokens, grouped in query blocks of `block_q` rows.

    Args:
      q: [num_tokens, num_q_heads, head_dim].
      k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim].
      block_tables: i32[max_num_seqs, max_blocks_per_seq].
      seq_lens: i32[max_num_seqs], 0 for padded sequences.
      token_start: i32[max_num_seqs], query_start_loc[:-1].
      token_end: i32[max_num_seqs], query_start_loc[1:], but int32 max for padded sequences.
      q_lens: i32[max_num_seqs], 0 for padded sequences.

    Returns:
      [num_tokens, num_q_heads, head_dim] in q.dtype; rows of padding tokens are finite.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    max_num_seqs, max_blocks_per_seq = block_tables.shape
    group = num_q_heads // num_kv_heads
    # Every sequence wastes at most one partial block, so this many blocks always suffice.
    num_query_blocks = min(_cdiv(num_tokens, block_q) + max_num_seqs, num_tokens)

    # query blocks -> (sequence, first query row within the sequence)
    blocks_per_seq = _cdiv(q_lens, block_q)
    blocks_end = jnp.cumsum(blocks_per_seq)
    blocks_start = blocks_end - blocks_per_seq
    block_ids = jnp.arange(num_query_blocks, dtype=jnp.int32)
    block_seq = jnp.minimum(jnp.searchsorted(blocks_end, block_ids, side="right"), max_num_seqs - 1)
    block_real = block_ids < blocks_end[-1]
    row_in_seq = (block_ids - blocks_start[block_seq])[:, None] * block_q + jnp.arange(block_q)[None, :]
    row_valid = block_real[:, None] & (row_in_seq < q_lens[block_seq][:, None])  # [B, Q]
    row_token = jnp.where(row_valid, token_start[block_seq][:, None] + row_in_seq, 0)
    block_seq_len = jnp.where(block_real, seq_lens[block_seq], 0)  # [B]
    # Query row j of a sequence with q_len rows sits at position seq_len - q_len + j.
    q_pos = (block_seq_len - q_lens[block_seq])[:, None] + row_in_seq  # [B, Q]

    q_blocks = q[row_token].reshape(num_query_blocks, block_q, num_kv_heads, group, head_dim)
    chunk_pages = max(1, min(max_blocks_per_seq, CONTEXT_CHUNK_TOKENS // block_size))
    num_chunks_max = _cdiv(max_blocks_per_seq, chunk_pages)
    # Pad the table width to whole chunks with the null page (never -1).
    tables = jnp.pad(block_tables, ((0, 0), (0, num_chunks_max * chunk_pages - max_blocks_per_seq)))
    tables = tables[block_seq]  # [B, W']
    chunk_len = chunk_pages * block_size

    def chunk_step(chunk, carry):
        m_prev, l_prev, acc_prev = carry  # [B, K, G, Q], [B, K, G, Q], [B, K, G, Q, D]
        pages = lax.dynamic_slice_in_dim(tables, chunk * chunk_pages, chunk_pages, axis=1)
        k = k_cache[pages].reshape(num_query_blocks, chunk_len, num_kv_heads, head_dim)
        v = v_cache[pages].reshape(num_query_blocks, chunk_len, num_kv_heads, head_dim)
        key_pos = chunk * chunk_len + jnp.arange(chunk_len, dtype=jnp.int32)  # [C]
        key_owned = key_pos[None, :] < block_seq_len[:, None]  # [B, C]
        # Slots past seq_len and pages of other sequences may hold NaN: a zero weight times
        # NaN is still NaN, so the values themselves are masked, not only the scores.
        v = jnp.where(key_owned[:, :, None, None], v, jnp.zeros((), v.dtype))
        scores = jnp.einsum("BQKGD,BCKD->BKGQC", q_blocks, k, preferred_element_type=jnp.float32)
        visible = key_owned[:, None, :] & (key_pos[None, None, :] <= q_pos[:, :, None])  # [B, Q, C]
        scores = jnp.where(visible[:, None, None], scores * sm_scale, MASK_VALUE)
        m_next = jnp.maximum(m_prev, scores.max(axis=-1))
        correction = jnp.exp(m_prev - m_next)
        probs = jnp.exp(scores - m_next[..., None])
        l_next = l_prev * correction + probs.sum(axis=-1)
        pv = jnp.einsum("BKGQC,BCKD->BKGQD", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return m_next, l_next, acc_prev * correction[..., None] + pv

    stat_shape = (num_query_blocks, num_kv_heads, group, block_q)
    carry = (
        jnp.full(stat_shape, MASK_VALUE, jnp.float32),
        jnp.zeros(stat_shape, jnp.float32),
        jnp.zeros((*stat_shape, head_dim), jnp.float32),
    )
    # Stop at the longest context in the batch, not at the table width (max_model_len).
    num_chunks = _cdiv(jnp.max(block_seq_len), chunk_len)
    _, l_final, acc = lax.fori_loop(0, num_chunks, chunk_step, carry)
    out_blocks = acc / jnp.maximum(l_final, 1e-30)[..., None]  # [B, K, G, Q, D]
    out_blocks = out_blocks.transpose(0, 3, 1, 2, 4).reshape(num_query_blocks * block_q, num_q_heads, head_dim)

    # tokens -> (query block, row): the inverse of the mapping above
    token_ids = jnp.arange(num_tokens, dtype=jnp.int32)
    token_seq = jnp.minimum(jnp.searchsorted(token_end, token_ids, side="right"), max_num_seqs - 1)
    offset = token_ids - token_start[token_seq]
    token_block = blocks_start[token_seq] + offset // block_q
    flat_row = jnp.clip(token_block * block_q + offset % block_q, 0, num_query_blocks * block_q - 1)
    return out_blocks[flat_row].astype(q.dtype)


def ragged_paged_attention_xla(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, num_seqs, sm_scale):
    """Gather-based ragged paged attention; arguments as in `ragged_paged_attention`."""
    max_num_seqs = seq_lens.shape[0]
    real_seq = jnp.arange(max_num_seqs) < jnp.reshape(num_seqs, ())
    q_lens = jnp.where(real_seq, query_start_loc[1:] - query_start_loc[:-1], 0).astype(jnp.int32)
    seq_lens = jnp.where(real_seq, seq_lens, 0).astype(jnp.int32)
    token_start = query_start_loc[:-1].astype(jnp.int32)
    # Padded sequences end past every token, so that token -> sequence searches land on real ones.
    token_end = jnp.where(real_seq, query_start_loc[1:], jnp.iinfo(jnp.int32).max).astype(jnp.int32)
    attend = functools.partial(
        _attend_query_blocks, q, k_cache, v_cache, block_tables, seq_lens, token_start, token_end, q_lens, sm_scale
    )
    return lax.cond(
        jnp.max(q_lens) <= 1,
        functools.partial(attend, block_q=1),
        functools.partial(attend, block_q=min(PREFILL_QUERY_BLOCK, q.shape[0])),
    )
