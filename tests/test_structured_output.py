"""Structured outputs and penalties: the sampler's mask and penalty math against numpy, and
the engine's guided and penalized outputs against a dense loop that applies them on the host.

References:
- apply_token_bitmask: llguidance.numpy's own (independent) mask application;
- apply_penalties: a hand example, and a numpy transcription of vLLM's rules;
- the engine: a dense greedy loop (full recomputation, no cache) whose next token is the
  argmax of the raw logits after a mask from a fresh llguidance matcher stepped one token at a
  time and the numpy penalties; free requests batched with guided ones against a run alone.
"""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import jsonschema
import llguidance
import llguidance.numpy as llguidance_np
import numpy as np
import pytest
from flax import nnx

from paged_jax import GuidedDecodingParams, SamplingParams
from paged_jax.core.step_inputs import LogitsProcessingMetadata, SamplingMetadata
from paged_jax.engine import LLMEngine
from paged_jax.engine_config import EngineConfig
from paged_jax.sampler import apply_penalties, apply_token_bitmask, sample
from tests.engine_reference import BLOCK_SIZE, MAX_MODEL_LEN, assert_no_leak, get_engine, run_to_completion

SCHEMAS = [
    {  # nested objects, bounded numbers, enums
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "address": {"type": "object", "properties": {"zip": {"type": "integer", "minimum": 10000,
                                                                 "maximum": 99999},
                                                         "kind": {"enum": ["home", "work"]}},
                        "required": ["zip", "kind"], "additionalProperties": False},
        },
        "required": ["name", "age", "address"], "additionalProperties": False,
    },
    {  # arrays with bounds, booleans, numbers
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
                       "ok": {"type": "boolean"},
                       "score": {"type": "number", "minimum": -1, "maximum": 1}},
        "required": ["tags", "ok", "score"], "additionalProperties": False,
    },
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 4},
]


# --- the sampler's pieces ---------------------------------------------------------------

def test_bitmask_matches_llguidance_numpy():
    rng = np.random.default_rng(0)
    vocab = 75  # not a multiple of 32: the last word's high bits are past the vocabulary
    logits = rng.normal(size=(4, vocab)).astype(np.float32)
    bitmask = rng.integers(-2**31, 2**31, size=(4, 3), dtype=np.int64).astype(np.int32)
    bitmask[3] = -1  # a free row
    expected = logits.copy()
    llguidance_np.apply_token_bitmask_inplace(expected, bitmask)
    got = np.asarray(apply_token_bitmask(jnp.asarray(logits), jnp.asarray(bitmask)))
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(got[3], logits[3])


