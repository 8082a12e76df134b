"""Ragged paged attention: prefill chunks and decodes in one call, K/V read through block tables.

Layout (the one place it is documented): k_cache and v_cache are
[num_blocks, block_size, num_kv_heads, head_dim]; slot s is page s // block_size, row
s % block_size. Page 0 is the null page: padded block-table entries point to it, never -1.

The Pallas kernel (Triton backend) runs one program per (work item, KV head, context split).
A work item is a query block of one sequence, and the program handles all query heads of
the KV group, so every K/V page is read once per item: its rows are token * group + head.
Two launches share the kernel body: decodes (one row block per decoding sequence, the
context split flash-decoding style and combined by logsumexp) and prefill chunks (blocks
of `prefill_rows` rows, one split). Items with nothing to do exit at once, so a batch
without prefills or without decodes costs an empty launch, not a branch on the host.

Sliding-window (local) attention (Gemma 3, Mistral): the query at position p sees keys
p - sliding_window < k <= p. Each item's block table is shifted to start at the page that
holds the oldest key its first row sees (ragged_batch.window_tables) and cut to the pages a
window can span, so pages wholly before the window are never read, the decode splits cover
the window rather than the whole table, and older keys of that first page are masked per row.

Quantized caches (int8 / fp8 pages, models/kv_cache_spec.py QuantizedAttentionSpec) are read
a tile at a time and converted to q's dtype in registers; their per-token scales
(k_scale, v_scale: f32[num_blocks, block_size, num_kv_heads]) multiply the tile's scores and
probabilities, so no dequantized page exists anywhere, and a decode step reads one byte per
K/V element plus 4 bytes per (token, KV head) of scales.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.kv_cache_write import get_format, pages_to_values
from pallas_kernels.ragged_batch import (cdiv, check_ragged_args, max_prefill_blocks, query_blocks, ragged_batch,
                                         split_decodes_and_prefills, token_block_rows, token_sequence,
                                         window_first_key, window_pages, window_tables)

# Finite, so rows that see no key (padding, empty splits) stay finite instead of NaN.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
LOG2_E = math.log2(math.e)
MIN_DOT_DIM = 16  # tl.dot needs M, N and K >= 16
# Triton keeps up to num_stages K and V tiles in shared memory (227 KB per block on Hopper);
# block_k is halved until they fit in this much, leaving room for q and scratch.
SHARED_MEMORY_BUDGET = 192 * 1024


@dataclasses.dataclass(frozen=True)
class PallasConfig:
    """Tunable launch parameters of the Pallas kernel (block dims are powers of two).

    block_k values are upper bounds: the launch halves them until num_stages K and V tiles
    fit in SHARED_MEMORY_BUDGET (f32 at head_dim 128, say). The defaults are first guesses,
    not yet measured on a GPU: scripts/gpu_check.sh sweeps these fields and writes the table
    that should replace them (issue 7).
    """

    decode_block_k: int = 128  # keys per inner step (pages_per_compute_block * block_size)
    decode_num_splits: int | None = None  # None: enough splits for ~decode_target_programs
    decode_target_programs: int = 1024
    decode_num_warps: int = 4
    decode_num_stages: int = 2
    prefill_rows: int = 64  # query rows (tokens * group) per program
    prefill_block_k: int = 64
    prefill_num_warps: int = 4
    prefill_num_stages: int = 2

    def __post_init__(self):
        for name in ("decode_block_k", "prefill_rows", "prefill_block_k"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"{type(self).__name__}.{name}={value} must be a power of two")


def _next_power_of_2(n):
    return 1 << max(0, int(n) - 1).bit_length()


def _attention_kernel(
    q_ref,  # [rows, head_dim]: one work item, one KV head; row = token * group + head
    k_ref,  # [num_blocks, block_size, head_dim]: KV head h of k_cache (q's dtype or quantized)
    v_ref,  # [num_blocks, block_size, head_dim]
    *refs,  # (ks_ref, vs_ref: f32[num_blocks, block_size], KV head h's scales, only when scaled),
    # pages_ref: i32[pages_per_split], this split's slice of the item's block table (with a
    #   sliding window: of the table shifted to start at the window's first page),
    # q_pos0_ref: i32[1], position of the item's first query token,
    # num_rows_ref: i32[1], real query tokens of the item; 0 means nothing to do,
    # o_ref: [rows, head_dim], normalised within this split,
    # m_ref, l_ref: f32[rows] in log2 units, only when the context is split
    group,
    pages_per_compute_block,
    scale_log2,
    scaled,
    fmt,
    sliding_window,
):
    ks_ref, vs_ref = refs[:2] if scaled else (None, None)
    pages_ref, q_pos0_ref, num_rows_ref, o_ref, *stat_refs = refs[2:] if scaled else refs
    rows, head_dim = q_ref.shape
    block_size = k_ref.shape[1]
    pages_per_split = pages_ref.shape[0]
    block_k = pages_per_compute_block * block_size
    split_start = pl.program_id(2) * pages_per_split * block_size
    q_pos0 = q_pos0_ref[0]
    if sliding_window is not None:
        # The table starts at the page holding the first row's oldest visible key (window_tables).
        kv_first = window_first_key(q_pos0, sliding_window)
        split_start = split_start + kv_first // block_size * block_size
    # Keys past the item's last query position are never visible: do not even load them.
    kv_end = q_pos0 + num_rows_ref[0]
    num_steps = jnp.clip(cdiv(kv_end - split_start, block_k), 0, pages_per_split // pages_per_compute_block)
    precision = lax.Precision.HIGHEST if q_ref.dtype == jnp.float32 else None
    q = q_ref[...]
    row_pos = q_pos0 + jnp.arange(rows, dtype=jnp.int32)[:, None] // group  # [rows, 1]

    def body(step, carry):
        m_prev, l_prev, acc_prev = carry  # f32[rows], f32[rows], f32[rows, head_dim]
        pages = pages_ref[pl.ds(step * pages_per_compute_block, pages_per_compute_block)]
        # A quantized tile becomes q's dtype here, in registers (exact: int8 and fp8 fit bf16).
        k = k_ref[pages].reshape(block_k, head_dim)
        v = v_ref[pages].reshape(block_k, head_dim)
        if fmt is not None:  # uint8 bytes of fp8 values (or int8): reinterpret the loaded tile
            k, v = pages_to_values(k, fmt), pages_to_values(v, fmt)
        k, v = k.astype(q.dtype), v.astype(q.dtype)
        key_pos = split_start + step * block_k + jnp.arange(block_k, dtype=jnp.int32)  # [block_k]
        key_valid = key_pos < kv_end
        if sliding_window is not None:  # older keys of the first page: stale, or another sequence's
            key_valid = key_valid & (key_pos >= kv_first)
        # Foreign pages and slots past seq_len may hold NaN, and 0 * NaN = NaN: mask V itself.
        v = jnp.where(key_valid[:, None], v, jnp.zeros((), v.dtype))
        scores = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                                 preferred_element_type=jnp.float32) * scale_log2  # [rows, block_k]
        if scaled:  # q . (k s) = (q . k) s per key
            scores = scores * ks_ref[pages].reshape(block_k)[None, :]
        visible = key_valid[None, :] & (key_pos[None, :] <= row_pos)
        if sliding_window is not None:
            visible = visible & (key_pos[None, :] > row_pos - sliding_window)
        m_next, l_next, correction, probs = online_softmax_step(m_prev, l_prev, jnp.where(visible, scores, MASK_VALUE))
        if scaled:  # sum_k p (v s) = sum_k (p s) v; unowned slots' scales may be NaN
            probs = probs * jnp.where(key_valid, vs_ref[pages].reshape(block_k), 0.0)[None, :]
        pv = lax.dot_general(probs.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision,
                             preferred_element_type=jnp.float32)
        return m_next, l_next, acc_prev * correction[:, None] + pv

    run_online_softmax(body, num_steps, head_dim, o_ref, stat_refs)


def online_softmax_step(m_prev, l_prev, scores):
    """One key block of the online softmax, in log2 units (scores already times log2(e)):
    (running max, running sum, the factor the accumulator is rescaled by, the block's
    unnormalised probabilities) after scores f32[rows, block_k] (masked keys at MASK_VALUE)."""
    m_next = jnp.maximum(m_prev, scores.max(axis=1))
    correction = jnp.exp2(m_prev - m_next)
    probs = jnp.exp2(scores - m_next[:, None])
    return m_next, l_prev * correction + probs.sum(axis=1), correction, probs


def run_online_softmax(body, num_steps, width: int, o_ref, stat_refs) -> None:
    """Runs body(step, (m, l, acc)) over the key blocks from the empty state, writes the
    normalised output into o_ref [rows, width] and, when the context is split, the split's
    (m, l) into stat_refs for the logsumexp combine (every kernel of this package)."""
    rows = o_ref.shape[0]
    carry = (jnp.full((rows,), MASK_VALUE, jnp.float32), jnp.zeros((rows,), jnp.float32),
             jnp.zeros((rows, width), jnp.float32))
    m_final, l_final, acc = lax.fori_loop(0, num_steps, body, carry)
    o_ref[...] = (acc / jnp.maximum(l_final, 1e-30)[:, None]).astype(o_ref.dtype)
    if stat_refs:
        m_ref, l_ref = stat_refs
        m_ref[...] = m_final
        l_ref[...] = l_final


def split_pages(item_tables, block_k: int, block_size: int, num_splits: int, tile_bytes: int):
    """Key-block geometry of a launch: block_k halved until a pipelined tile (tile_bytes per
    key) fits SHARED_MEMORY_BUDGET; pages per compute block (tl.dot needs >= 16 keys; short
    tables need no more pages a step than they have); pages per split (whole compute blocks);
    item_tables padded to whole splits with the null page, never -1.
    Returns (block_k, pages_per_compute_block, pages_per_split, padded item_tables)."""
    while block_k > MIN_DOT_DIM and block_k * tile_bytes > SHARED_MEMORY_BUDGET:
        block_k //= 2
    pages_per_compute_block = max(MIN_DOT_DIM // block_size, 1,
                                  min(block_k // block_size, _next_power_of_2(item_tables.shape[1])))
    pages_per_split = cdiv(cdiv(item_tables.shape[1], num_splits), pages_per_compute_block) * pages_per_compute_block
    item_tables = jnp.pad(item_tables, ((0, 0), (0, num_splits * pages_per_split - item_tables.shape[1])))
    return block_k, pages_per_compute_block, pages_per_split, item_tables


def _attention_call(q_items, k_cache, v_cache, item_tables, q_pos0, num_rows, *, group, sm_scale, num_splits,
                    block_k, num_warps, num_stages, interpret, k_scale=None, v_scale=None, fmt=None,
                    sliding_window=None):
    """Launch the kernel over (item, KV head, split) and combine the splits.

    q_items: [num_items, num_kv_heads, rows, head_dim]; item_tables: i32[num_items, W] (with a
    sliding window: shifted by window_tables); q_pos0, num_rows: i32[num_items]; k_scale,
    v_scale: None or f32[num_blocks, block_size, num_kv_heads].
    Returns [num_items, num_kv_heads, rows, head_dim] f32.
    """
    num_items, num_kv_heads, rows, head_dim = q_items.shape
    num_blocks, block_size, _, _ = k_cache.shape
    scaled = k_scale is not None
    tile_bytes = 2 * num_stages * (head_dim * k_cache.dtype.itemsize + 4 * scaled)  # per key of block_k
    block_k, pages_per_compute_block, pages_per_split, item_tables = split_pages(
        item_tables, block_k, block_size, num_splits, tile_bytes)
    split = num_splits > 1
    out_dtype = jnp.float32 if split else q_items.dtype
    stat_shape = jax.ShapeDtypeStruct((num_items, num_splits, num_kv_heads, rows), jnp.float32)
    stat_spec = pl.BlockSpec((None, None, None, rows), lambda i, h, s: (i, s, h, 0))
    kernel = functools.partial(_attention_kernel, group=group, pages_per_compute_block=pages_per_compute_block,
                               scale_log2=sm_scale * LOG2_E, scaled=scaled, fmt=fmt,
                               sliding_window=sliding_window)
    scale_specs = [pl.BlockSpec((num_blocks, block_size, None), lambda i, h, s: (0, 0, h))] * 2 if scaled else []
    outs = pl.pallas_call(
        kernel,
        grid=(num_items, num_kv_heads, num_splits),
        in_specs=[
            pl.BlockSpec((None, None, rows, head_dim), lambda i, h, s: (i, h, 0, 0)),  # q: item i, KV head h
            pl.BlockSpec((num_blocks, block_size, None, head_dim), lambda i, h, s: (0, 0, h, 0)),  # k: head h pages
            pl.BlockSpec((num_blocks, block_size, None, head_dim), lambda i, h, s: (0, 0, h, 0)),  # v: head h pages
        ] + scale_specs + [  # k_scale, v_scale: head h's per-token scales (quantized caches)
            pl.BlockSpec((None, pages_per_split), lambda i, h, s: (i, s)),  # pages of split s of item i
            pl.BlockSpec((1,), lambda i, h, s: (i,)),  # q_pos0 of item i
            pl.BlockSpec((1,), lambda i, h, s: (i,)),  # num_rows of item i
        ],
        out_specs=[pl.BlockSpec((None, None, None, rows, head_dim), lambda i, h, s: (i, s, h, 0, 0))]
        + ([stat_spec, stat_spec] if split else []),
        out_shape=[jax.ShapeDtypeStruct((num_items, num_splits, num_kv_heads, rows, head_dim), out_dtype)]
        + ([stat_shape, stat_shape] if split else []),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"ragged_paged_attention_{rows=}_{block_k=}_{num_splits=}"
        + ("" if sliding_window is None else f"_{sliding_window=}"),
    )(q_items, k_cache, v_cache, *((k_scale, v_scale) if scaled else ()), item_tables, q_pos0, num_rows)
    if not split:
        return outs[0][:, 0].astype(jnp.float32)
    o, m, l = outs
    # flash-decoding combine: weight each split by its softmax mass relative to the best split
    weight = jnp.exp2(m - m.max(axis=1, keepdims=True)) * l  # [items, splits, K, rows]
    total = jnp.maximum(weight.sum(axis=1), 1e-30)
    return jnp.einsum("ISKR,ISKRD->IKRD", weight, o) / total[..., None]  # I item, S split, R row


def _items_from_blocks(q, blocks, block_tables, num_kv_heads, rows):
    """Gather each block's query rows into the kernel layout [items, K, rows, D] (row = token * G + g)."""
    num_items, block_q = blocks.row_token.shape
    _, num_q_heads, head_dim = q.shape
    group = num_q_heads // num_kv_heads
    q_items = q[blocks.row_token].reshape(num_items, block_q, num_kv_heads, group, head_dim)
    q_items = q_items.transpose(0, 2, 1, 3, 4).reshape(num_items, num_kv_heads, block_q * group, head_dim)
    q_items = jnp.pad(q_items, ((0, 0), (0, 0), (0, rows - block_q * group), (0, 0)))
    return q_items, block_tables[blocks.seq]


