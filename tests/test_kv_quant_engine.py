"""The engine with a quantized KV pool: prefix caching, preemption, chunked prefill, donation.

Reference: the dense generation loop (no cache, no paging) with the same quantization applied
to K and V where they are computed (quantize, then dequantize, per token and KV head, or with
the static per-tensor scales; keys rotated by key_rotation before and back after, as the pool
stores them). The paged engine stores the quantized values and dequantizes
them inside attention, so it must pick the reference's greedy tokens in every configuration.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from engine_reference import (BLOCK_SIZE, ENGINE_CONFIGS, MAX_MODEL_LEN, assert_no_leak, big_llm, greedy_params,
                              make_prompts, run_to_completion)
from models.llama import Attention
from paged_jax.core.config import CacheConfig, SchedulerConfig
from paged_jax.core.kv_quant import FORMATS, key_rotation
from paged_jax.engine import LLMEngine
from paged_jax.engine_config import EngineConfig, ResolvedConfig
from paged_jax.runner import ModelRunner
from pallas_kernels.kv_cache_write import dequantize_pages, quantize_rows

LOGPROB_TOL = 1e-3  # the dense loop and the kernels round differently (f32): a rare rounding flip of one element
# A bf16 pool: the reference rounds q, k, v and the attention output as the pool does, but not
# the attention's own bf16 intermediates (4.4e-3 apart at most here; the unrounded dense loop
# is 0.54 apart and picks another token once).
BF16_LOGPROB_TOL = 1e-2


def fake_quant_dense_greedy(prompts, max_tokens, kv_cache_dtype, kv_scales=None):
    """dense_greedy (engine_reference) with K and V quantized and dequantized as computed."""
    fmt = FORMATS[kv_cache_dtype]
    original = Attention._qkv

    def fake(x, scale):
        stored, row_scale = quantize_rows(x, fmt, scale)
        return dequantize_pages(stored, row_scale).astype(x.dtype)

    def qkv(self, x, positions):
        q, k, v = original(self, x, positions)
        # keys are stored rotated (the offsets are zeros here): quantize k @ R, read back @ R^T
        rotation = jnp.asarray(key_rotation(k.shape[-1]))
        hi = jax.lax.Precision.HIGHEST
        k = jnp.matmul(fake(jnp.matmul(k.astype(jnp.float32), rotation, precision=hi),
                            None if kv_scales is None else kv_scales[0]).astype(jnp.float32), rotation.T, precision=hi)
        return q, k.astype(q.dtype), fake(v, None if kv_scales is None else kv_scales[1])

    return patched_dense_greedy(prompts, max_tokens, {"_qkv": qkv})


def patched_dense_greedy(prompts, max_tokens, patches: dict):
    """dense_greedy (engine_reference) with Attention's methods replaced by `patches` (name ->
    function) while the dense step traces; returns (tokens, logprobs) per prompt."""
    graphdef, state = nnx.split(big_llm().engine.model)

    @jax.jit
    def step(token_ids, last):
        logits = nnx.merge(graphdef, state).dense_forward(token_ids)
        return jax.nn.log_softmax(jnp.take_along_axis(logits, last[:, None, None], axis=1)[:, 0], axis=-1)

    originals = {name: getattr(Attention, name) for name in patches}
    for name, fn in patches.items():  # traced once, below; restored before anything else traces a layer
        setattr(Attention, name, fn)
    try:
        n = len(prompts)
        tokens = np.zeros((-(-n // 8) * 8, MAX_MODEL_LEN), np.int32)
        lens = np.ones(tokens.shape[0], np.int32)
        for i, p in enumerate(prompts):
            tokens[i, : len(p)], lens[i] = p, len(p)
        outs, logprobs = [[] for _ in range(n)], [[] for _ in range(n)]
        while active := [i for i in range(n) if len(outs[i]) < max_tokens[i]]:
            logp = np.asarray(step(jnp.asarray(tokens), jnp.asarray(lens - 1)))
            for i in active:
                t = int(np.argmax(logp[i]))
                outs[i].append(t)
                logprobs[i].append(float(logp[i, t]))
                tokens[i, lens[i]] = t
                lens[i] += 1
        return outs, logprobs
    finally:
        for name, fn in originals.items():
            setattr(Attention, name, fn)


@functools.cache
def quantized_engine(name: str, kv_cache_dtype: str = "fp8", **kwargs) -> LLMEngine:
    base = big_llm().engine
    config = EngineConfig(model="tiny", max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE, warm_up="full",
                          kv_cache_dtype=kv_cache_dtype, **ENGINE_CONFIGS[name], **kwargs)
    return LLMEngine(config, model=base.model, tokenizer=base.tokenizer)


@pytest.fixture(scope="module")
def workload():
    prompts, max_tokens = make_prompts(seed=1, num=16)
    assert all(len(p) + m <= MAX_MODEL_LEN for p, m in zip(prompts, max_tokens))
    return prompts, max_tokens


def run(engine, prompts, max_tokens, prefix):
    for i, (p, m) in enumerate(zip(prompts, max_tokens)):
        engine.add_request(f"{prefix}-{i}", p, greedy_params(m, logprobs=True))
    finished = run_to_completion(engine)
    return [finished[f"{prefix}-{i}"] for i in range(len(prompts))]


def check_against_reference(outputs, reference, engine, before, atol=LOGPROB_TOL):
    ref_tokens, ref_logprobs = reference
    assert [o.token_ids for o in outputs] == ref_tokens
    for o, ref in zip(outputs, ref_logprobs):
        np.testing.assert_allclose(o.outputs[0].logprobs, ref, atol=atol, rtol=0)
    after = engine.get_stats()
    assert after["prefix_cache_hits"] > before["prefix_cache_hits"]  # the shared system prompt's blocks
    assert after["num_compilations"] == before["num_compilations"]
    assert_no_leak(engine)
    return after


@pytest.mark.slow
def test_fp8_engine_with_preemption_matches_fake_quantized_dense_reference(workload):
    """An fp8 pool with per-token scales, small enough that requests are preempted (and
    recomputed, their prefix blocks found again in the cache): the dense loop's greedy tokens
    over the same quantized K/V, logprobs within rounding, and the pool comes back whole."""
    prompts, max_tokens = workload
    reference = fake_quant_dense_greedy(prompts, max_tokens, "fp8_e4m3")
    engine = quantized_engine("small_pool")
    before = engine.get_stats()
    after = check_against_reference(run(engine, prompts, max_tokens, "fp8"), reference, engine, before)
    assert after["num_preemptions"] > before["num_preemptions"]


@pytest.mark.slow
def test_int8_per_tensor_engine_with_chunked_prefill_matches_fake_quantized_dense_reference(workload):
    """int8 with static per-tensor scales (runtime inputs of the layer programs; one pair for
    every layer here, so the dense reference can apply them too), prompts longer than the
    step budget prefilled in chunks over a quantized prefix."""
    prompts, max_tokens = workload
    scales = (0.03, 0.02)
    reference = fake_quant_dense_greedy(prompts, max_tokens, "int8", kv_scales=scales)
    engine = quantized_engine("chunked", "int8", kv_cache_scaling="per_tensor", kv_scales=scales)
    assert sum(len(p) > ENGINE_CONFIGS["chunked"]["max_num_batched_tokens"] for p in prompts) >= 4
    before = engine.get_stats()
    check_against_reference(run(engine, prompts, max_tokens, "int8"), reference, engine, before)


def bf16_dense_greedy(prompts, max_tokens):
    """dense_greedy with the bf16 pool's rounding: q, k and v rounded to bfloat16 (the pool
    stores k and v so, attention reads q in the cache dtype) and the attention output too (it
    comes back in the cache dtype)."""
    qkv, out = Attention._qkv, Attention._out

    def bf16(x):
        return x.astype(jnp.bfloat16).astype(x.dtype)

    return patched_dense_greedy(prompts, max_tokens, {"_qkv": lambda self, x, positions: tuple(
        map(bf16, qkv(self, x, positions))), "_out": lambda self, attn: out(self, bf16(attn))})


@pytest.mark.slow
def test_bf16_pool_under_an_f32_model_matches_its_dense_reference(workload):
    """kv_cache_dtype="bfloat16" under the f32 model: bf16 pages (half the f32 pool's bytes a
    token), and the dense loop's greedy tokens with the same roundings, logprobs within rounding,
    through preemption and the prefix cache; the pool comes back whole. Without the roundings
    the reference's logprobs differ (so the check sees them)."""
    prompts, max_tokens = workload
    engine = quantized_engine("small_pool", "bfloat16")
    assert [a.dtype.name for a in engine.runner.kv_caches[0]] == ["bfloat16"] * 2
    assert 2 * engine.runner.pool.kv_cache_bytes == big_llm().engine.runner.pool.kv_cache_bytes * (
        engine.cache_config.num_blocks / big_llm().engine.cache_config.num_blocks)
    reference = bf16_dense_greedy(prompts, max_tokens)
    before = engine.get_stats()
    outputs = run(engine, prompts, max_tokens, "bf16")
    after = check_against_reference(outputs, reference, engine, before, atol=BF16_LOGPROB_TOL)
    assert after["num_preemptions"] > before["num_preemptions"]
    unrounded = patched_dense_greedy(prompts, max_tokens, {})[1]
    assert max(np.abs(np.subtract(o.outputs[0].logprobs[:len(r)], r[:len(o.outputs[0].logprobs)])).max()
               for o, r in zip(outputs, unrounded)) > BF16_LOGPROB_TOL


