"""KV-cache quantization: the formats, quantize-on-write, and both attention paths over quantized pages.

References are independent of the code under test: numpy/ml_dtypes rounding
(paged_jax.core.kv_quant.quantize_numpy) for the writes, the format's own error bound for the
quantization error, and float64 numpy attention (test_paged_attention.attention_f64) over the
dequantized pages for the kernels, so only the kernels' arithmetic differs. Pages and scales
nobody owns are NaN (fp8) or garbage with NaN scales (int8).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from models.llama import LlamaConfig
from models.kv_cache_spec import (FullAttentionSpec, QuantizedAttentionSpec, attention_spec, init_kv_caches,
                                  kv_cache_bytes_per_token)
from paged_jax.attention import make_attention_backend
from paged_jax.core.kv_quant import (FORMATS, check_scale, from_pages_numpy, get_kv_quant_format, key_rotation,
                                     quantize_numpy, to_pages_numpy)
from paged_jax.core.step_inputs import AttentionMetadata
from pallas_kernels.kv_cache_write import _least_error_scale, _round_in_f32, write_kv_cache
from test_paged_attention import TOLERANCE, attention_f64, build_batch, cdiv, run_impl

FORMAT_NAMES = tuple(FORMATS)  # fp8_e4m3, fp8_e5m2, int8


def per_token_scales(x, fmt):
    """amax over head_dim / max_value (float32): the int8 write's scale, the fp8 write's first candidate."""
    amax = np.max(np.abs(np.asarray(x, np.float32)), axis=-1)
    return np.maximum(amax / np.float32(fmt.max_value), np.finfo(np.float32).tiny).astype(np.float32)


def assert_write_scales(x, scale, fmt, rtol=3e-7):
    """The scales a per-token write chose: amax / max_value for int8; for fp8 one of
    amax / max_value * 2**(j/8), j < 8, whose rounding leaves the row no more squared error
    (float64) than any other of them. rtol: how far x may be from what the write was given."""
    base = per_token_scales(x, fmt)
    if fmt.is_integer:  # (XLA may divide by a constant as a multiply: 1 ulp)
        np.testing.assert_allclose(scale, base, rtol=rtol)
        return
    j = np.round(np.log2(scale / base) * 8)
    assert np.all((j >= 0) & (j < 8)), j
    np.testing.assert_allclose(scale, base * 2.0 ** (j / 8), rtol=max(rtol, 1e-6))

    def error(s):
        deq = quantize_numpy(x, fmt, s[..., None]).astype(np.float64) * s[..., None]
        return np.sum((deq - x) ** 2, axis=-1)

    candidates = [error((base * np.float32(2.0 ** (i / 8))).astype(np.float32)) for i in range(8)]
    assert np.all(error(scale) <= np.min(candidates, axis=0) * (1 + 1e-5))
    assert np.any(j > 0)  # the search chose something other than amax somewhere


# formats and bad input

def test_format_table():
    assert get_kv_quant_format("auto") is None
    assert get_kv_quant_format("fp8") is get_kv_quant_format("fp8_e4m3") is FORMATS["fp8_e4m3"]
    assert FORMATS["fp8_e4m3"].max_value == 448.0 and FORMATS["fp8_e4m3"].storage_dtype == "float8_e4m3fn"
    assert FORMATS["fp8_e5m2"].max_value == 57344.0 and FORMATS["fp8_e5m2"].storage_dtype == "float8_e5m2"
    assert FORMATS["int8"].max_value == 127.0 and FORMATS["int8"].storage_dtype == "int8"
    assert all(fmt.itemsize == 1 for fmt in FORMATS.values())
    # fp8 pages are their bytes (vLLM's uint8 fp8 caches); int8 pages are int8
    assert [fmt.page_dtype for fmt in FORMATS.values()] == ["uint8", "uint8", "int8"]


@pytest.mark.parametrize("bad", ["fp16", "FP8", "e4m3", "", None])
def test_unknown_kv_cache_dtype_names_the_choices(bad):
    with pytest.raises(ValueError, match="kv_cache_dtype.*'auto', 'bfloat16', 'fp8', 'fp8_e4m3', 'fp8_e5m2', 'int8'"):
        get_kv_quant_format(bad)
    with pytest.raises(ValueError, match="fp8_e5m2"):
        attention_spec(2, 16, "float32", bad)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf"), "x", None])
def test_scale_must_be_positive_and_finite(bad):
    with pytest.raises(ValueError, match="k_scale=.*positive finite"):
        check_scale("k_scale", bad)
    assert check_scale("k_scale", "0.5") == 0.5


def test_engine_config_rejects_bad_quantization_arguments():
    from paged_jax.engine_config import EngineConfig

    with pytest.raises(ValueError, match="'fp8_e4m3', 'fp8_e5m2', 'int8'"):
        EngineConfig(kv_cache_dtype="float8")
    with pytest.raises(ValueError, match="per_token.*per_tensor"):
        EngineConfig(kv_cache_dtype="int8", kv_cache_scaling="per_block")
    with pytest.raises(ValueError, match="positive finite"):
        EngineConfig(kv_cache_dtype="int8", kv_cache_scaling="per_tensor", kv_scales=(1.0, 0.0))
    with pytest.raises(ValueError, match="positive finite"):
        EngineConfig(kv_cache_dtype="fp8", kv_cache_scaling="per_tensor", kv_scales=[(1.0, 2.0), (float("nan"), 1)])
    with pytest.raises(ValueError, match="per_tensor"):
        EngineConfig(kv_cache_dtype="fp8", kv_scales=(1.0, 1.0))  # per-token scaling has no static scales
    offsets = np.zeros((2, 2, 16), np.float32)
    with pytest.raises(ValueError, match="kv_key_offsets .*quantized pool.*'fp8'"):
        EngineConfig(kv_key_offsets=offsets)  # kv_cache_dtype="auto"
    with pytest.raises(ValueError, match=r"kv_key_offsets must be f32\[num_layers, num_kv_heads, head_dim\].*"
                                         "calibrate_key_offsets"):
        EngineConfig(kv_cache_dtype="int8", kv_key_offsets=offsets[0])
    with pytest.raises(ValueError, match="kv_key_offsets must be finite"):
        EngineConfig(kv_cache_dtype="int8", kv_key_offsets=np.where(offsets == 0, np.inf, offsets))
    config = EngineConfig(kv_cache_dtype="fp8", kv_key_offsets=offsets + 0.5)
    assert hash(config) == hash(EngineConfig(kv_cache_dtype="fp8", kv_key_offsets=(offsets + 0.5).tolist()))


def test_runner_rejects_key_offsets_of_another_shape():
    """The model's shape is known once it is loaded: the runner names it."""
    from paged_jax.kv_pool import static_key_offsets

    spec = attention_spec(2, 16, "float32", "fp8")
    assert static_key_offsets(spec, None, 3).shape == (3, 2, 16) and not np.any(static_key_offsets(spec, None, 3))
    with pytest.raises(ValueError, match=r"f32\[3, 2, 16\] \(\[num_layers, num_kv_heads, head_dim\]\), got shape "
                                         r"\(2, 2, 16\)"):
        static_key_offsets(spec, np.zeros((2, 2, 16)), 3)
    with pytest.raises(ValueError, match="need a quantized kv_cache_dtype"):
        static_key_offsets(attention_spec(2, 16, "float32"), np.zeros((3, 2, 16)), 3)