def test_penalties_hand_example():
    # Prompt [1, 2], output [2, 2, 3]: history {1, 2, 3}, output counts {2: 2, 3: 1}.
    logits = jnp.asarray([[1.0, 2.0, -1.0, 4.0, 0.5], [1.0, 2.0, -1.0, 4.0, 0.5]])
    penalties = jnp.asarray([[0.5, 0.25, 2.0], [0.0, 0.0, 1.0]])  # presence, frequency, repetition; none
    history = jnp.asarray([[1, 2, 3, 5], [5, 5, 5, 5]])  # 5 = V: padding
    counts = jnp.asarray([[0.0, 2.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    got = np.asarray(apply_penalties(logits, penalties, history, counts))
    # token 1: prompt only: 2 / 2 = 1; token 2: -1 * 2 = -2, then - 0.25 * 2 - 0.5 = -3;
    # token 3: 4 / 2 = 2, then - 0.25 - 0.5 = 1.25; tokens 0 and 4 untouched.
    np.testing.assert_allclose(got[0], [1.0, 1.0, -3.0, 1.25, 0.5])
    np.testing.assert_array_equal(got[1], np.asarray(logits[1]))


def _numpy_penalties(logits, prompt, output, presence, frequency, repetition):
    """vLLM's penalty rules, on one row of raw logits."""
    logits = logits.astype(np.float64).copy()
    seen = np.zeros(logits.shape, bool)
    seen[list(prompt) + list(output)] = True
    logits[seen] = np.where(logits[seen] > 0, logits[seen] / repetition, logits[seen] * repetition)
    counts = np.bincount(np.asarray(output, np.int64), minlength=logits.size)[: logits.size]
    return logits - frequency * counts - presence * (counts > 0)


def test_neutral_processing_changes_nothing():
    """Free rows of a processed step draw exactly what the plain sampler draws."""
    rng = np.random.default_rng(1)
    s, vocab, h = 4, 70, 8
    logits = jnp.asarray(rng.normal(size=(s, vocab)).astype(np.float32) * 3)
    meta = SamplingMetadata(temperature=jnp.asarray([0.0, 1.0, 0.7, 1.3]), top_k=jnp.asarray([-1, -1, 5, -1]),
                            top_p=jnp.asarray([1.0, 1.0, 1.0, 0.8]),
                            rng_keys=jnp.asarray(rng.integers(0, 2**32, (s, 2)), jnp.uint32))
    neutral = LogitsProcessingMetadata(bitmask=jnp.full((s, 3), -1, jnp.int32),
                                       penalties=jnp.tile(jnp.asarray([0.0, 0.0, 1.0]), (s, 1)),
                                       history_ids=jnp.full((s, h), vocab, jnp.int32),
                                       output_counts=jnp.zeros((s, h)))
    plain = jax.jit(sample)(logits, meta)
    processed = jax.jit(sample)(logits, meta, neutral)
    for a, b in zip(plain, processed):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # A mask on row 1 forces its token and leaves the others' draws alone.
    only = np.full((s, 3), -1, np.int32)
    only[1] = 0
    only[1, 1] = 1 << (37 - 32)
    masked = jax.jit(sample)(logits, meta, neutral._replace(bitmask=jnp.asarray(only)))
    assert int(masked[0][1]) == 37
    np.testing.assert_array_equal(np.asarray(masked[0])[[0, 2, 3]], np.asarray(plain[0])[[0, 2, 3]])
    # logprobs stay raw: log_softmax of the unprocessed logits
    np.testing.assert_allclose(float(masked[1][1]), float(jax.nn.log_softmax(logits[1])[37]), rtol=1e-6)


# --- the engine --------------------------------------------------------------------------

def _guided(engine, prompts, params):
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"g{i}", prompt, p)
    finished = run_to_completion(engine)
    return [finished[f"g{i}"].outputs[0] for i in range(len(prompts))]


@pytest.mark.slow
def test_json_schemas_always_validate():
    """Sampled (temperature 1, a random model: it would write anything) outputs under three
    schemas all parse and validate, and finish by EOS, not the token limit."""
    engine = get_engine("big")
    params = [SamplingParams(max_tokens=160, temperature=1.0, seed=i,
                             guided_decoding=GuidedDecodingParams(json=SCHEMAS[i % 3])) for i in range(24)]
    outs = _guided(engine, [[1 + i, 7, 9] for i in range(24)], params)
    for i, out in enumerate(outs):
        assert out.finish_reason == "stop", (i, out.text)
        jsonschema.validate(json.loads(out.text), SCHEMAS[i % 3])
    assert_no_leak(engine)
    assert len(engine.structured_output) == 0  # every matcher released


def test_choice_regex_grammar_and_json_object():
    engine = get_engine("big")
    choices = ["yes", "no", "maybe so"]
    lark = 'start: "(" num ("+" num)* ")"\nnum: /[0-9]{1,2}/'
    params = ([SamplingParams(max_tokens=40, temperature=1.0, seed=i, guided_decoding=GuidedDecodingParams(
        choice=choices)) for i in range(6)]
              + [SamplingParams(max_tokens=40, temperature=1.0, seed=i, guided_decoding=GuidedDecodingParams(
                  regex=r"[a-z]{2}-[0-9]{3}")) for i in range(3)]
              + [SamplingParams(max_tokens=60, temperature=1.0, seed=i, guided_decoding=GuidedDecodingParams(
                  grammar=lark)) for i in range(3)]
              + [SamplingParams(max_tokens=200, temperature=1.0, seed=i, guided_decoding=GuidedDecodingParams(
                  json_object=True)) for i in range(2)])
    outs = _guided(engine, [[3, 4, 5 + i] for i in range(len(params))], params)
    import re
    for out in outs[:6]:
        assert out.text in choices
    for out in outs[6:9]:
        assert re.fullmatch(r"[a-z]{2}-[0-9]{3}", out.text), out.text
    for out in outs[9:12]:
        assert re.fullmatch(r"\([0-9]{1,2}(\+[0-9]{1,2})*\)", out.text), out.text
    for out in outs[12:]:
        if out.finish_reason == "stop":  # an unbounded object may run to the limit
            assert isinstance(json.loads(out.text), dict)
        else:
            assert out.text.startswith("{")
    assert_no_leak(engine)


@functools.cache
def _dense_logits_fn(graphdef):
    @jax.jit
    def step(state, token_ids, last):  # raw logits at `last` (penalties are not shift-invariant)
        logits = nnx.merge(graphdef, state).dense_forward(token_ids)
        return jnp.take_along_axis(logits, last[:, None, None], axis=1)[:, 0].astype(jnp.float32)

    return step


def _dense_processed_greedy(engine, prompt, params: SamplingParams):
    """One greedy continuation by full recomputation, the grammar's mask from a fresh
    matcher stepped token by token and the penalties in numpy."""
    graphdef, state = nnx.split(engine.model)
    step = _dense_logits_fn(graphdef)
    vocab = engine.model.config.vocab_size
    matcher = None
    if params.guided_decoding is not None:
        manager = engine.structured_output
        matcher = llguidance.LLMatcher(manager._lltokenizer, llguidance_grammar(params.guided_decoding))
    tokens = np.zeros((1, MAX_MODEL_LEN), np.int32)
    tokens[0, : len(prompt)] = prompt
    n, out = len(prompt), []
    while len(out) < params.max_tokens:
        logits = np.asarray(step(state, jnp.asarray(tokens), jnp.asarray([n - 1])))[0]
        if matcher is not None:
            mask = llguidance_np.allocate_token_bitmask(1, vocab)
            llguidance_np.fill_next_token_bitmask(matcher, mask)
            logits = logits[None].copy()
            llguidance_np.apply_token_bitmask_inplace(logits, mask)
            logits = logits[0]
        if params.has_penalties:
            logits = _numpy_penalties(logits, prompt, out, params.presence_penalty, params.frequency_penalty,
                                      params.repetition_penalty)
        t = int(np.argmax(logits))
        out.append(t)
        if matcher is not None:
            assert matcher.consume_token(t)
        if t in engine.eos_token_ids and not params.ignore_eos:
            break
        tokens[0, n] = t
        n += 1
    return out


def llguidance_grammar(params):
    from paged_jax.structured_output import grammar_text

    return grammar_text(params)


def test_guided_and_penalized_greedy_match_the_dense_loop():
    engine = get_engine("big")
    prompts = [[5, 9, 13, 21], [40, 41, 42], [7, 7, 7, 7, 7], [100, 3, 200]]
    params = [
        SamplingParams(max_tokens=48, temperature=0, guided_decoding=GuidedDecodingParams(json=SCHEMAS[1])),
        SamplingParams(max_tokens=20, temperature=0, guided_decoding=GuidedDecodingParams(regex=r"([a-c] )+x")),
        SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, repetition_penalty=1.5,
                       presence_penalty=0.4, frequency_penalty=0.3),
        SamplingParams(max_tokens=24, temperature=0, repetition_penalty=0.8,
                       guided_decoding=GuidedDecodingParams(regex=r"[a-z ]{4,30}")),
    ]
    outs = _guided(engine, prompts, params)
    for prompt, p, out in zip(prompts, params, outs):
        assert out.token_ids == _dense_processed_greedy(engine, prompt, p), (p, out.text)
    assert_no_leak(engine)


def test_free_requests_unchanged_beside_guided_ones():
    """Greedy and seeded free requests give the same tokens and logprobs whether or not
    guided and penalized requests share their steps."""
    engine = get_engine("big")
    free = [SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=True),
            SamplingParams(max_tokens=16, temperature=1.0, top_k=20, seed=5, ignore_eos=True, logprobs=True)]
    prompts = [[11, 12, 13], [50, 60]]
    alone = _guided(engine, prompts, free)
    others = [SamplingParams(max_tokens=30, temperature=1.0, seed=1,
                             guided_decoding=GuidedDecodingParams(json=SCHEMAS[0])),
              SamplingParams(max_tokens=16, temperature=0.8, seed=2, repetition_penalty=1.3)]
    mixed = _guided(engine, prompts + [[1, 2], [3, 4]], free + others)
    for a, b in zip(alone, mixed[:2]):
        assert a.token_ids == b.token_ids
        np.testing.assert_array_equal(a.logprobs, b.logprobs)
    assert_no_leak(engine)