def test_bf16_pool_rejects_static_scales():
    """Static scales and key offsets belong to a quantized pool: a bf16 one is not."""
    with pytest.raises(ValueError, match="kv_scales"):
        EngineConfig(model="tiny", kv_cache_dtype="bfloat16", kv_cache_scaling="per_tensor", kv_scales=(1.0, 1.0))
    with pytest.raises(ValueError, match="kv_key_offsets"):
        EngineConfig(model="tiny", kv_cache_dtype="bfloat16", kv_key_offsets=np.zeros((2, 2, 64)))


def test_quantized_pool_is_sized_and_donated_in_place():
    """The quantized pool's leaves (pages and scales) are donated to each layer program and
    updated in place: the compiled program aliases them all and its temporaries stay far below
    one layer's cache, so no dequantized copy of the cache exists (memory analysis; a pool of
    4097 blocks so that the pool, not the step's activations, dominates)."""
    model = big_llm().engine.model
    config = model.config
    num_blocks = 4097
    runner = ModelRunner(model, ResolvedConfig(EngineConfig(kv_cache_dtype="fp8"),
                                               CacheConfig(BLOCK_SIZE, num_blocks, MAX_MODEL_LEN),
                                               SchedulerConfig(8, 16, MAX_MODEL_LEN)))
    per_token = config.num_kv_heads * (2 * config.head_dim * 1 + 2 * 4)  # fp8 pages + f32 scales
    assert runner.pool.kv_cache_bytes == config.num_layers * num_blocks * BLOCK_SIZE * per_token
    assert [a.dtype.name for a in runner.kv_caches[0]] == ["uint8"] * 2 + ["float32"] * 2
    layer_cache_bytes = runner.pool.kv_cache_bytes // config.num_layers
    k = runner.layers_per_program
    t, s = runner.bucket_shapes()[-1]  # the 16-token bucket (the smaller ones are decode batches)
    layer = runner.compiled_memory(t, s)["layer"]
    assert layer.alias_size_in_bytes == k * layer_cache_bytes
    # a dequantized f32 copy of one layer's pages would be 3.2x layer_cache_bytes
    assert layer.temp_size_in_bytes < layer_cache_bytes / 4
    assert layer.output_size_in_bytes - layer.alias_size_in_bytes < layer_cache_bytes / 4
    before = [a for cache in runner.kv_caches for a in cache]
    runner.execute(runner.dummy_inputs(t, s))
    assert all(a.is_deleted() for a in before), "the step kept the old pages alive: donation did not happen"


