"""Multi-head latent attention (DeepSeek-V2 MLA) over the paged latent pool, in plain XLA.

Same contract as pallas_kernels/mla_attention.py's `mla_paged_attention`, whose
`mla_paged_attention_reference` (float64, decompressing) is the reference of both.

One token of the pool holds a latent c_kv [L] and a rope key k_rope [R], shared by every
head. Head n's key is [c_kv @ W_uk[:, n] | k_rope] and its value c_kv @ W_uv[:, n]. Two
ways to attend over it, both exact:
- absorbed: fold W_uk into the query (q_latent = q_nope @ W_uk^T, [N, L]) and attend in
  latent space, scores q_latent . c_kv + q_rope . k_rope, output sum p c_kv [N, L], then
  W_uv; the history is never decompressed (a decode step reads L + R numbers per token);
- decompressed: expand each context chunk to per-head keys and values and attend as
  usual (costs context x L x N x (P + V) multiply-adds per query block, so it pays off only
  when a block has many query rows, i.e. prefill).
`decode_form` / `prefill_form` choose per kind of query block (scripts/bench_memory.py
measures decode both ways).

Query blocks and loops as in paged_jax/attention/xla.py: one sequence per block, decode
blocks of one row (longest context first, groups of DECODE_GROUP), prefill blocks of
PREFILL_QUERY_BLOCK rows, the context walked in chunks with an online softmax up to the
group's longest context.

Einsum legend: B query block, Q query row in the block, N head, C key in the chunk,
L kv_lora_rank, R qk_rope_head_dim, P qk_nope_head_dim, V v_head_dim.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from paged_jax.attention.xla import (CONTEXT_CHUNK_TOKENS, DECODE_GROUP, MASK_VALUE, PREFILL_GROUP, PREFILL_QUERY_BLOCK,
                                     attend_in_blocks)
from pallas_kernels.mla_attention import FORMS, check_mla_args
from pallas_kernels.ragged_batch import cdiv, max_prefill_blocks, ragged_batch, split_decodes_and_prefills


def _attend_group(queries, c_kv_cache, k_rope_cache, w_uk, w_uv, tables, q_pos0, num_rows, row_token, sm_scale,
                  form):
    """One group of query blocks over their pages, chunk by chunk.

    Args:
      queries: absorbed: (q_latent [T, N, L], q_rope [T, N, R]); decompressed: (q_nope [T, N, P], q_rope).
      c_kv_cache: [num_blocks, block_size, L]; k_rope_cache: [num_blocks, block_size, R].
      w_uk: [L, N, P]; w_uv: [L, N, V].
      tables: i32[B, W'], each block's sequence's block table, W' whole chunks of pages.
      q_pos0, num_rows: i32[B]; row_token: i32[B, Q].
    Returns:
      f32[B, Q, N, V]; rows past num_rows are finite garbage.
    """
    num_blocks_g, block_q = row_token.shape
    q_main, q_rope = (q[row_token] for q in queries)  # [B, Q, N, L or P], [B, Q, N, R]
    num_heads = q_rope.shape[2]
    _, block_size, latent = c_kv_cache.shape
    chunk_pages = min(tables.shape[1], max(1, CONTEXT_CHUNK_TOKENS // block_size))
    chunk_len = chunk_pages * block_size
    q_pos = q_pos0[:, None] + jnp.arange(block_q)[None, :]  # [B, Q]
    kv_end = q_pos0 + num_rows  # [B]: keys at or past it are never visible to the block
    acc_dim = latent if form == "absorbed" else w_uv.shape[-1]

    def chunk_step(chunk, carry):
        m_prev, l_prev, acc_prev = carry  # [B, N, Q], [B, N, Q], [B, N, Q, L or V]
        pages = lax.dynamic_slice_in_dim(tables, chunk * chunk_pages, chunk_pages, axis=1)
        c_kv = c_kv_cache[pages].reshape(num_blocks_g, chunk_len, latent)
        k_rope = k_rope_cache[pages].reshape(num_blocks_g, chunk_len, -1)
        key_pos = chunk * chunk_len + jnp.arange(chunk_len, dtype=jnp.int32)  # [C]
        key_valid = key_pos[None, :] < kv_end[:, None]  # [B, C]
        # Foreign pages and slots past seq_len may hold NaN: the latent is the value (and
        # feeds it), so it is zeroed, not only its scores masked.
        c_kv = jnp.where(key_valid[:, :, None], c_kv, jnp.zeros((), c_kv.dtype))
        scores = jnp.einsum("BQNR,BCR->BNQC", q_rope, k_rope, preferred_element_type=jnp.float32)
        if form == "absorbed":
            scores += jnp.einsum("BQNL,BCL->BNQC", q_main, c_kv, preferred_element_type=jnp.float32)
            value = c_kv
        else:
            k_nope = jnp.einsum("BCL,LNP->BCNP", c_kv, w_uk)
            scores += jnp.einsum("BQNP,BCNP->BNQC", q_main, k_nope, preferred_element_type=jnp.float32)
            value = jnp.einsum("BCL,LNV->BCNV", c_kv, w_uv)
        visible = key_valid[:, None, :] & (key_pos[None, None, :] <= q_pos[:, :, None])  # [B, Q, C]
        scores = jnp.where(visible[:, None], scores * sm_scale, MASK_VALUE)
        m_next = jnp.maximum(m_prev, scores.max(axis=-1))
        correction = jnp.exp(m_prev - m_next)
        probs = jnp.exp(scores - m_next[..., None])
        l_next = l_prev * correction + probs.sum(axis=-1)
        probs = probs.astype(value.dtype)
        if form == "absorbed":
            pv = jnp.einsum("BNQC,BCL->BNQL", probs, value, preferred_element_type=jnp.float32)
        else:
            pv = jnp.einsum("BNQC,BCNV->BNQV", probs, value, preferred_element_type=jnp.float32)
        return m_next, l_next, acc_prev * correction[..., None] + pv

    stat_shape = (num_blocks_g, num_heads, block_q)
    carry = (jnp.full(stat_shape, MASK_VALUE, jnp.float32), jnp.zeros(stat_shape, jnp.float32),
             jnp.zeros((*stat_shape, acc_dim), jnp.float32))
    num_chunks = jnp.minimum(cdiv(jnp.max(kv_end), chunk_len), tables.shape[1] // chunk_pages)
    _, l_final, acc = lax.fori_loop(0, num_chunks, chunk_step, carry)
    out = (acc / jnp.maximum(l_final, 1e-30)[..., None]).transpose(0, 2, 1, 3)  # [B, Q, N, L or V]
    if form == "absorbed":
        out = jnp.einsum("BQNL,LNV->BQNV", out.astype(w_uv.dtype), w_uv, preferred_element_type=jnp.float32)
    return out


def _attend_blocks(out, queries, c_kv_cache, k_rope_cache, w_uk, w_uv, block_tables, batch, q_lens, sm_scale, *,
                   form, block_q, num_blocks, group_blocks):
    """Attention for the tokens of `q_lens` (a subset of the batch), scattered into out [T, N, V]."""

    def attend_group(tables, q_pos0, num_rows, row_token):
        return _attend_group(queries, c_kv_cache, k_rope_cache, w_uk, w_uv, tables, q_pos0, num_rows, row_token,
                             sm_scale, form)

    return attend_in_blocks(out, attend_group, block_tables, batch, q_lens, block_size=c_kv_cache.shape[1],
                            block_q=block_q, num_blocks=num_blocks, group_blocks=group_blocks)


@functools.partial(jax.jit, static_argnames=("sm_scale", "decode_form", "prefill_form"))
def mla_paged_attention_xla(q_nope, q_rope, c_kv_cache, k_rope_cache, w_uk, w_uv, block_tables, seq_lens,
                            query_start_loc, num_seqs, *, sm_scale, decode_form="absorbed",
                            prefill_form="absorbed"):
    """Causal MLA of a ragged batch over the paged latent pool, gather-based.

    Args and Returns: those of pallas_kernels.mla_attention.mla_paged_attention, plus
      decode_form, prefill_form: "absorbed" or "decompressed" (module docstring), per kind
        of query block (decoding sequences, prefill chunks). Padding rows are zero.
    """
    check_mla_args(q_nope, q_rope, c_kv_cache, k_rope_cache, w_uk, w_uv, block_tables, seq_lens, query_start_loc,
                   num_seqs)
    for name, form in (("decode_form", decode_form), ("prefill_form", prefill_form)):
        if form not in FORMS:
            raise ValueError(f"{name}={form!r} must be one of {FORMS}")
    num_tokens, num_heads, _ = q_nope.shape
    max_num_seqs = block_tables.shape[0]
    batch = ragged_batch(seq_lens, query_start_loc, jnp.reshape(num_seqs, ()))
    split = split_decodes_and_prefills(batch)
    queries = {"decompressed": (q_nope, q_rope)}
    if "absorbed" in (decode_form, prefill_form):
        # W_uk folded into the query once for every token: [T, N, P] x [L, N, P] -> [T, N, L].
        q_latent = jnp.einsum("TNP,LNP->TNL", q_nope, w_uk, preferred_element_type=jnp.float32)
        queries["absorbed"] = (q_latent.astype(q_nope.dtype), q_rope)
    attend = functools.partial(_attend_blocks, c_kv_cache=c_kv_cache, k_rope_cache=k_rope_cache, w_uk=w_uk,
                               w_uv=w_uv, block_tables=block_tables, batch=batch, sm_scale=sm_scale)
    out = jnp.zeros((num_tokens, num_heads, w_uv.shape[-1]), q_nope.dtype)  # padding rows stay zero
    # decode
    out = attend(out, queries[decode_form], q_lens=split.decode_q_lens, form=decode_form, block_q=1,
                 num_blocks=max_num_seqs, group_blocks=min(DECODE_GROUP, max_num_seqs))
    # prefill chunks
    block_q = min(PREFILL_QUERY_BLOCK, num_tokens)
    num_blocks = max_prefill_blocks(num_tokens, max_num_seqs, block_q)
    return attend(out, queries[prefill_form], q_lens=split.prefill_q_lens, form=prefill_form, block_q=block_q,
                  num_blocks=num_blocks, group_blocks=min(PREFILL_GROUP, num_blocks))
