"""x @ W^T with W kept in a compact block format and dequantized inside the matmul.

Formats (one row of W = the K inputs of one output, stored as GGUF stores it, bytes unchanged):

| format | block | bytes | element                                        |
|---|---|---|---|
| q8_0   | 32    | 34    | f16 d, int8 q[32]: d * q                        |
| q4_1   | 32    | 20    | f16 d, f16 m, u8 qs[16]: d * q + m, q[j] = qs[j] & 15, q[j+16] = qs[j] >> 4 |
| bf16   | 1     | 2     | bfloat16                                        |

On a CPU the matmul is a native kernel (quant_matmul.cc, an XLA FFI custom call compiled with
the machine's compiler on first use and cached under ~/.cache/paged-jax/native): it reads
each weight row's blocks once per four rows of x and never writes a dequantized copy, so a
decode step reads the format's bytes, not f32's. XLA:CPU has no such kernel of its own: a
bf16 or int8 dot runs as a naive loop, ~8x slower than the f32 dot, and a fused
convert-multiply-reduce reaches ~5 G elements/s (docs/BENCHMARKS.md section 18).

Elsewhere (a GPU, a CPU without a C++ compiler, PAGED_JAX_NATIVE_KERNELS=0) and for many rows
at once (prefill, where the matmul is compute-bound and XLA's dot is faster), the weight is
dequantized by XLA (`dequantize`, one matrix's f32 temporary) and multiplied by its dot.

Both are exact: activations stay f32, every element is the dequantized f32 value, so the
result is the f32 matmul of the dequantized weight up to summation order.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import subprocess
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["NATIVE_MAX_ROWS", "WEIGHT_FORMATS", "dequantize", "dequantize_reference", "native_available",
           "pack", "quant_matmul", "quant_matmul_reference", "row_bytes"]

logger = logging.getLogger(__name__)

# format -> (elements per block, bytes per block)
WEIGHT_FORMATS = {"q8_0": (32, 34), "q4_1": (32, 20), "bf16": (1, 2)}
# Rows of x up to which the native kernel runs; above it the matmul is compute-bound and XLA's
# f32 dot of the dequantized weight is faster (docs/BENCHMARKS.md section 18).
NATIVE_MAX_ROWS = 1 << 30
_SOURCE = os.path.join(os.path.dirname(__file__), "quant_matmul.cc")
_DISABLE_ENV = "PAGED_JAX_NATIVE_KERNELS"


def row_bytes(fmt: str, k: int) -> int:
    """Bytes of one weight row of k elements in fmt."""
    block, nbytes = _format(fmt)
    if k % block:
        raise ValueError(f"{fmt} rows hold multiples of {block} elements; got k={k}: keep this weight in float32")
    return k // block * nbytes


def _format(fmt: str) -> tuple[int, int]:
    if fmt not in WEIGHT_FORMATS:
        raise ValueError(f"weight format {fmt!r} is not one of {sorted(WEIGHT_FORMATS)}")
    return WEIGHT_FORMATS[fmt]


def pack(w, fmt: str) -> np.ndarray:
    """u8[N, row_bytes(fmt, K)] of an f32[N, K] weight, quantized by gguf.quants (llama.cpp's
    own rounding) for q8_0 / q4_1, rounded to nearest even for bf16."""
    import gguf

    w = np.ascontiguousarray(np.asarray(w, np.float32))
    row_bytes(fmt, w.shape[-1])
    qtype = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_1": gguf.GGMLQuantizationType.Q4_1,
             "bf16": gguf.GGMLQuantizationType.BF16}[fmt]
    return np.ascontiguousarray(gguf.quants.quantize(w, qtype)).view(np.uint8).reshape(w.shape[0], -1)


def dequantize_reference(data, fmt: str, k: int) -> np.ndarray:
    """f32[N, k] of packed u8[N, row_bytes] rows, in numpy (the tests' independent reference)."""
    data = np.asarray(data, np.uint8)
    block, nbytes = _format(fmt)
    n = data.shape[0]
    if fmt == "bf16":
        return (data.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(n, k)
    blocks = data.reshape(n, k // block, nbytes)
    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)  # [N, B, 1]
    if fmt == "q8_0":
        q = blocks[..., 2:].view(np.int8).astype(np.float32)
        return (d * q).reshape(n, k)
    m = blocks[..., 2:4].copy().view(np.float16).astype(np.float32)
    qs = blocks[..., 4:]
    q = np.concatenate([qs & 15, qs >> 4], axis=-1).astype(np.float32)
    return (d * q + m).reshape(n, k)


def _f16(two_bytes):
    """f32 of little-endian f16 bytes u8[..., 2]."""
    return jax.lax.bitcast_convert_type(two_bytes, jnp.float16).astype(jnp.float32)


def dequantize(data, fmt: str, k: int):
    """f32[..., k] of packed u8[..., row_bytes] rows, in XLA (fuses into its consumer)."""
    block, nbytes = _format(fmt)
    lead = data.shape[:-1]
    if fmt == "bf16":
        pairs = data.reshape(*lead, k, 2)
        return jax.lax.bitcast_convert_type(pairs, jnp.bfloat16).astype(jnp.float32)
    blocks = data.reshape(*lead, k // block, nbytes)
    d = _f16(blocks[..., 0:2])[..., None]
    if fmt == "q8_0":
        q = jax.lax.bitcast_convert_type(blocks[..., 2:], jnp.int8).astype(jnp.float32)
        return (d * q).reshape(*lead, k)
    m = _f16(blocks[..., 2:4])[..., None]
    qs = blocks[..., 4:]
    q = jnp.concatenate([qs & 15, qs >> 4], axis=-1).astype(jnp.float32)
    return (d * q + m).reshape(*lead, k)


def _build_flags() -> list[str]:
    return ["-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-w", f"-I{jax.ffi.include_dir()}"]


def _cpu_signature() -> str:
    # -march=native builds for this CPU: a cache shared by machines must not mix their builds.
    try:
        with open("/proc/cpuinfo") as fh:
            return next((line for line in fh if line.startswith("flags")), platform.processor())
    except OSError:
        return platform.processor()


@functools.lru_cache(maxsize=None)
def native_available() -> bool:
    """Whether the native CPU kernel is built (or cached) and registered with XLA."""
    if os.environ.get(_DISABLE_ENV, "1") == "0" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    cxx = os.environ.get("CXX", "g++")
    with open(_SOURCE, "rb") as fh:
        source = fh.read()
    key = hashlib.sha256(b"\0".join([source, " ".join([cxx, *_build_flags()]).encode(),
                                     jax.__version__.encode(), _cpu_signature().encode()])).hexdigest()[:16]
    cache_dir = os.path.join(os.path.expanduser(os.environ.get("PAGED_JAX_CACHE", "~/.cache/paged-jax")), "native")
    path = os.path.join(cache_dir, f"quant_matmul-{key}.so")
    if not os.path.exists(path):
        os.makedirs(cache_dir, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache_dir)
        os.close(fd)
        try:
            subprocess.run([cxx, *_build_flags(), _SOURCE, "-o", tmp], check=True, capture_output=True, timeout=300)
            os.replace(tmp, path)  # atomic: processes building at once each install a whole file
        except (OSError, subprocess.SubprocessError) as error:
            os.unlink(tmp)
            detail = getattr(error, "stderr", b"") or b""
            logger.warning("native CPU matmul kernel not built (%s %s); compact weights dequantize in XLA, "
                           "slower", error, detail.decode(errors="replace")[-500:])
            return False
    library = ctypes.cdll.LoadLibrary(path)
    for fmt in WEIGHT_FORMATS:
        jax.ffi.register_ffi_target(f"pj_quant_matmul_{fmt}", jax.ffi.pycapsule(getattr(library, f"pj_quant_matmul_{fmt}")),
                                    platform="cpu")
    return True


def _xla_matmul(x, data, fmt: str):
    w = dequantize(data, fmt, x.shape[-1])  # [N, K]
    return jnp.einsum("MK,NK->MN", x, w, preferred_element_type=jnp.float32)


def _native_matmul(x, data, fmt: str):
    out = jax.ShapeDtypeStruct((x.shape[0], data.shape[0]), jnp.float32)
    return jax.ffi.ffi_call(f"pj_quant_matmul_{fmt}", out)(x, data)


def quant_matmul(x, data, fmt: str):
    """x @ W^T for W packed in fmt.

    Args:
      x: f32[M, K] (other float dtypes are cast to f32).
      data: u8[N, row_bytes(fmt, K)], the packed rows of W [N, K].
      fmt: a WEIGHT_FORMATS key.
    Returns:
      f32[M, N].
    Raises:
      ValueError when data's row bytes do not match K in fmt.
    """
    if x.ndim != 2 or data.ndim != 2:
        raise ValueError(f"quant_matmul takes x [M, K] and data [N, row_bytes]; got {x.shape} and {data.shape}")
    if data.shape[1] != row_bytes(fmt, x.shape[1]):
        raise ValueError(f"data rows of {data.shape[1]} bytes are not {fmt} rows of K={x.shape[1]} "
                         f"({row_bytes(fmt, x.shape[1])} bytes)")
    x = x.astype(jnp.float32)
    if x.shape[0] > NATIVE_MAX_ROWS or not native_available():
        return _xla_matmul(x, data, fmt)
    return jax.lax.platform_dependent(x, data, cpu=functools.partial(_native_matmul, fmt=fmt),
                                      default=functools.partial(_xla_matmul, fmt=fmt))


def quant_matmul_reference(x, data, fmt: str):
    """quant_matmul in numpy float64 over dequantize_reference (the tests' reference)."""
    w = dequantize_reference(data, fmt, np.shape(x)[1]).astype(np.float64)
    return np.asarray(x, np.float64) @ w.T
