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

from pallas_kernels.ragged_batch import cdiv, query_blocks, ragged_batch, token_block_rows, token_sequence

# Finite, so a row with every key masked (a padding row) gives a finite output, not NaN.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
PREFILL_QUERY_BLOCK = 16
CONTEXT_CHUNK_TOKENS = 512


def _attend_query_blocks(q, k_cache, v_cache, block_tables, batch, sm_scale, *, block_q):
    """Attention for all query tokens, grouped in query blocks of `block_q` rows.

    Args:
      q: [num_tokens, num_q_heads, head_dim].
      k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim].
      block_tables: i32[max_num_seqs, max_blocks_per_seq].
      batch: RaggedBatch of the call.

    Returns:
      [num_tokens, num_q_heads, head_dim] in q.dtype; rows of padding tokens are finite.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    max_num_seqs, max_blocks_per_seq = block_tables.shape
    group = num_q_heads // num_kv_heads
    # Every sequence wastes at most one partial block, so this many blocks always suffice.
    num_query_blocks = min(cdiv(num_tokens, block_q) + max_num_seqs, num_tokens)
    blocks = query_blocks(batch, batch.q_lens, num_query_blocks, block_q)
    q_pos = blocks.q_pos0[:, None] + jnp.arange(block_q)[None, :]  # [B, Q]
    # Keys past the block's last query position are never visible to it.
    kv_end = blocks.q_pos0 + blocks.num_rows  # [B]

    q_blocks = q[blocks.row_token].reshape(num_query_blocks, block_q, num_kv_heads, group, head_dim)
    chunk_pages = max(1, min(max_blocks_per_seq, CONTEXT_CHUNK_TOKENS // block_size))
    num_chunks_max = cdiv(max_blocks_per_seq, chunk_pages)
    # Pad the table width to whole chunks with the null page (never -1).
    tables = jnp.pad(block_tables, ((0, 0), (0, num_chunks_max * chunk_pages - max_blocks_per_seq)))
    tables = tables[blocks.seq]  # [B, W']
    chunk_len = chunk_pages * block_size

    def chunk_step(chunk, carry):
        m_prev, l_prev, acc_prev = carry  # [B, K, G, Q], [B, K, G, Q], [B, K, G, Q, D]
        pages = lax.dynamic_slice_in_dim(tables, chunk * chunk_pages, chunk_pages, axis=1)
        k = k_cache[pages].reshape(num_query_blocks, chunk_len, num_kv_heads, head_dim)
        v = v_cache[pages].reshape(num_query_blocks, chunk_len, num_kv_heads, head_dim)
        key_pos = chunk * chunk_len + jnp.arange(chunk_len, dtype=jnp.int32)  # [C]
        key_valid = key_pos[None, :] < kv_end[:, None]  # [B, C]
        # Slots past seq_len and pages of other sequences may hold NaN: a zero weight times
        # NaN is still NaN, so the values themselves are masked, not only the scores.
        v = jnp.where(key_valid[:, :, None, None], v, jnp.zeros((), v.dtype))
        scores = jnp.einsum("BQKGD,BCKD->BKGQC", q_blocks, k, preferred_element_type=jnp.float32)
        visible = key_valid[:, None, :] & (key_pos[None, None, :] <= q_pos[:, :, None])  # [B, Q, C]
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
    num_chunks = jnp.minimum(cdiv(jnp.max(kv_end), chunk_len), num_chunks_max)
    _, l_final, acc = lax.fori_loop(0, num_chunks, chunk_step, carry)
    out_blocks = acc / jnp.maximum(l_final, 1e-30)[..., None]  # [B, K, G, Q, D]
    out_blocks = out_blocks.transpose(0, 3, 1, 2, 4).reshape(num_query_blocks * block_q, num_q_heads, head_dim)
    rows = token_block_rows(batch, blocks, token_sequence(batch, num_tokens), block_q)
    return out_blocks[rows].astype(q.dtype)


def ragged_paged_attention_xla(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, num_seqs, sm_scale):
    """Gather-based ragged paged attention; arguments as in `ragged_paged_attention`."""
    batch = ragged_batch(seq_lens, query_start_loc, num_seqs)
    attend = functools.partial(_attend_query_blocks, q, k_cache, v_cache, block_tables, batch, sm_scale)
    return lax.cond(
        jnp.max(batch.q_lens) <= 1,
        functools.partial(attend, block_q=1),
        functools.partial(attend, block_q=min(PREFILL_QUERY_BLOCK, q.shape[0])),
    )
