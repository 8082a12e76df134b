"""Speculative decoding with a draft model (speculative_config method 'draft_model').

The draft's layers are layers of the target's KV pool (its pages in the target's blocks, read
through the target's block tables), and it writes KV past the scheduled tokens into lookahead
slots the scheduler reserves (paged_jax/draft_proposer.py).

- Bad input: a draft of another vocabulary, a draft without a model, a draft given for
  another method, a draft on a tensor-parallel mesh, a draft of a shorter context: each a
  ValueError naming the field.
- A hand-traced allocation: a decode verifying 3 proposals with a draft of k = 3 takes the
  slots of 1 + 3 + 3 tokens (block ids exact), caches only verified tokens, and the
  reservation stops at max_model_len.
- Greedy outputs equal the dense greedy loop's (full recomputation, no cache) for three
  drafts: the target itself (every proposal accepted), the target with noise in its weights
  (some accepted, some not), and an unrelated model with its own cache geometry (its own
  KV-cache group); with preemption (a small pool) and prefix caching; after every step every
  cached block holds verified tokens only, and the pool returns to idle.
- The draft's KV stays right: with the target as its own draft, proposals are accepted
  ~always, also across preemption and prefix hits (a draft reading stale or missing pages
  would propose wrong tokens), and a stop token, EOS or max_tokens inside an accepted run ends
  the request exactly where decoding without speculation does.
- Sampled outputs with a draft follow the same distribution as without (chi-square).
- No compilation after warm-up (the draft's buckets included), and the counters.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from engine_reference import BLOCK_SIZE, MAX_MODEL_LEN, assert_no_leak, big_llm
from models.llama import LlamaConfig, LlamaForCausalLM
from paged_jax.core.config import CacheConfig, SchedulerConfig
from paged_jax.core.kv_cache_manager import KVCacheManager
from paged_jax.core.request import Request, SamplingParams
from paged_jax.core.scheduler import Scheduler
from paged_jax.core.spec_decode import SpeculativeConfig
from paged_jax.engine import LLMEngine
from paged_jax.engine_config import EngineConfig
from test_spec_decode import (assert_cached_blocks_hold_verified_tokens, generate, generate_watching_batches, greedy,
                              repetitive_workload)

K = 3
DRAFT = {"method": "draft_model", "model": "tiny", "num_speculative_tokens": K}


def target():
    return big_llm().engine.model


@functools.cache
def noisy_draft(scale: float = 0.1, seed: int = 1):
    """The target with Gaussian noise (scale x each weight's std) in every weight: it agrees with
    the target often, not always."""
    graphdef, state = nnx.split(target())
    keys = iter(jax.random.split(jax.random.key(seed), len(jax.tree.leaves(state))))
    noisy = jax.tree.map(lambda w: w + scale * jnp.std(w) * jax.random.normal(next(keys), w.shape, w.dtype), state)
    return nnx.merge(graphdef, noisy)


@functools.cache
def other_draft():
    """An unrelated random model of the target's vocabulary with its own cache geometry (1 KV head
    of 8 dims, 1 layer): its layers make a KV-cache group of their own."""
    config = LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                         num_kv_heads=1, head_dim=8, rms_norm_eps=1e-5, rope_theta=10000.0,
                         max_position_embeddings=2048, bos_token_id=1, eos_token_ids=(2,))
    return LlamaForCausalLM(config, rngs=nnx.Rngs(7))


DRAFTS = {"itself": target, "noisy": noisy_draft, "other": other_draft}


def draft_engine(draft, **overrides) -> LLMEngine:
    base = big_llm().engine
    config = EngineConfig(**{"model": "tiny", "max_model_len": MAX_MODEL_LEN, "block_size": BLOCK_SIZE,
                             "warm_up": "none", "speculative_config": DRAFT, "max_num_seqs": 8,
                             "max_num_batched_tokens": 64, **overrides})
    return LLMEngine(config, model=base.model, tokenizer=base.tokenizer, draft_model=draft)


# ---------------------------------------------------------------- bad input
def test_a_draft_of_another_vocabulary_is_refused_naming_the_field():
    small_vocab = LlamaForCausalLM(dataclasses.replace(other_draft().config, vocab_size=256), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"speculative_config model='tiny' has vocab_size=256, the target 512"):
        draft_engine(small_vocab)


@pytest.mark.parametrize("config, field", [
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model=None"),
    ({"method": "draft_model", "model": "", "num_speculative_tokens": 2}, "model=''"),
    ({"method": "draft_model", "model": "tiny", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "model": "tiny"}, "model='tiny'"),
])
def test_bad_draft_config_names_the_field(config, field):
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig.parse(config)


def test_draft_combinations_this_engine_refuses():
    base = big_llm().engine
    with pytest.raises(ValueError, match="draft_model= is the draft of speculative_config method='draft_model'"):
        LLMEngine(EngineConfig(model="tiny", warm_up="none"), model=base.model, tokenizer=base.tokenizer,
                  draft_model=base.model)
    with pytest.raises(ValueError, match="tensor_parallel_size=2: a draft model runs on one device"):
        EngineConfig(model="tiny", speculative_config=DRAFT, tensor_parallel_size=2)
    short = LlamaForCausalLM(dataclasses.replace(other_draft().config, max_position_embeddings=64), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="holds 64 positions, fewer than max_model_len=256"):
        draft_engine(short)


# ---------------------------------------------------------------- the allocation, by hand
def test_lookahead_for_the_draft_is_reserved_past_the_proposals_and_never_cached():
    bs = 4
    mgr = KVCacheManager(CacheConfig(bs, 11, 24))
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16, max_model_len=24,
                                          num_spec_tokens=K, num_lookahead_tokens=K), mgr)
    request = Request("A", [1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=20))
    scheduler.add_request(request)
    out = scheduler.schedule()
    # The prompt's 6 slots and the draft's 3 (it writes positions 6..8 while proposing): 9 slots.
    assert out.new_block_ids == [([1, 2, 3],)] and out.num_scheduled_tokens == [6]
    scheduler.update_from_output(out, np.array([7]))
    request.spec_token_ids = [8, 9, 10]
    out = scheduler.schedule()
    # Positions 6..9 verified this step (7 and 3 proposals), 10..12 the draft's lookahead: 13 slots.
    assert out.new_block_ids == [([4],)] and out.num_scheduled_tokens == [4]
    pool = mgr.block_pool
    # Only block 1 (tokens 0-3) holds verified tokens alone; the rest hold proposals or nothing yet.
    assert [b.block_hash is not None for b in pool.blocks[1:5]] == [True, False, False, False]
    # All 3 accepted, 11 the target's own: 11 tokens, 10 computed; next step reserves to position 16.
    scheduler.update_from_output(out, np.array([[8, 9, 10, 11]]), num_accepted=np.array([3]))
    assert (request.num_tokens, request.num_computed_tokens) == (11, 10)
    request.spec_token_ids = [12, 13, 14]
    out = scheduler.schedule()
    assert out.new_block_ids == [([5],)]  # positions 10..13 and 14..16: block 5 covers 16..19
    assert pool.blocks[2].block_hash == request.block_hashes[1]  # tokens 4-7 (5 6 7 8), verified, cached
    assert pool.blocks[3].block_hash is None
    scheduler.update_from_output(out, np.array([[12, 13, 14, 15]]), num_accepted=np.array([3]))
    request.spec_token_ids = [16, 17, 18]
    out = scheduler.schedule()  # positions 14..17 verified, 18..20 lookahead: 21 slots
    assert out.new_block_ids == [([6],)] and out.num_scheduled_tokens == [4]
    scheduler.update_from_output(out, np.array([[16, 17, 18, 19]]), num_accepted=np.array([3]))
    # 19 tokens of max_model_len 24: positions 18..21 to verify and 3 of lookahead would reach 24;
    # the reservation stops at max_model_len (2 slots), so the table never outgrows its 6 blocks.
    request.spec_token_ids = [20, 21, 22]
    out = scheduler.schedule()
    assert out.new_block_ids == [()] and out.num_scheduled_tokens == [4]  # () : no new block
    assert len(mgr.get_block_ids("A")[0]) == 6
    assert scheduler._draft_lookahead(22) == 2 and scheduler._draft_lookahead(24) == 0
    mgr.check_invariants({"A": request})


# ---------------------------------------------------------------- through the engine
@pytest.mark.parametrize("draft, pool", [
    ("itself", dict(num_blocks=2048)), ("itself", dict(num_blocks=14)), ("noisy", dict(num_blocks=2048)),
    ("noisy", dict(num_blocks=14)), ("other", dict(num_blocks=2048)),
], ids=["itself-roomy", "itself-preempting", "noisy-roomy", "noisy-preempting", "other-roomy"])
def test_greedy_outputs_equal_dense_greedy(draft, pool):
    prompts, max_tokens, reference = repetitive_workload()
    engine = draft_engine(DRAFTS[draft](), **pool)
    assert generate(engine, prompts, [greedy(m) for m in max_tokens]) == reference
    stats = engine.get_stats()
    groups = engine.cache_config.kv_cache_groups
    assert len(groups) == (2 if draft == "other" else 1)  # equal specs share the target's group
    assert len(engine.runner.pool.specs) == len(target().layers) + len(engine.draft_model.layers)
    rate = stats["spec_acceptance_rate"]
    if draft == "itself":
        assert rate > 0.97, rate  # near-ties aside, the target agrees with itself
    elif draft == "noisy":
        assert 0.2 < rate < 0.9, rate  # accepted and rejected runs both exercised
    if pool["num_blocks"] == 14:
        assert stats["num_preemptions"] > 0
    # Everything again: the roomy pool's prompts hit the prefix cache, whose blocks must hold the
    # draft's pages too (an identical draft keeps proposing what the target accepts).
    assert generate(engine, prompts, [greedy(m) for m in max_tokens]) == reference
    assert (engine.get_stats()["prefix_cache_hits"] > 0) == (pool["num_blocks"] > 14)
    if draft == "itself":
        assert engine.get_stats()["spec_acceptance_rate"] > 0.97
    assert_no_leak(engine)


def test_disable_by_batch_size_keeps_the_drafts_kv_level():
    """While the batch is too large to speculate, the draft still writes the KV of every token
    the target computes: with the target as its own draft, proposals made once the batch
    shrinks are still accepted ~always (a draft missing those pages would propose wrong ones)."""
    prompts, max_tokens, reference = repetitive_workload()
    engine = draft_engine(target(), num_blocks=2048, speculative_config={**DRAFT, "disable_by_batch_size": 4})
    assert generate_watching_batches(engine, prompts, [greedy(m) for m in max_tokens], limit=4) == reference
    stats = engine.get_stats()
    assert stats["spec_num_disabled_steps"] > 0
    assert stats["spec_acceptance_rate"] > 0.97, stats["spec_acceptance_rate"]
    assert_no_leak(engine)


@pytest.mark.parametrize("how", ["stop token", "eos", "max_tokens"])
def test_a_stop_inside_an_accepted_run_ends_the_request_there(how):
    """With the target as its draft every step emits up to k + 1 tokens; a stop at output
    index 5 (inside the second run) ends each request exactly where plain decoding ends it."""
    prompts, max_tokens, reference = repetitive_workload()
    cases = [(p, r) for p, r in zip(prompts, reference) if len(r) > 8 and r[5] not in r[:5]][:4]
    assert len(cases) >= 3
    engine = draft_engine(target())
    for prompt, ref in cases:
        stop = ref[5]
        kwargs = {"stop token": {"stop_token_ids": (stop,)}, "max_tokens": {}, "eos": {}}[how]
        params = SamplingParams(max_tokens=6 if how == "max_tokens" else 30, temperature=0.0,
                                ignore_eos=how != "eos", **kwargs)
        if how == "eos":
            engine._eos_token_id = stop  # this request's EOS is the token at index 5
        try:
            (out,) = generate(engine, [prompt], [params])
        finally:
            engine._eos_token_id = 2
        assert out == ref[:6], (how, out, ref[:8])
    assert engine.get_stats()["spec_mean_accepted_length"] > 2.5
    assert_no_leak(engine)


def test_sampled_tokens_follow_the_same_distribution_with_and_without_a_draft():
    """800 seeded requests, 4 tokens each, top-k 2 at temperature 1, proposals from the noisy
    draft: the counts of whole outputs with and without speculation pass a two-sample
    chi-square test (test_spec_decode.py's n-gram twin shows the test fails without the
    residual resampling)."""
    from scipy.stats import chi2_contingency

    rng = np.random.default_rng(5)
    prompt = rng.integers(0, 512, 12).tolist()
    num = 800
    params = [SamplingParams(max_tokens=4, temperature=1.0, top_k=2, seed=i, ignore_eos=True) for i in range(num)]
    settings = dict(max_num_seqs=64, max_num_batched_tokens=512, num_blocks=2048)
    counts = []
    for spec in (DRAFT, None):
        engine = draft_engine(noisy_draft() if spec else None, speculative_config=spec, **settings)
        counts.append(Counter(tuple(out) for out in generate(engine, [prompt] * num, params, check_each_step=False)))
        if spec is not None:
            stats = engine.get_stats()
    assert stats["spec_num_draft_tokens"] > num, "too few proposals: the sampler was hardly exercised"
    assert 0.1 < stats["spec_acceptance_rate"] < 0.9, stats["spec_acceptance_rate"]
    keys = sorted(set(counts[0]) | set(counts[1]))
    table = np.array([[c.get(k, 0) for k in keys] for c in counts])
    common = table.sum(axis=0) >= 10
    rare = table[:, ~common].sum(axis=1)
    table = np.column_stack([table[:, common], rare]) if rare.any() else table[:, common]
    _, p_value, _, _ = chi2_contingency(table)
    assert p_value > 1e-3, (p_value, table)


def test_no_compiles_after_warm_up_and_the_counters():
    prompts, max_tokens, reference = repetitive_workload()
    engine = draft_engine(noisy_draft(), warm_up="full", num_blocks=2048)
    compiled = engine.get_stats()["num_compilations"]
    assert compiled == len(engine.runner.bucket_shapes()) + len(engine.drafter.runner.bucket_shapes())
    assert generate(engine, prompts, [greedy(m) for m in max_tokens], check_each_step=False) == reference
    stats = engine.get_stats()
    assert stats["num_compilations"] == compiled, "a step compiled after warm-up"
    drafts, proposed, accepted = (stats[k] for k in ("spec_num_drafts", "spec_num_draft_tokens",
                                                     "spec_num_accepted_tokens"))
    assert 0 < accepted < proposed <= K * drafts
    assert stats["num_generated_tokens"] == sum(len(out) for out in reference)
    # k passes per step that proposes (a first pass, then k - 1 of one token each), never more.
    assert engine.drafter.num_passes <= K * stats["num_steps"]


def test_the_draft_model_loads_by_name_through_llm():
    """The public path: LLM(..., speculative_config=...) loads the draft by name ("tiny", the
    same seed: the target itself) and every proposal of a greedy run is accepted."""
    from paged_jax import LLM

    llm = LLM("tiny", max_model_len=MAX_MODEL_LEN, warm_up="none", speculative_config=DRAFT)
    prompts, max_tokens, reference = repetitive_workload()
    outs = llm.generate(prompts[:4], [greedy(m) for m in max_tokens[:4]])
    assert [o.outputs[0].token_ids for o in outs] == reference[:4]
    assert llm.engine.get_stats()["spec_acceptance_rate"] > 0.97
    assert_no_leak(llm.engine)