@pytest.mark.parametrize("head_dim", [64, 48])
def test_key_rotation_is_orthonormal_and_mixes_every_channel(head_dim):
    r = key_rotation(head_dim).astype(np.float64)
    np.testing.assert_allclose(r @ r.T, np.eye(head_dim), atol=1e-6)
    assert np.all(np.abs(r) > 0) if head_dim == 64 else np.mean(np.abs(r) > 1e-3) > 0.95
    if head_dim == 64:  # Hadamard: every entry +-1/8
        np.testing.assert_array_equal(np.abs(r), np.full((64, 64), 1 / 8))
    assert key_rotation(head_dim) is key_rotation(head_dim) and not key_rotation(head_dim).flags.writeable


# sizing

def test_bytes_per_token_reproduces_the_seed_llama3_70b_numbers():
    """Seed section 4.4: MHA-64 bf16 2.56 MB -> GQA-8 320 KB -> fp8 160 KB per token (KB = 1024 B),
    one 16-token block at tensor-parallel 8: 640 KB in bf16. Per-token scales add 2 x 4 bytes
    per KV head and layer."""
    kb = 1024
    gqa = LlamaConfig(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64,
                      num_kv_heads=8, head_dim=128, dtype="bfloat16")
    mha = LlamaConfig(**{**gqa.__dict__, "num_kv_heads": 64})
    assert kv_cache_bytes_per_token(mha, "auto") == 2560 * kb  # "2.56 MB"
    assert kv_cache_bytes_per_token(gqa, "auto") == 320 * kb
    assert kv_cache_bytes_per_token(gqa, "fp8", "per_tensor") == 160 * kb
    for name in ("fp8", "fp8_e5m2", "int8"):
        assert kv_cache_bytes_per_token(gqa, name) == 160 * kb + 80 * 8 * 2 * 4  # scales included
    tensor_parallel = 8
    assert kv_cache_bytes_per_token(gqa, "auto") * 16 // tensor_parallel == 640 * kb


