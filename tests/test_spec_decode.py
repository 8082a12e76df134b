"""Speculative decoding with the n-gram proposer (prompt lookup), through the engine.

- The proposer against hand-worked token lists: the longest suffix first, its latest
  earlier occurrence, at most k tokens, nothing without a match.
- speculative_config's bad input: each a ValueError naming the field.
- A hand-traced allocation with lookahead: a decode with 3 proposals takes the slots of
  1 + 3 tokens (block ids exact), caches only verified tokens, and after 1 of 3 is accepted
  the next step reuses the rejected slots.
- Greedy outputs with speculation equal the dense greedy loop's (full recomputation, no
  cache), with preemption (a small pool) and prefix caching, in batches mixing requests
  with and without proposals and prefills; max_tokens falling inside an accepted run ends
  the request exactly where decoding without speculation does; after every
  step every cached block holds verified tokens only (its hash is the hash of the request's
  tokens there), and the pool returns to idle.
- Sampled outputs: seeded draws with speculation follow the same distribution as without
  (a two-sample chi-square over thousands of requests).
- The counters: proposals, acceptances (per position), mean accepted length.
"""

from __future__ import annotations

import functools
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_reference import BLOCK_SIZE, MAX_MODEL_LEN, assert_no_leak, big_llm, dense_greedy, runs_of_tokens
from paged_jax.core.block_pool import hash_with_group_id
from paged_jax.core.config import CacheConfig
from paged_jax.core.kv_cache_manager import KVCacheManager
from paged_jax.core.request import Request, RequestStatus, SamplingParams
from paged_jax.core.spec_decode import SpeculativeConfig, propose_ngram
from paged_jax.engine import LLMEngine
from paged_jax.engine_config import EngineConfig

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


# ---------------------------------------------------------------- the proposer
def test_prompt_lookup_proposes_what_followed_the_latest_longest_match():
    # The last 2 tokens (7, 8) occur at 1 and 5; the latest is at 5: 9, 4 follow it.
    tokens = [6, 7, 8, 1, 2, 7, 8, 9, 4, 3, 7, 8]
    assert propose_ngram(tokens, 2, 1, 3) == [9, 4]
    # The 3-gram (3, 7, 8) never occurs earlier; with max 3 the 2-gram still matches.
    assert propose_ngram(tokens, 5, 3, 3) == []
    assert propose_ngram(tokens, 5, 2, 3) == [9, 4, 3, 7, 8]
    # A longer match wins over a later shorter one: (1, 2, 3) at 0 against (2, 3) at 5.
    assert propose_ngram([1, 2, 3, 5, 6, 2, 3, 8, 9, 1, 2, 3], 2, 1, 3) == [5, 6]
    # What follows is cut at the end of the sequence.
    assert propose_ngram([4, 5, 4, 5], 3, 1, 2) == [4, 5]
    assert propose_ngram([1, 2, 3], 3, 1, 3) == [] and propose_ngram([5], 3, 1, 3) == []
    assert propose_ngram(tokens, 0, 1, 3) == []