def test_bad_grammar_is_a_value_error_and_the_engine_serves_on():
    engine = get_engine("big")
    engine.add_request("ok", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0))
    for bad, needle in [(GuidedDecodingParams(regex="(unclosed"), "guided_decoding"),
                        (GuidedDecodingParams(grammar="start: missing_rule"), "guided_decoding"),
                        (GuidedDecodingParams(json={"type": "no-such-type"}), "guided_decoding")]:
        with pytest.raises(ValueError, match=needle):
            engine.add_request("bad", [1, 2, 3], SamplingParams(max_tokens=4, guided_decoding=bad))
    assert "bad" not in engine.structured_output
    with pytest.raises(ValueError, match="exactly one"):
        GuidedDecodingParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=0)
    with pytest.raises(ValueError, match="presence_penalty"):
        SamplingParams(presence_penalty=3)
    finished = run_to_completion(engine)
    assert len(finished["ok"].outputs[0].token_ids) == 4
    assert_no_leak(engine)


def test_compiled_grammars_are_cached_and_nothing_compiles_after_warm_up():
    engine = get_engine("big")
    before = engine.get_stats()["num_compilations"]
    compiles = engine.structured_output.num_grammar_compiles
    params = [SamplingParams(max_tokens=8, temperature=1.0, seed=i,
                             guided_decoding=GuidedDecodingParams(json=dict(SCHEMAS[2]))) for i in range(5)]
    _guided(engine, [[9, 9, i + 1] for i in range(5)], params)
    assert engine.structured_output.num_grammar_compiles <= compiles + 1  # one schema, compiled once
    assert engine.get_stats()["num_compilations"] == before