def test_quantized_spec_layout_keeps_the_paged_invariant():
    spec = attention_spec(2, 16, "bfloat16", "fp8")
    assert spec == QuantizedAttentionSpec(2, 16, "bfloat16", "fp8_e4m3", "per_token")
    assert list(spec.page_arrays) == ["k", "v", "k_scale", "v_scale"]
    (cache,) = init_kv_caches([spec], 5, 16)
    assert [(a.shape, a.dtype.name) for a in cache] == [((5, 16, 2, 16), "uint8")] * 2 + [
        ((5, 16, 2), "float32")] * 2
    assert spec.bytes_per_token == sum(a.nbytes for a in cache) // (5 * 16) == 2 * 2 * 16 + 2 * 2 * 4
    per_tensor = attention_spec(2, 16, "float32", "int8", "per_tensor")
    assert [a.shape for a in per_tensor.allocate(5, 16)] == [(5, 16, 2, 16)] * 2
    assert attention_spec(2, 16, "float32") == FullAttentionSpec(2, 16, "float32")


# quantize on write

def heavy_tailed(rng, shape):
    """Normal values times a per-row magnitude spanning 1e-3..1e3 (scales matter), a few outliers."""
    x = rng.standard_normal(shape) * np.exp(rng.uniform(-7, 7, shape[:-1]))[..., None]
    x.reshape(-1)[rng.choice(x.size, 5, replace=False)] *= 50.0
    return x.astype(np.float32)


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_scale_search_rounds_without_a_conversion(name):
    """The search's rounding equals the format's conversion bit for bit (ties, subnormals,
    saturation), and its program converts nothing to fp8: XLA:GPU folds an f32 -> fp8 -> f32
    round trip away (SimplifyFPConversions), which left every candidate's error ~0 there."""
    fmt = FORMATS[name]
    finfo = ml_dtypes.finfo(fmt.storage_dtype)
    grid = np.arange(256, dtype=np.uint8).view(fmt.storage_dtype).astype(np.float32)
    grid = np.unique(grid[np.isfinite(grid)])
    midpoints = (grid[1:] + grid[:-1]) / 2  # ties: half to even
    rng = np.random.default_rng(0)
    y = np.concatenate([grid, midpoints, np.nextafter(midpoints, 0), np.nextafter(midpoints, np.inf),
                        rng.uniform(-1.2, 1.2, 4096) * float(finfo.max), [float(finfo.max) * 4, -1e30],
                        rng.standard_normal(1024) * float(finfo.smallest_subnormal) * 8]).astype(np.float32)
    x = jnp.asarray(y[None])
    one = jnp.ones((1,), jnp.float32)
    emulated = np.asarray(jax.jit(lambda x: _round_in_f32(x, one, fmt))(x))
    converted = quantize_numpy(y, fmt, np.float32(1)).astype(np.float32)
    np.testing.assert_array_equal(emulated[0], converted)
    hlo = jax.jit(lambda x, s: _least_error_scale(x, s, fmt)).lower(x, one).compile().as_text()
    # An fp8 type in the program (f8e4m3fn[...], f8e5m2[...]); not a bare "f8", which hex
    # hashes in the program's metadata contain.
    assert not re.search(r"f8e[45]m[23]", hlo), "the search converts to fp8, which XLA:GPU may fold away"


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_quantize_on_write_matches_numpy_and_the_format_error_bound(name):
    fmt = FORMATS[name]
    rng = np.random.default_rng(FORMAT_NAMES.index(name))
    num_blocks, block_size, num_kv_heads, head_dim = 6, 4, 2, 32
    k, v = heavy_tailed(rng, (9, num_kv_heads, head_dim)), heavy_tailed(rng, (9, num_kv_heads, head_dim))
    slots = rng.choice(np.arange(block_size, num_blocks * block_size), 9, replace=False).astype(np.int32)
    spec = attention_spec(num_kv_heads, head_dim, "float32", name)
    cache = tuple(jnp.asarray(rng.integers(0, 3, a.shape)).astype(a.dtype) for a in spec.allocate(num_blocks,
                                                                                                   block_size))
    k_pages, v_pages, k_scale, v_scale = (np.asarray(a) for a in write_kv_cache(
        jnp.asarray(k), jnp.asarray(v), *cache[:2], jnp.asarray(slots), *cache[2:], kv_cache_dtype=name))
    flat = lambda a: a.reshape(num_blocks * block_size, *a.shape[2:])  # noqa: E731

    # every other slot is untouched
    untouched = np.setdiff1d(np.arange(num_blocks * block_size), slots)
    for new, old in zip((k_pages, v_pages, k_scale, v_scale), cache):
        np.testing.assert_array_equal(flat(new)[untouched].astype(np.float32),
                                      flat(np.asarray(old))[untouched].astype(np.float32))
    for x, pages, scales in ((k, k_pages, k_scale), (v, v_pages, v_scale)):
        stored, scale = from_pages_numpy(flat(pages)[slots], fmt), flat(scales)[slots]
        assert_write_scales(x, scale, fmt)
        # bit for bit what numpy / ml_dtypes round to
        expected = quantize_numpy(x, fmt, scale[..., None])
        np.testing.assert_array_equal(stored.view(np.uint8), expected.view(np.uint8))
        # the error the format promises, per element
        deq = stored.astype(np.float64) * scale[..., None]
        err = np.abs(deq - x)
        if fmt.is_integer:  # half a step, the step being amax / 127
            assert np.all(err <= 0.5 * scale[..., None] * (1 + 1e-6))
        else:  # half an ulp relative in the normal range; half the subnormal step below it
            info = ml_dtypes.finfo(fmt.storage_dtype)
            normal = np.abs(x) >= float(info.smallest_normal) * scale[..., None]
            assert np.all(err[normal] <= fmt.relative_error * np.abs(x[normal]) * (1 + 1e-6))
            bound = 0.5 * float(info.smallest_subnormal) * np.broadcast_to(scale[..., None], x.shape)
            assert np.all(err[~normal] <= bound[~normal] * (1 + 1e-6))
        # and the bound is nearly reached: a looser rounding would show (int8: relative to the
        # row's amax; fp8: relative to each element in the normal range)
        rel = err / np.abs(x).max(axis=-1, keepdims=True) if fmt.is_integer else err[normal] / np.abs(x[normal])
        assert rel.max() > 0.5 * (fmt.relative_error if not fmt.is_integer else 0.5 / fmt.max_value)


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_large_values_saturate_instead_of_inf_or_nan(name):
    fmt = FORMATS[name]
    x = np.array([[[3e38, -3e38, 1e6, -1e6, 1.0, 0.0, -0.0, 1e-30]]], np.float32)  # [1 token, 1 head, 8]
    # a static scale of 1.0 (per tensor): everything past max_value saturates
    zeros = jnp.zeros((2, 2, 1, 8), fmt.page_dtype)
    k_pages, _ = write_kv_cache(jnp.asarray(x), jnp.asarray(x), zeros, zeros, jnp.array([2], jnp.int32),
                                tensor_scales=jnp.ones(2, jnp.float32), kv_cache_dtype=name)
    stored = from_pages_numpy(np.asarray(k_pages)[1, 0, 0], fmt).astype(np.float32)
    np.testing.assert_array_equal(stored[:4], [fmt.max_value, -fmt.max_value, fmt.max_value, -fmt.max_value])
    assert stored[4] == 1.0 and np.isfinite(stored).all()
    # per-token scales: 3e38 / max_value is a finite scale, and the row dequantizes finite
    pages, _, scale, _ = write_kv_cache(jnp.asarray(x), jnp.asarray(x), zeros, zeros, jnp.array([2], jnp.int32),
                                        jnp.zeros((2, 2, 1)), jnp.zeros((2, 2, 1)), kv_cache_dtype=name)
    deq = from_pages_numpy(np.asarray(pages)[1, 0, 0], fmt).astype(np.float64) * float(np.asarray(scale)[1, 0, 0])
    assert np.isfinite(deq).all() and abs(deq[0] - 3e38) <= 3e38 * max(fmt.relative_error, 0.5 / 127)
    # an all-zero row gets a tiny positive scale, not 0 (no 0 / 0)
    _, _, scale, _ = write_kv_cache(jnp.zeros((1, 1, 8)), jnp.zeros((1, 1, 8)), zeros, zeros,
                                    jnp.array([2], jnp.int32), jnp.zeros((2, 2, 1)), jnp.zeros((2, 2, 1)),
                                    kv_cache_dtype=name)
    assert np.asarray(scale)[1, 0, 0] > 0