def lookup_by_brute_force(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Prompt lookup over every window of every suffix length, longest first, latest first."""
    num = len(tokens)
    for n in range(min(max_n, num - 1), min_n - 1, -1):
        for start in range(num - n - 1, -1, -1):
            if tokens[start : start + n] == tokens[num - n :]:
                return tokens[start + n : start + n + k] if k > 0 else []
    return []


@settings(max_examples=400, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=48), st.integers(0, 7), st.integers(1, 4), st.integers(0, 3))
def test_prompt_lookup_equals_brute_force(tokens, k, min_n, extra):
    # A 4-token alphabet: suffixes recur often, at several lengths and places.
    assert propose_ngram(tokens, k, min_n, min_n + extra) == lookup_by_brute_force(tokens, k, min_n, min_n + extra)


@pytest.mark.parametrize("bad,field", [
    ({"method": "medusa"}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_max"),
    ({"method": "ngram", "lookahead": 2}, "unknown keys"),
    ({"num_speculative_tokens": 2}, "method"),
    ("{not json", "JSON"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model=None"),
    ({"method": "ngram", "disable_by_batch_size": 0}, "disable_by_batch_size"),
])
def test_bad_speculative_config_names_the_field(bad, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(speculative_config=bad)


def test_speculative_config_from_the_command_line_json():
    config = EngineConfig(speculative_config='{"method": "ngram", "num_speculative_tokens": 5}')
    assert config.spec_config == SpeculativeConfig("ngram", 5, 1, 4)
    config = EngineConfig(speculative_config='{"method": "ngram", "disable_by_batch_size": 8}')
    assert config.spec_config.disable_by_batch_size == 8 and not config.spec_config.enabled_for(8)
    assert config.spec_config.enabled_for(7) and EngineConfig(speculative_config=NGRAM).spec_config.enabled_for(10**6)
    assert hash(EngineConfig(speculative_config=NGRAM)) == hash(EngineConfig(speculative_config=dict(NGRAM)))


# ---------------------------------------------------------------- allocation with lookahead
def test_lookahead_slots_are_allocated_never_cached_and_reused_after_a_rejection():
    bs = 4
    mgr = KVCacheManager(CacheConfig(bs, 11, 64))
    req = Request("A", [1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=20))
    hits, num_hit = mgr.get_computed_blocks(req)
    assert mgr.allocate_slots(req, 6, num_hit, hits).get_block_ids() == ([1, 2],)
    req.num_computed_tokens = 6
    req.append_output_token_ids(7)  # 7 tokens, 6 computed: a decode, with 3 proposals 8, 9, 10
    # Slots for positions 6..9: the last token and 3 lookahead slots reach block 2 (positions 8, 9).
    assert mgr.allocate_slots(req, 1, num_lookahead_tokens=3).get_block_ids() == ([3],)
    # Only block 1 (tokens 0-3) is full of verified tokens; block 2 holds 4 5 6 and a proposal.
    pool = mgr.block_pool
    assert [b.block_hash is not None for b in pool.blocks[1:4]] == [True, False, False]
    # The target accepts 1 of 3 and adds its own: 8 accepted, 11 its own; slots of 9, 10 rolled back.
    req.num_computed_tokens = 6 + 1 + 1
    req.append_output_token_ids([8, 11])
    assert mgr.allocate_slots(req, 1, num_lookahead_tokens=3).get_block_ids() == ([],)  # 8..11 fit in block 3
    assert pool.blocks[2].block_hash == req.block_hashes[1]  # tokens 4-7 (5 6 7 8): all verified now
    assert pool.blocks[3].block_hash is None and len(req.block_hashes) == 2
    mgr.check_invariants({"A": req})


# ---------------------------------------------------------------- through the engine
def spec_engine(**overrides) -> LLMEngine:
    base = big_llm().engine
    config = EngineConfig(**{"model": "tiny", "max_model_len": MAX_MODEL_LEN, "block_size": BLOCK_SIZE,
                             "warm_up": "none", "speculative_config": NGRAM, "max_num_seqs": 8,
                             "max_num_batched_tokens": 64, **overrides})
    return LLMEngine(config, model=base.model, tokenizer=base.tokenizer)


@functools.cache
def repetitive_workload():
    """Prompts that repeat a phrase (prompt lookup finds it) beside ones that do not; the tiny
    random model's greedy continuations loop, so its own output is matched too."""
    rng = np.random.default_rng(3)
    prompts, max_tokens = [], []
    for i in range(12):
        phrase = rng.integers(0, 512, int(rng.integers(3, 9))).tolist()
        if i % 3 == 2:
            prompt = rng.integers(0, 512, int(rng.integers(5, 40))).tolist()
        else:
            prompt = (phrase * 6)[: int(rng.integers(10, 60))]
        prompts.append(prompt)
        max_tokens.append(int(rng.integers(8, 40)))
    return prompts, max_tokens, dense_greedy(prompts, max_tokens)[0]


def assert_cached_blocks_hold_verified_tokens(engine: LLMEngine) -> None:
    """Every block a live request has cached is keyed by the hash of its own verified tokens
    at that index: no proposal was ever hashed into the prefix cache."""
    kv = engine.kv_cache_manager
    for request in engine.scheduler.running:
        num_full = len(request.all_token_ids) // kv.block_size
        assert len(request.block_hashes) == num_full
        for g, manager in enumerate(kv.coordinator.managers):
            for i, block in enumerate(manager.req_to_blocks.get(request.request_id, [])):
                if block.block_hash is not None:
                    assert i < num_full, f"block {block.block_id} at {i} cached past the verified tokens"
                    assert block.block_hash == hash_with_group_id(request.block_hashes[i], g)


def generate(engine: LLMEngine, prompts, params, check_each_step: bool = True) -> list[list[int]]:
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", prompt, p)
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        if check_each_step:
            assert_cached_blocks_hold_verified_tokens(engine)
    return [finished[f"r{i}"].outputs[0].token_ids for i in range(len(prompts))]


def greedy(max_tokens, **kwargs):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kwargs)


