"""On-device sampling: greedy, temperature, top-k, top-p (nucleus) and per-request keys.

Every parameter is per row, so one jitted function with fixed shapes serves any mix of
requests. The runner calls `sample` inside its jitted step; the keys come from the host
(batch.py derives them from the request's seed and its number of output tokens, so a
seeded request draws the same tokens whatever batch it lands in and after preemption).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from cpu_kernels.row_stats import argmax_logsumexp, argmax_logsumexp_reference

# Temperatures below this are greedy, as in vLLM (dividing by ~0 would overflow the logits).
SAMPLING_EPS = 1e-5


def _top_k_top_p(scaled, top_k, top_p):
    """Masks (to -inf) every logit outside the row's top-k, then outside its nucleus.

    Args:
      scaled: f32[S, V] temperature-scaled logits.
      top_k: i32[S]; <= 0 or >= V keeps everything.
      top_p: f32[S] in (0, 1]; 1 keeps everything.
    Returns:
      f32[S, V] with the dropped logits at -inf. Ties with the last kept value are kept.
    """
    vocab = scaled.shape[-1]
    sorted_desc = -jnp.sort(-scaled, axis=-1)
    k = jnp.where((top_k <= 0) | (top_k >= vocab), vocab, top_k)
    rank = jnp.arange(vocab, dtype=jnp.int32)[None, :]
    in_top_k = rank < k[:, None]
    # top-p works on the distribution renormalised over the top-k (vLLM's order):
    # a token is kept while the mass ranked strictly above it is still below p.
    probs = jax.nn.softmax(jnp.where(in_top_k, sorted_desc, -jnp.inf), axis=-1)
    mass_above = jnp.cumsum(probs, axis=-1) - probs
    keep = in_top_k & (mass_above < top_p[:, None])
    num_keep = jnp.maximum(jnp.sum(keep, axis=-1), 1)  # keep is a prefix; the top token always stays
    threshold = jnp.take_along_axis(sorted_desc, (num_keep - 1)[:, None], axis=-1)
    return jnp.where(scaled >= threshold, scaled, -jnp.inf)


def _sample_random(logits, temperature, top_k, top_p, rng_keys):
    vocab = logits.shape[-1]
    scaled = logits / jnp.maximum(temperature, SAMPLING_EPS)[:, None]
    needs_filter = jnp.any(((top_k > 0) & (top_k < vocab)) | (top_p < 1.0))
    # cond, not where: the full-vocab sort runs only on steps where some row filters.
    scaled = jax.lax.cond(needs_filter, _top_k_top_p, lambda s, k, p: s, scaled, top_k, top_p)
    keys = jax.random.wrap_key_data(rng_keys.astype(jnp.uint32), impl="threefry2x32")
    return jax.vmap(jax.random.categorical)(keys, scaled).astype(jnp.int32)


def apply_token_bitmask(logits, bitmask):
    """-inf at every token a row's grammar forbids.

    Args:
      logits: f32[R, V].
      bitmask: i32[R, W], W * 32 >= V: bit b of word w allows token 32 * w + b (llguidance's
        and xgrammar's layout); all ones (-1) allows everything.
    """
    vocab = logits.shape[-1]
    bits = jnp.right_shift(bitmask[:, :, None].astype(jnp.uint32), jnp.arange(32, dtype=jnp.uint32)) & 1
    allowed = bits.reshape(bitmask.shape[0], -1)[:, :vocab] != 0
    return jnp.where(allowed, logits, -jnp.inf)


def apply_penalties(logits, penalties, history_ids, output_counts):
    """vLLM's repetition, then frequency and presence penalties, per sequence.

    Args:
      logits: f32[S, ..., V] (a verification step's [S, K + 1, V]: every position of a
        sequence gets its penalties; sequences with proposals carry none, see the engine).
      penalties: f32[S, 3] (presence, frequency, repetition).
      history_ids: i32[S, H] distinct ids of the prompt and the output; ids >= V are padding.
      output_counts: f32[S, H] how often each of them occurs in the output.
    Returns:
      logits with, for every id in the history, positive logits divided by the repetition
      penalty and negative ones multiplied by it; then minus frequency * count and minus
      presence where count > 0. Rows with (0, 0, 1) are returned unchanged, bit for bit.
    """
    num_seqs, vocab = logits.shape[0], logits.shape[-1]
    rows = jnp.arange(num_seqs, dtype=jnp.int32)[:, None]
    counts = jnp.zeros((num_seqs, vocab), jnp.float32).at[rows, history_ids].add(output_counts, mode="drop")
    seen = jnp.zeros((num_seqs, vocab), jnp.bool_).at[rows, history_ids].set(True, mode="drop")
    extra = (1,) * (logits.ndim - 2)  # broadcast over the positions of a verification step
    presence, frequency, repetition = (penalties[:, i].reshape(num_seqs, *extra, 1) for i in range(3))
    counts, seen = counts.reshape(num_seqs, *extra, vocab), seen.reshape(num_seqs, *extra, vocab)
    logits = jnp.where(seen, jnp.where(logits > 0, logits / repetition, logits * repetition), logits)
    return logits - frequency * counts - presence * (counts > 0).astype(jnp.float32)


def process_logits(logits, processing):
    """The grammar masks and the penalties of a LogitsProcessingMetadata (step_inputs.py).

    logits: f32[S, V], or f32[S, K + 1, V] with the mask's rows in sequence-major order. Each
    part runs only on steps where some row uses it (cond: a free row costs nothing)."""
    shape = logits.shape
    bitmask = processing.bitmask
    flat = logits.reshape(-1, shape[-1])
    flat = jax.lax.cond(jnp.any(bitmask != -1), apply_token_bitmask, lambda x, m: x, flat, bitmask)
    logits = flat.reshape(shape)
    none = jnp.array([0.0, 0.0, 1.0], jnp.float32)
    return jax.lax.cond(jnp.any(processing.penalties != none), apply_penalties, lambda x, *_: x, logits,
                        processing.penalties, processing.history_ids, processing.output_counts)


def sample(logits, sampling_metadata, processing=None):
    """Draws one token per row.

    Args:
      logits: f32[S, V] (any float dtype; computed in f32).
      sampling_metadata: a paged_jax.core.step_inputs.SamplingMetadata, per row:
        temperature f32[S] (< 1e-5 means greedy), top_k i32[S] (-1 or 0 disables),
        top_p f32[S] in (0, 1] (1.0 disables), rng_keys u32[S, 2] threefry key data.
      processing: a LogitsProcessingMetadata (grammar masks, penalties) applied before the
        draw, or None.
    Returns:
      (token_ids i32[S], logprobs f32[S]): the sampled tokens and their log-probabilities
      under the unprocessed distribution log_softmax(logits) (vLLM's default "raw" logprobs).
    """
    temperature, top_k, top_p, rng_keys = sampling_metadata
    raw = logits.astype(jnp.float32)
    logits = raw if processing is None else process_logits(raw, processing)
    temperature = temperature.astype(jnp.float32)
    is_greedy = temperature < SAMPLING_EPS
    greedy, log_norm = greedy_and_log_norm(raw, logits)
    token_ids = jax.lax.cond(
        jnp.all(is_greedy),
        lambda: greedy,  # all-greedy steps skip the random draw entirely
        lambda: jnp.where(is_greedy, greedy, _sample_random(logits, temperature, top_k, top_p.astype(jnp.float32), rng_keys)),
    )
    logprobs = jnp.take_along_axis(raw, token_ids[:, None], axis=-1)[:, 0] - log_norm
    return token_ids, logprobs


def greedy_and_log_norm(raw, logits):
    """(first_argmax(logits) i32[...], logsumexp(raw) f32[...]) over the last axis: the greedy
    token of the processed logits and the raw distribution's normaliser (one pass of
    cpu_kernels/row_stats.py where the two are the same array; the native kernel on a CPU,
    XLA's reductions elsewhere). Both samplers take them from here, so a verification step
    without proposals gives a plain step's logprobs exactly."""
    greedy, log_norm = argmax_logsumexp(raw)
    if logits is not raw:
        greedy = first_argmax(logits)
    return greedy, log_norm


def first_argmax(logits):
    """The first index of each row's maximum (i32[...]), as two plain reductions (the row
    max, then the first index holding it): XLA's CPU argmax is a (value, index) pair reduction
    that does not vectorise, much slower on XLA:CPU. A NaN row gives the last id. (The
    reference's log-sum-exp is dead code here, which XLA drops.)"""
    return argmax_logsumexp_reference(logits)[0]
