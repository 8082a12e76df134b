"""Rejection sampler against independent references: a greedy loop, sampler.sample, and
chi-square tests that every emitted token follows the target distribution (tests that are
shown to catch the classic bug of resampling from p instead of the residual)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from paged_jax import rejection_sampler
from paged_jax.core.step_inputs import SamplingMetadata
from paged_jax.rejection_sampler import rejection_sample
from paged_jax.sampler import sample

rejection_sample_jit = jax.jit(rejection_sample)
sample_jit = jax.jit(sample)


def _metadata(num_seqs, temperature, top_k=-1, top_p=1.0, seeds=0, output_index=0):
    """SamplingMetadata with per-row (or broadcast) fields; rng_keys = (seeds, output_index)."""
    rng_keys = np.stack([np.broadcast_to(np.asarray(seeds, np.uint32), (num_seqs,)),
                         np.broadcast_to(np.asarray(output_index, np.uint32), (num_seqs,))], axis=1)
    return SamplingMetadata(
        temperature=jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), (num_seqs,)),
        top_k=jnp.broadcast_to(jnp.asarray(top_k, jnp.int32), (num_seqs,)),
        top_p=jnp.broadcast_to(jnp.asarray(top_p, jnp.float32), (num_seqs,)),
        rng_keys=jnp.asarray(rng_keys, jnp.uint32),
    )


def _run(logits, draft_token_ids, num_draft_tokens, metadata, draft_probs=None, fn=rejection_sample_jit):
    out = fn(jnp.asarray(logits, jnp.float32), jnp.asarray(draft_token_ids, jnp.int32),
             jnp.asarray(num_draft_tokens, jnp.int32), metadata,
             None if draft_probs is None else jnp.asarray(draft_probs, jnp.float32))
    return tuple(np.asarray(x) for x in out)


def _np_log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def _np_target_probs(logits, temperature, top_k, top_p):
    """Reference p: softmax(logits / T); keep the top-k, renormalise; keep the tokens (by
    descending prob) while the mass ranked above them is below top_p; renormalise."""
    p = np.exp(_np_log_softmax(np.asarray(logits, np.float64) / temperature))
    order = np.argsort(-p, kind="stable")
    top = order[: len(p) if top_k <= 0 else min(top_k, len(p))]
    renormalised = p[top] / p[top].sum()
    nucleus = top[np.cumsum(renormalised) - renormalised < top_p]
    out = np.zeros_like(p)
    out[nucleus] = p[nucleus]
    return out / out.sum()


def _greedy_reference(logits, draft_token_ids, num_draft_tokens):
    """The rule as a loop: keep drafts while they equal the argmax, then emit the argmax."""
    num_seqs, num_positions, _ = logits.shape
    output = np.full((num_seqs, num_positions), -1)
    num_accepted = np.zeros(num_seqs, int)
    for i in range(num_seqs):
        for j in range(num_positions):
            target = int(np.argmax(logits[i, j]))
            output[i, j] = target
            if j == num_draft_tokens[i] or draft_token_ids[i, j] != target:
                break
            num_accepted[i] += 1
    return output, num_accepted


def _assert_logprobs_are_raw(logits, output, num_accepted, logprobs):
    """Emitted tokens carry log_softmax(raw logits); after them come -1 tokens with logprob 0."""
    for i in range(len(output)):
        emitted = num_accepted[i] + 1
        ref = _np_log_softmax(logits[i, :emitted])[np.arange(emitted), output[i, :emitted]]
        np.testing.assert_allclose(logprobs[i, :emitted], ref, rtol=1e-5, atol=1e-5)
        assert np.all(output[i, emitted:] == -1) and np.all(logprobs[i, emitted:] == 0)


# greedy


def test_greedy_hand_built_rows():
    """Argmax table A; each row narrates where its drafts stop matching."""
    rng = np.random.default_rng(0)
    num_seqs, max_drafts, vocab = 6, 3, 10
    argmax = rng.integers(0, vocab, size=(num_seqs, max_drafts + 1))
    logits = rng.normal(size=(num_seqs, max_drafts + 1, vocab)).astype(np.float32) * 0.1
    np.put_along_axis(logits, argmax[..., None], 3.0, axis=-1)
    wrong = (argmax + 1) % vocab
    a = argmax
    drafts = np.array([
        [a[0, 0], a[0, 1], wrong[0, 2]],  # two match, the third does not
        [a[1, 0], a[1, 1], a[1, 2]],  # all match: bonus
        [a[2, 0], a[2, 1], a[2, 2]],  # no drafts: padding that happens to match is ignored
        [a[3, 0], a[3, 1], a[3, 2]],  # one draft, matching padding after it
        [wrong[4, 0], a[4, 1], -1],  # the first draft already misses
        [a[5, 0], a[5, 1], -1],  # two drafts then -1 padding: bonus at position 2
    ])
    num_draft_tokens = [3, 3, 0, 1, 2, 2]
    output, num_accepted, logprobs = _run(logits, drafts, num_draft_tokens, _metadata(num_seqs, 0.0))
    np.testing.assert_array_equal(num_accepted, [2, 3, 0, 1, 0, 2])
    np.testing.assert_array_equal(output, [
        [a[0, 0], a[0, 1], a[0, 2], -1],
        [a[1, 0], a[1, 1], a[1, 2], a[1, 3]],
        [a[2, 0], -1, -1, -1],
        [a[3, 0], a[3, 1], -1, -1],
        [a[4, 0], -1, -1, -1],
        [a[5, 0], a[5, 1], a[5, 2], -1],
    ])
    _assert_logprobs_are_raw(logits, output, num_accepted, logprobs)


def test_greedy_rows_of_a_mixed_batch_match_the_loop_reference():
    """Random drafts (each the argmax, or not with probability 1/4), random draft counts, half
    the rows random: the greedy rows are exactly the loop's."""
    rng = np.random.default_rng(1)
    num_seqs, max_drafts, vocab = 32, 4, 16
    logits = rng.normal(size=(num_seqs, max_drafts + 1, vocab)).astype(np.float32)
    drafts = np.where(rng.random((num_seqs, max_drafts)) < 0.75, logits[:, :max_drafts].argmax(-1),
                      rng.integers(0, vocab, size=(num_seqs, max_drafts)))
    num_draft_tokens = rng.integers(0, max_drafts + 1, size=num_seqs)
    temperature = np.where(np.arange(num_seqs) % 2 == 0, 0.0, 0.8)
    output, num_accepted, logprobs = _run(logits, drafts, num_draft_tokens,
                                          _metadata(num_seqs, temperature, seeds=np.arange(num_seqs)))
    ref_output, ref_accepted = _greedy_reference(logits, drafts, num_draft_tokens)
    np.testing.assert_array_equal(output[::2], ref_output[::2])
    np.testing.assert_array_equal(num_accepted[::2], ref_accepted[::2])
    assert np.all(num_accepted <= num_draft_tokens)
    for i in range(num_seqs):  # random rows too: what a row keeps is its drafts
        np.testing.assert_array_equal(output[i, :num_accepted[i]], drafts[i, :num_accepted[i]])
    _assert_logprobs_are_raw(logits, output, num_accepted, logprobs)