@pytest.mark.parametrize("pool", [dict(num_blocks=2048), dict(num_blocks=12)], ids=["roomy", "preempting"])
def test_greedy_outputs_equal_dense_greedy(pool):
    prompts, max_tokens, reference = repetitive_workload()
    engine = spec_engine(**pool)
    assert generate(engine, prompts, [greedy(m) for m in max_tokens]) == reference
    stats = engine.get_stats()
    assert stats["spec_num_accepted_tokens"] > 20, "almost nothing was accepted: the test would prove little"
    assert stats["spec_num_draft_tokens"] > stats["spec_num_accepted_tokens"], "nothing was ever rejected"
    if pool["num_blocks"] == 12:
        assert stats["num_preemptions"] > 0
    # Everything again: the roomy pool's prompts hit the prefix cache (blocks cached from verified
    # tokens only); the small pool has evicted them, and it runs the workload preempting again.
    assert generate(engine, prompts, [greedy(m) for m in max_tokens]) == reference
    assert (engine.get_stats()["prefix_cache_hits"] > 0) == (pool["num_blocks"] > 12)
    assert_no_leak(engine)


def generate_watching_batches(engine: LLMEngine, prompts, params, limit: int) -> list[list[int]]:
    """generate, checking after every step that no request holds proposals while `limit` or
    more run (disable_by_batch_size), and that some do when fewer run."""
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", prompt, p)
    finished, proposed_below = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        running = engine.scheduler.running
        with_proposals = sum(bool(r.spec_token_ids) for r in running)
        if len(running) >= limit:
            assert with_proposals == 0, f"{with_proposals} requests propose in a batch of {len(running)}"
        proposed_below += with_proposals
    assert proposed_below > 0, "nothing was proposed below the limit either: the test would prove little"
    return [finished[f"r{i}"].outputs[0].token_ids for i in range(len(prompts))]


def test_disable_by_batch_size_proposes_nothing_in_large_batches_and_keeps_the_outputs():
    prompts, max_tokens, reference = repetitive_workload()
    engine = spec_engine(num_blocks=2048, speculative_config={**NGRAM, "disable_by_batch_size": 4})
    assert generate_watching_batches(engine, prompts, [greedy(m) for m in max_tokens], limit=4) == reference
    stats = engine.get_stats()
    assert stats["spec_num_disabled_steps"] > 0 and stats["spec_num_accepted_tokens"] > 0
    assert_no_leak(engine)


def accepted_runs(runs) -> list[tuple[int, int]]:
    """(request, output index) of the first token of each request's first step that emitted
    2+ tokens (an accepted proposal, then more of the same run)."""
    cases = []
    for i, request_runs in enumerate(runs):
        start = 0
        for run in request_runs:
            if len(run) >= 2:
                cases.append((i, start))
                break
            start += len(run)
    return cases


def test_max_tokens_caps_the_proposals_and_ends_the_request_exactly_there():
    """A request 2 tokens from max_tokens is given at most 1 proposal (the target's own token
    comes after it): where its earlier run accepted one, the step emits both and it ends."""
    prompts, max_tokens, reference = repetitive_workload()
    engine = spec_engine()
    runs = runs_of_tokens(engine, prompts, [greedy(m) for m in max_tokens])
    assert [sum(r, []) for r in runs] == reference
    cases = accepted_runs(runs)
    assert len(cases) >= 3, "too few accepted runs"
    picked = [prompts[i] for i, _ in cases]
    before = engine.get_stats()
    runs = runs_of_tokens(engine, picked, [greedy(at + 2) for _, at in cases])
    assert [sum(r, []) for r in runs] == [reference[i][: at + 2] for i, at in cases]
    assert all(len(r[-1]) == 2 for r in runs), [r[-1] for r in runs]
    after = engine.get_stats()
    assert after["spec_num_draft_tokens"] - before["spec_num_draft_tokens"] >= len(cases)
    assert_no_leak(engine)


