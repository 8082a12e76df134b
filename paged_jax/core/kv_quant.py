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
inf or NaN. An fp8 per-token scale is the one of FP8_SCALE_STEPS candidates, amax / max_value
times 2**(j/8), that leaves the row the least squared error: with 3 mantissa bits the grid
falls differently on the row's values for each, and no candidate saturates.

Keys are stored centered and rotated: a quantized pool holds (k - key_offset) @ R for each
(token, KV head), R = key_rotation(head_dim) orthonormal and key_offset one f32[num_kv_heads,
head_dim] per layer (zeros unless calibrated, paged_jax/kv_calibration.py), and attention
reads it with q @ R. q.k and the softmax are unchanged (q.(k - m) differs from q.k by q.m, the
same for every key a query sees), but the rotation spreads a key's outlier channels over all of
them and the offset removes the large component every key shares, so the error of one byte
per element costs the logits less (the seed warns that softmax is most sensitive to the keys).
Values are stored as they are.

Pages hold fp8 values as their bit patterns in uint8 (page_dtype), as vLLM's fp8 caches do:
page operations (the write's scatter, the attention's gather, offload copies) then move
plain bytes on every backend (XLA:CPU converted whole fp8 arrays around a scatter or gather),
and the kernels reinterpret a tile as fp8 once it is loaded.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import ml_dtypes
import numpy as np

# "auto" and "bfloat16" are unquantized: the model's dtype, or bf16 pages under any compute
# dtype (half an f32 model's KV bytes; attention reads bf16 queries, AttentionBackend.forward).
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "int8")
UNQUANTIZED_KV_CACHE_DTYPES = ("auto", "bfloat16")
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
    """The format a kv_cache_dtype names; None for the unquantized "auto" (the model's dtype)
    and "bfloat16".

    Raises:
      ValueError: an unknown name (the message lists the choices).
    """
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is not one of {KV_CACHE_DTYPES} "
                         "('auto' keeps the model's dtype, 'fp8' means fp8_e4m3)")
    if kv_cache_dtype in UNQUANTIZED_KV_CACHE_DTYPES:
        return None
    return FORMATS[_ALIASES.get(kv_cache_dtype, kv_cache_dtype)]


# Multipliers of amax / max_value an fp8 per-token scale is chosen among (the first is the
# plain amax scale; all are >= 1, so no candidate saturates the row's largest element).
FP8_SCALE_STEPS = (2.0 ** (np.arange(8) / 8)).astype(np.float32)


@functools.cache
def key_rotation(head_dim: int) -> np.ndarray:
    """The orthonormal f32[head_dim, head_dim] R a quantized pool stores its keys rotated by.

    The Sylvester-Hadamard matrix / sqrt(head_dim) when head_dim is a power of two (every
    entry +-1/sqrt(head_dim): each rotated channel is an even mix of all of them); else the
    orthonormal factor of a fixed-seed Gaussian matrix. A pure function of head_dim, so every
    process and tier that reads a page agrees on it. Read-only.
    """
    if head_dim & (head_dim - 1) == 0:
        h = np.ones((1, 1))
        while h.shape[0] < head_dim:
            h = np.block([[h, h], [h, -h]])
        r = h / np.sqrt(head_dim)
    else:
        q, upper = np.linalg.qr(np.random.default_rng(0).standard_normal((head_dim, head_dim)))
        r = q * np.sign(np.diag(upper))
    r = r.astype(np.float32)
    r.setflags(write=False)
    return r


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