def test_greedy_without_drafts_is_the_samplers_argmax():
    """An all-greedy step (the cond's greedy branch) without drafts is sampler.sample's argmax."""
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(16, 4, 50)).astype(np.float32)
    logits[0, 0, [4, 9]] = 10.0  # a tie takes the first index, as sampler.sample's
    metadata = _metadata(16, 0.0)
    output, num_accepted, logprobs = _run(logits, np.zeros((16, 3)), np.zeros(16), metadata)
    tokens, token_logprobs = (np.asarray(x) for x in sample_jit(jnp.asarray(logits[:, 0]), metadata))
    assert output[0, 0] == 4
    np.testing.assert_array_equal(output[:, 0], tokens)
    np.testing.assert_array_equal(logprobs[:, 0], token_logprobs)
    assert np.all(num_accepted == 0) and np.all(output[:, 1:] == -1)


# random rows


@pytest.mark.parametrize("max_drafts", [0, 3])
def test_a_step_without_drafts_is_the_plain_sampler(max_drafts):
    """Nobody proposes: every row's token and logprob is sampler.sample's with the same keys,
    for greedy, temperature, top-k and top-p rows alike."""
    rng = np.random.default_rng(3)
    num_seqs, vocab = 16, 50
    logits = rng.normal(size=(num_seqs, max_drafts + 1, vocab)).astype(np.float32) * 3
    metadata = _metadata(num_seqs, temperature=np.tile([0.0, 1.0, 0.7, 1.3], 4), top_k=np.tile([-1, -1, 5, 0], 4),
                         top_p=np.tile([1.0, 0.9, 1.0, 0.8], 4), seeds=rng.integers(0, 2**32, num_seqs),
                         output_index=rng.integers(0, 1000, num_seqs))
    output, num_accepted, logprobs = _run(logits, np.full((num_seqs, max_drafts), 7), np.zeros(num_seqs), metadata)
    tokens, token_logprobs = (np.asarray(x) for x in sample_jit(jnp.asarray(logits[:, 0]), metadata))
    np.testing.assert_array_equal(output[:, 0], tokens)
    np.testing.assert_array_equal(logprobs[:, 0], token_logprobs)
    assert np.all(num_accepted == 0) and np.all(output[:, 1:] == -1) and np.all(logprobs[:, 1:] == 0)


