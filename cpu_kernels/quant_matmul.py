"""x @ W^T with W kept in a compact block format and dequantized inside the matmul.

Formats (GGUF's own blocks; one logical row of W = the K inputs of one output):

| format | block | bytes | element                                        |
|---|---|---|---|
| q8_0   | 32    | 34    | f16 d, int8 q[32]: d * q                        |
| q4_1   | 32    | 20    | f16 d, f16 m, u8 qs[16]: d * q + m, q[j] = qs[j] & 15, q[j+16] = qs[j] >> 4 |
| bf16   | 1     | 2     | bfloat16                                        |

How they are stored (`pack`, `tile_rows`): bf16 as rows, u8[N, 2K]. q8_0 and q4_1 hold the
same block values rearranged in tiles of 16 output rows, u8[ceil(N/16), K/32 * tile block
bytes], so that one 512-bit register holds the same inputs of 16 rows and the kernel needs no
horizontal sums (quant_matmul.cc's header gives the byte order; `untile_rows` is its numpy
inverse). A tile is 16 rows' bytes, rearranged: a tiled weight is exactly as large as the
GGUF's rows (padded to a multiple of 16 rows).

On a CPU the matmul is a native kernel (quant_matmul.cc, an XLA FFI custom call compiled with
the machine's compiler on first use and cached: cpu_kernels/native.py; its f32-activation
loops use AVX-512, or AVX2 + FMA + F16C on a CPU without it, as two 8-row halves of each
tile; int8 activations use AVX-512 VNNI or AVX2's vpmaddubsw, else a portable loop serves): it reads
each tile once per four rows of x (eight in the AVX-512 int8 loops, so a verification step of
up to 1 + 7 tokens reads it once) and never writes a dequantized copy, so a decode step reads
the format's bytes, not f32's. XLA:CPU has no such kernel of its own: a bf16 or int8 dot runs
as a naive loop, ~8x slower than the f32 dot, and a fused convert-multiply-reduce reaches
~5 G elements/s (docs/BENCHMARKS.md section 18). Elsewhere (a GPU, a CPU without a C++
compiler, PAGED_JAX_NATIVE_KERNELS=0) the weight is dequantized by XLA (`dequantize`, one
matrix's f32 temporary) and multiplied by its dot.

Activations (ACTIVATIONS):
  "float32" (exact): every element is the dequantized f32 value and every product f32, so the
    result is the f32 matmul of the dequantized weight up to summation order.
  "int8": x is quantized per block of 32 inputs to int8 with scale max|x| / 127 (llama.cpp's
    Q8_0 / Q8_1 activations) and each block's dot is an integer dot (AVX-512 VNNI or AVX2). Faster
    (the exact q4_1 kernel is compute-bound), not exact: docs/BENCHMARKS.md has its quality.
    q8_0 and q4_1 only; the XLA path multiplies the same quantized x, so every backend agrees.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from cpu_kernels import native

__all__ = ["ACTIVATIONS", "MAX_GROUP", "TILE_ROWS", "WEIGHT_FORMATS", "dequantize", "dequantize_reference",
           "dequantize_rows", "native_available", "pack", "quant_matmul", "quant_matmul_group", "quant_matmul_reference",
           "quantize_activations_reference", "row_bytes", "stored_shape", "tile_rows", "untile_rows"]

# format -> (elements per block, bytes per block)
WEIGHT_FORMATS = {"q8_0": (32, 34), "q4_1": (32, 20), "bf16": (1, 2)}
TILED = ("q8_0", "q4_1")
TILE_ROWS = 16
ACTIVATIONS = ("float32", "int8")
_LOADS = {"q8_0": 8, "q4_1": 4}  # 64-byte loads of a tile block's values
_HEADER = {"q8_0": 32, "q4_1": 64}  # bytes of f16 d[16] (and m[16]) before them
_TARGET = "pj_quant_matmul"
MAX_GROUP = 4  # weights one quant_matmul_group call takes (quant_matmul.cc kMaxParts)


def row_bytes(fmt: str, k: int) -> int:
    """Bytes of one GGUF row of k elements in fmt."""
    block, nbytes = _format(fmt)
    if k % 32:  # the kernel's blocks (bf16 too: it reads 16 inputs at a time)
        raise ValueError(f"{fmt} rows hold multiples of 32 elements; got k={k}: keep this weight in float32")
    return k // block * nbytes


def stored_shape(fmt: str, n: int, k: int) -> tuple[int, int]:
    """Shape of the u8 array holding an [n, k] weight in fmt."""
    nbytes = row_bytes(fmt, k)
    if fmt in TILED:
        return -(-n // TILE_ROWS), nbytes * TILE_ROWS
    return n, nbytes


def _format(fmt: str) -> tuple[int, int]:
    if fmt not in WEIGHT_FORMATS:
        raise ValueError(f"weight format {fmt!r} is not one of {sorted(WEIGHT_FORMATS)}")
    return WEIGHT_FORMATS[fmt]


def _check_activations(activations: str, fmt: str) -> None:
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations={activations!r} is not one of {ACTIVATIONS}")
    if activations == "int8" and fmt not in TILED:
        raise ValueError(f"int8 activations need q8_0 or q4_1 weights, not {fmt}; use activations='float32'")


# The tile layout, as numpy index arrays: element j of a block lives in 64-byte load L, byte u
# of its lane's 32 bits, and (q4_1) nibble h (low for j < 16).
def _tile_index(fmt: str):
    """(L, u, h) per block element j = 0..31."""
    j = np.arange(32)
    if fmt == "q8_0":
        return j // 4, j % 4, np.zeros(32, int)
    h = j // 16
    return (j % 16) // 4, j % 4, h


def tile_rows(rows, fmt: str) -> np.ndarray:
    """GGUF rows u8[N, row_bytes] of a q8_0 / q4_1 weight in the tiled layout (the rows as
    they are for bf16). Rows past N in the last tile are zero blocks (they are never written out)."""
    rows = np.asarray(rows, np.uint8)
    if fmt not in TILED:
        return np.ascontiguousarray(rows)
    _, nbytes = _format(fmt)
    n = rows.shape[0]
    num_tiles = -(-n // TILE_ROWS)
    padded = np.zeros((num_tiles * TILE_ROWS, rows.shape[1]), np.uint8)
    padded[:n] = rows
    blocks = padded.reshape(num_tiles, TILE_ROWS, -1, nbytes).transpose(0, 2, 1, 3)  # [T, B, lane, bytes]
    num_blocks = blocks.shape[1]
    header = blocks[..., : _HEADER[fmt] // TILE_ROWS]  # [T, B, lane, 2 or 4]: d (and m) of each lane
    parts = [header[..., 0:2].reshape(num_tiles, num_blocks, -1)]
    if fmt == "q4_1":
        parts.append(header[..., 2:4].reshape(num_tiles, num_blocks, -1))
        qs = blocks[..., 4:]
        q = np.concatenate([qs & 15, qs >> 4], axis=-1)  # [T, B, lane, 32] element values
    else:
        q = blocks[..., 2:] ^ np.uint8(0x80)  # q + 128
    L, u, h = _tile_index(fmt)
    values = np.zeros((num_tiles, num_blocks, _LOADS[fmt], TILE_ROWS, 4), np.uint8)
    for j in range(32):
        values[:, :, L[j], :, u[j]] |= (q[..., j] << np.uint8(4 * h[j])).astype(np.uint8)
    parts.append(values.reshape(num_tiles, num_blocks, -1))
    return np.ascontiguousarray(np.concatenate(parts, axis=-1).reshape(num_tiles, -1))


def untile_rows(data, fmt: str, n: int) -> np.ndarray:
    """GGUF rows u8[n, row_bytes] of a stored weight (tile_rows' inverse; the tests' reference)."""
    data = np.asarray(data, np.uint8)
    if fmt not in TILED:
        return data[:n]
    num_tiles = data.shape[0]
    blocks = data.reshape(num_tiles, -1, TILE_ROWS * _format(fmt)[1])  # [T, B, tile block]
    num_blocks = blocks.shape[1]
    d = blocks[..., :32].reshape(num_tiles, num_blocks, TILE_ROWS, 2)
    values = blocks[..., _HEADER[fmt]:].reshape(num_tiles, num_blocks, _LOADS[fmt], TILE_ROWS, 4)
    L, u, h = _tile_index(fmt)
    q = np.stack([(values[:, :, L[j], :, u[j]] >> np.uint8(4 * h[j])) & np.uint8(15 if fmt == "q4_1" else 255)
                  for j in range(32)], axis=-1).astype(np.uint8)  # [T, B, lane, 32]
    if fmt == "q4_1":
        m = blocks[..., 32:64].reshape(num_tiles, num_blocks, TILE_ROWS, 2)
        out = np.concatenate([d, m, q[..., :16] | (q[..., 16:] << 4)], axis=-1)
    else:
        out = np.concatenate([d, q ^ np.uint8(0x80)], axis=-1)
    return np.ascontiguousarray(out.transpose(0, 2, 1, 3).reshape(num_tiles * TILE_ROWS, -1)[:n])


def pack(w, fmt: str) -> np.ndarray:
    """The stored array (stored_shape) of an f32[N, K] weight, quantized by gguf.quants
    (llama.cpp's own rounding) for q8_0 / q4_1, rounded to nearest even for bf16."""
    import gguf

    w = np.ascontiguousarray(np.asarray(w, np.float32))
    row_bytes(fmt, w.shape[-1])
    qtype = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_1": gguf.GGMLQuantizationType.Q4_1,
             "bf16": gguf.GGMLQuantizationType.BF16}[fmt]
    rows = np.ascontiguousarray(gguf.quants.quantize(w, qtype)).view(np.uint8).reshape(w.shape[0], -1)
    return tile_rows(rows, fmt)