def check_key_offsets(key_offsets, shape: tuple[int, ...] | None = None) -> np.ndarray:
    """kv_key_offsets as a read-only float32 array: 3-D ([num_layers, num_kv_heads, head_dim],
    exactly `shape` when given) and finite, else ValueError."""
    try:
        offsets = np.array(key_offsets, np.float32)
    except (TypeError, ValueError):
        offsets = np.full(1, np.nan, np.float32)
    want = "[num_layers, num_kv_heads, head_dim]"
    if shape is not None:
        want = f"{list(shape)} ({want})"
    if offsets.ndim != 3 or (shape is not None and offsets.shape != tuple(shape)):
        raise ValueError(f"kv_key_offsets must be f32{want}, got shape {offsets.shape}; "
                         "paged_jax.kv_calibration.calibrate_key_offsets(model, prompts) computes them")
    if not np.isfinite(offsets).all():
        raise ValueError("kv_key_offsets must be finite (mean keys of each layer; calibrate_key_offsets computes them)")
    offsets.setflags(write=False)
    return offsets


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
    """The per-token scale rule on the host, as the device's quantize-on-write computes it:
    amax over the last axis / max_value, at least MIN_SCALE (float32); for fp8, times the
    FP8_SCALE_STEPS multiplier whose rounding leaves the row the least squared error (the
    first on a tie).

    Args:
      x: float array [..., head_dim].
    Returns:
      f32[...] (x's shape without its last axis).
    """
    x = np.asarray(x, np.float32)
    base = np.maximum(np.max(np.abs(x), axis=-1) / np.float32(fmt.max_value), np.float32(MIN_SCALE))
    base = base.astype(np.float32)
    if fmt.is_integer:
        return base
    units = x / base[..., None]  # errors in units of base: a huge row cannot overflow them
    candidates = base[..., None] * FP8_SCALE_STEPS  # [..., steps]
    errors = np.stack([np.sum((quantize_numpy(x, fmt, candidates[..., j, None]).astype(np.float32) * step - units) ** 2,
                              axis=-1) for j, step in enumerate(FP8_SCALE_STEPS)], axis=-1)
    return np.take_along_axis(candidates, np.argmin(errors, axis=-1)[..., None], axis=-1)[..., 0]


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


def save_kv_calibration(path: str, key_offsets, kv_scales=None, kv_cache_dtype: str | None = None) -> None:
    """Write a calibration (`paged-jax calibrate-kv`) as an .npz: key_offsets
    f32[num_layers, num_kv_heads, head_dim]; with per-tensor scales, kv_scales f32[num_layers, 2]
    and the kv_cache_dtype they were computed for (their range is that format's)."""
    arrays = {"key_offsets": check_key_offsets(key_offsets)}
    if kv_scales is not None:
        fmt = get_kv_quant_format(kv_cache_dtype or "auto")
        if fmt is None:
            raise ValueError("kv_scales are computed for a format: give kv_cache_dtype ('fp8', 'fp8_e5m2' or 'int8')")
        arrays |= {"kv_scales": np.asarray(kv_scales, np.float32), "kv_cache_dtype": np.array(fmt.name)}
    with open(path, "wb") as f:
        np.savez(f, **arrays)


def load_kv_calibration(path: str, kv_cache_dtype: str, kv_cache_scaling: str) -> dict:
    """The EngineConfig fields a calibration file sets for this cache: kv_key_offsets, and
    kv_scales when the pool is scaled per tensor (the file must hold scales of the same format).

    Raises:
      ValueError: unreadable file, not a calibration, or scales missing / of another format.
    """
    fmt = get_kv_quant_format(kv_cache_dtype)
    if fmt is None:
        raise ValueError(f"--kv-calibration {path}: a calibration applies to a quantized pool; set --kv-cache-dtype "
                         "to fp8, fp8_e5m2 or int8")
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {name: data[name] for name in data.files}
    except (OSError, ValueError) as error:
        raise ValueError(f"--kv-calibration {path}: not a readable .npz ({error}); write one with "
                         "`paged-jax calibrate-kv`") from error
    if "key_offsets" not in arrays:
        raise ValueError(f"--kv-calibration {path} holds no key_offsets; write it with `paged-jax calibrate-kv`")
    out = {"kv_key_offsets": check_key_offsets(arrays["key_offsets"])}
    if kv_cache_scaling == "per_tensor":
        stored = str(arrays["kv_cache_dtype"]) if "kv_cache_dtype" in arrays else None
        if "kv_scales" not in arrays or stored != fmt.name:
            raise ValueError(f"--kv-calibration {path} holds no per-tensor scales for {fmt.name} (it has "
                             f"{stored or 'none'}); run `paged-jax calibrate-kv --kv-cache-dtype {fmt.name} "
                             "--kv-cache-scaling per_tensor`")
        out["kv_scales"] = tuple(map(tuple, arrays["kv_scales"].tolist()))
    return out