# Distribution tests: V = 8, distinct target logits at each of 1 + K = 3 positions, N rows
# that are N independent draws (seed word = row).
VOCAB, MAX_DRAFTS, NUM_DRAWS = 8, 2, 4096
TARGET_LOGITS = np.array([
    [2.0, 1.5, 1.2, 0.9, 0.3, 0.0, -0.5, -1.5],
    [0.0, -0.5, 2.0, 0.3, 1.5, -1.5, 1.2, 0.9],
    [-1.5, 0.9, 0.3, 2.0, -0.5, 1.2, 0.0, 1.5],
], np.float32)


def _chi_square_pvalue(tokens, probs):
    """p-value of the tokens' counts under probs; 0 for a token outside probs' support."""
    counts = np.bincount(tokens, minlength=len(probs))
    support = probs > 0
    if np.any(counts[~support]):
        return 0.0
    expected = counts.sum() * probs[support] / probs[support].sum()
    return stats.chisquare(counts[support], expected).pvalue


def _emitted_pvalues(output, num_accepted, target_probs):
    """{position j: p-value of the token emitted at j, over the rows that reach j} for every
    position with enough rows for the chi-square approximation (>= 5 expected per cell)."""
    pvalues = {}
    for j, probs in enumerate(target_probs):
        reached = num_accepted >= j
        if reached.sum() * probs[probs > 0].min() >= 5:
            pvalues[j] = _chi_square_pvalue(output[reached, j], probs)
    return pvalues


def _draw_many(temperature, top_k, top_p, drafts, draft_probs=None, fn=rejection_sample_jit):
    """NUM_DRAWS independent verifications of the same drafts (or per-row drafts [N, K])."""
    logits = np.broadcast_to(TARGET_LOGITS, (NUM_DRAWS, MAX_DRAFTS + 1, VOCAB))
    drafts = np.broadcast_to(drafts, (NUM_DRAWS, MAX_DRAFTS))
    metadata = _metadata(NUM_DRAWS, temperature, top_k, top_p, seeds=1000 + np.arange(NUM_DRAWS), output_index=17)
    return _run(logits, drafts, np.full(NUM_DRAWS, MAX_DRAFTS), metadata, draft_probs, fn)


def _resampling_from_p(monkeypatch):
    """A fresh jit of the sampler with the bug: a rejected position draws from p itself."""
    monkeypatch.setattr(rejection_sampler, "_residual_logits", lambda scaled, drafts, draft_probs: scaled)
    return jax.jit(lambda *args: rejection_sampler.rejection_sample(*args))


