"""A quantized pool's static inputs calibrated from a few prompts: key offsets and per-tensor scales.

Both run the prompts through the model on an unquantized paged cache and read what each
layer wrote:
- calibrate_key_offsets: each layer's mean key (per KV head and channel, after RoPE). A
  quantized pool stores k - offset (paged_jax/core/kv_quant.py): softmax is blind to an
  offset every key of a query shares, and the keys' large common component no longer costs
  quantization error. Zeros unless given.
- calibrate_kv_scales: with kv_cache_scaling="per_tensor" a quantized pool keeps no scales
  beside its pages: each layer has one K scale and one V scale (vLLM's k_scale / v_scale),
  1.0 unless given; calibrated, amax / max_value of what the layer stores (keys centered
  and rotated as the pool stores them), so the format's range covers the observed values (a
  value past it later saturates, never inf or NaN).

    prompts = [tokenizer.encode(p) for p in texts]
    offsets = calibrate_key_offsets(model, prompts)
    scales = calibrate_kv_scales(model, prompts, "fp8", key_offsets=offsets)  # per_tensor only
    llm = LLM(..., kv_cache_dtype="fp8", kv_key_offsets=offsets)

paged_prefill is the one-sequence forward both this module and scripts/bench_kv_quant.py
use: one prefill of every token over a fresh paged cache of any spec, per-layer static
scales bound as the runner binds them, logits of every position.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.kv_cache_spec import FullAttentionSpec
from paged_jax.attention import bind_layer, make_attention_backend
from paged_jax.core.kv_quant import MIN_SCALE, check_key_offsets, get_kv_quant_format, key_rotation
from paged_jax.core.step_inputs import AttentionMetadata, ModelInputs

CALIBRATION_BLOCK_SIZE = 16


def _prefill_inputs(token_ids, block_size: int):
    """One sequence prefilled into pages 1.. (page 0 stays the null page)."""
    num_tokens = token_ids.shape[0]
    num_pages = -(-num_tokens // block_size)
    model_inputs = ModelInputs(token_ids=token_ids, positions=jnp.arange(num_tokens, dtype=jnp.int32),
                               logits_indices=jnp.arange(num_tokens, dtype=jnp.int32))
    md = AttentionMetadata(slot_mapping=jnp.arange(num_tokens, dtype=jnp.int32) + block_size,
                           block_tables=jnp.arange(1, num_pages + 1, dtype=jnp.int32)[None, :],
                           seq_lens=jnp.array([num_tokens], jnp.int32),
                           query_start_loc=jnp.array([0, num_tokens], jnp.int32), num_seqs=jnp.ones(1, jnp.int32))
    return model_inputs, md


@functools.partial(jax.jit, static_argnames=("graphdef", "attention", "block_size", "num_blocks"))
def _prefill(graphdef, state, token_ids, layer_inputs, *, attention, block_size, num_blocks):
    model = nnx.merge(graphdef, state)
    inputs, md = _prefill_inputs(token_ids, block_size)
    caches = [attention.spec.allocate(num_blocks, block_size) for _ in model.layers]
    x = model.embed(inputs.token_ids)
    new_caches = []
    for i, (layer, cache) in enumerate(zip(model.layers, caches)):
        x, cache = layer(x, inputs.positions, cache, md, bind_layer(attention, layer_inputs, i))
        new_caches.append(cache)
    return model.compute_logits(x, inputs), new_caches


def paged_prefill(model, token_ids, spec, *, kv_scales=None, key_offsets=None,
                  block_size: int = CALIBRATION_BLOCK_SIZE, attention=None):
    """Teacher-forced logits of one sequence through a paged cache laid out by `spec`.

    Args:
      model: a registered model (embed, layers, compute_logits).
      token_ids: the sequence, ints.
      spec: the per-layer cache spec (every layer alike), e.g. model.kv_cache_specs(...)[0].
      kv_scales: f32[num_layers, 2] static (k_scale, v_scale) per layer (per-tensor specs only).
      key_offsets: f32[num_layers, num_kv_heads, head_dim] per-layer key offsets (quantized specs).
      attention: a backend to use instead of make_attention_backend(spec, "xla") (any callable
        with the backend's signature and a `spec`; with kv_scales or key_offsets, a `bind`).
    Returns:
      (f32[T, V] logits of every position, the per-layer caches after the prefill).
    """
    token_ids = jnp.asarray(np.asarray(token_ids, np.int32))
    attention = attention or make_attention_backend(spec, "xla")
    graphdef, state = nnx.split(model)
    num_blocks = -(-token_ids.shape[0] // block_size) + 1
    layer_inputs = {name: jnp.asarray(value, jnp.float32) for name, value in
                    (("kv_scales", kv_scales), ("key_offset", key_offsets)) if value is not None}
    return _prefill(graphdef, state, token_ids, layer_inputs, attention=attention, block_size=block_size,
                    num_blocks=num_blocks)


def text_passages(token_ids, num: int, length: int) -> list[list[int]]:
    """The first `num` consecutive cuts of `length` tokens of token_ids (fewer if it runs out)."""
    return [list(token_ids[i : i + length]) for i in range(0, len(token_ids) - length + 1, length)][:num]


def documentation_passages(tokenizer, length: int, *, reverse: bool = False) -> list[list[int]]:
    """The first `length` tokens of each topic of Python's own documentation
    (pydoc_data.topics, in every Python install) that has as many, in name order (reverse:
    from the last): text to calibrate or evaluate on without a download."""
    from pydoc_data.topics import topics

    passages = (tokenizer.encode(topics[name]) for name in sorted(topics, reverse=reverse))
    return [ids[:length] for ids in passages if len(ids) >= length]


def _check_prompts(prompts, what: str) -> None:
    if not prompts or not all(len(p) for p in prompts):
        raise ValueError(f"{what} needs at least one non-empty prompt (token-id lists)")


def _float_spec(model) -> FullAttentionSpec:
    """The model's unquantized float32 GQA cache spec (ValueError for any other cache)."""
    spec = model.kv_cache_specs("float32")[0]
    if not isinstance(spec, FullAttentionSpec):
        raise ValueError(f"KV calibration reads the keys and values of a GQA cache; {type(model).__name__} keeps a "
                         f"{type(spec).__name__}, which is not quantized")
    return spec


def _written_keys_values(model, spec, prompts):
    """Per prompt, per layer, (keys, values) f32[len(prompt), num_kv_heads, head_dim] as the
    model computes them (through `spec`, its unquantized float32 cache: what a quantized pool
    is given)."""
    for prompt in prompts:
        _, caches = paged_prefill(model, prompt, spec)
        # page 0 is the null page; the prompt's tokens fill pages 1.. in order
        yield [tuple(np.asarray(a[1:]).reshape(-1, *a.shape[2:])[: len(prompt)] for a in cache) for cache in caches]


def calibrate_key_offsets(model, prompts) -> np.ndarray:
    """Each layer's mean key over the prompts' tokens: kv_key_offsets of a quantized pool.

    Args:
      model: a registered GQA model; prompts: token-id lists (a thousand tokens in all suffice).
    Returns:
      f32[num_layers, num_kv_heads, head_dim].
    """
    _check_prompts(prompts, "calibrate_key_offsets")
    spec = _float_spec(model)
    total, count = 0.0, 0
    for layers in _written_keys_values(model, spec, prompts):
        total = total + np.stack([keys.sum(axis=0, dtype=np.float64) for keys, _ in layers])
        count += len(layers[0][0])
    return (total / count).astype(np.float32)


def calibrate_kv_scales(model, prompts, kv_cache_dtype: str, key_offsets=None) -> tuple[tuple[float, float], ...]:
    """Per-layer static (k_scale, v_scale) for kv_cache_dtype: amax / max_value over the prompts.

    Args:
      model: a registered model; prompts: token-id lists (a few hundred tokens in all suffice).
      kv_cache_dtype: a quantized format name ("fp8", "fp8_e4m3", "fp8_e5m2", "int8").
      key_offsets: the kv_key_offsets the pool will use (None: zeros); the K scale covers the
        keys as the pool stores them, centered and rotated.
    Returns:
      One (k_scale, v_scale) pair per layer, each a positive float.
    """
    fmt = get_kv_quant_format(kv_cache_dtype)
    if fmt is None:
        raise ValueError("kv_cache_dtype='auto' stores no scales; calibrate for 'fp8', 'fp8_e5m2' or 'int8'")
    _check_prompts(prompts, "calibrate_kv_scales")
    spec = _float_spec(model)
    shape = (len(model.layers), spec.num_kv_heads, spec.head_dim)
    offsets = np.zeros(shape, np.float32) if key_offsets is None else check_key_offsets(key_offsets, shape)
    rotation = key_rotation(spec.head_dim).astype(np.float64)
    amax = np.zeros((len(model.layers), 2))
    for layers in _written_keys_values(model, spec, prompts):
        for i, (keys, values) in enumerate(layers):
            stored_keys = (keys - offsets[i]).astype(np.float64) @ rotation
            amax[i] = np.maximum(amax[i], [np.abs(stored_keys).max(), np.abs(values).max()])
    return tuple((max(float(k) / fmt.max_value, MIN_SCALE), max(float(v) / fmt.max_value, MIN_SCALE)) for k, v in amax)