# attention over quantized pages

def quantized_batch(rng, name, q_lens, seq_lens, **shape):
    """build_batch's hostile batch with its pages quantized per (token, KV head).

    Returns (batch with the dequantized float64 pages, for attention_f64; the stored pages
    and scales). Unowned slots: NaN pages (fp8) or garbage (int8), NaN scales either way.
    """
    fmt = FORMATS[name]
    q, k, v, *rest = build_batch(rng, q_lens, seq_lens, **shape)
    owned = np.isfinite(k[..., 0])  # [num_blocks, block_size, num_kv_heads]
    # magnitudes that differ per token and head, so a wrong scale index shows
    k = k * np.exp(rng.uniform(-1.5, 1.5, owned.shape))[..., None]
    v = v * np.exp(rng.uniform(-1.5, 1.5, owned.shape))[..., None]
    stored, deq = [], []
    for x in (k, v):
        scale = np.where(owned, per_token_scales(np.nan_to_num(x), fmt), np.nan).astype(np.float32)
        pages = quantize_numpy(np.nan_to_num(x), fmt, np.where(owned, scale, 1.0)[..., None])
        if not fmt.is_integer:
            pages = np.where(owned[..., None], pages, np.array(np.nan, pages.dtype))
        else:
            pages = np.where(owned[..., None], pages, rng.integers(-127, 128, pages.shape).astype(np.int8))
        stored += [to_pages_numpy(pages, fmt), scale]
        deq.append(pages.astype(np.float64) * scale[..., None].astype(np.float64))
    return (q, deq[0], deq[1], *rest), stored


