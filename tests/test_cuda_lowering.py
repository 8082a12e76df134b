"""The Pallas kernels lower for CUDA on this CPU-only machine (Triton IR is built at lowering).

This catches what interpret mode cannot: Triton's power-of-two block dims, unsupported ops
in the kernel body, and compiler params that route to the wrong GPU backend.
"""

import functools

import jax
import jax.numpy as jnp
import pytest

from paged_jax.core.kv_quant import FORMATS
from pallas_kernels.kv_cache_write import write_kv_cache
from pallas_kernels.paged_attention import PallasConfig, ragged_paged_attention

NUM_BLOCKS, BLOCK_SIZE, HEAD_DIM = 2048, 16, 128
NUM_TOKENS, MAX_NUM_SEQS, MAX_BLOCKS_PER_SEQ = 512, 64, 256  # max_model_len 4096


def attention_args(num_q_heads, num_kv_heads, dtype=jnp.bfloat16):
    cache = jax.ShapeDtypeStruct((NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, HEAD_DIM), dtype)
    return (jax.ShapeDtypeStruct((NUM_TOKENS, num_q_heads, HEAD_DIM), dtype), cache, cache,
            jax.ShapeDtypeStruct((MAX_NUM_SEQS, MAX_BLOCKS_PER_SEQ), jnp.int32),
            jax.ShapeDtypeStruct((MAX_NUM_SEQS,), jnp.int32),
            jax.ShapeDtypeStruct((MAX_NUM_SEQS + 1,), jnp.int32), jax.ShapeDtypeStruct((), jnp.int32))


def lower_for_cuda(fn, *args):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("num_q_heads, num_kv_heads", [(32, 8), (8, 8)], ids=["gqa32x8", "mha8x8"])
@pytest.mark.parametrize("config", [None, PallasConfig(decode_num_splits=1, prefill_rows=128, prefill_block_k=128)],
                         ids=["default", "alt"])
def test_pallas_attention_lowers_for_cuda(num_q_heads, num_kv_heads, dtype, config):
    fn = functools.partial(ragged_paged_attention, config=config)
    text = lower_for_cuda(fn, *attention_args(num_q_heads, num_kv_heads, dtype))
    # Two Triton launches: decode items and prefill query blocks.
    assert text.count("custom_call @__gpu$xla.gpu.triton") == 2, "expected the decode and the prefill kernel"


@pytest.mark.parametrize("sliding_window", [512, 100, 5])  # Gemma 3's; not a multiple of a page; under one page
@pytest.mark.parametrize("config", [None, PallasConfig(decode_num_splits=1, prefill_rows=128, prefill_block_k=128)],
                         ids=["default", "alt"])