def _dequantize_gguf_rows(rows, fmt: str, k: int) -> np.ndarray:
    block, nbytes = _format(fmt)
    n = rows.shape[0]
    if fmt == "bf16":
        return (rows.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(n, k)
    blocks = rows.reshape(n, k // block, nbytes)
    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)  # [N, B, 1]
    if fmt == "q8_0":
        return (d * blocks[..., 2:].view(np.int8).astype(np.float32)).reshape(n, k)
    m = blocks[..., 2:4].copy().view(np.float16).astype(np.float32)
    qs = blocks[..., 4:]
    q = np.concatenate([qs & 15, qs >> 4], axis=-1).astype(np.float32)
    return (d * q + m).reshape(n, k)


def dequantize_reference(data, fmt: str, k: int, n: int) -> np.ndarray:
    """f32[n, k] of a stored weight, in numpy (the tests' independent reference)."""
    return _dequantize_gguf_rows(untile_rows(data, fmt, n), fmt, k)


def _f16(two_bytes):
    """f32 of little-endian f16 bytes u8[..., 2]."""
    return jax.lax.bitcast_convert_type(two_bytes, jnp.float16).astype(jnp.float32)


def _tile_values(data, fmt: str, k: int):
    """(d, m, q) of stored tiles u8[..., tile bytes] in XLA: d, m f32[..., 16, B, 1] (m None for
    q8_0), q u8[..., 16, B, 32] the block values (q8_0's as q + 128)."""
    lead = data.shape[:-1]
    blocks = data.reshape(*lead, k // 32, TILE_ROWS * _format(fmt)[1])  # a tile block: 16 GGUF blocks' bytes
    lanes_first = lambda a: jnp.moveaxis(a, -1, len(lead))[..., None]  # noqa: E731  [..., B, 16] -> [..., 16, B, 1]
    d = lanes_first(_f16(blocks[..., :32].reshape(*lead, k // 32, TILE_ROWS, 2)))
    values = blocks[..., _HEADER[fmt]:].reshape(*lead, k // 32, _LOADS[fmt], TILE_ROWS, 4)
    values = jnp.moveaxis(values, -2, len(lead))  # [..., 16, B, L, 4]: j = 4L + u
    if fmt == "q8_0":
        return d, None, values.reshape(*lead, TILE_ROWS, k // 32, 32)
    m = lanes_first(_f16(blocks[..., 32:64].reshape(*lead, k // 32, TILE_ROWS, 2)))
    values = values.reshape(*lead, TILE_ROWS, k // 32, 16)
    return d, m, jnp.concatenate([values & 15, values >> 4], axis=-1)


def _tile_weights(d, m, q, fmt: str):
    if fmt == "q8_0":
        return d * (q.astype(jnp.float32) - 128.0)
    return d * q.astype(jnp.float32) + m


def dequantize(data, fmt: str, k: int, n: int):
    """f32[n, k] of a stored weight, in XLA (fuses into its consumer)."""
    if fmt == "bf16":
        return jax.lax.bitcast_convert_type(data.reshape(n, k, 2), jnp.bfloat16).astype(jnp.float32)
    w = _tile_weights(*_tile_values(data, fmt, k), fmt)  # [T, 16, B, 32]
    return w.reshape(-1, k)[:n]


def dequantize_rows(data, fmt: str, k: int, ids):
    """f32[*ids.shape, k]: rows ids of a stored weight (an embedding lookup), in XLA; a tiled
    weight's row is picked out of its tile before it is converted."""
    if fmt == "bf16":
        return jax.lax.bitcast_convert_type(jnp.take(data, ids, axis=0).reshape(*ids.shape, k, 2),
                                            jnp.bfloat16).astype(jnp.float32)
    d, m, q = _tile_values(jnp.take(data, ids // TILE_ROWS, axis=0), fmt, k)
    lane = (ids % TILE_ROWS)[..., None, None, None]
    pick = lambda a: None if a is None else jnp.take_along_axis(a, lane, axis=ids.ndim)[..., 0, :, :]  # noqa: E731
    return _tile_weights(pick(d), pick(m), pick(q), fmt).reshape(*ids.shape, k)


def _quantize_activations(x):
    """x f32[M, K] as the kernel's int8 activations, returned dequantized (q * d), in XLA."""
    blocks = x.reshape(x.shape[0], -1, 32)
    d = jnp.max(jnp.abs(blocks), axis=-1, keepdims=True) / jnp.float32(127)
    inv = jnp.where(d != 0, 1 / jnp.where(d != 0, d, 1), 0)
    return (jnp.round(blocks * inv) * d).reshape(x.shape)


def quantize_activations_reference(x):
    """(q int8[M, K], d f32[M, K/32]): the kernel's quantization of x, in numpy."""
    blocks = np.asarray(x, np.float32).reshape(np.shape(x)[0], -1, 32)
    d = np.abs(blocks).max(axis=-1) / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    q = np.rint(blocks * inv[..., None]).astype(np.int8)  # half to even, as the kernel
    return q.reshape(np.shape(x)), d


def _targets(fmt: str, activations: str, prefix: str = _TARGET) -> str:
    return f"{prefix}_{fmt}" + ("_i8" if activations == "int8" else "")


def build_and_register(extra_flags=(), prefix: str = _TARGET) -> bool:
    """Builds quant_matmul.cc (cpu_kernels/native.py) with extra_flags and registers its
    handlers with XLA as prefix_<format>[_i8]. False (with a warning) when it cannot be built."""
    return native.build_and_register(extra_flags, {
        _targets(fmt, acts, prefix): _targets(fmt, acts)
        for fmt in WEIGHT_FORMATS for acts in ACTIVATIONS if acts == "float32" or fmt in TILED})


@functools.lru_cache(maxsize=None)
def native_available() -> bool:
    """Whether the native CPU kernel is built (or cached) and registered with XLA."""
    return native.enabled() and build_and_register()


def _xla_matmul(x, data, fmt: str, n: int, activations: str):
    if activations == "int8":
        x = _quantize_activations(x)
    w = dequantize(data, fmt, x.shape[-1], n)  # [N, K]
    return jnp.einsum("MK,NK->MN", x, w, preferred_element_type=jnp.float32)


def _native_matmul(x, *datas, fmt: str, ns: tuple[int, ...], activations: str, prefix: str = _TARGET):
    outs = tuple(jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32) for n in ns)
    return tuple(jax.ffi.ffi_call(_targets(fmt, activations, prefix), outs)(x, *datas))


def _xla_matmuls(x, *datas, fmt: str, ns: tuple[int, ...], activations: str):
    return tuple(_xla_matmul(x, data, fmt, n, activations) for data, n in zip(datas, ns))


def quant_matmul_group(x, datas, fmt: str, ns, activations: str = "float32", *, native: str | None = _TARGET):
    """x @ W_p^T for each weight W_p [ns[p], K] of datas, all stored in fmt: one native call
    (x prepared once, every weight's tiles one list of work), the same numbers as one
    quant_matmul per weight. A layer's q, k and v (or gate and up) take one call instead of three.

    Args:
      x: f32[M, K] (other float dtypes are cast to f32).
      datas: 1 to 4 stored weights, each u8[stored_shape(fmt, ns[p], K)].
      fmt: a WEIGHT_FORMATS key.
      ns: each weight's rows (outputs).
      activations: "float32" (exact) or "int8" (module docstring).
      native: the registered kernel's name prefix (None: XLA's path only; tests name a build of
        their own).
    Returns:
      a tuple of f32[M, ns[p]].
    Raises:
      ValueError when a weight's shape is not its ns entry's in fmt, for an unknown activations,
      or for more than 4 weights.
    """
    _check_activations(activations, fmt)
    datas, ns = tuple(datas), tuple(int(n) for n in ns)
    if not 1 <= len(datas) <= MAX_GROUP or len(ns) != len(datas):
        raise ValueError(f"quant_matmul_group takes 1 to {MAX_GROUP} weights and one n each; "
                         f"got {len(datas)} weights and ns={ns}")
    if x.ndim != 2:
        raise ValueError(f"quant_matmul takes x [M, K]; got {x.shape}")
    for data, n in zip(datas, ns):
        if data.ndim != 2 or tuple(data.shape) != stored_shape(fmt, n, x.shape[1]):
            raise ValueError(f"data of shape {tuple(data.shape)} is not a {fmt} weight of {n} rows of K={x.shape[1]} "
                             f"(stored as {stored_shape(fmt, n, x.shape[1])})")
    x = x.astype(jnp.float32)
    xla = functools.partial(_xla_matmuls, fmt=fmt, ns=ns, activations=activations)
    if native is None or (native == _TARGET and not native_available()):
        return xla(x, *datas)
    return jax.lax.platform_dependent(
        x, *datas, cpu=functools.partial(_native_matmul, fmt=fmt, ns=ns, activations=activations, prefix=native),
        default=xla)


def quant_matmul(x, data, fmt: str, n: int, activations: str = "float32", *, native: str | None = _TARGET):
    """x @ W^T for W [n, K] stored in fmt: f32[M, n] (quant_matmul_group of one weight).

    Args:
      x: f32[M, K] (other float dtypes are cast to f32).
      data: the stored weight, u8[stored_shape(fmt, n, K)].
      fmt: a WEIGHT_FORMATS key.
      n: W's rows (outputs).
      activations: "float32" (exact) or "int8" (module docstring).
      native: as quant_matmul_group's.
    Raises:
      ValueError when data's shape is not W's in fmt, or for an unknown activations.
    """
    return quant_matmul_group(x, (data,), fmt, (n,), activations, native=native)[0]


def quant_matmul_reference(x, data, fmt: str, n: int, activations: str = "float32"):
    """quant_matmul in numpy float64 over dequantize_reference (the tests' reference); with int8
    activations x is replaced by its quantization (quantize_activations_reference), dequantized."""
    _check_activations(activations, fmt)
    x = np.asarray(x, np.float32)
    k = x.shape[1]
    if activations == "int8":
        q, d = quantize_activations_reference(x)
        x = (q.reshape(-1, k // 32, 32).astype(np.float64) * d[..., None]).reshape(-1, k)
    w = dequantize_reference(data, fmt, k, n).astype(np.float64)
    return np.asarray(x, np.float64) @ w.T