def check_quantized(batch, stored, dtype, name, impls=("xla", "pallas")):
    q, _, _, block_tables, seq_lens, query_start_loc, num_seqs = batch
    k_pages, k_scale, v_pages, v_scale = stored
    expected = attention_f64(*batch)
    real = slice(0, int(query_start_loc[num_seqs]))
    args = (jnp.asarray(q, dtype), jnp.asarray(k_pages), jnp.asarray(v_pages), jnp.asarray(block_tables),
            jnp.asarray(seq_lens), jnp.asarray(query_start_loc), jnp.asarray(num_seqs))
    for impl in impls:
        out = run_impl(impl, *args, k_scale=jnp.asarray(k_scale), v_scale=jnp.asarray(v_scale), kv_cache_dtype=name)
        assert out.shape == q.shape and out.dtype == dtype
        out = np.asarray(out.astype(jnp.float32))
        assert np.isfinite(out).all(), f"{impl}: NaN pages or scales leaked into rows {np.where(~np.isfinite(out))[0]}"
        np.testing.assert_allclose(out[real], expected[real], **TOLERANCE[dtype], err_msg=f"{impl} vs float64")


QUANT_SHAPES = [  # (num_q_heads, num_kv_heads, head_dim, block_size, dtype)
    (8, 2, 64, 16, jnp.float32),  # GQA 4
    (8, 1, 32, 32, jnp.bfloat16),  # MQA, bf16 compute
]


