"""Write this step's K/V into their slots of the paged caches.

The write is an XLA scatter over the caches viewed as [num_blocks * block_size, ...] (a
free reshape): with the caches donated to the enclosing jit, XLA updates them in place, so
a step costs num_tokens rows of traffic, not a cache-sized copy. A Pallas kernel would
need input_output_aliases for the same effect and gains nothing here.

Quantize-on-write: for a quantized cache (kv_cache_dtype names its format, see
paged_jax/core/kv_quant.py) the rows are quantized before the scatter: with per-token scales
(k_scale_cache / v_scale_cache, f32[num_blocks, block_size, num_kv_heads]) each (token, KV
head) row gets scale = amax / max_value, scattered beside it; without them one static scale
per tensor (tensor_scales) divides every row. An fp8 per-token scale is searched among
FP8_SCALE_STEPS multiples of amax / max_value for the least squared error of the row
(kv_quant.py). Values round to nearest and saturate at the format's max, so a large value
never turns into inf or NaN. fp8 rows are scattered as their
bytes into uint8 pages (kv_quant.py says why).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from paged_jax.core.kv_quant import FORMATS, FP8_SCALE_STEPS, MIN_SCALE


def get_format(kv_cache_dtype: str | None):
    """The KVQuantFormat of a canonical name ("fp8_e4m3", "fp8_e5m2", "int8"), None for None."""
    if kv_cache_dtype is None:
        return None
    if kv_cache_dtype not in FORMATS:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} must be None (a float cache) or one of {tuple(FORMATS)}")
    return FORMATS[kv_cache_dtype]


def pages_to_values(pages, fmt):
    """Page bytes (fmt.page_dtype) as the quantized values they hold (fmt.storage_dtype): a
    bitcast of what was loaded (a chunk or a tile, never the pool: XLA:CPU copies a bitcast)."""
    if pages.dtype == jnp.dtype(fmt.storage_dtype):
        return pages
    return jax.lax.bitcast_convert_type(pages, jnp.dtype(fmt.storage_dtype))


def values_to_pages(values, fmt):
    """Inverse of pages_to_values (this step's rows, before the scatter)."""
    if values.dtype == jnp.dtype(fmt.page_dtype):
        return values
    return jax.lax.bitcast_convert_type(values, jnp.dtype(fmt.page_dtype))


def quantize_rows(x, fmt, scale=None):
    """Quantize rows of x to fmt, round to nearest, saturated at fmt.max_value.

    Args:
      x: [..., head_dim], any float dtype.
      fmt: a paged_jax.core.kv_quant.KVQuantFormat.
      scale: None for one scale per row (amax over head_dim / max_value; for fp8 the
        FP8_SCALE_STEPS multiple of it with the least squared error, as
        kv_quant.per_token_scale_numpy), else a static scale broadcastable to x[..., 0] (a
        per-tensor scale: a scalar).
    Returns:
      (x quantized, [..., head_dim] in fmt.storage_dtype; f32[...] the scale of each row).
    """
    x32 = x.astype(jnp.float32)
    if scale is None:
        scale = jnp.maximum(jnp.max(jnp.abs(x32), axis=-1) / fmt.max_value, MIN_SCALE)
        if not fmt.is_integer:
            scale = _least_error_scale(x32, scale, fmt)
    scale = jnp.broadcast_to(jnp.asarray(scale, jnp.float32), x.shape[:-1])
    return _round(x32, scale, fmt), scale


def _round(x32, scale, fmt):
    """x32 / scale (per row) rounded to fmt, saturated at fmt.max_value."""
    y = jnp.clip(x32 / scale[..., None], -fmt.max_value, fmt.max_value)
    if fmt.is_integer:
        y = jnp.round(y)  # half to even, as np.rint
    return y.astype(fmt.storage_dtype)


def _round_in_f32(x32, scale, fmt):
    """What _round(x32, scale, fmt).astype(f32) is, computed without a float conversion.

    XLA:GPU may drop an f32 -> fp8 -> f32 round trip (SimplifyFPConversions, under its default
    xla_allow_excess_precision), so a search that compares rounding errors cannot rely on one:
    there every candidate's error came out ~0 and the argmin was noise. Rounding to nearest
    even on the format's grid is exact in f32: the grid step at y is 2**(e - nmant) with e =
    max(floor(log2|y|), minexp), and scaling by a power of two loses nothing.
    """
    finfo = jnp.finfo(fmt.storage_dtype)
    y = jnp.clip(x32 / scale[..., None], -fmt.max_value, fmt.max_value)
    _, exponent = jnp.frexp(y)  # y = m * 2**exponent, 0.5 <= |m| < 1
    step = jnp.ldexp(jnp.float32(1), jnp.maximum(exponent - 1, finfo.minexp) - finfo.nmant)
    return jnp.round(y / step) * step  # half to even, as the conversion


def _least_error_scale(x32, base, fmt):
    """Of the scales base * FP8_SCALE_STEPS, each row's with the least squared rounding error
    (the first on a tie), as kv_quant.per_token_scale_numpy. Errors are measured in units of
    base, so a huge row cannot overflow them."""
    steps = jnp.asarray(FP8_SCALE_STEPS)
    candidates = base[..., None] * steps  # [..., steps]
    rounded = _round_in_f32(x32[..., None, :], candidates, fmt)  # [..., steps, head_dim]
    errors = jnp.sum((rounded * steps[:, None] - (x32 / base[..., None])[..., None, :]) ** 2, axis=-1)
    return jnp.take_along_axis(candidates, jnp.argmin(errors, axis=-1)[..., None], axis=-1)[..., 0]


def dequantize_pages(pages, scale=None, fmt=None):
    """f32 value of quantized values or (with fmt) page bytes: pages * scale (scale
    [..., num_kv_heads] per token, or a scalar). For tests and references: the attention paths
    never build this for the pool."""
    out = (pages if fmt is None else pages_to_values(pages, fmt)).astype(jnp.float32)
    if scale is None:
        return out
    scale = jnp.asarray(scale, jnp.float32)
    return out * (scale[..., None] if scale.ndim else scale)


def _check_args(k, v, k_cache, v_cache, slot_mapping, fmt=None):
    """Trace-time checks of user input: a ValueError that names the fix."""
    if k_cache.ndim != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], "
                         f"got {k_cache.shape=} and {v_cache.shape=}")
    num_kv_heads, head_dim = k_cache.shape[2:]
    if k.ndim != 3 or k.shape != v.shape or k.shape[1:] != (num_kv_heads, head_dim):
        raise ValueError(f"k and v must both be [num_tokens, {num_kv_heads}, {head_dim}] to match the cache, "
                         f"got {k.shape=} and {v.shape=}")
    if fmt is not None:
        if k_cache.dtype != jnp.dtype(fmt.page_dtype) or v_cache.dtype != k_cache.dtype:
            raise ValueError(f"a {fmt.name} cache holds {fmt.page_dtype} pages, got {k_cache.dtype}/{v_cache.dtype}; "
                             "allocate it from its QuantizedAttentionSpec")
        if not (jnp.issubdtype(k.dtype, jnp.floating) and jnp.issubdtype(v.dtype, jnp.floating)):
            raise ValueError(f"k/v must be float to quantize into a {fmt.name} cache, got {k.dtype}/{v.dtype}")
    elif k.dtype != k_cache.dtype or v.dtype != v_cache.dtype:
        raise ValueError(f"k/v dtypes {k.dtype}/{v.dtype} must equal the cache dtypes "
                         f"{k_cache.dtype}/{v_cache.dtype}; cast k and v before writing")
    if slot_mapping.dtype != jnp.int32 or slot_mapping.shape != (k.shape[0],):
        raise ValueError(f"slot_mapping must be i32[{k.shape[0]}] (one slot per token), "
                         f"got {slot_mapping.dtype}{slot_mapping.shape}")