def test_sliding_window_pallas_attention_lowers_for_cuda(sliding_window, config):
    """The windowed kernel (its tables shifted to the window and cut to the pages a window
    spans, per-row window masks) lowers in both launches."""
    fn = functools.partial(ragged_paged_attention, config=config, sliding_window=sliding_window)
    text = lower_for_cuda(fn, *attention_args(32, 8))
    assert text.count("custom_call @__gpu$xla.gpu.triton") == 2, "expected the decode and the prefill kernel"
    assert text.count(f"sliding_window_{sliding_window}\\00") == 2, "both launches are the windowed kernel"


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "int8"])
def test_sliding_window_quantized_pallas_attention_lowers_for_cuda(kv_cache_dtype):
    q, cache, _, *rest = attention_args(32, 8)
    pages = jax.ShapeDtypeStruct(cache.shape, FORMATS[kv_cache_dtype].page_dtype)
    scales = jax.ShapeDtypeStruct(cache.shape[:3], jnp.float32)
    fn = lambda *a, k_scale, v_scale: ragged_paged_attention(*a, k_scale=k_scale, v_scale=v_scale,  # noqa: E731
                                                             kv_cache_dtype=kv_cache_dtype, sliding_window=512)
    text = jax.jit(fn).trace(q, pages, pages, *rest, k_scale=scales, v_scale=scales).lower(
        lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @__gpu$xla.gpu.triton") == 2, "expected the decode and the prefill kernel"


def test_write_kv_cache_lowers_for_cuda():
    cache = jax.ShapeDtypeStruct((NUM_BLOCKS, BLOCK_SIZE, 8, HEAD_DIM), jnp.bfloat16)
    rows = jax.ShapeDtypeStruct((NUM_TOKENS, 8, HEAD_DIM), jnp.bfloat16)
    text = lower_for_cuda(write_kv_cache, rows, rows, cache, cache, jax.ShapeDtypeStruct((NUM_TOKENS,), jnp.int32))
    assert "scatter" in text


@pytest.mark.parametrize("config", [None, "split1"], ids=["default", "no_split"])
def test_mla_attention_lowers_for_cuda_at_deepseek_v2_lite_shapes(config):
    """DeepSeek-V2-Lite: 16 heads, kv_lora_rank 512, rope 64, nope 128, v 128, bf16."""
    from pallas_kernels.mla_attention import MlaPallasConfig, mla_paged_attention

    heads, latent, rope, nope, v = 16, 512, 64, 128, 128
    bf16 = jnp.bfloat16
    args = (jax.ShapeDtypeStruct((NUM_TOKENS, heads, nope), bf16),
            jax.ShapeDtypeStruct((NUM_TOKENS, heads, rope), bf16),
            jax.ShapeDtypeStruct((NUM_BLOCKS, BLOCK_SIZE, latent), bf16),
            jax.ShapeDtypeStruct((NUM_BLOCKS, BLOCK_SIZE, rope), bf16),
            jax.ShapeDtypeStruct((latent, heads, nope), bf16), jax.ShapeDtypeStruct((latent, heads, v), bf16),
            jax.ShapeDtypeStruct((MAX_NUM_SEQS, MAX_BLOCKS_PER_SEQ), jnp.int32),
            jax.ShapeDtypeStruct((MAX_NUM_SEQS,), jnp.int32), jax.ShapeDtypeStruct((MAX_NUM_SEQS + 1,), jnp.int32),
            jax.ShapeDtypeStruct((), jnp.int32))
    config = MlaPallasConfig(decode_num_splits=1) if config else None
    fn = functools.partial(mla_paged_attention, sm_scale=192 ** -0.5, config=config)
    text = lower_for_cuda(fn, *args)
    assert text.count("custom_call @__gpu$xla.gpu.triton") == 2, "expected the decode and the prefill kernel"


# quantized pages (int8 / fp8): the kernels read one byte per element and per-token f32 scales
QUANTIZED_FORMATS = ["fp8_e4m3", "fp8_e5m2", "int8"]


@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED_FORMATS)
@pytest.mark.parametrize("q_dtype", [jnp.bfloat16, jnp.float32], ids=lambda d: jnp.dtype(d).name)
def test_quantized_pallas_attention_lowers_for_cuda(kv_cache_dtype, q_dtype):
    q, cache, _, *rest = attention_args(32, 8, q_dtype)
    pages = jax.ShapeDtypeStruct(cache.shape, FORMATS[kv_cache_dtype].page_dtype)
    scales = jax.ShapeDtypeStruct(cache.shape[:3], jnp.float32)
    fn = lambda *a, k_scale, v_scale: ragged_paged_attention(*a, k_scale=k_scale, v_scale=v_scale,  # noqa: E731
                                                             kv_cache_dtype=kv_cache_dtype)
    text = jax.jit(fn).trace(q, pages, pages, *rest, k_scale=scales, v_scale=scales).lower(
        lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @__gpu$xla.gpu.triton") == 2, "expected the decode and the prefill kernel"
    # the scale operands reach the kernels: f32[2048, 16, 8] appears as a Triton operand type
    assert "2048x16x8xf32" in text


@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED_FORMATS)
def test_quantize_on_write_lowers_for_cuda(kv_cache_dtype):
    pages = jax.ShapeDtypeStruct((NUM_BLOCKS, BLOCK_SIZE, 8, HEAD_DIM), FORMATS[kv_cache_dtype].page_dtype)
    scales = jax.ShapeDtypeStruct((NUM_BLOCKS, BLOCK_SIZE, 8), jnp.float32)
    rows = jax.ShapeDtypeStruct((NUM_TOKENS, 8, HEAD_DIM), jnp.bfloat16)
    write = functools.partial(write_kv_cache, kv_cache_dtype=kv_cache_dtype)
    text = lower_for_cuda(write, rows, rows, pages, pages, jax.ShapeDtypeStruct((NUM_TOKENS,), jnp.int32),
                          scales, scales)
    assert text.count("scatter") >= 4  # pages and scales of K and V


