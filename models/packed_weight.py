"""Weights kept compact on the device: PackedWeight and the matmul every family calls.

A model's linear weight is either a float array in the family's einsum layout (in axes first:
q_proj [D, N, H], o_proj [N, H, D], gate_proj [D, F]; embeddings [V, D]) or a PackedWeight:
the same logical weight in a block format (cpu_kernels/quant_matmul.py: q8_0, q4_1, bf16), one
logical row per output, each row the weight's inputs in order, stored as that module stores
the format (q8_0 / q4_1 in tiles of 16 rows). `linear` and `embed_rows` take either, so a
family's layer code reads the same for both; a GGUF's Q8_0 / Q4_1 / Q4_0 / BF16 tensors become
PackedWeights with their block values unchanged (Q4_0 rewritten as the Q4_1 it equals), and
`pack_model` turns a float model's weights into a format (LLM(weight_dtype=...)).
`set_activations` picks how the packed matmuls treat activations: exact f32, or quantized to
int8 per block as llama.cpp does (LLM(activation_dtype=...)).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from cpu_kernels.quant_matmul import (ACTIVATIONS, MAX_GROUP, TILED, dequantize, dequantize_rows, pack, quant_matmul,
                                      quant_matmul_group, tile_rows)

__all__ = ["ACTIVATIONS", "WEIGHT_DTYPES", "PackedWeight", "embed_rows", "linear", "linear_group", "pack_model",
           "packed_formats", "set_activations", "weight_format"]

# LLM(weight_dtype=...): auto keeps what the checkpoint stores (a GGUF's blocks as they are, a HF
# checkpoint's dtype); the others store every linear weight and the embedding in one format.
WEIGHT_DTYPES = ("auto", "float32", "bfloat16", "int8")
_FORMAT_OF = {"bfloat16": "bf16", "int8": "q8_0"}
# Parameters whose inputs are their last axis (rows first, like HF); every other linear weight
# has its inputs first (einsum layout), o_proj's over two axes.
ROWS_FIRST = ("embed_tokens", "lm_head")
_NUM_IN_AXES = {"o_proj": 2}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedWeight:
    """A weight of logical `shape` stored in `format` (u8[stored_shape(format, num_outputs,
    num_inputs)], cpu_kernels/quant_matmul.py).

    Its logical rows are the weight's outputs in row-major order of the output axes, each
    holding the inputs in row-major order of in_axes. `shape` is what the float weight's shape
    would be, so a loader's shape checks and a family's `.shape` reads hold for both.
    `activations` ("float32" exact, or "int8") is how its matmul treats x.
    """

    data: jax.Array
    format: str = dataclasses.field(metadata=dict(static=True))
    shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
    in_axes: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
    activations: str = dataclasses.field(default="float32", metadata=dict(static=True))

    @property
    def num_inputs(self) -> int:
        return math.prod(self.shape[a] for a in self.in_axes)

    @property
    def num_outputs(self) -> int:
        return math.prod(self.shape) // self.num_inputs

    def matmul(self, x2):
        """f32[M, num_outputs] = x2 [M, num_inputs] @ the weight's rows^T."""
        return quant_matmul(x2, self.data, self.format, self.num_outputs, self.activations)

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def dense(self, dtype=jnp.float32):
        """The float weight in its einsum layout (for tests and the dense reference)."""
        out_axes = [a for a in range(len(self.shape)) if a not in self.in_axes]
        w = dequantize(self.data, self.format, self.num_inputs, self.num_outputs)
        w = w.reshape(*(self.shape[a] for a in out_axes), *(self.shape[a] for a in self.in_axes))
        order = np.argsort([*out_axes, *self.in_axes])
        return w.transpose(order).astype(dtype)


def _value(w):
    return w.get_value() if isinstance(w, nnx.Variable) else w


def linear(x, w, dtype, num_in: int = 1):
    """x [..., *in] @ w [*in, *out] -> [..., *out] in dtype, w a float array or a PackedWeight.

    Args:
      x: activations whose last num_in axes are w's leading (input) axes.
      w: an nnx.Param (or its value): a float array in einsum layout, or a PackedWeight whose
        in_axes are its first num_in axes.
      dtype: the compute dtype of the result (a packed matmul runs in f32 and is cast).
    """
    w = _value(w)
    lead = x.shape[:x.ndim - num_in]
    out_shape = w.shape[num_in:]
    x2 = x.reshape(math.prod(lead), math.prod(x.shape[x.ndim - num_in:]))
    if isinstance(w, PackedWeight):
        y = w.matmul(x2)
    else:
        y = x2 @ w.astype(dtype).reshape(x2.shape[1], -1)
    return y.astype(dtype).reshape(*lead, *out_shape)


