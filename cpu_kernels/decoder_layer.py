"""One Llama decoder layer of a small batch as one native call on the CPU (decoder_layer.cc).

A decode step of a small model on a CPU is bound by fixed costs more than by bytes: as XLA
thunks a layer is ~20 fused ops and five native calls (q/k/v, attention, o, gate/up, down),
each of which hands its work to a helper thread. This kernel runs the whole layer (both
RMSNorms, the four packed matmuls, RoPE, the paged KV write, attention, SwiGLU and both
residuals) in one call whose helpers stay in it from the first matmul to the last
(decoder_layer.cc says how), with the matmuls of quant_matmul.h and the attention of
paged_attention.h, so its numbers are those kernels' numbers.

Every token attends as a decode row of its own (`rows`: paged_jax/attention/xla.py's
token_rows, which the XLA layers' attention uses on a CPU as well), exact for any batch: the
runner uses the kernel for steps of at most MAX_TOKENS tokens (its bucket) whose queries are
at most SHORT_QUERY_ROWS tokens each (decodes, verification steps, short chunks), and the
layer's XLA path for the others (paged_jax/runner.py ModelRunner.native_step).

Weights are packed (q8_0 / q4_1 tiles or bf16 rows: cpu_kernels/quant_matmul.py), q/k/v in
one format and gate/up in one; activations "float32" (exact) or "int8" for the tiled ones
(bf16 weights always multiply f32 activations). The caches are f32 or bf16 and are updated in
place (the call's results alias them). `decoder_layer_reference` is the same layer in jnp.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from cpu_kernels import native
from cpu_kernels.quant_matmul import ACTIVATIONS, TILED, WEIGHT_FORMATS, quant_matmul, stored_shape

__all__ = ["MAX_TOKENS", "LayerWeights", "Weight", "decoder_layer", "decoder_layer_reference", "native_available",
           "usable"]

MAX_TOKENS = 64  # tokens a step's bucket may have for the runner to use the kernel (module docstring)
_PREFIX = "pj_decoder_layer"
_CACHE_SUFFIXES = {"float32": "f32", "bfloat16": "bf16"}
_FORMAT_IDS = {"q8_0": 0, "q4_1": 1, "bf16": 2}  # quant_matmul.h's Format


class Weight(NamedTuple):
    data: jax.Array  # u8[stored_shape(format, n, k)]
    format: str  # a WEIGHT_FORMATS key


class LayerWeights(NamedTuple):
    """A layer's weights as the kernel takes them: the norms' f32[D] scales and seven packed
    weights, each one logical row per output (q [N*H, D], k / v [K*H, D], o [D, N*H], gate /
    up [F, D], down [D, F])."""

    input_norm: jax.Array
    q: Weight
    k: Weight
    v: Weight
    o: Weight
    post_norm: jax.Array
    gate: Weight
    up: Weight
    down: Weight


def build_and_register(extra_flags=(), prefix: str = _PREFIX) -> bool:
    """Builds decoder_layer.cc (cpu_kernels/native.py) with extra_flags and registers its
    handlers with XLA as prefix_<f32|bf16>. False (with a warning) when it cannot be built."""
    return native.build_and_register(extra_flags, {f"{prefix}_{suffix}": f"{_PREFIX}_{suffix}"
                                                   for suffix in _CACHE_SUFFIXES.values()})


@functools.lru_cache(maxsize=None)
def native_available() -> bool:
    """Whether the kernel is built (or cached) and registered with XLA."""
    return native.enabled() and build_and_register()


def usable(weights: LayerWeights, k_cache, activations: str) -> bool:
    """Whether the kernel can run a layer of these weights, cache and activations here (the
    caller still keeps it to CPU devices)."""
    formats = [w.format for w in weights if isinstance(w, Weight)]
    return (jnp.dtype(k_cache.dtype).name in _CACHE_SUFFIXES and all(f in _FORMAT_IDS for f in formats)
            and weights.q.format == weights.k.format == weights.v.format and weights.gate.format == weights.up.format
            and activations in ACTIVATIONS and native_available())


def _shapes(hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
            intermediate_size: int) -> dict[str, tuple[int, int]]:
    """Each weight's [out, in] shape (as a Linear's, before packing)."""
    d = hidden_size
    return {"q": (num_heads * head_dim, d), "k": (num_kv_heads * head_dim, d), "v": (num_kv_heads * head_dim, d),
            "o": (d, num_heads * head_dim), "gate": (intermediate_size, d), "up": (intermediate_size, d),
            "down": (d, intermediate_size)}


def can_fetch_ahead(next_weights: LayerWeights, hidden_size: int, num_heads: int, num_kv_heads: int,
                    head_dim: int) -> bool:
    """Whether a layer call of these sizes can fetch next_weights' q / k / v ahead (decoder_layer's
    next_weights): they share one format the kernel reads (not necessarily the layer's own), and
    they are [out, in] weights of the layer's shapes in it."""
    fmt = next_weights.q.format
    shapes = _shapes(hidden_size, num_heads, num_kv_heads, head_dim, 0)
    return (fmt == next_weights.k.format == next_weights.v.format and fmt in _FORMAT_IDS
            and all(tuple(getattr(next_weights, name).data.shape) == stored_shape(fmt, *shapes[name])
                    for name in ("q", "k", "v")))


def _check(x, weights: LayerWeights, cos, k_cache, num_heads: int, intermediate_size: int):
    t, d = x.shape
    _, _, num_kv_heads, head_dim = k_cache.shape
    expected = _shapes(d, num_heads, num_kv_heads, head_dim, intermediate_size)
    checks = [(f"weights.{name}", getattr(weights, name), shape) for name, shape in expected.items()]
    for name, w, (n, k) in checks:
        stored = stored_shape(w.format, n, k) if w.format in WEIGHT_FORMATS else None
        if tuple(w.data.shape) != stored:
            raise ValueError(f"{name}: {w.format} data of shape {tuple(w.data.shape)} is not a [{n}, {k}] "
                             f"weight (stored as {stored or '?'})")
    if cos.shape != (t, head_dim // 2):
        raise ValueError(f"cos and sin must be [T, head_dim / 2] = {(t, head_dim // 2)}; got {cos.shape}")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads=} must be a multiple of the cache's {num_kv_heads} KV heads")


def decoder_layer(x, weights: LayerWeights, cos, sin, k_cache, v_cache, slot_mapping, rows, *, eps: float,
                  sm_scale: float, num_heads: int, intermediate_size: int, sliding_window: int | None = None,
                  activations: str = "float32", next_weights: LayerWeights | None = None, prefix: str = _PREFIX):
    """The layer of the module docstring, as one native call (CPU only: callers check `usable`).

    Args:
      x: f32[T, D], the layer's input (the residual stream).
      weights: LayerWeights.
      cos, sin: f32[T, head_dim / 2], each token's RoPE angles' cosines and sines
        (rotate_half layout: dim i pairs with dim i + head_dim / 2).
      k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], f32 or bf16.
      slot_mapping: i32[T], where each token's k and v go (block_id * block_size + offset).
      rows: (block_tables i32[T, W], seq_lens i32[T], query_start_loc i32[T + 1], num_rows): every
        token a decode row (paged_jax/attention/xla.py token_rows); a row with seq_lens 0 is padding.
      eps: the RMSNorms' epsilon; sm_scale: the softmax scale; num_heads: query heads;
        intermediate_size: the MLP's F; sliding_window: None, or the keys a query sees.
      activations: "float32" (exact) or "int8" (the tiled weights' x quantized per block).
      next_weights: the next layer's weights (can_fetch_ahead says which), or None. The call's
        helpers ask for their q / k / v from memory as they leave: between two calls nobody
        else reads memory, so the next call finds the start of its work in the cache.
      prefix: the registered build's name (build_and_register).
    Returns:
      (f32[T, D] the layer's output, k_cache, v_cache with this step's keys and values).
    """
    _check(x, weights, cos, k_cache, num_heads, intermediate_size)
    if next_weights is not None and not can_fetch_ahead(next_weights, x.shape[1], num_heads, *k_cache.shape[2:]):
        raise ValueError("next_weights: its q / k / v must be weights of this layer's shapes that share one "
                         f"format the kernel reads ({sorted(_FORMAT_IDS)}); check can_fetch_ahead, or pass None")
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations={activations!r} is not one of {ACTIVATIONS}")
    if sliding_window is not None and not 0 < sliding_window < 2**31:
        raise ValueError(f"{sliding_window=} must be None or a positive int32 (the keys each query sees)")
    if prefix == _PREFIX and not native_available():
        raise ValueError("the native decoder layer is not built here (no C++ compiler, not x86-64, or "
                         "PAGED_JAX_NATIVE_KERNELS=0): check usable() and run the layer's XLA path")
    tables, lens, qsl, num_rows = rows
    suffix = _CACHE_SUFFIXES[jnp.dtype(k_cache.dtype).name]
    outs = (jax.ShapeDtypeStruct(x.shape, jnp.float32), jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
            jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype))
    w = weights
    following = w if next_weights is None else next_weights  # without one, the own q / k / v (not asked for)
    i32 = lambda a: jnp.asarray(a).astype(jnp.int32)  # noqa: E731
    return jax.ffi.ffi_call(f"{prefix}_{suffix}", outs, input_output_aliases={15: 1, 16: 2})(
        x.astype(jnp.float32), cos.astype(jnp.float32), sin.astype(jnp.float32),
        w.input_norm.astype(jnp.float32), w.post_norm.astype(jnp.float32),
        *(getattr(w, name).data for name in ("q", "k", "v", "o", "gate", "up", "down")),
        *(getattr(following, name).data for name in ("q", "k", "v")), k_cache, v_cache,
        i32(slot_mapping), i32(tables), i32(lens), i32(qsl), jnp.reshape(i32(num_rows), (1,)),
        eps=np.float32(eps), sm_scale=np.float32(sm_scale), sliding_window=np.int32(sliding_window or 0),
        num_heads=np.int32(num_heads), intermediate_size=np.int32(intermediate_size),
        format_qkv=np.int32(_FORMAT_IDS[w.q.format]), format_o=np.int32(_FORMAT_IDS[w.o.format]),
        format_gate_up=np.int32(_FORMAT_IDS[w.gate.format]), format_down=np.int32(_FORMAT_IDS[w.down.format]),
        format_next_qkv=np.int32(-1 if next_weights is None else _FORMAT_IDS[next_weights.q.format]),
        activations=np.int32(ACTIVATIONS.index(activations)))


