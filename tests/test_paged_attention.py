"""Ragged paged attention: both impls against the jnp reference and a float64 numpy one.

Every batch is built the hostile way: pages are a random permutation of the pool, every
slot nobody owns (foreign pages, the null page, the tail of a last page) is NaN, and the
buckets carry padded tokens and padded sequences. Sliding-window batches also poison every
page wholly before a sequence's window (NaN) and the older slots of its first page (1e4).
The Pallas kernel runs in interpret mode on the CPU and compiled on a GPU
(scripts/gpu_check.sh runs this file there).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from models.kv_cache_spec import FullAttentionSpec
from paged_jax.attention import TritonAttention, XlaAttention, make_attention_backend
from paged_jax.attention.xla import ragged_paged_attention_xla
from pallas_kernels.paged_attention import (
    PallasConfig,
    ragged_paged_attention,
    ragged_paged_attention_reference,
)

INTERPRET = jax.default_backend() == "cpu"


def run_impl(impl, *args, config=None, **kwargs):
    """One attention call: the XLA path, or the Pallas kernel (interpret mode on CPU)."""
    if impl == "xla":
        assert config is None, "PallasConfig is for the Pallas kernel"
        return ragged_paged_attention_xla(*args, **kwargs)
    return ragged_paged_attention(*args, interpret=INTERPRET, config=config, **kwargs)

# Output tolerance vs the float64 numpy reference, per dtype. bf16 inputs are compared with
# the same bf16-rounded values; the error left is the bf16 output and the bf16 probabilities
# the kernels feed to the P @ V product.
TOLERANCE = {jnp.float32: dict(atol=2e-5, rtol=2e-5), jnp.bfloat16: dict(atol=3e-2, rtol=2e-2)}


def cdiv(a, b):
    return -(-a // b)


def build_batch(rng, q_lens, seq_lens, *, num_q_heads, num_kv_heads, head_dim, block_size, dtype,
                num_tokens, max_num_seqs, max_blocks_per_seq, num_blocks=None):
    """Numpy arrays of a ragged batch in the engine's padded layout, unowned slots NaN.

    num_blocks defaults to room for every sequence's table plus 3 foreign pages; tests that
    draw many batches fix it so that one bucket compiles once.
    """
    assert len(q_lens) == len(seq_lens) <= max_num_seqs and sum(q_lens) <= num_tokens
    pages_needed = [cdiv(n, block_size) for n in seq_lens]
    assert max(pages_needed) <= max_blocks_per_seq
    num_blocks = num_blocks or 4 + max_num_seqs * max_blocks_per_seq
    assert num_blocks > sum(pages_needed)
    pool = iter(rng.permutation(np.arange(1, num_blocks)))  # page 0 is the null page
    block_tables = np.zeros((max_num_seqs, max_blocks_per_seq), np.int32)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = np.full(cache_shape, np.nan), np.full(cache_shape, np.nan)
    for i, seq_len in enumerate(seq_lens):
        block_tables[i, : pages_needed[i]] = [next(pool) for _ in range(pages_needed[i])]
        for pos in range(seq_len):
            page, offset = block_tables[i, pos // block_size], pos % block_size
            k_cache[page, offset] = rng.standard_normal((num_kv_heads, head_dim))
            v_cache[page, offset] = rng.standard_normal((num_kv_heads, head_dim))
    query_start_loc = np.full(max_num_seqs + 1, sum(q_lens), np.int32)  # padded sequences repeat the end
    query_start_loc[: len(q_lens) + 1] = np.concatenate([[0], np.cumsum(q_lens)])
    seq_lens_arr = np.zeros(max_num_seqs, np.int32)
    seq_lens_arr[: len(seq_lens)] = seq_lens
    q = rng.standard_normal((num_tokens, num_q_heads, head_dim))  # padded token rows are random too
    # Round through the dtype so that the float64 reference sees exactly the kernel's inputs.
    q, k_cache, v_cache = (np.asarray(jnp.asarray(x, dtype).astype(jnp.float32), np.float64)
                           for x in (q, k_cache, v_cache))
    return q, k_cache, v_cache, block_tables, seq_lens_arr, query_start_loc, np.int32(len(q_lens))


def attention_f64(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, num_seqs, sliding_window=None):
    """Independent float64 numpy attention: token by token, head by head, from slot arithmetic
    (with sliding_window: the query at position p sees keys p - sliding_window < k <= p)."""
    _, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    out = np.zeros_like(q)
    for i in range(num_seqs):
        rows = np.arange(query_start_loc[i], query_start_loc[i + 1])
        seq_len = seq_lens[i]
        pos = np.arange(seq_len)
        pages, offsets = block_tables[i, pos // block_size], pos % block_size
        k, v = k_cache[pages, offsets], v_cache[pages, offsets]  # [L, num_kv_heads, D]
        for j, row in enumerate(rows):
            q_pos = seq_len - len(rows) + j
            first = 0 if sliding_window is None else max(0, q_pos - sliding_window + 1)
            for h in range(num_q_heads):
                kv_head = h // (num_q_heads // num_kv_heads)
                logits = k[first: q_pos + 1, kv_head] @ q[row, h] / np.sqrt(head_dim)
                weights = np.exp(logits - logits.max())
                out[row, h] = weights @ v[first: q_pos + 1, kv_head] / weights.sum()
    return out


def check_batch(batch, dtype, impls=("xla", "pallas"), config=None, with_reference=True, sliding_window=None):
    """Run the impls (and the jnp reference) on one batch and compare every real row."""
    q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, num_seqs = batch
    expected = attention_f64(*batch, sliding_window=sliding_window)
    window = {} if sliding_window is None else dict(sliding_window=sliding_window)
    args = (jnp.asarray(q, dtype), jnp.asarray(k_cache, dtype), jnp.asarray(v_cache, dtype),
            jnp.asarray(block_tables), jnp.asarray(seq_lens), jnp.asarray(query_start_loc), jnp.asarray(num_seqs))
    real = slice(0, int(query_start_loc[num_seqs]))
    tol = TOLERANCE[dtype]
    if with_reference:
        reference = np.asarray(ragged_paged_attention_reference(*args, **window).astype(jnp.float32))
        np.testing.assert_allclose(reference[real], expected[real], **tol, err_msg="jnp reference vs float64")
    for impl in impls:
        out = run_impl(impl, *args, config=config, **window)
        assert out.shape == q.shape and out.dtype == dtype
        out = np.asarray(out.astype(jnp.float32))
        # NaN pages must not leak anywhere, not even into padding rows.
        assert np.isfinite(out).all(), f"{impl}: non-finite output rows {np.where(~np.isfinite(out))[0]}"
        np.testing.assert_allclose(out[real], expected[real], **tol, err_msg=f"{impl} vs float64")
        if with_reference:
            np.testing.assert_allclose(out[real], reference[real], **tol, err_msg=f"{impl} vs reference")


def scenario(name, block_size, rng):
    """(q_lens, seq_lens) of a decode-only, prefill-only or mixed batch."""
    bs = block_size
    if name == "decode":  # lengths 1, bs - 1, exact multiples, and a random one
        seq_lens = [1, bs - 1, bs, 2 * bs, int(rng.integers(2, 3 * bs))]
        return [1] * len(seq_lens), seq_lens
    if name == "prefill":  # no cached context: q_len == seq_len
        seq_lens = [bs - 1, bs, 2 * bs + 5, 3]
        return seq_lens, seq_lens
    # mixed: chunked prefill on cached context, decodes, a fresh prefill, a 2-token chunk at a page edge
    return [bs + 3, 1, bs - 1, 1, 2], [3 * bs + 3, bs + 1, bs - 1, 1, bs]


SHAPES = [  # (num_q_heads, num_kv_heads, head_dim, block_size, dtype)
    (4, 4, 64, 16, jnp.float32),  # MHA
    (8, 2, 128, 16, jnp.bfloat16),  # GQA 4
    (8, 1, 64, 32, jnp.float32),  # MQA (group 8)
    (16, 2, 64, 16, jnp.bfloat16),  # GQA 8
    (4, 1, 128, 32, jnp.bfloat16),  # MQA (group 4)
    (8, 2, 64, 32, jnp.float32),  # GQA 4
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"q{s[0]}kv{s[1]}d{s[2]}bs{s[3]}{jnp.dtype(s[4]).name}")
@pytest.mark.parametrize("name", ["decode", "prefill", "mixed"])
def test_ragged_batches(shape, name):
    num_q_heads, num_kv_heads, head_dim, block_size, dtype = shape
    rng = np.random.default_rng(10 * SHAPES.index(shape) + ["decode", "prefill", "mixed"].index(name))
    q_lens, seq_lens = scenario(name, block_size, rng)
    # One bucket for all three scenarios: padded tokens and padded sequences always present.
    batch = build_batch(rng, q_lens, seq_lens, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                        head_dim=head_dim, block_size=block_size, dtype=dtype, num_tokens=4 * block_size + 16,
                        max_num_seqs=8, max_blocks_per_seq=cdiv(128, block_size))
    check_batch(batch, dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_long_context_xla(dtype):
    rng = np.random.default_rng(7)
    # decodes at 1100 and 2048, a 64-token chunk on 1024 cached tokens, a 1-token sequence
    batch = build_batch(rng, [1, 64, 1, 1], [1100, 1088, 2048, 1], num_q_heads=8, num_kv_heads=2, head_dim=64,
                        block_size=16, dtype=dtype, num_tokens=80, max_num_seqs=6, max_blocks_per_seq=130)
    check_batch(batch, dtype, impls=("xla",))


def test_many_sequences_xla():
    """More decodes and prefill blocks than one outer group of the xla path holds."""
    rng = np.random.default_rng(12)
    decode_lens = [int(n) for n in rng.integers(1, 100, 40)]
    q_lens = [1] * 20 + [300] + [1] * 20 + [40]
    seq_lens = decode_lens[:20] + [320] + decode_lens[20:] + [40]
    batch = build_batch(rng, q_lens, seq_lens, num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
                        dtype=jnp.float32, num_tokens=384, max_num_seqs=48, max_blocks_per_seq=21, num_blocks=256)
    check_batch(batch, jnp.float32, impls=("xla",), with_reference=False)


@pytest.mark.parametrize("max_num_seqs", [12, 64])
def test_decode_groups_sorted_by_context_xla(max_num_seqs):
    """Decodes of very different lengths, in sequence order unlike their length order: the
    xla path walks them longest first in groups of 8 (11 decodes: a full and a part-filled
    group, the longest one mid-batch; 45 decodes: six groups)."""
    rng = np.random.default_rng(14)
    n = 11 if max_num_seqs == 12 else 45
    seq_lens = [int(x) for x in rng.integers(1, 200, n)]
    seq_lens[n // 2] = 321  # the longest sits mid-batch
    batch = build_batch(rng, [1] * n, seq_lens, num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
                        dtype=jnp.float32, num_tokens=64, max_num_seqs=max_num_seqs, max_blocks_per_seq=21,
                        num_blocks=n * 21 + 4)
    check_batch(batch, jnp.float32, impls=("xla",), with_reference=False)


def test_long_context_pallas():
    rng = np.random.default_rng(8)
    batch = build_batch(rng, [1, 20, 1], [1030, 1044, 7], num_q_heads=4, num_kv_heads=1, head_dim=64,
                        block_size=32, dtype=jnp.float32, num_tokens=24, max_num_seqs=4, max_blocks_per_seq=34)
    check_batch(batch, jnp.float32, impls=("pallas",))


@pytest.mark.parametrize("config", [
    PallasConfig(decode_block_k=32, decode_num_splits=4, prefill_rows=16, prefill_block_k=32),
    PallasConfig(decode_block_k=16, decode_num_splits=1, prefill_rows=128, prefill_block_k=16),
], ids=["split4", "nosplit"])
def test_pallas_launch_configs(config):
    """Context splits and tile sizes other than the defaults compute the same attention."""
    rng = np.random.default_rng(9)
    batch = build_batch(rng, [1, 9, 1, 1], [200, 150, 16, 33], num_q_heads=8, num_kv_heads=2, head_dim=64,
                        block_size=16, dtype=jnp.float32, num_tokens=16, max_num_seqs=5, max_blocks_per_seq=13)
    check_batch(batch, jnp.float32, impls=("pallas",), config=config)


def test_pages_smaller_than_a_dot_tile():
    """block_size 8 with one-page tables: the kernel still steps over >= 16 keys (null-page padded)."""
    rng = np.random.default_rng(13)
    batch = build_batch(rng, [1, 5, 1], [8, 7, 3], num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=8,
                        dtype=jnp.float32, num_tokens=8, max_num_seqs=4, max_blocks_per_seq=1)
    check_batch(batch, jnp.float32)


@given(data=st.data())
def test_random_ragged_batches(data):
    """Random mixes of decodes, fresh prefills and chunks on cached context in one fixed bucket."""
    num_seqs = data.draw(st.integers(1, 5), label="num_seqs")
    q_lens = data.draw(st.lists(st.integers(1, 12), min_size=num_seqs, max_size=num_seqs), label="q_lens")
    cached = data.draw(st.lists(st.integers(0, 60), min_size=num_seqs, max_size=num_seqs), label="cached")
    seed = data.draw(st.integers(0, 2**31), label="seed")
    q_lens = [min(n, 28 // num_seqs) for n in q_lens]
    batch = build_batch(np.random.default_rng(seed), q_lens, [n + c for n, c in zip(q_lens, cached)],
                        num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=jnp.float32,
                        num_tokens=32, max_num_seqs=6, max_blocks_per_seq=5)
    # The eager jnp reference would compile per distinct length; the float64 one is the oracle here.
    check_batch(batch, jnp.float32, with_reference=False)


def _args(num_tokens=8, num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16, max_num_seqs=4, dtype=jnp.float32):
    return [jnp.zeros((num_tokens, num_q_heads, head_dim), dtype),
            jnp.zeros((10, block_size, num_kv_heads, head_dim), dtype),
            jnp.zeros((10, block_size, num_kv_heads, head_dim), dtype),
            jnp.zeros((max_num_seqs, 3), jnp.int32), jnp.zeros((max_num_seqs,), jnp.int32),
            jnp.zeros((max_num_seqs + 1,), jnp.int32), jnp.int32(0)]


def _replace(args, index, value):
    args = list(args)
    args[index] = value
    return args


@pytest.mark.parametrize("args, impl, match", [
    (_args(num_q_heads=6, num_kv_heads=4), "xla", "multiple of num_kv_heads"),
    (_replace(_args(), 0, jnp.zeros((8, 8, 64), jnp.bfloat16)), "xla", "share one dtype"),
    (_replace(_args(), 2, jnp.zeros((10, 16, 2, 32))), "xla", "v_cache must have k_cache's shape"),
    (_replace(_args(), 0, jnp.zeros((8, 8, 32))), "xla", "head_dim"),
    (_replace(_args(), 3, jnp.zeros((4, 3), jnp.int16)), "xla", "block_tables must be int32"),
    (_replace(_args(), 4, jnp.zeros((5,), jnp.int32)), "xla", "seq_lens must be i32"),
    (_replace(_args(), 5, jnp.zeros((4,), jnp.int32)), "xla", "query_start_loc must be i32"),
    (_replace(_args(), 6, jnp.float32(1)), "xla", "num_seqs must be an int32"),
    (_args(block_size=24), "pallas", "block_size=24 must be a power of two"),
    (_args(head_dim=96), "pallas", "head_dim=96 must be a power of two"),
])
def test_bad_input_raises_with_fix(args, impl, match):
    with pytest.raises(ValueError, match=match):
        run_impl(impl, *args)


def test_backend_is_chosen_once_for_a_spec():
    spec = FullAttentionSpec(num_kv_heads=2, head_dim=64, dtype="float32")
    assert make_attention_backend(spec, "xla") == XlaAttention(spec)
    triton = make_attention_backend(spec, "triton", interpret=True)
    assert type(triton) is TritonAttention and triton.interpret and triton.name == "triton"
    assert hash(triton) == hash(TritonAttention(spec, interpret=True))
    with pytest.raises(ValueError, match="attention_impl='cuda' must be one of"):
        make_attention_backend(spec, "cuda")
    with pytest.raises(ValueError, match="interpret and pallas_config apply to attention_impl='triton' only"):
        make_attention_backend(spec, "xla", interpret=True)
    with pytest.raises(ValueError, match="no attention backend for a str"):
        make_attention_backend("a latent cache", "xla")


def test_xla_accepts_shapes_the_kernel_cannot_tile():
    """block_size 24 and head_dim 96 are refused by the Pallas kernel but fine for impl='xla'."""
    rng = np.random.default_rng(10)
    batch = build_batch(rng, [3, 1], [50, 30], num_q_heads=6, num_kv_heads=3, head_dim=96, block_size=24,
                        dtype=jnp.float32, num_tokens=6, max_num_seqs=3, max_blocks_per_seq=3)
    check_batch(batch, jnp.float32, impls=("xla",))


def test_jits_with_traced_num_seqs_and_custom_scale():
    """num_seqs as i32[1] under an outer jit, and an explicit sm_scale, match the reference."""
    rng = np.random.default_rng(11)
    q, k, v, tables, seq_lens, qsl, num_seqs = build_batch(
        rng, [4, 1], [20, 9], num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=jnp.float32,
        num_tokens=8, max_num_seqs=3, max_blocks_per_seq=2)
    args = [jnp.asarray(x, jnp.float32) for x in (q, k, v)] + [jnp.asarray(x) for x in (tables, seq_lens, qsl)]
    args.append(jnp.asarray([num_seqs], jnp.int32))
    expected = ragged_paged_attention_reference(*args, sm_scale=0.3)
    for impl in ("xla", "pallas"):
        step = jax.jit(functools.partial(run_impl, impl, sm_scale=0.3))
        np.testing.assert_allclose(np.asarray(step(*args))[:5], np.asarray(expected)[:5], atol=2e-5, rtol=2e-5)


# sliding window (Gemma 3's local layers, Mistral): the query at position p sees the keys
# p - sliding_window < k <= p

STALE = 1e4  # stale keys of a partly-live page: finite, and loud (scores ~1e4) if a row sees one
WINDOWS = [1, 5, 16, 40]  # itself only, smaller than a page, one page, not a multiple of a page


def window_first_keys(batch, sliding_window):
    """Per real sequence: the oldest key its first query row sees."""
    _, _, _, _, seq_lens, qsl, num_seqs = batch
    return [max(0, int(seq_lens[i]) - int(qsl[i + 1] - qsl[i]) - sliding_window + 1) for i in range(num_seqs)]


def poison_outside_windows(batch, sliding_window):
    """The batch with each sequence's pages wholly before its first query row's window NaN (a
    sliding group frees them: they may hold anything), and the older slots of the page that
    holds the window's first key STALE (finite, so only a missing per-row mask shows)."""
    q, k, v, tables, seq_lens, qsl, num_seqs = batch
    k, v = k.copy(), v.copy()
    block_size = k.shape[1]
    for i, first in enumerate(window_first_keys(batch, sliding_window)):
        for pos in range(first):
            page, slot = tables[i, pos // block_size], pos % block_size
            k[page, slot] = v[page, slot] = np.nan if pos < first // block_size * block_size else STALE
    return q, k, v, tables, seq_lens, qsl, num_seqs


def window_batch(rng, sliding_window, *, num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
                 dtype=jnp.float32):
    """A mixed batch for a window: decodes of 1, bs - 1, bs keys and far past the window, a
    chunk on a context longer than the window, a fresh prefill longer than it, a 2-token
    chunk at a page edge; out-of-window pages poisoned."""
    bs = block_size
    q_lens = [1, 1, 1, 1, bs + 3, 2 * bs + 5, 2, 1]
    seq_lens = [1, bs - 1, bs, 4 * bs + 3, 5 * bs + 1, 2 * bs + 5, 3 * bs, sliding_window + bs]
    batch = build_batch(rng, q_lens, seq_lens, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                        block_size=bs, dtype=dtype, num_tokens=4 * bs + 16, max_num_seqs=9, max_blocks_per_seq=6)
    return poison_outside_windows(batch, sliding_window)


@pytest.mark.parametrize("sliding_window", WINDOWS)
@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_sliding_window_ragged_batch(impl, sliding_window):
    rng = np.random.default_rng(100 + sliding_window)
    batch = window_batch(rng, sliding_window)
    assert np.isnan(batch[1]).any(), "some page lies wholly outside a window"
    check_batch(batch, jnp.float32, impls=(impl,), sliding_window=sliding_window)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_sliding_window_bf16_mqa_bs32(impl):
    """Group 8 and pages of 32: a window of 40 spans parts of three pages."""
    rng = np.random.default_rng(120)
    batch = window_batch(rng, 40, num_q_heads=8, num_kv_heads=1, block_size=32, dtype=jnp.bfloat16)
    check_batch(batch, jnp.bfloat16, impls=(impl,), sliding_window=40, with_reference=False)


def test_sliding_window_with_split_decodes_pallas():
    """Decode splits over a window's pages only (several splits, some past the window, empty)."""
    rng = np.random.default_rng(121)
    batch = build_batch(rng, [1, 1, 1, 3], [200, 150, 16, 100], num_q_heads=8, num_kv_heads=2, head_dim=64,
                        block_size=16, dtype=jnp.float32, num_tokens=8, max_num_seqs=5, max_blocks_per_seq=13)
    config = PallasConfig(decode_block_k=16, decode_num_splits=4, prefill_rows=16, prefill_block_k=16)
    check_batch(poison_outside_windows(batch, 70), jnp.float32, impls=("pallas",), config=config,
                sliding_window=70, with_reference=False)


def test_long_context_sliding_window_xla():
    """Gemma 3's window (512) on contexts of 2048: decodes sorted into groups, a 64-token chunk."""
    rng = np.random.default_rng(122)
    batch = build_batch(rng, [1, 64, 1, 1], [1100, 1088, 2048, 1], num_q_heads=8, num_kv_heads=2, head_dim=64,
                        block_size=16, dtype=jnp.float32, num_tokens=80, max_num_seqs=6, max_blocks_per_seq=130)
    check_batch(poison_outside_windows(batch, 512), jnp.float32, impls=("xla",), sliding_window=512,
                with_reference=False)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_window_covering_every_context_changes_nothing(impl):
    """A window at least the table width sees every key: the same numbers as None, bit for bit
    (the same pages, splits and chunks; only masks that are all true are added)."""
    rng = np.random.default_rng(123)
    q_lens, seq_lens = scenario("mixed", 16, rng)
    batch = build_batch(rng, q_lens, seq_lens, num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
                        dtype=jnp.float32, num_tokens=48, max_num_seqs=6, max_blocks_per_seq=5)
    args = [jnp.asarray(x, jnp.float32) for x in batch[:3]] + [jnp.asarray(x) for x in batch[3:]]
    full = np.asarray(run_impl(impl, *args))
    np.testing.assert_array_equal(np.asarray(run_impl(impl, *args, sliding_window=None)), full)
    np.testing.assert_array_equal(np.asarray(run_impl(impl, *args, sliding_window=5 * 16)), full)


def test_window_tables_start_at_each_blocks_window():
    """Exact shifted tables: block b's column 0 is the page holding key q_pos0 - W + 1."""
    from pallas_kernels.ragged_batch import window_first_key, window_pages, window_tables

    tables = jnp.asarray([[7, 3, 9, 4, 2], [5, 6, 0, 0, 0], [8, 1, 0, 0, 0]], jnp.int32)
    q_pos0 = jnp.asarray([70, 20, 0], jnp.int32)  # window 40: first keys 31, 0, 0
    assert window_pages(40, 1, 16, 5) == 4 and window_pages(40, 32, 16, 100) == 6 and window_pages(1, 1, 16, 9) == 1
    assert window_first_key(q_pos0, 40).tolist() == [31, 0, 0]
    assert window_tables(tables, q_pos0, 40, 16, 4).tolist() == [[3, 9, 4, 2], [5, 6, 0, 0], [8, 1, 0, 0]]
    assert window_tables(tables, jnp.asarray([79, 79, 79], jnp.int32), 16, 16, 2).tolist() == [
        [2, 0], [0, 0], [0, 0]]


@pytest.mark.parametrize("impl", ["xla", "pallas", "reference"])
@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "512"])
def test_bad_sliding_window_raises(impl, bad):
    fn = ragged_paged_attention_reference if impl == "reference" else functools.partial(run_impl, impl)
    with pytest.raises(ValueError, match="sliding_window"):
        fn(*_args(), sliding_window=bad)


