"""Sampler against numpy references: greedy, filters, frequencies, seeds, logprobs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.core.step_inputs import SamplingMetadata
from paged_jax.sampler import sample

sample_jit = jax.jit(sample)


def _np_log_softmax(x):
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def _np_filtered_probs(logits, temperature, top_k, top_p):
    """Reference: softmax(logits / T), keep the top-k, renormalise, keep the smallest
    prefix (by descending prob) whose mass reaches top_p, renormalise."""
    p = np.exp(_np_log_softmax(logits / temperature))
    order = np.argsort(-p, kind="stable")
    keep = np.zeros(p.shape, bool)
    k = len(p) if top_k <= 0 else min(top_k, len(p))
    keep[order[:k]] = True
    q = np.where(keep, p, 0.0)
    q /= q.sum()
    mass = 0.0
    nucleus = np.zeros(p.shape, bool)
    for i in order[:k]:
        if mass >= top_p:
            break
        nucleus[i] = True
        mass += q[i]
    q = np.where(nucleus, q, 0.0)
    return q / q.sum()


def _run(logits, temperature, top_k, top_p, keys):
    s = logits.shape[0]
    out = sample_jit(jnp.asarray(logits, jnp.float32), SamplingMetadata(
        temperature=jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), (s,)),
        top_k=jnp.broadcast_to(jnp.asarray(top_k, jnp.int32), (s,)),
        top_p=jnp.broadcast_to(jnp.asarray(top_p, jnp.float32), (s,)),
        rng_keys=jnp.asarray(keys, jnp.uint32),
    ))
    return np.asarray(out[0]), np.asarray(out[1])


def _keys(seed, n):
    return np.stack([np.full(n, seed, np.uint32), np.arange(n, dtype=np.uint32)], axis=1)


@pytest.fixture
def logits():
    return np.random.default_rng(0).normal(size=(16, 50)).astype(np.float32) * 3


def test_greedy_is_argmax_and_logprob_is_log_softmax(logits):
    tokens, logprobs = _run(logits, 0.0, -1, 1.0, _keys(1, 16))
    np.testing.assert_array_equal(tokens, logits.argmax(-1))
    ref = _np_log_softmax(logits)[np.arange(16), tokens]
    np.testing.assert_allclose(logprobs, ref, rtol=1e-5, atol=1e-5)


def test_greedy_ties_take_the_first_index():
    """Greedy is argmax's tie rule (lowest id), also when the tie is the whole row."""
    logits = np.zeros((4, 50), np.float32)
    logits[0, [7, 3, 40]] = 2.0
    logits[1, [49, 48]] = 1.0
    logits[3, :] = -1.0
    tokens, logprobs = _run(logits, 0.0, -1, 1.0, _keys(1, 4))
    np.testing.assert_array_equal(tokens, [3, 48, 0, 0])
    np.testing.assert_allclose(logprobs, _np_log_softmax(logits)[np.arange(4), tokens], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("top_k,top_p", [(1, 1.0), (-1, 1e-6), (0, 1e-6), (1, 0.3)])
def test_filters_that_keep_one_token_are_greedy(logits, top_k, top_p):
    tokens, _ = _run(logits, 1.5, top_k, top_p, _keys(7, 16))
    np.testing.assert_array_equal(tokens, logits.argmax(-1))


def test_mixed_batch_greedy_rows_stay_greedy(logits):
    temperature = np.where(np.arange(16) % 2 == 0, 0.0, 1.0)
    tokens, logprobs = _run(logits, temperature, -1, 1.0, _keys(3, 16))
    np.testing.assert_array_equal(tokens[::2], logits.argmax(-1)[::2])
    ref = _np_log_softmax(logits)[np.arange(16), tokens]
    np.testing.assert_allclose(logprobs, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "temperature,top_k,top_p",
    [(1.0, -1, 1.0), (0.6, -1, 1.0), (1.0, 3, 1.0), (1.3, -1, 0.8), (1.0, 5, 0.6), (2.0, 4, 0.9)],
)
def test_frequencies_match_the_filtered_distribution(temperature, top_k, top_p):
    row = np.array([2.0, 1.5, 1.2, 0.9, 0.3, 0.0, -0.5, -1.0], np.float32)
    n = 40_000
    tokens, logprobs = _run(np.tile(row, (n, 1)), temperature, top_k, top_p, _keys(1234, n))
    expected = _np_filtered_probs(row, temperature, top_k, top_p)
    counts = np.bincount(tokens, minlength=len(row))
    assert np.all(counts[expected == 0] == 0), f"sampled outside the filter: {counts} vs {expected}"
    support = expected > 0
    chi2 = np.sum((counts[support] - n * expected[support]) ** 2 / (n * expected[support]))
    # df <= 7: the 99.99th percentile of chi-square(7) is about 29.9.
    assert chi2 < 30, f"chi2={chi2:.1f} counts={counts} expected={np.round(n * expected)}"
    np.testing.assert_allclose(logprobs, _np_log_softmax(row)[tokens], rtol=1e-5, atol=1e-5)


def test_same_keys_same_tokens_other_keys_other_tokens():
    logits = np.zeros((64, 100), np.float32)  # uniform: any key change shows up
    a, _ = _run(logits, 1.0, -1, 1.0, _keys(42, 64))
    b, _ = _run(logits, 1.0, -1, 1.0, _keys(42, 64))
    c, _ = _run(logits, 1.0, -1, 1.0, _keys(43, 64))
    np.testing.assert_array_equal(a, b)
    assert np.mean(a != c) > 0.8
    assert len(set(a.tolist())) > 30, "rows with different keys must draw independently"


def test_a_row_depends_only_on_its_own_key_and_logits():
    rng = np.random.default_rng(5)
    logits = rng.normal(size=(8, 30)).astype(np.float32)
    keys = _keys(9, 8)
    full, _ = _run(logits, 0.9, 10, 0.95, keys)
    for i in range(8):
        alone, _ = _run(logits[i : i + 1], 0.9, 10, 0.95, keys[i : i + 1])
        assert alone[0] == full[i]
