"""How a block's pages are stored off the device: one flat byte buffer per block.

A block's pages are the block's slab of every leaf of every layer's cache (each leaf is
[num_blocks, block_size, ...per-token shape], so one page of it is [block_size, ...]).
PageCodec packs them, layer by layer and leaf by leaf, into one uint8 buffer of a fixed
size (`nbytes`): the host tier keeps that buffer, the disk tier writes it as a file's
payload, and a batch of blocks is a uint8[n, nbytes] matrix, encoded and decoded in one
vectorised pass per leaf.

Storage formats (`storage_dtype`):
- None: the cache's own bytes (a round trip is bit-identical).
- a quantized format of core/kv_quant.py, by its kv_cache_dtype name ("int8", "fp8_e4m3",
  "fp8_e5m2"; "fp8" means fp8_e4m3): the device pool's own formats, with the same per-token
  rule (one float32 scale per (token, KV head), i.e. per row of the leaf's last axis: amax /
  max_value, at least MIN_SCALE), rounding and saturation (kv_quant.quantize_numpy), and the
  same page bytes (fp8 as uint8 bits). The format's relative_error bounds a round trip.
Only floating leaves of rank >= 3 ([block_size, heads, dim]) are quantized; others (a
quantized device pool's own pages and scales, integer leaves) are stored as they are, so a
quantized device pool goes through the tiers bit-identical whatever storage_dtype says.
Imports no jax.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from paged_jax.core.kv_quant import (KV_CACHE_DTYPES, UNQUANTIZED_KV_CACHE_DTYPES, KVQuantFormat, dequantize_numpy,
                                     get_kv_quant_format, per_token_scale_numpy, quantize_numpy, to_pages_numpy)

# None: the pool's own bytes; else one of the quantized kv_cache_dtype formats.
STORAGE_DTYPES = (None, *(name for name in KV_CACHE_DTYPES if name not in UNQUANTIZED_KV_CACHE_DTYPES))


def _np_dtype(name: str) -> np.dtype:
    """numpy dtype of a cache dtype name ("float32", "bfloat16", "float8_e4m3fn", ...)."""
    try:
        return np.dtype(name)
    except TypeError:
        return np.dtype(getattr(ml_dtypes, name))


def _is_float(dtype: np.dtype) -> bool:
    try:
        ml_dtypes.finfo(dtype)  # numpy's floats and ml_dtypes' (bfloat16, fp8)
    except ValueError:
        return False
    return True


def get_storage_format(storage_dtype: str | None) -> KVQuantFormat | None:
    """The kv_quant format an offload_dtype names; None for None (the cache's own bytes).

    Raises:
      ValueError: a name that is not one of STORAGE_DTYPES.
    """
    if storage_dtype not in STORAGE_DTYPES:
        raise ValueError(f"offload_dtype={storage_dtype!r} must be one of {STORAGE_DTYPES} "
                         "(None keeps the cache's dtype; the others are kv_cache_dtype's formats, 'fp8' = fp8_e4m3)")
    return None if storage_dtype is None else get_kv_quant_format(storage_dtype)


@dataclass(frozen=True)
class PageLeaf:
    """One leaf of one layer's cache, as one page of it: shape [block_size, ...], dtype name."""

    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class _Part:
    """Where one leaf lives in a block's buffer: its values, then (quantized) its scales."""

    leaf: PageLeaf
    offset: int
    stored_dtype: np.dtype  # the leaf's own dtype, or the format's page_dtype
    scale_offset: int  # -1: not quantized

    @property
    def values_nbytes(self) -> int:
        return int(np.prod(self.leaf.shape)) * self.stored_dtype.itemsize

    @property
    def scale_shape(self) -> tuple[int, ...]:
        return self.leaf.shape[:-1]


class PageCodec:
    """Packs the pages of blocks into uint8[n, nbytes] and back.

    Args:
      leaves: every page leaf, layer-major then leaf order (the order gather_pages returns).
      storage_dtype: one of STORAGE_DTYPES (module docstring).
    """

    def __init__(self, leaves, storage_dtype: str | None = None):
        self.format = get_storage_format(storage_dtype)
        self.leaves = tuple(PageLeaf(tuple(int(d) for d in leaf.shape), str(leaf.dtype)) for leaf in leaves)
        self.storage_dtype = storage_dtype
        parts, offset = [], 0
        for leaf in self.leaves:
            dtype = _np_dtype(leaf.dtype)
            quantized = self.format is not None and len(leaf.shape) >= 3 and _is_float(dtype)
            stored = np.dtype(self.format.page_dtype) if quantized else dtype
            part = _Part(leaf, offset, stored, -1)
            offset += part.values_nbytes
            if quantized:
                part = _Part(leaf, part.offset, stored, offset)
                offset += int(np.prod(part.scale_shape)) * 4
            parts.append(part)
        self._parts = tuple(parts)
        self.nbytes = offset  # bytes one block takes in this format

    @property
    def raw_nbytes(self) -> int:
        """Bytes one block takes on the device (unquantized)."""
        return sum(int(np.prod(leaf.shape)) * _np_dtype(leaf.dtype).itemsize for leaf in self.leaves)

    def describe(self) -> dict:
        """The geometry as plain data (the disk tier compares it with what a directory holds).
        The format by its canonical name: "fp8" and "fp8_e4m3" write the same bytes."""
        return {"pages": [[list(leaf.shape), leaf.dtype] for leaf in self.leaves],
                "storage_dtype": None if self.format is None else self.format.name}

    def encode(self, pages: list[np.ndarray]) -> np.ndarray:
        """Pages of n blocks -> uint8[n, nbytes].

        Args:
          pages: one array per leaf (self.leaves order), each [n, *leaf.shape] of leaf.dtype.
        """
        assert len(pages) == len(self._parts), f"{len(pages)} page arrays for {len(self._parts)} leaves"
        n = pages[0].shape[0]
        out = np.empty((n, self.nbytes), np.uint8)
        for part, page in zip(self._parts, pages):
            assert page.shape[1:] == part.leaf.shape, f"page shape {page.shape} is not [n, {part.leaf.shape}]"
            values = out[:, part.offset : part.offset + part.values_nbytes]
            if part.scale_offset < 0:
                values[:] = np.ascontiguousarray(page).reshape(n, -1).view(np.uint8)
                continue
            scale = per_token_scale_numpy(page, self.format)  # f32[n, *scale_shape]
            q = to_pages_numpy(quantize_numpy(page, self.format, scale[..., None]), self.format)
            values[:] = np.ascontiguousarray(q).reshape(n, -1).view(np.uint8)
            scale_bytes = scale.size // n * 4
            out[:, part.scale_offset : part.scale_offset + scale_bytes] = scale.reshape(n, -1).view(np.uint8)
        return out

    def decode(self, buffers: np.ndarray) -> list[np.ndarray]:
        """uint8[n, nbytes] -> one array per leaf, [n, *leaf.shape] of the leaf's dtype."""
        assert buffers.ndim == 2 and buffers.shape[1] == self.nbytes, (
            f"buffers of shape {buffers.shape} are not [n, {self.nbytes}]")
        n = buffers.shape[0]
        pages = []
        for part in self._parts:
            raw = np.ascontiguousarray(buffers[:, part.offset : part.offset + part.values_nbytes])
            values = raw.view(part.stored_dtype).reshape(n, *part.leaf.shape)
            if part.scale_offset < 0:
                pages.append(values)
                continue
            scale_bytes = int(np.prod(part.scale_shape)) * 4
            scale = np.ascontiguousarray(buffers[:, part.scale_offset : part.scale_offset + scale_bytes])
            scale = scale.view(np.float32).reshape(n, *part.scale_shape, 1)
            pages.append(dequantize_numpy(values, scale, self.format).astype(_np_dtype(part.leaf.dtype)))
        return pages