def decoding_request(scheduler, stop_token_ids=(), max_tokens=20, eos_token_id=None):
    """A request of 6 prompt tokens through its prefill, sampling 7: decoding from here."""
    request = Request("A", [1, 2, 3, 4, 5, 6],
                      SamplingParams(max_tokens=max_tokens, temperature=0.0, stop_token_ids=stop_token_ids),
                      eos_token_id=eos_token_id)
    scheduler.add_request(request)
    out = scheduler.schedule()
    scheduler.update_from_output(out, [7])
    return request


STOPS = {"stop token": {"stop_token_ids": (9,)}, "eos": {"eos_token_id": 9}, "max_tokens": {"max_tokens": 3}}


@pytest.mark.parametrize("how", list(STOPS))
def test_a_stop_inside_an_accepted_run_drops_the_rest_of_it(how):
    """Scheduler only: 3 proposals (8, 9, 10), all accepted plus the target's 11; a stop on 9
    (a stop token, EOS, or max_tokens = 3 outputs) ends the request on 9; 10, 11 are dropped."""
    from paged_jax.core.config import SchedulerConfig
    from paged_jax.core.scheduler import Scheduler

    from paged_jax.core.spec_decode import SpecDecodeStats

    mgr = KVCacheManager(CacheConfig(4, 11, 64))
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16, max_model_len=64), mgr)
    scheduler.spec_stats = SpecDecodeStats(3)
    request = decoding_request(scheduler, **STOPS[how])
    request.spec_token_ids = [8, 9, 10]
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == [4] and out.spec_token_ids == [[8, 9, 10]]
    assert request.num_computed_tokens == 10  # 6 + the last token + 3 proposals, until verified
    (core,) = scheduler.update_from_output(out, np.array([[8, 9, 10, 11]]), num_accepted=np.array([3]))
    assert core.new_token_ids == [8, 9] and core.finish_reason == ("length" if how == "max_tokens" else "stop")
    assert request.output_token_ids == [7, 8, 9] and request.status != RequestStatus.RUNNING
    assert not mgr.has_requests() and mgr.get_num_free_blocks() == 10
    assert scheduler.spec_stats.as_dict()["spec_num_accepted_tokens"] == 3
    mgr.check_invariants()


def test_a_stop_string_completed_inside_a_run_cuts_the_text_there():
    """The server cuts text at a stop string whatever number of tokens a step brings
    (server/app.py's TextStream): a run that completes it in its middle loses the rest."""
    from paged_jax.server.app import TextStream

    tokenizer = big_llm().engine.tokenizer
    ids = tokenizer.encode("alpha beta gamma delta epsilon")
    stream = TextStream(tokenizer, ("gamma",))
    sent = stream.push(ids[:1]) + stream.push(ids[1:])  # the second "step" brings every other token
    assert stream.stopped and sent + stream.flush() == tokenizer.decode(ids).split("gamma")[0]


def test_rejected_proposals_roll_back_num_computed_tokens():
    from paged_jax.core.config import SchedulerConfig
    from paged_jax.core.scheduler import Scheduler

    mgr = KVCacheManager(CacheConfig(4, 11, 64))
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16, max_model_len=64), mgr)
    request = decoding_request(scheduler)
    request.spec_token_ids = [8, 9, 10]
    out = scheduler.schedule()
    # 1 of 3 accepted: 8, then the target's 12 in place of 9.
    (core,) = scheduler.update_from_output(out, np.array([[8, 12, -1, -1]]), num_accepted=np.array([1]))
    assert core.new_token_ids == [8, 12] and request.output_token_ids == [7, 8, 12]
    assert request.num_computed_tokens == 8 and request.num_tokens == 9  # 6 + 7 + 8 computed; 12 next
    assert request.spec_token_ids == []
    # A budget of 16 holds all 3 new proposals; one of 2 would hold 1.
    request.spec_token_ids = [13, 14, 15]
    scheduler.max_num_batched_tokens = 2
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == [2] and out.spec_token_ids == [[13]]
    mgr.check_invariants({"A": request})