# Every format on the XLA path, and the Pallas kernel (interpret mode: slow) on one format per shape.
KERNEL_CASES = [("fp8_e4m3", 0, ("xla", "pallas")), ("int8", 1, ("xla", "pallas")), ("fp8_e5m2", 0, ("xla",))]


@pytest.mark.parametrize("name, shape_index, impls", KERNEL_CASES,
                         ids=[f"{n}-{'GQA-bs16-f32' if i == 0 else 'MQA-bs32-bf16'}-{'+'.join(im)}"
                              for n, i, im in KERNEL_CASES])
def test_attention_over_quantized_pages_equals_float64_over_dequantized(name, shape_index, impls):
    shape = QUANT_SHAPES[shape_index]
    num_q_heads, num_kv_heads, head_dim, block_size, dtype = shape
    rng = np.random.default_rng(7 * FORMAT_NAMES.index(name) + QUANT_SHAPES.index(shape))
    bs = block_size
    # ragged and mixed: chunked prefill on a long cached context (several XLA chunks and kernel
    # tiles), decodes, a fresh prefill, a page edge
    q_lens, seq_lens = [bs + 3, 1, bs - 1, 1, 2], [9 * bs + 3, bs + 1, bs - 1, 1, bs]
    batch, stored = quantized_batch(rng, name, q_lens, seq_lens, num_q_heads=num_q_heads,
                                    num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
                                    dtype=dtype, num_tokens=2 * bs + 16, max_num_seqs=8,
                                    max_blocks_per_seq=cdiv(320, block_size))
    check_quantized(batch, stored, dtype, name, impls)


def test_scales_are_required_in_pairs_and_match_the_pages():
    args = (jnp.zeros((4, 2, 16)), jnp.zeros((3, 16, 1, 16), jnp.int8), jnp.zeros((3, 16, 1, 16), jnp.int8),
            jnp.zeros((2, 2), jnp.int32), jnp.zeros(2, jnp.int32), jnp.zeros(3, jnp.int32), jnp.int32(1))
    for impl in ("xla", "pallas"):
        with pytest.raises(ValueError, match="both k_scale and v_scale"):
            run_impl(impl, *args, k_scale=jnp.ones((3, 16, 1)), kv_cache_dtype="int8")
        with pytest.raises(ValueError, match=r"k_scale must be f32\[3, 16, 1\]"):
            run_impl(impl, *args, k_scale=jnp.ones((3, 16)), v_scale=jnp.ones((3, 16)), kv_cache_dtype="int8")
        with pytest.raises(ValueError, match="a fp8_e4m3 cache holds uint8 pages"):
            run_impl(impl, *args, kv_cache_dtype="fp8_e4m3")
        with pytest.raises(ValueError, match="must be None .* or one of"):
            run_impl(impl, *args, kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="apply to quantized caches"):
        run_impl("xla", args[0], jnp.zeros((3, 16, 1, 16)), jnp.zeros((3, 16, 1, 16)), *args[3:],
                 k_scale=jnp.ones((3, 16, 1)), v_scale=jnp.ones((3, 16, 1)))


@pytest.mark.parametrize("impl, scaling, name", [("pallas", "per_token", "fp8_e4m3"), ("xla", "per_token", "int8"),
                                                 ("xla", "per_tensor", "int8")])
