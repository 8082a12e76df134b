"""The Llama model: config validation, RoPE, and the paged forward against the dense forward.

The paged path (write_kv_cache + ragged_paged_attention through permuted block tables, with
padding to token and sequence buckets) must give the logits of the dense causal forward,
which shares only the weights with it.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.layers import apply_rope, rope_inv_freq
from models.kv_cache_spec import FullAttentionSpec, init_kv_caches, kv_cache_bytes_per_token
from models.llama import Llama3RopeScaling, LlamaConfig, LlamaForCausalLM
from hand_step_inputs import hand_step_inputs
from paged_jax.attention import make_attention_backend

# ---------------------------------------------------------------- config


def test_tiny_preset_is_small_gqa():
    c = LlamaConfig.from_preset("tiny")
    assert (c.vocab_size, c.num_heads, c.num_kv_heads, c.head_dim) == (512, 4, 2, 16)
    assert c.num_queries_per_kv == 2
    hash(c)  # lives in the nnx graphdef, which jit hashes


def test_real_presets_have_the_published_shapes():
    small = LlamaConfig.from_preset("llama-3.2-1b")
    big = LlamaConfig.from_preset("llama-3.1-8b")
    assert (small.hidden_size, small.num_layers, small.num_heads, small.num_kv_heads, small.head_dim,
            small.intermediate_size, small.tie_word_embeddings) == (2048, 16, 32, 8, 64, 8192, True)
    assert (big.hidden_size, big.num_layers, big.num_heads, big.num_kv_heads, big.head_dim,
            big.intermediate_size, big.tie_word_embeddings) == (4096, 32, 32, 8, 128, 14336, False)
    assert big.rope_scaling == Llama3RopeScaling(8.0, 1.0, 4.0, 8192)
    assert small.rope_scaling.factor == 32.0 and small.vocab_size == big.vocab_size == 128256


@pytest.mark.parametrize("overrides, field", [
    (dict(num_kv_heads=3), "num_heads"),
    (dict(head_dim=15), "head_dim"),
    (dict(num_layers=0), "num_layers"),
    (dict(vocab_size=-1), "vocab_size"),
    (dict(rms_norm_eps=0.0), "rms_norm_eps"),
    (dict(rope_theta=-1.0), "rope_theta"),
    (dict(dtype="int8"), "dtype"),
    (dict(param_dtype="float64"), "param_dtype"),
    (dict(eos_token_ids=(512,)), "eos_token_ids"),
    (dict(rope_scaling=dict(factor=8.0, low_freq_factor=4.0, high_freq_factor=1.0,
                            original_max_position_embeddings=64)), "low_freq_factor"),
    (dict(rope_scaling=dict(rope_type="yarn", factor=2.0)), "rope_type"),
])
def test_bad_config_names_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        LlamaConfig.from_preset("tiny", **overrides)


def test_unknown_preset_lists_the_choices():
    with pytest.raises(ValueError, match="tiny"):
        LlamaConfig.from_preset("gpt2")


def test_dtypes_are_canonical_names():
    c = LlamaConfig.from_preset("tiny", param_dtype=jnp.bfloat16, dtype="bf16")
    assert (c.param_dtype, c.dtype) == ("bfloat16", "bfloat16")


# ---------------------------------------------------------------- rope


def test_rope_scores_depend_only_on_relative_position():
    """<rope(q, m), rope(k, n)> is a function of m - n: the property RoPE exists for."""
    rng = np.random.default_rng(0)
    inv_freq = rope_inv_freq(16, 10000.0, None)
    q = jnp.asarray(rng.normal(size=(1, 1, 16)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(1, 1, 16)), jnp.float32)

    def score(m, n):
        qm = apply_rope(q, jnp.array([m]), inv_freq)
        kn = apply_rope(k, jnp.array([n]), inv_freq)
        return float(jnp.sum(qm * kn))

    assert score(7, 3) == pytest.approx(score(104, 100), rel=1e-4)
    assert score(0, 0) == pytest.approx(float(jnp.sum(q * k)), rel=1e-5)
    assert score(7, 3) != pytest.approx(score(7, 5), rel=1e-3)
    # a rotation: norms are kept
    assert float(jnp.linalg.norm(apply_rope(q, jnp.array([37]), inv_freq))) == pytest.approx(
        float(jnp.linalg.norm(q)), rel=1e-5)


def test_llama3_scaling_bands():
    """High frequencies are kept, low ones divided by factor, the band between interpolated."""
    scaling = Llama3RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                original_max_position_embeddings=64)
    base = rope_inv_freq(32, 10000.0, None)
    scaled = rope_inv_freq(32, 10000.0, scaling)
    wavelen = 2 * math.pi / base
    high, low = wavelen < 64 / 4, wavelen > 64 / 1
    assert high.any() and low.any() and (~high & ~low).any()
    np.testing.assert_array_equal(scaled[high], base[high])
    np.testing.assert_allclose(scaled[low], base[low] / 8.0, rtol=1e-6)
    mid = ~high & ~low
    assert np.all(scaled[mid] < base[mid]) and np.all(scaled[mid] > base[mid] / 8.0)


# ---------------------------------------------------------------- paged vs dense


# Per sequence: its total length, then per step the end of the tokens it runs (None: idle).
# Sequence 0 prefills in 3 chunks then decodes; 1 prefills at once then decodes; 2 joins late.
SCHEDULE = {
    0: (23, [7, 16, 19, 20, 21, 22, 23]),
    1: (13, [10, 11, 12, 13, None, None, None]),
    2: (11, [None, None, 5, 9, 10, 11, None]),
}


def run_paged_vs_dense(config, impl, *, block_size=4, num_blocks=20, token_bucket=24, seq_bucket=4,
                       seed=0, atol=1e-4, rtol=1e-4):
    model = LlamaForCausalLM(config, rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    tokens = {i: rng.integers(0, config.vocab_size, size=n) for i, (n, _) in SCHEDULE.items()}
    # Random permuted block ids from 1.. (0 is the null block), disjoint across sequences.
    perm = iter(rng.permutation(np.arange(1, num_blocks)).tolist())
    block_ids = {i: [next(perm) for _ in range(-(-n // block_size))] for i, (n, _) in SCHEDULE.items()}
    width = max(len(b) for b in block_ids.values()) + 2  # padded columns point to block 0

    dense = {i: np.asarray(model.dense_forward(jnp.asarray(t)[None]))[0] for i, t in tokens.items()}

    # Pages nobody has written yet hold NaN: attention must mask by seq_len, not multiply by 0.
    specs = model.kv_cache_specs()
    kv_caches = init_kv_caches(specs, num_blocks, block_size)
    kv_caches = [(k.at[1:].set(jnp.nan), v.at[1:].set(jnp.nan)) for k, v in kv_caches]
    attention = make_attention_backend(specs[0], impl, interpret=(impl == "pallas"))
    step = jax.jit(lambda inputs, caches: model(inputs.model, caches, inputs.attention.for_group(0), attention))

    done = {i: 0 for i in SCHEDULE}
    num_steps = len(SCHEDULE[0][1])
    for s in range(num_steps):
        chunks, order = [], []
        for i, (_, ends) in SCHEDULE.items():
            if ends[s] is not None:
                chunks.append((tokens[i], block_ids[i], done[i], ends[s]))
                order.append(i)
        inputs = hand_step_inputs(chunks, block_size, width, token_bucket, seq_bucket)
        logits, kv_caches = step(inputs, kv_caches)
        logits = np.asarray(logits)
        assert logits.shape == (seq_bucket, config.vocab_size) and logits.dtype == np.float32
        for row, i in enumerate(order):
            pos = SCHEDULE[i][1][s] - 1
            np.testing.assert_allclose(logits[row], dense[i][pos], atol=atol, rtol=rtol,
                                       err_msg=f"step {s} sequence {i} position {pos}")
            done[i] = SCHEDULE[i][1][s]
    assert done == {i: n for i, (n, _) in SCHEDULE.items()}


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_paged_forward_matches_dense(impl):
    run_paged_vs_dense(LlamaConfig.from_preset("tiny"), impl)


def test_paged_forward_matches_dense_tied_llama3_rope():
    config = LlamaConfig.from_preset("tiny", tie_word_embeddings=True, rope_theta=500000.0,
                                     rope_scaling=dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                                       original_max_position_embeddings=16))
    run_paged_vs_dense(config, "xla", block_size=8, num_blocks=12, seed=1)


def test_paged_forward_bf16_close_to_dense():
    """bf16 weights and compute: the two paths round differently, so only close, not equal."""
    config = LlamaConfig.from_preset("tiny", param_dtype="bfloat16", dtype="bfloat16")
    run_paged_vs_dense(config, "xla", atol=0.15, rtol=0.05)


def test_dense_forward_is_causal():
    """Changing a later token never changes earlier logits (the reference must itself be causal)."""
    config = LlamaConfig.from_preset("tiny")
    model = LlamaForCausalLM(config, rngs=nnx.Rngs(3))
    ids = jnp.asarray(np.random.default_rng(3).integers(0, 512, size=(2, 12)), jnp.int32)
    changed = ids.at[:, 8].set((ids[:, 8] + 1) % 512)
    a, b = np.asarray(model.dense_forward(ids)), np.asarray(model.dense_forward(changed))
    np.testing.assert_array_equal(a[:, :8], b[:, :8])
    assert np.abs(a[:, 8:] - b[:, 8:]).max() > 1e-3


# ---------------------------------------------------------------- kv caches and donation


def test_kv_cache_helpers():
    config = LlamaConfig.from_preset("tiny")
    model = LlamaForCausalLM(config, rngs=nnx.Rngs(0))
    specs = model.kv_cache_specs()
    assert specs == (FullAttentionSpec(num_kv_heads=2, head_dim=16, dtype="float32"),) * config.num_layers
    caches = init_kv_caches(specs, num_blocks=10, block_size=16)
    assert len(caches) == config.num_layers
    assert caches[0][0].shape == (10, 16, 2, 16) and caches[0][0].dtype == jnp.float32
    total = sum(k.nbytes + v.nbytes for k, v in caches)
    assert kv_cache_bytes_per_token(specs) * 16 * 10 == total
    assert kv_cache_bytes_per_token(model.kv_cache_specs("bfloat16")) * 2 == kv_cache_bytes_per_token(specs)
    # Llama-3.1-8B in bf16: 32 layers * 2 (K, V) * 8 kv heads * 128 dims * 2 bytes = 128 KiB per token
    big = nnx.eval_shape(lambda: LlamaForCausalLM(LlamaConfig.from_preset("llama-3.1-8b"), rngs=nnx.Rngs(0)))
    assert kv_cache_bytes_per_token(big.kv_cache_specs()) == 131072
    with pytest.raises(AssertionError, match="null block"):
        init_kv_caches(specs, num_blocks=1, block_size=16)


def test_step_with_donated_caches_updates_in_place():
    """jit(split/merge) with the caches donated: no cache-sized temporary, the inputs are consumed."""
    config = LlamaConfig.from_preset("tiny")
    model = LlamaForCausalLM(config, rngs=nnx.Rngs(0))
    attention = make_attention_backend(model.kv_cache_specs()[0], "xla")
    graphdef, state = nnx.split(model)

    @functools.partial(jax.jit, donate_argnums=(1,))
    def step(state, kv_caches, inputs):
        model = nnx.merge(graphdef, state)
        return model(inputs.model, kv_caches, inputs.attention.for_group(0), attention)

    num_blocks, block_size = 512, 16
    kv_caches = init_kv_caches(model.kv_cache_specs(), num_blocks, block_size)
    cache_bytes = kv_caches[0][0].nbytes
    tokens = np.arange(5) + 3
    inputs = hand_step_inputs([(tokens, [7], 0, 5)], block_size, width=4, token_bucket=8, seq_bucket=2)
    inputs = jax.tree.map(jnp.asarray, inputs)

    stats = step.lower(state, kv_caches, inputs).compile().memory_analysis()
    total = 2 * config.num_layers * cache_bytes
    assert stats.alias_size_in_bytes >= total, "caches are not aliased to the outputs"
    assert stats.temp_size_in_bytes < cache_bytes, f"a cache-sized temporary exists: {stats}"

    pointers = [k.unsafe_buffer_pointer() for k, _ in kv_caches]
    _, new_caches = step(state, kv_caches, inputs)
    assert all(k.is_deleted() and v.is_deleted() for k, v in kv_caches)
    assert [k.unsafe_buffer_pointer() for k, _ in new_caches] == pointers
    # and the step's keys did land in block 7
    assert float(jnp.abs(new_caches[0][0][7, :5]).sum()) > 0
    assert float(jnp.abs(new_caches[0][0][7, 5:]).sum()) == 0
    # blocks 1..6 untouched (padded tokens write into the null block 0)
    assert float(jnp.abs(new_caches[0][0][1:7]).sum()) == 0


def test_wrong_number_of_caches_is_a_value_error():
    config = LlamaConfig.from_preset("tiny")
    model = LlamaForCausalLM(config, rngs=nnx.Rngs(0))
    inputs = hand_step_inputs([(np.arange(3), [1], 0, 3)], 4, 2, 4, 1)
    caches = init_kv_caches(model.kv_cache_specs()[:1], 4, 4)
    with pytest.raises(ValueError, match="got 1 layer caches for 2 layers"):
        model(inputs.model, caches, inputs.attention.for_group(0), make_attention_backend(model.kv_cache_specs()[0], "xla"))