POINT_MASS_CASES = {  # (temperature, top_k, top_p, drafts)
    "likely": (1.0, -1, 1.0, [0, 2]),  # each position's argmax
    "unlikely": (1.0, -1, 1.0, [6, 2]),  # p_0(6) ~ 0.03
    "top_k": (0.7, 4, 1.0, [2, 5]),  # position 1's draft is outside its top-4: always rejected
    "top_p": (1.3, -1, 0.8, [1, 4]),
}


@pytest.mark.parametrize("case", POINT_MASS_CASES)
def test_point_mass_drafts_emit_the_target_distribution(case):
    temperature, top_k, top_p, drafts = POINT_MASS_CASES[case]
    target_probs = [_np_target_probs(row, temperature, top_k, top_p) for row in TARGET_LOGITS]
    output, num_accepted, logprobs = _draw_many(temperature, top_k, top_p, drafts)
    pvalues = _emitted_pvalues(output, num_accepted, target_probs)
    assert 0 in pvalues and (case == "unlikely" or 1 in pvalues), f"too few rows reach position 1: {pvalues}"
    assert min(pvalues.values()) > 1e-3, f"{pvalues=}"
    if case == "top_k":
        assert np.all(num_accepted <= 1), "a draft the target filtered out (p = 0) must always be rejected"
    _assert_logprobs_are_raw(np.broadcast_to(TARGET_LOGITS, output.shape + (VOCAB,)), output[:64], num_accepted[:64],
                             logprobs[:64])


def test_a_draft_outside_the_top_k_is_always_rejected():
    output, num_accepted, _ = _draw_many(0.7, 4, 1.0, [5, 2])
    assert np.all(num_accepted == 0)
    assert _chi_square_pvalue(output[:, 0], _np_target_probs(TARGET_LOGITS[0], 0.7, 4, 1.0)) > 1e-3


@pytest.mark.parametrize("case", ["likely", "unlikely", "top_p"])
def test_the_distribution_test_catches_resampling_from_p(case, monkeypatch):
    """The same check on the buggy sampler: drawing the correction from p rather than the
    residual over-weights the draft (it is emitted when accepted and when redrawn)."""
    temperature, top_k, top_p, drafts = POINT_MASS_CASES[case]
    output, num_accepted, _ = _draw_many(temperature, top_k, top_p, drafts, fn=_resampling_from_p(monkeypatch))
    p0 = _np_target_probs(TARGET_LOGITS[0], temperature, top_k, top_p)
    assert _chi_square_pvalue(output[:, 0], p0) < 1e-6


def _draft_distributions():
    """q != p at both drafted positions: q puts mass where p has little and none on some of
    p's tokens (so the residual is not just p renormalised)."""
    q = np.exp(_np_log_softmax(-TARGET_LOGITS[:MAX_DRAFTS] * 0.8))
    q[0, [1, 4]] = 0.0
    q[1, [2, 7]] = 0.0
    return q / q.sum(axis=-1, keepdims=True)


@pytest.mark.parametrize("top_k", [-1, 5])
def test_draft_model_probs_emit_the_target_distribution(top_k, monkeypatch):
    """Drafts drawn from q (numpy), accepted with min(1, p/q), corrected from max(p - q, 0)."""
    q = _draft_distributions()
    rng = np.random.default_rng(4)
    drafts = np.stack([rng.choice(VOCAB, size=NUM_DRAWS, p=q[j]) for j in range(MAX_DRAFTS)], axis=1)
    draft_probs = np.broadcast_to(q, (NUM_DRAWS, MAX_DRAFTS, VOCAB))
    target_probs = [_np_target_probs(row, 1.0, top_k, 1.0) for row in TARGET_LOGITS]
    output, num_accepted, _ = _draw_many(1.0, top_k, 1.0, drafts, draft_probs)
    pvalues = _emitted_pvalues(output, num_accepted, target_probs)
    assert 0 in pvalues and 1 in pvalues, f"too few rows reach position 1: {pvalues}"
    assert min(pvalues.values()) > 1e-3, f"{pvalues=}"
    # Acceptance at position 0 is sum_t min(p(t), q(t)).
    acceptance = np.minimum(target_probs[0], q[0]).sum()
    assert abs(np.mean(num_accepted >= 1) - acceptance) < 4 * np.sqrt(acceptance * (1 - acceptance) / NUM_DRAWS)
    buggy_output, _, _ = _draw_many(1.0, top_k, 1.0, drafts, draft_probs, fn=_resampling_from_p(monkeypatch))
    assert _chi_square_pvalue(buggy_output[:, 0], target_probs[0]) < 1e-6


