"""Ragged paged multi-head latent attention (DeepSeek-V2 MLA): prefill chunks and decodes in one call.

Layout (models/kv_cache_spec.py, MLAAttentionSpec): c_kv_cache [num_blocks, block_size, L]
and k_rope_cache [num_blocks, block_size, R], one latent and one rope key per token shared
by every head; slot s is page s // block_size, row s % block_size; page 0 is the null page.
Kept as two arrays so both widths are powers of two (L = 512, R = 64 in DeepSeek-V2;
the 576-wide concatenation is not, and Triton's block dims must be).

The kernel attends in latent space ("absorbed" MLA): W_uk is folded into the query outside
the kernel (q_latent = q_nope W_uk^T, [N, L]), the kernel computes
softmax(q_latent . c_kv + q_rope . k_rope) and sum p c_kv per head, and W_uv is applied to
its [N, L] output. Every head reads the same pages, so like MQA one program serves all N
heads of a query block: its rows are token * N + head. Two launches as in
paged_attention.py: decodes (one row block per decoding sequence, the context split
flash-decoding style, combined by logsumexp) and prefill chunks.

`mla_paged_attention_reference` is the float64 reference of this kernel and of the XLA path
(paged_jax/attention/mla_xla.py): it decompresses every key and value and runs ordinary
attention per sequence.

Legend: T tokens, N heads, L kv_lora_rank, R qk_rope_head_dim, P qk_nope_head_dim, V v_head_dim.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.paged_attention import (LOG2_E, MASK_VALUE, MIN_DOT_DIM, PallasConfig, _items_from_blocks,
                                            _next_power_of_2, _token_rows, online_softmax_step, run_online_softmax,
                                            split_pages)
from pallas_kernels.ragged_batch import (cdiv, max_prefill_blocks, query_blocks, ragged_batch,
                                         split_decodes_and_prefills, token_sequence)

FORMS = ("absorbed", "decompressed")


@dataclasses.dataclass(frozen=True)
class MlaPallasConfig(PallasConfig):
    """Launch parameters of the MLA kernel: PallasConfig's fields with smaller defaults. Rows
    hold token * num_heads + head, and the accumulator is [rows, L] float32, so prefill
    blocks are kept smaller than GQA's. First guesses, not measured on a GPU
    (scripts/gpu_check.sh runs the kernel)."""

    decode_block_k: int = 64
    decode_target_programs: int = 512
    prefill_rows: int = 32
    prefill_block_k: int = 32


def _mla_kernel(
    q_latent_ref,  # [rows, L]: one work item; row = token * num_heads + head
    q_rope_ref,  # [rows, R]
    c_kv_ref,  # [num_blocks, block_size, L]: the whole latent pool
    k_rope_ref,  # [num_blocks, block_size, R]
    pages_ref,  # i32[pages_per_split]: this split's slice of the item's block table
    q_pos0_ref,  # i32[1]: position of the item's first query token
    num_rows_ref,  # i32[1]: real query tokens of the item; 0 means nothing to do
    o_ref,  # [rows, L]: latent output, normalised within this split
    *stat_refs,  # m_ref, l_ref: f32[rows] in log2 units, only when the context is split
    num_heads,
    pages_per_compute_block,
    scale_log2,
):
    rows, latent = q_latent_ref.shape
    rope = q_rope_ref.shape[1]
    block_size = c_kv_ref.shape[1]
    pages_per_split = pages_ref.shape[0]
    block_k = pages_per_compute_block * block_size
    split_start = pl.program_id(1) * pages_per_split * block_size
    q_pos0 = q_pos0_ref[0]
    kv_end = q_pos0 + num_rows_ref[0]  # keys past the last query position are not even loaded
    num_steps = jnp.clip(cdiv(kv_end - split_start, block_k), 0, pages_per_split // pages_per_compute_block)
    precision = lax.Precision.HIGHEST if q_latent_ref.dtype == jnp.float32 else None
    q_latent, q_rope = q_latent_ref[...], q_rope_ref[...]
    row_pos = q_pos0 + jnp.arange(rows, dtype=jnp.int32)[:, None] // num_heads  # [rows, 1]
    dot_t = functools.partial(lax.dot_general, dimension_numbers=(((1,), (1,)), ((), ())), precision=precision,
                              preferred_element_type=jnp.float32)

    def body(step, carry):
        m_prev, l_prev, acc_prev = carry  # f32[rows], f32[rows], f32[rows, L]
        pages = pages_ref[pl.ds(step * pages_per_compute_block, pages_per_compute_block)]
        c_kv = c_kv_ref[pages].reshape(block_k, latent)
        k_rope = k_rope_ref[pages].reshape(block_k, rope)
        key_pos = split_start + step * block_k + jnp.arange(block_k, dtype=jnp.int32)  # [block_k]
        key_valid = key_pos < kv_end
        # Foreign pages may hold NaN and the latent is also the value: zero it, not only its scores.
        c_kv = jnp.where(key_valid[:, None], c_kv, jnp.zeros((), c_kv.dtype))
        scores = (dot_t(q_latent, c_kv) + dot_t(q_rope, k_rope)) * scale_log2  # [rows, block_k]
        visible = key_valid[None, :] & (key_pos[None, :] <= row_pos)
        m_next, l_next, correction, probs = online_softmax_step(m_prev, l_prev, jnp.where(visible, scores, MASK_VALUE))
        pv = lax.dot_general(probs.astype(c_kv.dtype), c_kv, (((1,), (0,)), ((), ())), precision=precision,
                             preferred_element_type=jnp.float32)
        return m_next, l_next, acc_prev * correction[:, None] + pv

    run_online_softmax(body, num_steps, latent, o_ref, stat_refs)


def _mla_call(q_latent_items, q_rope_items, c_kv_cache, k_rope_cache, item_tables, q_pos0, num_rows, *, num_heads,
              sm_scale, num_splits, block_k, num_warps, num_stages, interpret):
    """Launch the kernel over (item, split) and combine the splits.

    q_latent_items: [num_items, rows, L]; q_rope_items: [num_items, rows, R];
    item_tables: i32[num_items, W]; q_pos0, num_rows: i32[num_items].
    Returns f32[num_items, rows, L].
    """
    num_items, rows, latent = q_latent_items.shape
    rope = q_rope_items.shape[-1]
    num_blocks, block_size, _ = c_kv_cache.shape
    tile_bytes = num_stages * (latent + rope) * c_kv_cache.dtype.itemsize  # per key of block_k
    block_k, pages_per_compute_block, pages_per_split, item_tables = split_pages(
        item_tables, block_k, block_size, num_splits, tile_bytes)
    split = num_splits > 1
    out_dtype = jnp.float32 if split else q_latent_items.dtype
    stat_shape = jax.ShapeDtypeStruct((num_items, num_splits, rows), jnp.float32)
    stat_spec = pl.BlockSpec((None, None, rows), lambda i, s: (i, s, 0))
    kernel = functools.partial(_mla_kernel, num_heads=num_heads, pages_per_compute_block=pages_per_compute_block,
                               scale_log2=sm_scale * LOG2_E)
    outs = pl.pallas_call(
        kernel,
        grid=(num_items, num_splits),
        in_specs=[
            pl.BlockSpec((None, rows, latent), lambda i, s: (i, 0, 0)),  # q_latent of item i
            pl.BlockSpec((None, rows, rope), lambda i, s: (i, 0, 0)),  # q_rope of item i
            pl.BlockSpec((num_blocks, block_size, latent), lambda i, s: (0, 0, 0)),  # every c_kv page
            pl.BlockSpec((num_blocks, block_size, rope), lambda i, s: (0, 0, 0)),  # every k_rope page
            pl.BlockSpec((None, pages_per_split), lambda i, s: (i, s)),  # pages of split s of item i
            pl.BlockSpec((1,), lambda i, s: (i,)),  # q_pos0 of item i
            pl.BlockSpec((1,), lambda i, s: (i,)),  # num_rows of item i
        ],
        out_specs=[pl.BlockSpec((None, None, rows, latent), lambda i, s: (i, s, 0, 0))]
        + ([stat_spec, stat_spec] if split else []),
        out_shape=[jax.ShapeDtypeStruct((num_items, num_splits, rows, latent), out_dtype)]
        + ([stat_shape, stat_shape] if split else []),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"mla_paged_attention_{rows=}_{block_k=}_{num_splits=}",
    )(q_latent_items, q_rope_items, c_kv_cache, k_rope_cache, item_tables, q_pos0, num_rows)
    if not split:
        return outs[0][:, 0].astype(jnp.float32)
    o, m, l = outs
    weight = jnp.exp2(m - m.max(axis=1, keepdims=True)) * l  # [items, splits, rows]
    total = jnp.maximum(weight.sum(axis=1), 1e-30)
    return jnp.einsum("ISR,ISRL->IRL", weight, o) / total[..., None]  # I item, S split, R row


def _mla_pallas_latent(q_latent, q_rope, c_kv_cache, k_rope_cache, block_tables, seq_lens, query_start_loc, num_seqs,
                       sm_scale, interpret, config):
    """The kernel's latent output [T, N, L] (f32) for every token."""
    num_tokens, num_heads, _ = q_latent.shape
    max_num_seqs, max_blocks_per_seq = block_tables.shape
    batch = ragged_batch(seq_lens, query_start_loc, num_seqs)
    token_seq = token_sequence(batch, num_tokens)
    split = split_decodes_and_prefills(batch)

    def run(blocks, block_q, rows, **launch):
        lat_items, tables = _items_from_blocks(q_latent, blocks, block_tables, 1, rows)
        rope_items, _ = _items_from_blocks(q_rope, blocks, block_tables, 1, rows)
        out = _mla_call(lat_items[:, 0], rope_items[:, 0], c_kv_cache, k_rope_cache, tables, blocks.q_pos0,
                        blocks.num_rows, num_heads=num_heads, sm_scale=sm_scale, interpret=interpret, **launch)
        return _token_rows(out[:, None], batch, blocks, token_seq, block_q, num_heads)

    # decode: one item per decoding sequence, its num_heads rows in one tl.dot tile
    decode = query_blocks(batch, split.decode_q_lens, max_num_seqs, 1)
    num_splits = config.decode_num_splits or _next_power_of_2(cdiv(config.decode_target_programs, max_num_seqs))
    max_splits = cdiv(max_blocks_per_seq * c_kv_cache.shape[1], config.decode_block_k)
    num_splits = max(1, min(num_splits, _next_power_of_2(max_splits)))
    out_decode = run(decode, 1, max(MIN_DOT_DIM, _next_power_of_2(num_heads)), num_splits=num_splits,
                     block_k=config.decode_block_k, num_warps=config.decode_num_warps,
                     num_stages=config.decode_num_stages)
    # prefill chunks: blocks of block_q tokens of one sequence, num_heads rows each
    block_q = max(1, config.prefill_rows // num_heads)
    prefill = query_blocks(batch, split.prefill_q_lens, max_prefill_blocks(num_tokens, max_num_seqs, block_q),
                           block_q)
    out_prefill = run(prefill, block_q, max(MIN_DOT_DIM, _next_power_of_2(block_q * num_heads)), num_splits=1,
                      block_k=config.prefill_block_k, num_warps=config.prefill_num_warps,
                      num_stages=config.prefill_num_stages)
    is_decode = (split.decode_q_lens[token_seq] == 1)[:, None, None]
    return jnp.where(is_decode, out_decode, out_prefill)


def check_mla_args(q_nope, q_rope, c_kv_cache, k_rope_cache, w_uk, w_uv, block_tables, seq_lens, query_start_loc,
                   num_seqs):
    """Trace-time checks of an MLA call (both impls): a ValueError that names the fix."""
    if q_nope.ndim != 3 or q_rope.ndim != 3 or q_nope.shape[:2] != q_rope.shape[:2]:
        raise ValueError(f"q_nope and q_rope must be [num_tokens, num_heads, P] and [num_tokens, num_heads, R], "
                         f"got {q_nope.shape=} {q_rope.shape=}")
    if c_kv_cache.ndim != 3 or k_rope_cache.ndim != 3 or c_kv_cache.shape[:2] != k_rope_cache.shape[:2]:
        raise ValueError(f"c_kv_cache and k_rope_cache must be [num_blocks, block_size, L] and [num_blocks, "
                         f"block_size, R], got {c_kv_cache.shape=} {k_rope_cache.shape=}")
    num_heads, latent = q_nope.shape[1], c_kv_cache.shape[2]
    if k_rope_cache.shape[2] != q_rope.shape[2]:
        raise ValueError(f"q_rope's width {q_rope.shape[2]} differs from k_rope_cache's {k_rope_cache.shape[2]}")
    if w_uk.shape != (latent, num_heads, q_nope.shape[2]) or w_uv.ndim != 3 or w_uv.shape[:2] != (latent, num_heads):
        raise ValueError(f"w_uk must be [L={latent}, N={num_heads}, P={q_nope.shape[2]}] and w_uv [L, N, V], got "
                         f"{w_uk.shape=} {w_uv.shape=}")
    dtypes = {a.dtype for a in (q_nope, q_rope, c_kv_cache, k_rope_cache, w_uk, w_uv)}
    if len(dtypes) != 1 or not jnp.issubdtype(q_nope.dtype, jnp.floating):
        raise ValueError(f"queries, caches and W_uk/W_uv must share one floating dtype, got "
                         f"{sorted(map(str, dtypes))}; cast them to the cache dtype")
    for name, arr, ndim in (("block_tables", block_tables, 2), ("seq_lens", seq_lens, 1),
                            ("query_start_loc", query_start_loc, 1)):
        if arr.dtype != jnp.int32 or arr.ndim != ndim:
            raise ValueError(f"{name} must be int32 with {ndim} dimension(s), got {arr.dtype}{arr.shape}")
    max_num_seqs = block_tables.shape[0]
    if seq_lens.shape != (max_num_seqs,) or query_start_loc.shape != (max_num_seqs + 1,):
        raise ValueError(f"seq_lens must be i32[{max_num_seqs}] and query_start_loc i32[{max_num_seqs + 1}], got "
                         f"{seq_lens.shape} and {query_start_loc.shape}")
    num_seqs = jnp.asarray(num_seqs)
    if num_seqs.dtype != jnp.int32 or num_seqs.shape not in ((), (1,)):
        raise ValueError(f"num_seqs must be an int32 scalar or i32[1], got {num_seqs.dtype}{num_seqs.shape}")


def _check_pallas_args(c_kv_cache, k_rope_cache, num_heads):
    """What the Triton lowering needs: power-of-two tile dims."""
    block_size, latent = c_kv_cache.shape[1:]
    rope = k_rope_cache.shape[2]
    for name, value in (("block_size", block_size), ("kv_lora_rank", latent), ("qk_rope_head_dim", rope)):
        if value & (value - 1) or (name != "block_size" and value < MIN_DOT_DIM):
            raise ValueError(f"{name}={value} must be a power of two (>= 16 for the widths) for the Pallas MLA "
                             "kernel (Triton block dims); use the XLA attention")


@functools.partial(jax.jit, static_argnames=("sm_scale", "interpret", "config"))
def mla_paged_attention(q_nope, q_rope, c_kv_cache, k_rope_cache, w_uk, w_uv, block_tables, seq_lens,
                        query_start_loc, num_seqs, *, sm_scale, interpret=False, config=None):
    """Causal multi-head latent attention of a ragged batch over the paged latent pool (absorbed form).

    Args:
      q_nope: [num_tokens, N, P], the non-rotary part of the queries; q_rope: [num_tokens, N, R],
        rotated. Sequence i owns rows query_start_loc[i]:query_start_loc[i + 1].
      c_kv_cache: [num_blocks, block_size, L]; k_rope_cache: [num_blocks, block_size, R] (rotated).
      w_uk: [L, N, P], latent -> per-head non-rotary key; w_uv: [L, N, V], latent -> per-head value.
      block_tables: i32[max_num_seqs, max_blocks_per_seq], padded with the null page 0.
      seq_lens: i32[max_num_seqs], context length including this step's query tokens; 0 when padded.
      query_start_loc: i32[max_num_seqs + 1]; num_seqs: i32 scalar or i32[1].
      sm_scale: softmax scale (DeepSeek: qk_head_dim**-0.5 times YaRN's mscale**2).
      interpret: run the kernel in interpret mode (CPU tests); config: MlaPallasConfig.
    Returns:
      [num_tokens, N, V] in q_nope.dtype: head n of query j of a sequence with q_len tokens
      (position seq_len - q_len + j) attends to positions <= its own with key
      [c_kv W_uk[:, n] | k_rope] and value c_kv W_uv[:, n]. Padding rows are finite.
    """
    check_mla_args(q_nope, q_rope, c_kv_cache, k_rope_cache, w_uk, w_uv, block_tables, seq_lens, query_start_loc,
                   num_seqs)
    _check_pallas_args(c_kv_cache, k_rope_cache, q_nope.shape[1])
    q_latent = jnp.einsum("TNP,LNP->TNL", q_nope, w_uk, preferred_element_type=jnp.float32).astype(q_nope.dtype)
    latent = _mla_pallas_latent(q_latent, q_rope, c_kv_cache, k_rope_cache, block_tables, seq_lens, query_start_loc,
                                jnp.reshape(num_seqs, ()), sm_scale, interpret, config or MlaPallasConfig())
    out = jnp.einsum("TNL,LNV->TNV", latent.astype(w_uv.dtype), w_uv, preferred_element_type=jnp.float32)
    return out.astype(q_nope.dtype)


def mla_paged_attention_reference(q_nope, q_rope, c_kv_cache, k_rope_cache, w_uk, w_uv, block_tables, seq_lens,
                                  query_start_loc, num_seqs, *, sm_scale):
    """float64 numpy: decompress every key and value of each sequence, then ordinary causal attention.

    Same arguments as `mla_paged_attention`; returns f64[num_tokens, N, V], padding rows zero.
    Only slots below seq_len are read, so NaN in foreign pages cannot reach it.
    """
    q_nope, q_rope, c_kv_cache, k_rope_cache, w_uk, w_uv = (
        np.asarray(jnp.asarray(a, jnp.float32), np.float64) for a in (q_nope, q_rope, c_kv_cache, k_rope_cache, w_uk,
                                                                     w_uv))
    block_tables, seq_lens, query_start_loc = (np.asarray(a) for a in (block_tables, seq_lens, query_start_loc))
    num_tokens, num_heads, _ = q_nope.shape
    block_size = c_kv_cache.shape[1]
    out = np.zeros((num_tokens, num_heads, w_uv.shape[-1]))
    for i in range(int(np.asarray(num_seqs).reshape(()))):
        start, end, seq_len = int(query_start_loc[i]), int(query_start_loc[i + 1]), int(seq_lens[i])
        slots = np.arange(seq_len)
        pages = block_tables[i][slots // block_size]
        c_kv = c_kv_cache[pages, slots % block_size]  # [S, L]
        k_rope = k_rope_cache[pages, slots % block_size]  # [S, R]
        k = np.concatenate([np.einsum("SL,LNP->SNP", c_kv, w_uk),
                            np.broadcast_to(k_rope[:, None], (seq_len, num_heads, k_rope.shape[1]))], axis=-1)
        v = np.einsum("SL,LNV->SNV", c_kv, w_uv)
        q = np.concatenate([q_nope[start:end], q_rope[start:end]], axis=-1)  # [T, N, P + R]
        scores = np.einsum("TND,SND->NTS", q, k) * sm_scale
        q_pos = seq_len - (end - start) + np.arange(end - start)
        scores = np.where(slots[None, None, :] <= q_pos[None, :, None], scores, -np.inf)
        weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
        weights /= weights.sum(axis=-1, keepdims=True)
        out[start:end] = np.einsum("NTS,SNV->TNV", weights, v)
    return out
