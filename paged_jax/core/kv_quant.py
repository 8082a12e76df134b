"""KV-cache quantization formats: names, storage dtypes, ranges and the rounding rule (jax-free).

One byte per element, as vLLM's `kv_cache_dtype` stores it. The device side (the quantized
cache spec in models/kv_cache_spec.py, quantize-on-write in pallas_kernels/kv_cache_write.py)
and the host side (an offload tier copying pages) read their formats from here, so the two
can never disagree on what a page holds.

A stored value q and its scale s stand for q * s. Scales are float32:
- "per_token" (the default): one scale per (token, KV head), amax over head_dim / max_value,
  stored beside the pages in the same paged layout (models/kv_cache_spec.py).
- "per_tensor": one static scale per layer for K and one for V (vLLM's k_scale / v_scale),
  1.0 unless given or calibrated; the pages hold no scales.
Writes round to nearest and saturate at +-max_value, so a large finite value never becomes
inf or NaN.

Pages hold fp8 values as their bit patterns in uint8 (page_dtype), as vLLM's fp8 caches do:
page operations (the write's scatter, the attention's gather, offload copies) then move
plain bytes on every backend (XLA:CPU converted whole fp8 arrays around a scatter or gather),
and the kernels reinterpret a tile as fp8 once it is loaded.
"""

from __future__ import annotations

import dataclasses
import math

import ml_dtypes
import numpy as np

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8")
KV_CACHE_SCALINGS = ("per_token", "per_tensor")
SCALE_DTYPE = "float32"
# A token whose K (or V) row is all zeros gets this scale rather than 0, so that q * s stays
# 0 and the division never sees 0 / 0.
MIN_SCALE = float(np.finfo(np.float32).tiny)


@dataclasses.dataclass(frozen=True)
class KVQuantFormat:
    """One stored format.

    Attributes:
      name: the canonical kv_cache_dtype ("fp8_e4m3", "fp8_e5m2", "int8").
      storage_dtype: numpy/ml_dtypes name of the element type (float8_e4m3fn, float8_e5m2, int8).
      page_dtype: the dtype of the pool's page arrays: uint8 holding the fp8 bits, or int8.
      max_value: the largest finite magnitude stored; writes saturate there.
      is_integer: int8 rounds to integers (round half to even); fp8 rounds to the format.
      relative_error: the worst relative error of one element with a per-token scale, as a
        fraction of the row's amax (int8: half a step of amax/127; fp8: half an ulp of the
        mantissa, 2**-(mantissa_bits + 1), for values in the normal range).
    """

    name: str
    storage_dtype: str
    page_dtype: str
    max_value: float
    is_integer: bool
    relative_error: float

    @property
    def itemsize(self) -> int:
        return np.dtype(self.storage_dtype).itemsize


def _fp8(name: str, dtype) -> KVQuantFormat:
    info = ml_dtypes.finfo(dtype)
    return KVQuantFormat(name, np.dtype(dtype).name, "uint8", float(info.max), False, 2.0 ** -(info.nmant + 1))


FORMATS = {
    "fp8_e4m3": _fp8("fp8_e4m3", ml_dtypes.float8_e4m3fn),
    "fp8_e5m2": _fp8("fp8_e5m2", ml_dtypes.float8_e5m2),
    "int8": KVQuantFormat("int8", "int8", "int8", 127.0, True, 0.5 / 127.0),
}
_ALIASES = {"fp8": "fp8_e4m3"}


def get_kv_quant_format(kv_cache_dtype: str) -> KVQuantFormat | None:
    """The format a kv_cache_dtype names; None for "auto" (the model's dtype, unquantized).

    Raises:
      ValueError: an unknown name (the message lists the choices).
    """
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is not one of {KV_CACHE_DTYPES} "
                         "('auto' keeps the model's dtype, 'fp8' means fp8_e4m3)")
    if kv_cache_dtype == "auto":
        return None
    return FORMATS[_ALIASES.get(kv_cache_dtype, kv_cache_dtype)]


def check_kv_cache_scaling(kv_cache_scaling: str) -> None:
    if kv_cache_scaling not in KV_CACHE_SCALINGS:
        raise ValueError(f"kv_cache_scaling={kv_cache_scaling!r} is not one of {KV_CACHE_SCALINGS}")


def check_scale(name: str, value) -> float:
    """A static K or V scale: a positive finite float, else ValueError."""
    try:
        scale = float(value)
    except (TypeError, ValueError):
        scale = math.nan
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"{name}={value!r} must be a positive finite float (a per-tensor K/V scale; "
                         "1.0 means none, calibrate_kv_scales computes one)")
    return scale


def quantize_numpy(x, fmt: KVQuantFormat, scale):
    """Reference rounding on the host: x / scale to the stored dtype, saturated (no NaN or inf).

    Args:
      x: float array; scale: broadcastable to x (float32).
    Returns:
      x's shape in fmt.storage_dtype.
    """
    y = np.clip(np.asarray(x, np.float32) / np.asarray(scale, np.float32), -fmt.max_value, fmt.max_value)
    if fmt.is_integer:
        y = np.rint(y)
    return y.astype(fmt.storage_dtype)


def per_token_scale_numpy(x, fmt: KVQuantFormat):
    """The per-token scale rule on the host: amax over the last axis / max_value, at least
    MIN_SCALE (float32), as the device's quantize-on-write computes it.

    Args:
      x: float array [..., head_dim].
    Returns:
      f32[...] (x's shape without its last axis).
    """
    amax = np.max(np.abs(np.asarray(x, np.float32)), axis=-1)
    return np.maximum(amax / np.float32(fmt.max_value), np.float32(MIN_SCALE)).astype(np.float32)


def to_pages_numpy(q, fmt: KVQuantFormat):
    """Quantized values (fmt.storage_dtype) as page bytes (fmt.page_dtype): a view, no copy."""
    return np.asarray(q).view(fmt.page_dtype)


def from_pages_numpy(pages, fmt: KVQuantFormat):
    """Page bytes as the quantized values they hold: a view, no copy."""
    return np.asarray(pages).view(fmt.storage_dtype)


def dequantize_numpy(q, scale, fmt: KVQuantFormat | None = None):
    """q * scale in float32 (the value a quantized page stands for); q may be page bytes if fmt is given."""
    if fmt is not None:
        q = from_pages_numpy(q, fmt)
    return np.asarray(q).astype(np.float32) * np.asarray(scale, np.float32)