def _token_rows(out_items, batch, blocks, token_seq, block_q, group):
    """Inverse of _items_from_blocks: [items, K, rows, D] -> [num_tokens, num_q_heads, D]."""
    num_items, num_kv_heads, _, head_dim = out_items.shape
    out = out_items[:, :, : block_q * group].reshape(num_items, num_kv_heads, block_q, group, head_dim)
    out = out.transpose(0, 2, 1, 3, 4).reshape(num_items * block_q, num_kv_heads * group, head_dim)
    return out[token_block_rows(batch, blocks, token_seq, block_q)]


def _ragged_paged_attention_pallas(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, num_seqs,
                                   sm_scale, interpret, config, k_scale=None, v_scale=None, fmt=None,
                                   sliding_window=None):
    num_tokens, num_q_heads, _ = q.shape
    block_size, num_kv_heads = k_cache.shape[1:3]
    max_num_seqs, max_blocks_per_seq = block_tables.shape
    group = num_q_heads // num_kv_heads
    batch = ragged_batch(seq_lens, query_start_loc, num_seqs)
    token_seq = token_sequence(batch, num_tokens)
    call = functools.partial(_attention_call, k_cache=k_cache, v_cache=v_cache, group=group, sm_scale=sm_scale,
                             interpret=interpret, k_scale=k_scale, v_scale=v_scale, fmt=fmt,
                             sliding_window=sliding_window)

    def items(blocks, rows, block_q):
        q_items, tables = _items_from_blocks(q, blocks, block_tables, num_kv_heads, rows)
        if sliding_window is not None:  # each item reads the pages of its window only
            tables = window_tables(tables, blocks.q_pos0, sliding_window, block_size,
                                   window_pages(sliding_window, block_q, block_size, max_blocks_per_seq))
        return q_items, tables

    # decode: one item per decoding sequence, all rows of a KV group in one tl.dot tile
    decode_rows = max(MIN_DOT_DIM, _next_power_of_2(group))
    split = split_decodes_and_prefills(batch)
    decode = query_blocks(batch, split.decode_q_lens, max_num_seqs, 1)
    q_items, tables = items(decode, decode_rows, 1)
    num_splits = config.decode_num_splits or _next_power_of_2(
        cdiv(config.decode_target_programs, max_num_seqs * num_kv_heads))
    max_splits = cdiv(tables.shape[1] * block_size, config.decode_block_k)  # a window needs fewer
    num_splits = max(1, min(num_splits, _next_power_of_2(max_splits)))
    out_decode = call(q_items, item_tables=tables, q_pos0=decode.q_pos0, num_rows=decode.num_rows,
                      num_splits=num_splits, block_k=config.decode_block_k, num_warps=config.decode_num_warps,
                      num_stages=config.decode_num_stages)

    # prefill chunks: blocks of block_q tokens of one sequence, group rows each
    block_q = max(1, config.prefill_rows // group)
    prefill_rows = max(MIN_DOT_DIM, _next_power_of_2(block_q * group))
    prefill = query_blocks(batch, split.prefill_q_lens, max_prefill_blocks(num_tokens, max_num_seqs, block_q),
                           block_q)
    q_items, tables = items(prefill, prefill_rows, block_q)
    out_prefill = call(q_items, item_tables=tables, q_pos0=prefill.q_pos0, num_rows=prefill.num_rows,
                       num_splits=1, block_k=config.prefill_block_k, num_warps=config.prefill_num_warps,
                       num_stages=config.prefill_num_stages)

    is_decode = (split.decode_q_lens[token_seq] == 1)[:, None, None]
    out = jnp.where(is_decode, _token_rows(out_decode, batch, decode, token_seq, 1, group),
                    _token_rows(out_prefill, batch, prefill, token_seq, block_q, group))
    return out.astype(q.dtype)


def _check_pallas_args(k_cache, head_dim):
    """What the Triton lowering needs beyond check_ragged_args: power-of-two tile dims."""
    block_size = k_cache.shape[1]
    if block_size & (block_size - 1):
        raise ValueError(f"{block_size=} must be a power of two for the Pallas kernel (Triton block dims); "
                         "pick 16 or 32, or use the XLA attention")
    if head_dim & (head_dim - 1) or head_dim < 16:
        raise ValueError(f"{head_dim=} must be a power of two >= 16 for the Pallas kernel (tl.dot tiles); "
                         "pad head_dim or use the XLA attention")


@functools.partial(jax.jit, static_argnames=("sm_scale", "interpret", "config", "kv_cache_dtype", "sliding_window"))
def ragged_paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, num_seqs, *,
                           sm_scale=None, interpret=False, config=None, k_scale=None, v_scale=None,
                           kv_cache_dtype=None, sliding_window=None):
    """Causal (optionally sliding-window) attention of a ragged batch of query tokens over paged K/V.

    Args:
      q: [num_tokens, num_q_heads, head_dim]; sequence i owns rows
        query_start_loc[i]:query_start_loc[i + 1]; rows past query_start_loc[num_seqs] are padding.
      k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], q's dtype, or
        quantized pages (kv_cache_dtype: int8, or uint8 holding fp8 bits) with q in any float dtype.
      block_tables: i32[max_num_seqs, max_blocks_per_seq], padded with the null page 0.
      seq_lens: i32[max_num_seqs], context length INCLUDING this step's query tokens; 0 when padded.
      query_start_loc: i32[max_num_seqs + 1].
      num_seqs: i32 scalar or i32[1], the number of real sequences.
      sm_scale: softmax scale, default 1/sqrt(head_dim).
      interpret: run the kernel in interpret mode (CPU tests).
      config: PallasConfig launch parameters (None: the defaults).
      k_scale, v_scale: None (scale 1.0) or, for a quantized cache, its per-token scales, each
        f32[num_blocks, block_size, num_kv_heads]: key slot s stands for k_cache[s] * k_scale[s].
      kv_cache_dtype: None (a float cache) or the quantized format of the pages ("fp8_e4m3",
        "fp8_e5m2", "int8"; paged_jax/core/kv_quant.py), static.
      sliding_window: None (full causal attention) or a positive int, static: the query at
        position p sees the keys p - sliding_window < k <= p (sliding_window keys, itself
        included; HF / vLLM semantics). Pages wholly before a query block's window are never
        read, so their block-table entries may point anywhere (a freed page, the null page).

    Returns:
      [num_tokens, num_q_heads, head_dim] in q.dtype. Query token j of a sequence with q_len
      tokens sits at position seq_len - q_len + j and attends to positions <= its own (and,
      with a window, > its own - sliding_window). Padding rows are finite and otherwise unspecified.
    """
    check_ragged_args(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, num_seqs, k_scale, v_scale,
                      kv_cache_dtype, sliding_window)
    _check_pallas_args(k_cache, q.shape[-1])
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(q.shape[-1])
    num_seqs = jnp.reshape(num_seqs, ())
    return _ragged_paged_attention_pallas(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, num_seqs,
                                          sm_scale, interpret, config or PallasConfig(), k_scale, v_scale,
                                          get_format(kv_cache_dtype), sliding_window)