@pytest.mark.parametrize("name, impl", [("int8", "xla"), ("fp8_e4m3", "xla"), ("fp8_e4m3", "pallas")])
def test_sliding_window_over_quantized_pages(name, impl):
    """Per-token-scaled one-byte pages through the same loops: the window applies there too
    (NaN scales, and NaN fp8 pages, on every page wholly outside a window)."""
    from paged_jax.core.kv_quant import FORMATS, per_token_scale_numpy, quantize_numpy, to_pages_numpy

    fmt = FORMATS[name]
    rng = np.random.default_rng(124)
    q, k, v, *rest = window_batch(rng, 40)
    stored, dequantized = [], []
    for x in (k, v):
        live = np.isfinite(x[..., 0])  # [num_blocks, block_size, num_kv_heads]
        scale = np.where(live, per_token_scale_numpy(np.nan_to_num(x), fmt), np.nan).astype(np.float32)
        values = quantize_numpy(np.nan_to_num(x), fmt, np.where(live, scale, 1.0)[..., None])
        if not fmt.is_integer:
            values = np.where(live[..., None], values, np.array(np.nan, values.dtype))
        stored += [jnp.asarray(to_pages_numpy(values, fmt)), jnp.asarray(scale)]
        dequantized.append(values.astype(np.float64) * scale[..., None].astype(np.float64))
    batch = (q, *dequantized, *rest)
    expected = attention_f64(*batch, sliding_window=40)
    out = run_impl(impl, jnp.asarray(q, jnp.float32), stored[0], stored[2], *[jnp.asarray(x) for x in rest],
                   k_scale=stored[1], v_scale=stored[3], kv_cache_dtype=name, sliding_window=40)
    out = np.asarray(out)
    real = slice(0, int(rest[2][rest[3]]))
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out[real], expected[real], **TOLERANCE[jnp.float32])