def linear_group(x, ws, dtype):
    """(linear(x, w, dtype) for w in ws) for weights that share their input axis (a layer's q,
    k and v, or gate and up), as one matmul call when they can be.

    When every w is a PackedWeight of one format and activations with one input axis, and there
    are at most MAX_GROUP, one quant_matmul_group call does them all (x prepared once, one
    dispatch: on a CPU decode step the per-call cost is a visible share of a small matrix's
    time). Otherwise each is its own linear. The results are the same either way.
    """
    vals = [_value(w) for w in ws]
    first = vals[0]
    fusable = (isinstance(first, PackedWeight) and len(vals) <= MAX_GROUP
               and all(isinstance(w, PackedWeight) and w.in_axes == (0,) and w.format == first.format
                       and w.activations == first.activations and w.num_inputs == first.num_inputs for w in vals))
    if not fusable:
        return tuple(linear(x, w, dtype) for w in vals)
    lead = x.shape[:-1]
    x2 = x.reshape(math.prod(lead), x.shape[-1])
    ys = quant_matmul_group(x2, [w.data for w in vals], first.format, [w.num_outputs for w in vals],
                            first.activations)
    return tuple(y.astype(dtype).reshape(*lead, *w.shape[1:]) for y, w in zip(ys, vals))


def logits(x, head):
    """f32[..., V] = x [..., D] @ head [V, D]^T (an embedding / lm_head, float or packed)."""
    head = _value(head)
    if isinstance(head, PackedWeight):
        return head.matmul(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], -1)
    return jnp.einsum("...D,VD->...V", x, head.astype(x.dtype), preferred_element_type=jnp.float32).astype(jnp.float32)


def embed_rows(table, token_ids, dtype):
    """[..., D] rows token_ids selects from an embedding table [V, D], float or packed."""
    table = _value(table)
    if isinstance(table, PackedWeight):
        return dequantize_rows(table.data, table.format, table.shape[1], token_ids).astype(dtype)
    return jnp.take(table, token_ids, axis=0).astype(dtype)


def in_axes_of(name: str, ndim: int) -> tuple[int, ...]:
    """The input axes of parameter `name` of ndim axes in the families' layouts."""
    if name in ROWS_FIRST:
        return (ndim - 1,)
    return tuple(range(_NUM_IN_AXES.get(name, 1)))


def packed_from_rows(rows, fmt: str, name: str, shape: tuple[int, ...]) -> PackedWeight:
    """A PackedWeight of parameter `name` (logical `shape`) from GGUF rows u8[num_rows, row_bytes]."""
    return PackedWeight(jnp.asarray(tile_rows(rows, fmt)), fmt, tuple(int(s) for s in shape),
                        in_axes_of(name, len(shape)))


def weight_format(weight_dtype: str) -> str | None:
    """The PackedWeight format weight_dtype stores linear weights in (None: float arrays)."""
    if weight_dtype not in WEIGHT_DTYPES:
        raise ValueError(f"weight_dtype={weight_dtype!r} is not one of {WEIGHT_DTYPES}")
    return _FORMAT_OF.get(weight_dtype)


def pack_model(model, weight_dtype: str):
    """Store every 2-D-or-more float weight of model (linear weights, embeddings) in the format
    weight_dtype names, in place; norms and other vectors stay float. Returns the model."""
    fmt = weight_format(weight_dtype)
    if fmt is None:
        return model
    for path, param in nnx.iter_graph(model):
        if not isinstance(param, nnx.Param) or not path:
            continue
        value = param.get_value()
        if isinstance(value, PackedWeight) or value.ndim < 2:
            continue
        name = str(path[-1])
        in_axes = in_axes_of(name, value.ndim)
        out_axes = [a for a in range(value.ndim) if a not in in_axes]
        w = np.asarray(value, np.float32).transpose(*out_axes, *in_axes)
        rows = w.reshape(math.prod(w.shape[:len(out_axes)]), -1)
        param.set_value(PackedWeight(jnp.asarray(pack(rows, fmt)), fmt, tuple(value.shape), in_axes))
    return model


def set_activations(model, activations: str):
    """Every q8_0 / q4_1 PackedWeight of model multiplies its activations as `activations`
    ("float32": exact; "int8": quantized per block of 32, cpu_kernels/quant_matmul.py), in
    place; bf16 and float weights stay exact. Returns the model."""
    if activations not in ACTIVATIONS:
        raise ValueError(f"activation_dtype={activations!r} is not one of {ACTIVATIONS}")
    for _, param in nnx.iter_graph(model):
        value = param.get_value() if isinstance(param, nnx.Param) else None
        if isinstance(value, PackedWeight) and value.format in TILED:
            param.set_value(dataclasses.replace(value, activations=activations))
    return model


def packed_formats(model) -> dict[str, int]:
    """format -> bytes of the model's PackedWeights (empty for an all-float model)."""
    sizes: dict[str, int] = {}
    for leaf in jax.tree.leaves(nnx.state(model), is_leaf=lambda v: isinstance(v, PackedWeight)):
        if isinstance(leaf, PackedWeight):
            sizes[leaf.format] = sizes.get(leaf.format, 0) + leaf.nbytes
    return sizes
