"""Bookkeeping of a ragged batch, shared by both attention impls.

A ragged batch packs the query tokens of every sequence back to back. Both impls cut each
sequence's tokens into query blocks of `block_q` rows, one sequence per block, so that a
block reads its sequence's pages once for all its rows. These helpers map sequences to
blocks and back to tokens with fixed-shape int32 arithmetic (everything runs under jit).
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp

# Sequence counts are small (<= a few hundred): one fused compare beats a log-depth loop of
# tiny kernels on a GPU, and costs little on a CPU.
SEARCH = "compare_all"


class RaggedBatch(NamedTuple):
    """Per-sequence view of a batch; padded sequences (index >= num_seqs) have q_len 0."""

    q_lens: jnp.ndarray  # i32[max_num_seqs]: query tokens this step
    seq_lens: jnp.ndarray  # i32[max_num_seqs]: context length including the query tokens
    token_start: jnp.ndarray  # i32[max_num_seqs]: first token row, query_start_loc[:-1]
    token_end: jnp.ndarray  # i32[max_num_seqs]: query_start_loc[1:]; int32 max when padded


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
