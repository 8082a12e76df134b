"""On-device rejection sampling for speculative decoding (vLLM v1's rejection sampler).

A row proposes up to K draft tokens; the target model scores its 1 + K positions in one
step, and this module decides which drafts to keep so that every emitted token is
distributed exactly as the target would have sampled it alone:

- greedy rows (temperature < SAMPLING_EPS) keep draft j while it equals the target argmax at
  position j, then emit the argmax where the first mismatch is (or, all matched, the argmax
  after the last draft: the bonus token);
- random rows keep draft d_j with probability min(1, p_j(d_j) / q_j(d_j)), p the processed
  target distribution (temperature, top-k, top-p as in sampler.py) and q the proposer's (a
  point mass at d_j for a proposer that only looks tokens up); the first rejected position
  emits a draw from the residual max(p_j - q_j, 0), renormalised, and a row whose drafts were
  all kept emits a bonus draw from p at the position after its last draft.

Keys: position j of row i draws with the threefry key data (rng_keys[i, 0], rng_keys[i, 1] + j),
the key the request's (rng_keys[i, 1] + j)-th output token gets in sampler.py, so a seeded
request draws the same tokens whatever batch it lands in. A position consumes either its key
(the bonus: the same categorical draw sampler.sample makes, so a step where nobody proposes
emits exactly the plain sampler's tokens) or the two children of its key (drafted positions:
the acceptance uniform and the correction draw), never both.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from paged_jax.sampler import SAMPLING_EPS, _top_k_top_p, greedy_and_log_norm, process_logits


def _position_key_data(rng_keys, num_positions):
    """u32[S, P, 2]: position j's key data is (seed word, output index + j) (uint32 wraps)."""
    rng_keys = rng_keys.astype(jnp.uint32)
    offsets = jnp.arange(num_positions, dtype=jnp.uint32)[None, :]
    seed = jnp.broadcast_to(rng_keys[:, None, 0], (rng_keys.shape[0], num_positions))
    return jnp.stack([seed, rng_keys[:, None, 1] + offsets], axis=-1)


def _wrap(key_data):
    """Typed threefry keys key[N] from u32[N, 2] key data (sampler.py's format)."""
    return jax.random.wrap_key_data(key_data, impl="threefry2x32")


def _process(logits, temperature, top_k, top_p):
    """f32[S, P, V] -> the logits each position samples from: scaled by the row's temperature,
    then top-k / top-p filtered (dropped logits at -inf) when some row filters."""
    num_seqs, num_positions, vocab = logits.shape
    scaled = logits / jnp.maximum(temperature, SAMPLING_EPS)[:, None, None]
    needs_filter = jnp.any(((top_k > 0) & (top_k < vocab)) | (top_p < 1.0))
    # cond, not where: the full-vocab sort runs only on steps where some row filters.
    flat = jax.lax.cond(needs_filter, _top_k_top_p, lambda s, k, p: s, scaled.reshape(-1, vocab),
                        jnp.repeat(top_k, num_positions), jnp.repeat(top_p, num_positions))
    return flat.reshape(num_seqs, num_positions, vocab)


def _draft_token_probs(scaled, drafts, draft_probs):
    """(p(d) f32[S, K], q(d) f32[S, K]): the target's and the proposer's probability of each draft.

    scaled: f32[S, K, V] processed target logits at the drafted positions; drafts: i32[S, K]
    valid ids; draft_probs: None (point mass: q(d) = 1) or f32[S, K, V].
    """
    draft_logit = jnp.take_along_axis(scaled, drafts[..., None], axis=-1)[..., 0]
    target_prob = jnp.exp(draft_logit - jax.nn.logsumexp(scaled, axis=-1))  # a filtered draft: exp(-inf) = 0
    if draft_probs is None:
        return target_prob, jnp.ones_like(target_prob)
    return target_prob, jnp.take_along_axis(draft_probs, drafts[..., None], axis=-1)[..., 0]


def _residual_logits(scaled, drafts, draft_probs):
    """f32[S, K, V]: logits of the normalised residual max(p - q, 0) a rejected position draws from.

    Where the residual is all zero (p == q, so the draft was accepted for certain and the draw
    is never emitted) it falls back to p itself, to stay a valid distribution.
    """
    if draft_probs is None:
        # q is the point mass at d: the residual is p without d, i.e. d's logit dropped.
        vocab = scaled.shape[-1]
        residual = jnp.where(jnp.arange(vocab, dtype=jnp.int32) == drafts[..., None], -jnp.inf, scaled)
        is_empty = jnp.all(residual == -jnp.inf, axis=-1, keepdims=True)
    else:
        residual = jnp.maximum(jax.nn.softmax(scaled, axis=-1) - draft_probs, 0.0)
        is_empty = jnp.all(residual <= 0.0, axis=-1, keepdims=True)
        residual = jnp.log(residual)  # log(0) = -inf: never drawn
    return jnp.where(is_empty, scaled, residual)


