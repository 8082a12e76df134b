"""The Pallas kernels lower for CUDA on this CPU-only machine (Triton IR is built at lowering).

This catches what interpret mode cannot: Triton's power-of-two block dims, unsupported ops
in the kernel body, and compiler params that route to the wrong GPU backend.
"""

import functools

import jax
import jax.numpy as jnp
import pytest

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