def _check_scale_args(k_cache, k_scale_cache, v_scale_cache, tensor_scales, fmt):
    per_token = k_scale_cache is not None or v_scale_cache is not None
    if fmt is None and (per_token or tensor_scales is not None):
        raise ValueError(f"scales apply to quantized caches only (kv_cache_dtype int8 / fp8_*), got a "
                         f"{k_cache.dtype} cache and {fmt=}")
    if per_token:
        shape = k_cache.shape[:3]
        for name, arr in (("k_scale_cache", k_scale_cache), ("v_scale_cache", v_scale_cache)):
            if arr is None or arr.shape != shape or arr.dtype != jnp.float32:
                raise ValueError(f"{name} must be f32{list(shape)} ([num_blocks, block_size, num_kv_heads]) when "
                                 f"per-token scales are used, got {None if arr is None else (arr.dtype, arr.shape)}")
        if tensor_scales is not None:
            raise ValueError("give per-token scale caches or tensor_scales, not both")
    elif tensor_scales is not None and jnp.shape(tensor_scales) != (2,):
        raise ValueError(f"tensor_scales must be f32[2] (k_scale, v_scale), got shape {jnp.shape(tensor_scales)}")


@functools.partial(jax.jit, static_argnames=("kv_cache_dtype",))
def write_kv_cache(k, v, k_cache, v_cache, slot_mapping, k_scale_cache=None, v_scale_cache=None, *,
                   tensor_scales=None, kv_cache_dtype=None):
    """Store k[t], v[t] at slot slot_mapping[t] of the caches, quantized if the caches are.

    Args:
      k, v: [num_tokens, num_kv_heads, head_dim].
      k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]. Updated in place when
        the caller's jit donates them (the engine step does); called on its own, this returns
        new arrays and leaves the inputs alive (wrap it in jax.jit(..., donate_argnums=(2, 3))
        to update in place).
      slot_mapping: i32[num_tokens]; slot s is page s // block_size, row s % block_size.
        Padded tokens point into the null page 0 (never -1); which padded write wins there
        is unspecified, and nothing reads the null page unmasked.

      k_scale_cache, v_scale_cache: f32[num_blocks, block_size, num_kv_heads], only with a
        quantized cache: per-token scales, written beside the rows (and donated like them).
      tensor_scales: f32[2], the static (k_scale, v_scale) of a quantized cache without
        per-token scales (None: 1.0).
      kv_cache_dtype: None for a float cache (k, v in its dtype), or the format of a quantized
        one ("fp8_e4m3", "fp8_e5m2": uint8 pages holding fp8 bits; "int8"), static.

    Returns:
      (k_cache, v_cache), or (k_cache, v_cache, k_scale_cache, v_scale_cache) with per-token
      scales, with the addressed slots overwritten and every other slot unchanged.
    """
    fmt = get_format(kv_cache_dtype)
    _check_args(k, v, k_cache, v_cache, slot_mapping, fmt)
    _check_scale_args(k_cache, k_scale_cache, v_scale_cache, tensor_scales, fmt)
    num_slots = k_cache.shape[0] * k_cache.shape[1]

    def scatter(cache, new):
        flat = cache.reshape(num_slots, *cache.shape[2:])
        # Out-of-range slots are dropped rather than clamped onto a live slot.
        return flat.at[slot_mapping].set(new, mode="drop").reshape(cache.shape)

    if fmt is None:
        return scatter(k_cache, k), scatter(v_cache, v)
    if k_scale_cache is None:
        scales = jnp.ones(2, jnp.float32) if tensor_scales is None else tensor_scales
        (k_q, _), (v_q, _) = quantize_rows(k, fmt, scales[0]), quantize_rows(v, fmt, scales[1])
        return scatter(k_cache, values_to_pages(k_q, fmt)), scatter(v_cache, values_to_pages(v_q, fmt))
    (k_q, k_s), (v_q, v_s) = quantize_rows(k, fmt), quantize_rows(v, fmt)
    return (scatter(k_cache, values_to_pages(k_q, fmt)), scatter(v_cache, values_to_pages(v_q, fmt)),
            scatter(k_scale_cache, k_s), scatter(v_scale_cache, v_s))


def write_kv_cache_reference(k, v, k_cache, v_cache, slot_mapping):
    """Same contract as `write_kv_cache`, written as a one-hot select (no scatter).

    For padded tokens that share a slot the last one wins, one of the outcomes that
    `write_kv_cache` allows.
    """
    _check_args(k, v, k_cache, v_cache, slot_mapping)
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    hits = slot_mapping[:, None] == jnp.arange(num_slots)[None, :]  # [T, num_slots]
    written = hits.any(axis=0)
    # The last token addressing a slot wins.
    last_token = (k.shape[0] - 1) - jnp.argmax(hits[::-1], axis=0)

    def select(cache, new):
        flat = cache.reshape(num_slots, *cache.shape[2:])
        return jnp.where(written[:, None, None], new[last_token], flat).reshape(cache.shape)

    return select(k_cache, k), select(v_cache, v)