def _sample_random(logits, draft_token_ids, has_draft, temperature, top_k, top_p, rng_keys, draft_probs):
    """The random rows' verdicts: (accepted bool[S, K], draws i32[S, K + 1]).

    draws[i, j] is what position j emits if it is where row i stops: the correction drawn
    from the residual at a drafted position, the bonus drawn from p after the last draft.
    """
    num_seqs, num_positions, vocab = logits.shape
    max_drafts = num_positions - 1
    scaled = _process(logits, temperature, top_k, top_p)
    drafts = jnp.where(has_draft, draft_token_ids, 0)  # padding may hold any value: gather a valid id
    target_prob, draft_prob = _draft_token_probs(scaled[:, :max_drafts], drafts, draft_probs)
    residual = _residual_logits(scaled[:, :max_drafts], drafts, draft_probs)

    key_data = _position_key_data(rng_keys, num_positions)
    children = jax.vmap(jax.random.split)(_wrap(key_data[:, :max_drafts].reshape(-1, 2)))  # key[S * K, 2]
    uniform = jax.vmap(jax.random.uniform)(children[:, 0]).reshape(num_seqs, max_drafts)  # [0, 1)
    # u * q < p is u < p / q without dividing: p = 0 always rejects (u * q >= 0), q = 0 < p
    # always accepts (the ratio is infinite), and the point mass reads u < p.
    accepted = has_draft & (uniform * draft_prob < target_prob)

    # One draw per position, since a position emits at most one of them: a drafted position
    # draws its correction from the residual with its key's second child; any other position
    # draws its bonus from p with the key itself, the draw sampler.sample makes with it.
    drafted = jnp.pad(has_draft, ((0, 0), (0, 1)))[..., None]  # bool[S, K + 1, 1]
    recover_data = jax.random.key_data(children[:, 1]).reshape(num_seqs, max_drafts, 2)
    draw_data = jnp.where(drafted, jnp.concatenate([recover_data, key_data[:, max_drafts:]], axis=1), key_data)
    draw_logits = jnp.where(drafted, jnp.concatenate([residual, scaled[:, max_drafts:]], axis=1), scaled)
    draws = jax.vmap(jax.random.categorical)(_wrap(draw_data.reshape(-1, 2)), draw_logits.reshape(-1, vocab))
    return accepted, draws.astype(jnp.int32).reshape(num_seqs, num_positions)


def _check_shapes(target_logits, draft_token_ids, num_draft_tokens, sampling_metadata, draft_probs):
    if target_logits.ndim != 3:
        raise ValueError(f"target_logits must be [num_seqs, max_drafts + 1, vocab]; got {target_logits.shape=}")
    num_seqs, num_positions, vocab = target_logits.shape
    if draft_token_ids.shape != (num_seqs, num_positions - 1):
        raise ValueError(f"draft_token_ids must be [num_seqs, max_drafts] = {(num_seqs, num_positions - 1)} "
                         f"to match {target_logits.shape=}; got {draft_token_ids.shape=}")
    if num_draft_tokens.shape != (num_seqs,):
        raise ValueError(f"num_draft_tokens must be [num_seqs] = {(num_seqs,)}; got {num_draft_tokens.shape=}")
    if sampling_metadata.rng_keys.shape != (num_seqs, 2) or sampling_metadata.temperature.shape != (num_seqs,):
        raise ValueError(f"sampling_metadata must hold one row per sequence ({num_seqs}); got "
                         f"{sampling_metadata.temperature.shape=}, {sampling_metadata.rng_keys.shape=}")
    if draft_probs is not None and draft_probs.shape != (num_seqs, num_positions - 1, vocab):
        raise ValueError(f"draft_probs must be [num_seqs, max_drafts, vocab] = {(num_seqs, num_positions - 1, vocab)} "
                         f"or None for a point-mass proposer; got {draft_probs.shape=}")