def test_memory_budget_holds_more_tokens_when_quantized():
    """The same kv_cache_memory_bytes buys 8 * head_dim / (2 * head_dim + 8) times the blocks of
    f32 (scales included: 3.2x at the tiny model's head_dim 16, 3.88x at 128) and half that over bf16."""
    model = big_llm().engine.model
    budget = 1 << 20
    blocks = {}
    for dtype, kv in (("float32", "auto"), ("bfloat16", "auto"), ("float32", "fp8"), ("float32", "int8")):
        config = EngineConfig(model="tiny", kv_cache_memory_bytes=budget, dtype=dtype, kv_cache_dtype=kv,
                              max_model_len=MAX_MODEL_LEN)
        blocks[(dtype, kv)] = config.resolve(model).cache.num_blocks
    head_dim = model.config.head_dim
    assert blocks[("float32", "fp8")] == blocks[("float32", "int8")]
    # per (token, KV head): f32 8 * head_dim bytes, bf16 4 * head_dim, fp8 2 * head_dim + 8
    expected_ratio = 8 * head_dim / (2 * head_dim + 8)
    assert abs(blocks[("float32", "fp8")] / blocks[("float32", "auto")] - expected_ratio) < 0.05
    assert abs(blocks[("float32", "fp8")] / blocks[("bfloat16", "auto")] - expected_ratio / 2) < 0.05