def decoder_layer_reference(x, weights: LayerWeights, cos, sin, k_cache, v_cache, slot_mapping, rows, *, eps: float,
                            sm_scale: float, num_heads: int, intermediate_size: int,
                            sliding_window: int | None = None, activations: str = "float32",
                            next_weights: LayerWeights | None = None):
    """decoder_layer in jnp: XLA's dequantized matmuls (quant_matmul's XLA path, which
    quantizes x alike for int8 activations) and attention over each row's gathered pages
    (next_weights, which only says what to fetch ahead, changes nothing here)."""
    _check(x, weights, cos, k_cache, num_heads, intermediate_size)
    t, d = x.shape
    _, _, num_kv_heads, head_dim = k_cache.shape
    tables, lens, _, _ = rows

    def matmul(h, w: Weight, n: int):
        acts = activations if w.format in TILED else "float32"
        return quant_matmul(h, w.data, w.format, n, acts, native=None)

    def norm(h, scale):
        return h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + eps) * scale

    def rope(h):  # [T, heads, H]
        h1, h2 = jnp.split(h, 2, axis=-1)
        c, s = cos[:, None], sin[:, None]
        return jnp.concatenate([h1 * c - h2 * s, h2 * c + h1 * s], axis=-1)

    n1 = norm(x, weights.input_norm)
    q = rope(matmul(n1, weights.q, num_heads * head_dim).reshape(t, num_heads, head_dim))
    k = rope(matmul(n1, weights.k, num_kv_heads * head_dim).reshape(t, num_kv_heads, head_dim))
    v = matmul(n1, weights.v, num_kv_heads * head_dim).reshape(t, num_kv_heads, head_dim)
    k_cache = k_cache.reshape(-1, num_kv_heads, head_dim).at[slot_mapping].set(k.astype(k_cache.dtype)).reshape(
        k_cache.shape)
    v_cache = v_cache.reshape(-1, num_kv_heads, head_dim).at[slot_mapping].set(v.astype(v_cache.dtype)).reshape(
        v_cache.shape)
    # attention: row t over keys 0 .. lens[t] - 1 of its table (the last sliding_window of them)
    q = q.astype(k_cache.dtype).astype(jnp.float32).reshape(t, num_kv_heads, num_heads // num_kv_heads, head_dim)
    keys = k_cache[tables].reshape(t, -1, num_kv_heads, head_dim).astype(jnp.float32)  # [T, S, K, H]
    values = v_cache[tables].reshape(t, -1, num_kv_heads, head_dim).astype(jnp.float32)
    pos = jnp.arange(keys.shape[1])
    visible = pos[None] < lens[:, None]
    if sliding_window is not None:
        visible &= pos[None] >= lens[:, None] - sliding_window
    scores = jnp.einsum("TKGH,TSKH->TKGS", q, keys) * sm_scale
    probs = jax.nn.softmax(jnp.where(visible[:, None, None], scores, -jnp.inf), axis=-1)
    values = jnp.where(visible[:, :, None, None], values, 0.0)  # a page's unwritten slots may hold anything
    attn = jnp.einsum("TKGS,TSKH->TKGH", jnp.where(lens[:, None, None, None] > 0, probs, 0.0), values)
    attn = attn.astype(k_cache.dtype).astype(jnp.float32).reshape(t, num_heads * head_dim)
    h = x + matmul(attn, weights.o, d)
    n2 = norm(h, weights.post_norm)
    act = jax.nn.silu(matmul(n2, weights.gate, intermediate_size)) * matmul(n2, weights.up, intermediate_size)
    return h + matmul(act, weights.down, d), k_cache, v_cache
