"""Static per-tensor K/V scales (vLLM's k_scale / v_scale) calibrated from a few prompts.

With kv_cache_scaling="per_tensor" a quantized pool keeps no scales beside its pages: each
layer has one K scale and one V scale, 1.0 unless given. calibrate_kv_scales runs the
prompts through the model on an unquantized paged cache and sets each layer's scales to
amax / max_value of what that layer wrote, so the format's range covers the observed
values (a value past it later saturates, never inf or NaN):

    scales = calibrate_kv_scales(model, [tokenizer.encode(p) for p in prompts], "fp8")
    llm = LLM(..., kv_cache_dtype="fp8", kv_cache_scaling="per_tensor", kv_scales=scales)

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

from paged_jax.attention import make_attention_backend
from paged_jax.core.kv_quant import MIN_SCALE, get_kv_quant_format
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
def _prefill(graphdef, state, token_ids, kv_scales, *, attention, block_size, num_blocks):
    model = nnx.merge(graphdef, state)
    inputs, md = _prefill_inputs(token_ids, block_size)
    caches = [attention.spec.allocate(num_blocks, block_size) for _ in model.layers]
    x = model.embed(inputs.token_ids)
    new_caches = []
    for i, (layer, cache) in enumerate(zip(model.layers, caches)):
        bound = attention if kv_scales is None else attention.with_kv_scales(kv_scales[i])
        x, cache = layer(x, inputs.positions, cache, md, bound)
        new_caches.append(cache)
    return model.compute_logits(x, inputs), new_caches


def paged_prefill(model, token_ids, spec, *, kv_scales=None, block_size: int = CALIBRATION_BLOCK_SIZE,
                  attention=None):
    """Teacher-forced logits of one sequence through a paged cache laid out by `spec`.

    Args:
      model: a registered model (embed, layers, compute_logits).
      token_ids: the sequence, ints.
      spec: the per-layer cache spec (every layer alike), e.g. model.kv_cache_specs(...)[0].
      kv_scales: f32[num_layers, 2] static (k_scale, v_scale) per layer (per-tensor specs only).
      attention: a backend to use instead of make_attention_backend(spec, "xla") (any callable
        with the backend's signature and a `spec`).
    Returns:
      (f32[T, V] logits of every position, the per-layer caches after the prefill).
    """
    token_ids = jnp.asarray(np.asarray(token_ids, np.int32))
    attention = attention or make_attention_backend(spec, "xla")
    graphdef, state = nnx.split(model)
    num_blocks = -(-token_ids.shape[0] // block_size) + 1
    scales = None if kv_scales is None else jnp.asarray(kv_scales, jnp.float32)
    return _prefill(graphdef, state, token_ids, scales, attention=attention, block_size=block_size,
                    num_blocks=num_blocks)


def calibrate_kv_scales(model, prompts, kv_cache_dtype: str) -> tuple[tuple[float, float], ...]:
    """Per-layer static (k_scale, v_scale) for kv_cache_dtype: amax / max_value over the prompts.

    Args:
      model: a registered model; prompts: token-id lists (a few hundred tokens in all suffice).
      kv_cache_dtype: a quantized format name ("fp8", "fp8_e4m3", "fp8_e5m2", "int8").
    Returns:
      One (k_scale, v_scale) pair per layer, each a positive float.
    """
    fmt = get_kv_quant_format(kv_cache_dtype)
    if fmt is None:
        raise ValueError("kv_cache_dtype='auto' stores no scales; calibrate for 'fp8', 'fp8_e5m2' or 'int8'")
    if not prompts or not all(len(p) for p in prompts):
        raise ValueError("calibrate_kv_scales needs at least one non-empty prompt")
    spec = model.kv_cache_specs("float32")[0]
    amax = np.zeros((len(model.layers), 2))
    for prompt in prompts:
        _, caches = paged_prefill(model, prompt, spec)
        for i, (k_cache, v_cache) in enumerate(caches):
            # page 0 is the null page; the prompt's pages hold nothing else
            amax[i] = np.maximum(amax[i], [float(jnp.max(jnp.abs(k_cache[1:]))), float(jnp.max(jnp.abs(v_cache[1:])))])
    return tuple((max(float(k) / fmt.max_value, MIN_SCALE), max(float(v) / fmt.max_value, MIN_SCALE)) for k, v in amax)