def test_counters_and_no_compiles_after_warm_up():
    prompts, max_tokens, reference = repetitive_workload()
    engine = spec_engine(warm_up="full", num_blocks=2048)
    compiled = engine.get_stats()["num_compilations"]
    assert generate(engine, prompts, [greedy(m) for m in max_tokens], check_each_step=False) == reference
    stats = engine.get_stats()
    assert stats["num_compilations"] == compiled, "a step compiled after warm-up"
    drafts, proposed, accepted = (stats[k] for k in ("spec_num_drafts", "spec_num_draft_tokens",
                                                     "spec_num_accepted_tokens"))
    assert 0 < accepted < proposed <= 3 * drafts
    assert stats["spec_acceptance_rate"] == pytest.approx(accepted / proposed)
    assert stats["spec_mean_accepted_length"] == pytest.approx(1 + accepted / drafts)
    per_position = stats["spec_acceptance_rate_per_position"]
    assert len(per_position) == 3 and per_position[0] >= per_position[1] >= per_position[2]
    assert sum(per_position) * drafts == pytest.approx(accepted)
    # Every output token came from a step: verified drafts plus one of the target's per row.
    assert stats["num_generated_tokens"] == sum(len(out) for out in reference)


def test_sampled_tokens_follow_the_same_distribution_with_and_without_speculation():
    """1,200 seeded requests, 4 tokens each, top-k 2 at temperature 1, after a prompt that ends
    in the model's own greedy continuation (so prompt lookup proposes likely tokens, and the
    target accepts some and rejects others): the counts of whole outputs with and without
    speculation pass a two-sample chi-square test. Proposals start at the 2nd token (the 1st
    comes from the prefill). Removing the residual resampling (a correction drawn from the
    target's distribution itself) fails it: p = 1e-13 when measured (p = 0.9999 as it is)."""
    from scipy.stats import chi2_contingency

    rng = np.random.default_rng(5)
    start = rng.integers(0, 512, 10).tolist()
    prompt = start + dense_greedy([start], [40])[0][0]
    num = 1200
    params = [SamplingParams(max_tokens=4, temperature=1.0, top_k=2, seed=i, ignore_eos=True) for i in range(num)]
    settings = dict(max_num_seqs=64, max_num_batched_tokens=512, num_blocks=2048)
    counts = []
    for spec in (NGRAM, None):
        engine = spec_engine(speculative_config=spec, **settings)
        counts.append(Counter(tuple(out) for out in generate(engine, [prompt] * num, params, check_each_step=False)))
        if spec is not None:
            stats = engine.get_stats()
    assert stats["spec_num_draft_tokens"] > num / 4, "too few proposals: the sampler was hardly exercised"
    assert 0.1 < stats["spec_acceptance_rate"] < 0.9, stats["spec_acceptance_rate"]
    keys = sorted(set(counts[0]) | set(counts[1]))
    table = np.array([[c.get(k, 0) for k in keys] for c in counts])
    common = table.sum(axis=0) >= 10  # rare outputs pooled into one cell (chi-square needs counts)
    rare = table[:, ~common].sum(axis=1)
    table = np.column_stack([table[:, common], rare]) if rare.any() else table[:, common]
    _, p_value, _, _ = chi2_contingency(table)
    assert p_value > 1e-3, (p_value, table)


def test_a_verification_step_pads_to_its_own_sequences_not_its_tokens():
    """One sequence verifying 4 proposals has 5 tokens: (5, 1) (1 + k is a token bucket of its
    own), not the (8, 8) a 5-token step gets without speculation (8 rows of logits, and the
    verification's 8 x 5); every bucket a step can get is among the compiled shapes."""
    from paged_jax.core.config import SchedulerConfig

    plain = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512, max_model_len=1024)
    spec = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512, max_model_len=1024, num_spec_tokens=4)
    assert plain.bucket_for(5, 1) == (8, 8) and spec.bucket_for(5, 1) == (5, 1) and spec.bucket_for(6, 1) == (8, 1)
    assert 5 in spec.token_buckets and 5 not in plain.token_buckets
    assert spec.bucket_for(16 * 5, 16) == (128, 16) and spec.bucket_for(3 * 5, 3) == (16, 4)
    assert spec.bucket_for(1, 1) == plain.bucket_for(1, 1) == (1, 1)
    shapes = set(spec.bucket_shapes())
    for num_tokens in range(1, 513):
        for num_seqs in range(1, min(num_tokens, 16) + 1):
            assert spec.bucket_for(num_tokens, num_seqs) in shapes
    with pytest.raises(ValueError, match="num_spec_tokens"):
        SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=8, max_model_len=8, num_spec_tokens=-1)