def test_a_target_point_mass_keeps_its_own_draft():
    """top_k = 1: p is a point mass. Drafting it is always accepted, also with q = p (the
    residual is empty there and falls back to p); anything else is rejected and corrected to
    it, and a rejection ends the row even when a later draft would match. Four draft
    patterns, each verified with NUM_DRAWS / 4 keys."""
    argmax = TARGET_LOGITS.argmax(-1)
    patterns = np.array([argmax[:2], [argmax[0], 7], [7, argmax[1]], [7, 7]])
    drafts = np.tile(patterns, (NUM_DRAWS // 4, 1))
    for draft_probs in [None, np.eye(VOCAB)[drafts]]:
        output, num_accepted, _ = _draw_many(1.0, 1, 1.0, drafts, draft_probs)
        np.testing.assert_array_equal(num_accepted, np.tile([2, 1, 0, 0], NUM_DRAWS // 4))
        expected = [argmax, [*argmax[:2], -1], [argmax[0], -1, -1], [argmax[0], -1, -1]]
        np.testing.assert_array_equal(output, np.tile(expected, (NUM_DRAWS // 4, 1)))


# keys


def test_same_keys_same_tokens_other_seeds_other_tokens():
    """Uniform target over 64 tokens, random drafts: almost every row rejects and redraws."""
    rng = np.random.default_rng(5)
    logits = np.zeros((64, 3, 64), np.float32)
    drafts = rng.integers(0, 64, size=(64, 2))
    a = _run(logits, drafts, np.full(64, 2), _metadata(64, 1.0, seeds=42 + np.arange(64)))
    b = _run(logits, drafts, np.full(64, 2), _metadata(64, 1.0, seeds=42 + np.arange(64)))
    c = _run(logits, drafts, np.full(64, 2), _metadata(64, 1.0, seeds=10_000 + np.arange(64)))
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    assert np.mean(a[0][:, 0] != c[0][:, 0]) > 0.8
    assert len(set(a[0][:, 0].tolist())) > 30, "rows with different keys must draw independently"


def test_a_row_depends_only_on_its_own_key_and_inputs():
    """The same rows reversed, and each row alone among padded rows (temperature 0, no
    drafts), emit what they emit in the full batch."""
    rng = np.random.default_rng(6)
    logits = rng.normal(size=(8, 4, 30)).astype(np.float32)
    drafts = logits[:, :3].argmax(-1)
    num_draft_tokens = np.array([3, 2, 1, 0, 3, 3, 2, 1])
    metadata = _metadata(8, 0.9, top_k=10, top_p=0.95, seeds=9 + np.arange(8), output_index=np.arange(8) * 5)
    full = _run(logits, drafts, num_draft_tokens, metadata)
    reversed_ = _run(logits[::-1], drafts[::-1], num_draft_tokens[::-1],
                     SamplingMetadata(*(field[::-1] for field in metadata)))
    for x, y in zip(full, reversed_):
        np.testing.assert_array_equal(x, y[::-1])
    for i in range(8):
        alone = np.arange(8) == i
        padded = SamplingMetadata(*(jnp.where(alone.reshape((8,) + (1,) * (field.ndim - 1)), field, 0)
                                    for field in metadata))
        out = _run(np.where(alone[:, None, None], logits, 0.0), np.where(alone[:, None], drafts, 0),
                   np.where(alone, num_draft_tokens, 0), padded)
        for x, y in zip(full, out):
            np.testing.assert_array_equal(x[i], y[i])


def test_position_j_draws_with_the_output_index_plus_j():
    """A row keeps two certain drafts (p = 1), then draws its bonus at position 2; that token
    is the one the next plain decode step (no drafts, output index + 2) draws from the same
    logits."""
    num_seqs, vocab = 64, 64
    logits = np.zeros((num_seqs, 3, vocab), np.float32)
    logits[:, 0, 3] = logits[:, 1, 5] = 100.0  # p(3) = p(5) = 1 in f32: u < 1 always accepts
    seeds = 7 + np.arange(num_seqs)
    output, num_accepted, _ = _run(logits, np.tile([3, 5], (num_seqs, 1)), np.full(num_seqs, 2),
                                   _metadata(num_seqs, 1.0, seeds=seeds, output_index=20))
    assert np.all(num_accepted == 2) and np.all(output[:, :2] == [3, 5])
    next_step, _, _ = _run(np.zeros_like(logits), np.zeros((num_seqs, 2)), np.zeros(num_seqs),
                           _metadata(num_seqs, 1.0, seeds=seeds, output_index=22))
    np.testing.assert_array_equal(output[:, 2], next_step[:, 0])
    assert len(set(output[:, 2].tolist())) > 20


# compilation


def _abstract_args(num_seqs, max_drafts, vocab):
    sds = jax.ShapeDtypeStruct
    metadata = SamplingMetadata(sds((num_seqs,), jnp.float32), sds((num_seqs,), jnp.int32),
                                sds((num_seqs,), jnp.float32), sds((num_seqs, 2), jnp.uint32))
    return (sds((num_seqs, max_drafts + 1, vocab), jnp.float32), sds((num_seqs, max_drafts), jnp.int32),
            sds((num_seqs,), jnp.int32), metadata)


def _primitives_outside_conds(jaxpr):
    """Names of the primitives a jaxpr runs unconditionally (nested jits included)."""
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        if eqn.primitive.name != "cond":
            for param in eqn.params.values():
                inner = getattr(param, "jaxpr", param)
                if hasattr(inner, "eqns"):
                    names |= _primitives_outside_conds(inner)
    return names


def test_all_greedy_steps_skip_the_random_path():
    """No key work and no sort outside the all-greedy cond: a greedy or padded batch pays for
    one argmax per position."""
    jaxpr = jax.make_jaxpr(rejection_sample)(*_abstract_args(4, 2, 8)).jaxpr
    unconditional = _primitives_outside_conds(jaxpr)
    assert "cond" in unconditional
    assert not {name for name in unconditional if name.startswith("random_") or name == "sort"}, unconditional


def test_invalid_shapes_are_refused():
    logits, drafts, num_draft_tokens, metadata = _abstract_args(4, 2, 8)
    with pytest.raises(ValueError, match="draft_token_ids"):
        jax.eval_shape(rejection_sample, logits, jax.ShapeDtypeStruct((4, 3), jnp.int32), num_draft_tokens, metadata)
    with pytest.raises(ValueError, match="draft_probs"):
        jax.eval_shape(rejection_sample, logits, drafts, num_draft_tokens, metadata,
                       jax.ShapeDtypeStruct((4, 3, 8), jnp.float32))


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_lowers_for_cuda(with_draft_probs):
    try:
        jax.jit(lambda x: x + 1).trace(jax.ShapeDtypeStruct((2,), jnp.float32)).lower(lowering_platforms=("cuda",))
    except Exception as e:  # noqa: BLE001 - any failure here means this jax cannot lower for CUDA at all
        pytest.skip(f"this jax cannot lower for CUDA on this machine: {e}")
    args = _abstract_args(8, 3, 128)
    if with_draft_probs:
        args += (jax.ShapeDtypeStruct((8, 3, 128), jnp.float32),)
    text = jax.jit(rejection_sample).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "stablehlo.case" in text, "the all-greedy and filter conds survive lowering"