def ragged_paged_attention_reference(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, num_seqs, *,
                                     sm_scale=None, interpret=False, config=None, k_scale=None, v_scale=None,
                                     kv_cache_dtype=None, sliding_window=None):
    """Dense per-sequence causal attention over K/V gathered from the pages (float32 softmax).

    Same arguments as `ragged_paged_attention` (interpret and config are ignored); the
    reference of both the Pallas kernel and the XLA path (paged_jax/attention/xla.py).
    Sequence i attends with every token row and keeps the rows it owns, so all shapes are
    those of the bucket and eager calls compile once per bucket. Padding rows are zero.
    A sliding window masks the keys each row cannot see (every page is gathered, a reference may).
    """
    del interpret, config
    check_ragged_args(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, num_seqs, k_scale, v_scale,
                      kv_cache_dtype, sliding_window)
    fmt = get_format(kv_cache_dtype)
    if fmt is not None:  # a reference may convert every page
        k_cache, v_cache = pages_to_values(k_cache, fmt), pages_to_values(v_cache, fmt)
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    token = jnp.arange(num_tokens)
    key_pos = jnp.arange(block_tables.shape[1] * block_size)
    out = jnp.zeros(q.shape, jnp.float32)
    for i in range(int(np.asarray(num_seqs).reshape(()))):
        start, end, seq_len = query_start_loc[i], query_start_loc[i + 1], seq_lens[i]
        k = k_cache[block_tables[i]].reshape(-1, num_kv_heads, head_dim).astype(jnp.float32)  # [L, K, D]
        v = v_cache[block_tables[i]].reshape(-1, num_kv_heads, head_dim).astype(jnp.float32)
        if k_scale is not None:  # dequantize this sequence's pages (a reference may)
            k = k * k_scale[block_tables[i]].reshape(-1, num_kv_heads, 1)
            v = v * v_scale[block_tables[i]].reshape(-1, num_kv_heads, 1)
        live = key_pos < seq_len
        if sliding_window is not None:  # keys before the first query's window may be freed pages
            live = live & (key_pos > seq_len - (end - start) - sliding_window)
        v = jnp.where(live[:, None, None], v, 0.0)  # unowned slots may be NaN
        k, v = jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1)  # [L, H, D]
        q_pos = seq_len - (end - start) + (token - start)  # [T]
        visible = (key_pos[None, :] <= q_pos[:, None]) & (key_pos[None, :] < seq_len)  # [T, L]
        if sliding_window is not None:
            visible = visible & (key_pos[None, :] > q_pos[:, None] - sliding_window)
        scores = jnp.einsum("THD,LHD->HTL", q.astype(jnp.float32), k) * sm_scale  # T token, L key, H head
        weights = jax.nn.softmax(jnp.where(visible[None], scores, -jnp.inf), axis=-1)
        owned = (token >= start) & (token < end)
        out = jnp.where(owned[:, None, None], jnp.einsum("HTL,LHD->THD", weights, v), out)
    return out.astype(q.dtype)
