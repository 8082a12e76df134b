"""GGUF (llama.cpp) files, read for any family's loader and for the tokenizer (models/tokenizer.py).

The file is read with the `gguf` package (GGUFReader memory-maps it; gguf.quants.dequantize
expands every quantized type it implements to float32), never parsed by hand. What a
family's tensors are called and how its config is spelled in the metadata is the family's
(models/llama/gguf.py); this module only opens files, reads metadata and dequantizes.

GGUF dims are listed fastest-first (ggml order); numpy order is the reverse, which for a
2-D weight is HF's [out, in]: dequantize returns that order.
"""

from __future__ import annotations

import os
from functools import lru_cache
from typing import NamedTuple

import numpy as np

__all__ = ["PackedRows", "dequantize", "packed_rows", "get_architecture", "get_float", "get_metadata", "open_gguf", "require_metadata"]


def open_gguf(reader_or_path):
    """(GGUFReader, name for messages); ValueError naming the file when it cannot be read."""
    import gguf

    if isinstance(reader_or_path, gguf.GGUFReader):
        return reader_or_path, "the GGUF file"
    path = os.fspath(reader_or_path)
    if not os.path.isfile(path):
        raise ValueError(f"GGUF file {path!r} does not exist; pass the path of a .gguf file")
    stat = os.stat(path)
    return _read(path, stat.st_size, stat.st_mtime_ns), path


@lru_cache(maxsize=2)
def _read(path: str, size: int, mtime_ns: int):
    """One GGUFReader per file version (size and mtime are part of the key), shared by the
    model and its tokenizer: the reader parses every metadata field in Python on open (seconds
    for SmolLM2's 49k-token vocabulary and merges), and an LLM reads the file twice."""
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except Exception as error:  # the reader raises ValueError, KeyError, IndexError... on bad bytes
        raise ValueError(f"{path} is not a readable GGUF file (truncated or corrupt?): "
                         f"{type(error).__name__}: {error}") from error
    for tensor in reader.tensors:
        # A memmap slice past the end of the file is silently short.
        if tensor.data.nbytes != tensor.n_bytes:
            raise ValueError(f"{path} is truncated: tensor {tensor.name} has {tensor.data.nbytes} of its "
                             f"{tensor.n_bytes} bytes; download the file again")
    return reader


def get_metadata(reader, key: str, default=None):
    """The value of metadata key (default when the file has none)."""
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def get_float(reader, key: str, default: float) -> float:
    """A float metadata value as the converter was given it (default when absent)."""
    # GGUF stores config floats as float32; the shortest decimal that rounds to the same float32
    # is the value the converter was given (9.999999747e-06 -> 1e-05, as in config.json).
    field = reader.fields.get(key)
    if field is None:
        return float(default)
    return float(np.format_float_positional(np.float32(field.contents()), unique=True, trim="-"))


def require_metadata(reader, key: str, name: str):
    """The value of metadata key; ValueError naming the file (name) and the key when it is absent."""
    value = get_metadata(reader, key)
    if value is None:
        architecture = get_metadata(reader, "general.architecture")
        raise ValueError(f"{name} has no {key!r} metadata; a {architecture} GGUF needs it")
    return value


def get_architecture(reader_or_path) -> str | None:
    """general.architecture of a GGUF ("llama", "gemma3", ...): which family's loader reads it."""
    reader, _ = open_gguf(reader_or_path)
    return get_metadata(reader, "general.architecture")


def dequantize(tensor, name: str) -> np.ndarray:
    """f32 array of a GGUF tensor in numpy (HF) order; ValueError naming the file (name), the
    tensor and its type when gguf.quants cannot dequantize it."""
    import gguf

    try:
        w = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as error:
        raise ValueError(f"{name}: tensor {tensor.name} has type {tensor.tensor_type.name}, which "
                         f"gguf.quants cannot dequantize ({error}); re-quantize the file to a "
                         "supported type such as Q8_0 or F16") from error
    return np.asarray(w, np.float32).reshape(tuple(reversed([int(d) for d in tensor.shape])))


class PackedRows(NamedTuple):
    """A GGUF tensor's own block bytes, one row per output: u8[num_rows, row_bytes] in format
    (cpu_kernels/quant_matmul.py), with shape the [out, in] shape it dequantizes to."""

    rows: np.ndarray
    format: str
    shape: tuple[int, int]


_FORMAT_OF_TYPE = {"Q8_0": "q8_0", "Q4_1": "q4_1", "Q4_0": "q4_1", "BF16": "bf16"}


def packed_rows(tensor) -> PackedRows | None:
    """The tensor's blocks as PackedRows when it is a 2-D tensor in a format the packed matmul
    reads (Q8_0, Q4_1, BF16 as stored; Q4_0 as the Q4_1 it equals); None for any other."""
    kind = tensor.tensor_type.name
    if kind not in _FORMAT_OF_TYPE or len(tensor.shape) != 2:
        return None
    num_inputs, num_rows = (int(d) for d in tensor.shape)
    rows = np.asarray(tensor.data).view(np.uint8).reshape(num_rows, -1)
    if kind == "Q4_0":
        # Q4_0 is d * (q - 8): Q4_1's d * q + m with m = -8 d, exact in f16 (a power-of-two multiple).
        blocks = rows.reshape(num_rows, -1, 18)
        d = blocks[..., :2].copy().view(np.float16)
        m = (d.astype(np.float32) * -8).astype(np.float16)
        if not np.all(np.isfinite(m)):
            return None
        rows = np.concatenate([blocks[..., :2], m.view(np.uint8), blocks[..., 2:]], axis=-1).reshape(num_rows, -1)
    return PackedRows(np.ascontiguousarray(rows), _FORMAT_OF_TYPE[kind], (num_rows, num_inputs))