def dense_keys_values(model, token_ids) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each layer's (keys, values) f32[T, K, H] of one sequence as the dense forward (no cache)
    computes them: K after RoPE, captured where Attention computes them."""
    captured, original = [], Attention._qkv

    def qkv(self, x, positions):
        q, k, v = original(self, x, positions)
        captured.append((np.asarray(k, np.float32)[0], np.asarray(v, np.float32)[0]))
        return q, k, v

    Attention._qkv = qkv
    try:
        model.dense_forward(jnp.asarray([token_ids], jnp.int32))
    finally:
        Attention._qkv = original
    return captured


def test_calibration_reads_the_dense_models_keys_and_values(workload):
    """calibrate_key_offsets is each layer's mean key over every prompt token, and
    calibrate_kv_scales' K scale covers the keys as the pool stores them, (k - offset) @ R:
    both against the dense forward's own K and V."""
    from paged_jax.kv_calibration import calibrate_key_offsets, calibrate_kv_scales

    model = big_llm().engine.model
    prompts = [p for p in workload[0] if len(p) > 20][:3]
    dense = [dense_keys_values(model, p) for p in prompts]  # [prompt][layer] -> (k, v)
    keys = [np.concatenate([d[i][0] for d in dense]) for i in range(len(model.layers))]
    values = [np.concatenate([d[i][1] for d in dense]) for i in range(len(model.layers))]
    offsets = calibrate_key_offsets(model, prompts)
    expected = np.stack([k.mean(axis=0) for k in keys])
    assert offsets.shape == expected.shape and np.abs(expected).max() > 0.1
    np.testing.assert_allclose(offsets, expected, rtol=1e-4, atol=1e-5)

    rotation = key_rotation(keys[0].shape[-1]).astype(np.float64)
    scales = np.array(calibrate_kv_scales(model, prompts, "int8", key_offsets=offsets))
    for i, (k, v) in enumerate(zip(keys, values)):
        stored = (k - offsets[i]).astype(np.float64) @ rotation
        np.testing.assert_allclose(scales[i], [np.abs(stored).max() / 127, np.abs(v).max() / 127], rtol=1e-4)
    with pytest.raises(ValueError, match="at least one non-empty prompt"):
        calibrate_key_offsets(model, [[]])


def test_pages_hold_each_layers_centered_rotated_keys(workload):
    """With kv_key_offsets (a different one per layer, one layer per program), each layer's
    pages stand for (k - offset[layer]) @ R: read back, rotated back and offset again, they
    equal the dense forward's keys within fp8's error, and its values as they are. A layer
    given another layer's offset, or none, misses by the offset's size."""
    base = big_llm().engine
    model = base.model
    prompt = max(workload[0], key=len)
    dense = dense_keys_values(model, prompt)
    rng = np.random.default_rng(5)
    rms = np.sqrt(np.mean([np.mean(k ** 2) for k, _ in dense]))
    offsets = (rng.standard_normal((len(dense), *dense[0][0].shape[1:])) * 3 * rms).astype(np.float32)
    config = EngineConfig(model="tiny", max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE, warm_up="none",
                          kv_cache_dtype="fp8", kv_key_offsets=offsets, layers_per_program=1,
                          max_num_batched_tokens=256, num_blocks=64)
    engine = LLMEngine(config, model=model, tokenizer=base.tokenizer)
    engine.add_request("r", prompt, greedy_params(4))
    engine.step()  # the whole prompt is prefilled in this step
    (block_ids,) = engine.kv_cache_manager.get_block_ids("r")
    fmt = FORMATS["fp8_e4m3"]
    rotation = key_rotation(dense[0][0].shape[-1]).astype(np.float64)
    n = len(prompt)
    for i, ((k, v), cache) in enumerate(zip(dense, engine.runner.kv_caches)):
        k_pages, v_pages, k_scale, v_scale = (np.asarray(a)[block_ids].reshape(-1, *a.shape[2:])[:n] for a in cache)
        stored = dequantize_pages(jnp.asarray(k_pages), jnp.asarray(k_scale), fmt)
        keys = np.asarray(stored, np.float64) @ rotation.T + offsets[i]
        err = np.linalg.norm(keys - k, axis=-1) / np.linalg.norm(k - offsets[i], axis=-1)
        assert err.max() <= fmt.relative_error * 1.01, (i, err.max())
        values = np.asarray(dequantize_pages(jnp.asarray(v_pages), jnp.asarray(v_scale), fmt))
        assert np.all(np.abs(values - v) <= fmt.relative_error * np.abs(v).max(axis=-1, keepdims=True))
        other = offsets[(i + 1) % len(offsets)]
        assert np.min(np.linalg.norm(keys - offsets[i] + other - k, axis=-1)
                      / np.linalg.norm(k - offsets[i], axis=-1)) > 10 * fmt.relative_error
    run_to_completion(engine)
    assert_no_leak(engine)