@pytest.mark.parametrize("tp", [2, 16], ids=["tp2", "tp16_kv_replicated"])
def test_sharded_layer_lowers_for_cuda(tp):
    """One decoder layer of Llama-3.2-1B's shape (32 query heads, 8 KV heads, bf16) on a "tp"
    mesh, weights split by paged_jax/sharding.py's rules and the Pallas kernel per shard inside
    shard_map: the runner's layer program as the GPUs would get it. An AbstractMesh stands in
    for the devices; at tp=16 each KV head is held twice."""
    from flax import nnx
    from jax.sharding import AbstractMesh, AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    from models.kv_cache_spec import FullAttentionSpec
    from models.llama import DecoderLayer, LlamaConfig, LlamaForCausalLM
    from paged_jax.attention import make_attention_backend
    from paged_jax.core.step_inputs import AttentionMetadata
    from paged_jax.sharding import (TP_AXIS, ShardedAttention, cache_partition_specs, kv_head_replicas,
                                    param_shardings, sharded_cache_spec)

    config = LlamaConfig.from_preset("llama-3.2-1b")
    graphdef, state = nnx.split(nnx.eval_shape(lambda: DecoderLayer(config, rngs=nnx.Rngs(0))))
    mesh = AbstractMesh((tp,), (TP_AXIS,), axis_types=(AxisType.Auto,))  # as make_mesh's (jax 0.11 defaults to Explicit)
    replicas = kv_head_replicas(config.num_kv_heads, tp)
    spec = sharded_cache_spec(FullAttentionSpec(config.num_kv_heads, config.head_dim, "bfloat16"), tp)
    attention = ShardedAttention(make_attention_backend(spec, "pallas"), mesh, replicas)
    params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), state,
                          param_shardings(state, mesh, LlamaForCausalLM.param_partition_rules))

    def arg(shape, dtype, spec=P()):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))

    cache = tuple(arg((NUM_BLOCKS, BLOCK_SIZE, spec.num_kv_heads, config.head_dim), jnp.bfloat16, p)
                  for p in cache_partition_specs(spec))
    md = AttentionMetadata(arg((NUM_TOKENS,), jnp.int32), arg((MAX_NUM_SEQS, MAX_BLOCKS_PER_SEQ), jnp.int32),
                           arg((MAX_NUM_SEQS,), jnp.int32), arg((MAX_NUM_SEQS + 1,), jnp.int32),
                           arg((1,), jnp.int32))

    def layer(params, x, kv_cache, positions, md):
        return nnx.merge(graphdef, params)(x, positions, kv_cache, md, attention)

    # Outputs pinned as the runner pins them: activations replicated, caches as they came in.
    out_shardings = (NamedSharding(mesh, P()), tuple(a.sharding for a in cache))
    text = jax.jit(layer, donate_argnums=(2,), out_shardings=out_shardings).trace(
        params, arg((NUM_TOKENS, config.hidden_size), jnp.bfloat16), cache, arg((NUM_TOKENS,), jnp.int32),
        md).lower(lowering_platforms=("cuda",)).as_text()
    assert f"mhlo.num_partitions = {tp}" in text
    assert text.count("sdy.manual_computation(") == 1, "the attention backend runs per shard (one shard_map)"
    assert text.count("custom_call @__gpu$xla.gpu.triton") == 2, "expected the decode and the prefill kernel"
    assert text.count("tf.aliasing_output") == 2, "the donated k and v caches must alias outputs"
    assert text.count('[{}, {}, {"tp"}, {}]>, tf.aliasing_output') == 2, "each cache split on its KV-head axis"


@pytest.mark.parametrize("num_tokens, max_num_seqs", [(5, 1), (5, 2), (9, 1)])
def test_verification_buckets_lower_for_cuda(num_tokens, max_num_seqs):
    """Speculative decoding's 1 + k token buckets are not powers of two (SchedulerConfig.token_buckets)."""
    cache = jax.ShapeDtypeStruct((64, BLOCK_SIZE, 2, HEAD_DIM), jnp.bfloat16)
    args = (jax.ShapeDtypeStruct((num_tokens, 8, HEAD_DIM), jnp.bfloat16), cache, cache,
            jax.ShapeDtypeStruct((max_num_seqs, 16), jnp.int32), jax.ShapeDtypeStruct((max_num_seqs,), jnp.int32),
            jax.ShapeDtypeStruct((max_num_seqs + 1,), jnp.int32), jax.ShapeDtypeStruct((), jnp.int32))
    assert lower_for_cuda(ragged_paged_attention, *args).count("custom_call @__gpu$xla.gpu.triton") == 2


def test_processed_sampler_lowers_for_cuda():
    """The grammar mask and penalties (structured outputs) are plain XLA: they lower for CUDA
    at SmolLM2's vocabulary, for a plain head's rows and a verification step's."""
    from paged_jax.core.step_inputs import LogitsProcessingMetadata, SamplingMetadata
    from paged_jax.rejection_sampler import rejection_sample
    from paged_jax.sampler import sample

    s, k, vocab, history = 8, 4, 49152, 2048
    arg = jax.ShapeDtypeStruct
    meta = SamplingMetadata(arg((s,), jnp.float32), arg((s,), jnp.int32), arg((s,), jnp.float32),
                            arg((s, 2), jnp.uint32))

    def processing(rows):
        return LogitsProcessingMetadata(arg((rows, vocab // 32), jnp.int32), arg((s, 3), jnp.float32),
                                        arg((s, history), jnp.int32), arg((s, history), jnp.float32))

    assert "stablehlo" in lower_for_cuda(sample, arg((s, vocab), jnp.float32), meta, processing(s))
    def verify(logits, drafts, num_drafts, meta, processing):
        return rejection_sample(logits, drafts, num_drafts, meta, processing=processing)

    assert "stablehlo" in lower_for_cuda(verify, arg((s, k + 1, vocab), jnp.float32), arg((s, k), jnp.int32),
                                         arg((s,), jnp.int32), meta, processing(s * (k + 1)))