@functools.cache
def _ngram_engine() -> LLMEngine:
    base = get_engine("big")
    config = EngineConfig(model="tiny", max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE, warm_up="full",
                          max_num_seqs=8, max_num_batched_tokens=64,
                          speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                              "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    return LLMEngine(config, model=base.model, tokenizer=base.tokenizer)


@pytest.mark.slow
def test_speculation_keeps_guided_outputs_exact():
    """Prompt lookup proposes (the prompts repeat, and a grammar that loops makes the output
    repeat), the masks cover every scored position and the matchers advance only by what was
    accepted: the guided greedy outputs equal the plain engine's, and penalized requests
    (which never propose) too."""
    spec = _ngram_engine()
    plain = get_engine("big")
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 8, 9, 8, 9, 8], [1, 2, 3, 1, 2, 3]]
    params = [SamplingParams(max_tokens=40, temperature=0, guided_decoding=GuidedDecodingParams(
                  regex=r"(ab|cd|[0-9] )+!")),
              SamplingParams(max_tokens=40, temperature=0, guided_decoding=GuidedDecodingParams(json=SCHEMAS[2])),
              SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, repetition_penalty=1.2)]
    want = _guided(plain, prompts, params)
    got = _guided(spec, prompts, params)
    for a, b in zip(want, got):
        assert a.token_ids == b.token_ids
    stats = spec.get_stats()
    assert stats["spec_num_draft_tokens"] > 0  # proposals were made and verified
    assert_no_leak(spec)