def rejection_sample(target_logits, draft_token_ids, num_draft_tokens, sampling_metadata, draft_probs=None,
                     processing=None):
    """Verifies each row's draft tokens against the target model and emits 1 to K + 1 tokens per row.

    Jittable; the maximum draft count K comes from the shapes, so it is static. Padded rows
    (temperature 0, no drafts) cost one argmax, and a step whose rows are all greedy skips the
    random path (filter, keys, draws) entirely.

    Args:
      target_logits: f32[S, K + 1, V] (any float dtype; computed in f32): position j is the
        target's distribution of the token after (last verified token, draft_0 .. draft_{j-1}).
      draft_token_ids: i32[S, K] proposed tokens; entries at or past num_draft_tokens[i] are
        padding and are ignored (any value).
      num_draft_tokens: i32[S] in [0, K]: how many drafts row i has (0: a plain decode row).
      sampling_metadata: a paged_jax.core.step_inputs.SamplingMetadata, per row, as
        sampler.sample reads it: temperature f32[S] (< 1e-5 means greedy), top_k i32[S],
        top_p f32[S], rng_keys u32[S, 2] = (seed word, output index of position 0's token).
      draft_probs: None for a point-mass proposer (n-gram prompt lookup: q(draft) = 1), or
        f32[S, K, V] the draft model's processed probabilities at each drafted position.
      processing: a LogitsProcessingMetadata whose masks (S * (K + 1) rows, sequence-major)
        and penalties apply to the target's logits before verification, or None. p is then
        the processed distribution: a draft the grammar forbids has p = 0 and is rejected.
    Returns:
      (output_token_ids i32[S, K + 1], num_accepted i32[S], logprobs f32[S, K + 1]): row i
      emits output_token_ids[i, :num_accepted[i] + 1], its accepted drafts then one token (the
      correction at the first rejected position, or the bonus at position num_draft_tokens[i]);
      later entries are -1. logprobs are the emitted tokens' log_softmax(target_logits) (vLLM's
      "raw" logprobs, as sampler.sample's), 0 after the emitted tokens.
    """
    _check_shapes(target_logits, draft_token_ids, num_draft_tokens, sampling_metadata, draft_probs)
    temperature, top_k, top_p, rng_keys = sampling_metadata
    raw = target_logits.astype(jnp.float32)
    logits = raw if processing is None else process_logits(raw, processing)
    temperature = temperature.astype(jnp.float32)
    num_seqs, num_positions, _ = logits.shape
    max_drafts = num_positions - 1
    position = jnp.arange(num_positions, dtype=jnp.int32)[None, :]
    # A count past K would read positions that were not scored.
    num_draft_tokens = jnp.clip(num_draft_tokens.astype(jnp.int32), 0, max_drafts)
    draft_token_ids = draft_token_ids.astype(jnp.int32)
    has_draft = position[:, :max_drafts] < num_draft_tokens[:, None]  # bool[S, K]

    # greedy: a kept draft equals the argmax, so every emitted token is the argmax at its position.
    is_greedy = temperature < SAMPLING_EPS
    greedy_tokens, log_norm = greedy_and_log_norm(raw, logits)  # i32[S, K + 1], f32[S, K + 1]
    greedy_accepted = has_draft & (draft_token_ids == greedy_tokens[:, :max_drafts])

    def mixed():
        accepted, draws = _sample_random(logits, draft_token_ids, has_draft, temperature, top_k,
                                         top_p.astype(jnp.float32), rng_keys,
                                         None if draft_probs is None else draft_probs.astype(jnp.float32))
        return (jnp.where(is_greedy[:, None], greedy_accepted, accepted),
                jnp.where(is_greedy[:, None], greedy_tokens, draws))

    accepted, stop_tokens = jax.lax.cond(jnp.all(is_greedy), lambda: (greedy_accepted, greedy_tokens), mixed)

    # A row keeps its drafts up to the first rejection, then emits the stop token there.
    num_accepted = jnp.sum(jnp.cumprod(accepted.astype(jnp.int32), axis=1), axis=1)
    kept = jnp.pad(draft_token_ids, ((0, 0), (0, 1)))
    stop = num_accepted[:, None]
    output_token_ids = jnp.where(position < stop, kept, jnp.where(position == stop, stop_tokens, -1))

    # Raw logprobs with sampler.sample's arithmetic (log_norm above), so a draft-free step matches it exactly.
    emitted = output_token_ids >= 0
    token_logit = jnp.take_along_axis(raw, jnp.where(emitted, output_token_ids, 0)[..., None], axis=-1)[..., 0]
    logprobs = jnp.where(emitted, token_logit - log_norm, 0.0)
    return output_token_ids, num_accepted, logprobs