def test_backend_writes_then_attends(impl, scaling, name):
    """The backend end to end (write, then attend) for one prefill and one decode sequence,
    with a key offset: the pages it leaves equal numpy's quantization of (k - offset) @ R (R
    the orthonormal key_rotation) and v, and its output equals float64 attention of the
    original queries over the keys those pages stand for, deq @ R^T + offset, and the
    dequantized values (per-tensor: with static scales 0.5 for K and 3.0 for V)."""
    rng = np.random.default_rng(11)
    num_q_heads, num_kv_heads, head_dim, block_size, num_blocks = 4, 2, 32, 16, 6
    fmt = FORMATS[name]
    spec = attention_spec(num_kv_heads, head_dim, "float32", name, scaling)
    backend = make_attention_backend(spec, impl, interpret=impl == "pallas")
    kv_scales = None if scaling == "per_token" else jnp.array([0.5, 3.0], jnp.float32)
    offset = (rng.standard_normal((num_kv_heads, head_dim)) * 6).astype(np.float32)
    rotation = key_rotation(head_dim).astype(np.float64)
    np.testing.assert_allclose(rotation @ rotation.T, np.eye(head_dim), atol=1e-6)
    # sequence 0 prefills 20 tokens into pages [3, 1]; sequence 1 decodes its 1st token in page 4
    slots = np.array([3 * 16 + i for i in range(16)] + [1 * 16 + i for i in range(4)] + [4 * 16], np.int32)
    num_tokens = 24
    q = rng.standard_normal((num_tokens, num_q_heads, head_dim)).astype(np.float32)
    k = (rng.standard_normal((num_tokens, num_kv_heads, head_dim)) * 4 + offset).astype(np.float32)
    v = (rng.standard_normal((num_tokens, num_kv_heads, head_dim)) * 4).astype(np.float32)
    md = AttentionMetadata(slot_mapping=jnp.asarray(np.concatenate([slots, np.zeros(3, np.int32)])),
                           block_tables=jnp.array([[3, 1], [4, 0]], jnp.int32), seq_lens=jnp.array([20, 1], jnp.int32),
                           query_start_loc=jnp.array([0, 20, 21], jnp.int32), num_seqs=jnp.full(1, 2, jnp.int32))
    cache = spec.allocate(num_blocks, block_size)
    call = backend.bind(kv_scales=kv_scales, key_offset=jnp.asarray(offset))
    out, cache = jax.jit(lambda *a: call(*a, sm_scale=head_dim ** -0.5))(q, k, v, cache, md)
    pages = [np.asarray(a).reshape(num_blocks * block_size, *a.shape[2:])[slots] for a in cache]
    stored_k = ((k[:21] - offset).astype(np.float64) @ rotation).astype(np.float32)
    if scaling == "per_token":
        k_scale, v_scale = pages[2][..., None], pages[3][..., None]
        assert_write_scales(stored_k, pages[2], fmt, rtol=2e-6)  # the rotation in f32 vs f64
        assert_write_scales(v[:21], pages[3], fmt)
    else:
        k_scale, v_scale = np.float32(0.5), np.float32(3.0)
    q_k, q_v = from_pages_numpy(pages[0], fmt), from_pages_numpy(pages[1], fmt)
    # (k - offset) @ R in f32 on the device and in f64 here: a value on a rounding boundary may
    # land one step away, nothing more
    steps = np.abs(q_k.astype(np.float64) - quantize_numpy(stored_k, fmt, k_scale).astype(np.float64))
    assert (steps > 0).sum() <= 2 and np.all(steps <= np.abs(q_k.astype(np.float64)) * 0.125 + 1), steps.max()
    np.testing.assert_array_equal(q_v, quantize_numpy(v[:21], fmt, v_scale))
    deq_k = (q_k * k_scale.astype(np.float64)) @ rotation.T + offset
    deq_v = q_v * v_scale.astype(np.float64)
    for rows, keys in ((slice(0, 20), slice(0, 20)), (slice(20, 21), slice(20, 21))):
        for t in range(rows.start, rows.stop):
            pos = t - rows.start
            for h in range(num_q_heads):
                kh = h // (num_q_heads // num_kv_heads)
                kk, vv = deq_k[keys][: pos + 1, kh], deq_v[keys][: pos + 1, kh]
                logits = kk @ q[t, h].astype(np.float64) / np.sqrt(head_dim)
                w = np.exp(logits - logits.max())
                np.testing.assert_allclose(np.asarray(out)[t, h], w @ vv / w.sum(), atol=2e-5, rtol=2e-5)