def test_backends_pass_the_specs_window():
    import dataclasses

    from models.kv_cache_spec import QuantizedAttentionSpec
    from paged_jax.attention import QuantizedTritonAttention, QuantizedXlaAttention

    if "sliding_window" not in {f.name for f in dataclasses.fields(FullAttentionSpec)}:
        pytest.skip("FullAttentionSpec has no sliding_window yet")
    spec = FullAttentionSpec(num_kv_heads=2, head_dim=64, dtype="float32", sliding_window=40)
    quantized = QuantizedAttentionSpec(2, 64, "float32", "int8", sliding_window=40)
    assert XlaAttention(spec).sliding_window == TritonAttention(spec).sliding_window == 40
    assert QuantizedXlaAttention(quantized).sliding_window == QuantizedTritonAttention(quantized).sliding_window == 40
    assert XlaAttention(dataclasses.replace(spec, sliding_window=None)).sliding_window is None
    rng = np.random.default_rng(125)
    batch = window_batch(rng, 40)
    args = [jnp.asarray(x, jnp.float32) for x in batch[:3]] + [jnp.asarray(x) for x in batch[3:]]
    np.testing.assert_array_equal(np.asarray(XlaAttention(spec)._attend(*args, sm_scale=0.125)),
                                  np.asarray(ragged_paged_attention_xla(*args, sm_scale=0.125, sliding_window=40)))
