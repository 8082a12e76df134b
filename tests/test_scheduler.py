"""Scheduler on the real KVCacheManager: exact hand-traced steps, then a randomized
simulation that reads every token back through the block tables."""

import numpy as np
import pytest

from paged_jax.core.batch import StepInputsBuilder
from paged_jax.core.config import CacheConfig, SchedulerConfig
from paged_jax.core.kv_cache_manager import KVCacheManager
from paged_jax.core.request import Request, RequestStatus, SamplingParams
from paged_jax.core.scheduler import Scheduler

GREEDY = SamplingParams(temperature=0.0, max_tokens=100)


def _make(num_blocks=64, budget=64, max_num_seqs=8, max_model_len=64, caching=True, threshold=0, block_size=4):
    kv = KVCacheManager(CacheConfig(block_size, num_blocks, max_model_len, enable_prefix_caching=caching))
    config = SchedulerConfig(max_num_seqs, budget, max_model_len, threshold, min_token_bucket=4, min_seq_bucket=1)
    return Scheduler(config, kv)


def _req(rid, n, start=0, max_tokens=100, **kw):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw.pop("params", {}))
    return Request(rid, list(range(start, start + n)), params, **kw)


def _group_ids(block_ids):
    """The one KV-cache group's new block ids (() is a step that allocated none; unpacking
    fails on more groups)."""
    if block_ids == ():
        return []
    (ids,) = block_ids
    return ids


def _view(out):
    """The step's lists, with the block ids of the one KV-cache group."""
    return (out.req_ids, out.num_computed_tokens, out.num_scheduled_tokens, out.samples,
            [_group_ids(ids) for ids in out.new_block_ids], out.is_new)


def _step(sched, tokens=None):
    out = sched.schedule()
    sampled = tokens if tokens is not None else [7] * out.num_seqs
    return out, sched.update_from_output(out, np.asarray(sampled, np.int32))


def test_token_budget_and_chunked_prefill():
    s = _make(budget=8)
    a, b, c = _req("A", 10, 0), _req("B", 5, 100), _req("C", 3, 200)
    for r in (a, b, c):
        s.add_request(r)
    # step 1: A's prompt does not fit in 8 tokens -> a chunk of 8 that samples nothing.
    out, res = _step(s, [99])
    assert _view(out) == (["A"], [0], [8], [False], [[1, 2]], [True])
    assert res == [] and a.output_token_ids == [] and a.num_computed_tokens == 8
    # step 2: A finishes its prompt (2) and samples; B fits (5); C gets the last token.
    out, res = _step(s, [50, 51, 52])
    assert _view(out) == (["A", "B", "C"], [8, 0, 0], [2, 5, 1], [True, True, False], [[3], [4, 5], [6]],
                          [False, True, True])
    assert [r.request_id for r in res] == ["A", "B"] and a.output_token_ids == [50] and c.output_token_ids == []
    # step 3: decodes take 1 token each; C's remaining 2 prompt tokens complete it.
    out, _ = _step(s)
    assert _view(out)[:4] == (["A", "B", "C"], [10, 5, 1], [1, 1, 2], [True, True, True])
    assert out.total_num_scheduled_tokens == 4


def test_max_num_seqs_keeps_the_rest_waiting():
    s = _make(max_num_seqs=2)
    for i in range(3):
        s.add_request(_req(f"r{i}", 4, 10 * i))
    out, _ = _step(s)
    assert out.req_ids == ["r0", "r1"] and [r.request_id for r in s.waiting] == ["r2"]


def test_fcfs_a_blocked_head_blocks_the_queue():
    s = _make(num_blocks=5)  # 4 usable blocks
    a = _req("A", 8, max_tokens=4)
    s.add_request(a)
    _step(s)
    s.add_request(_req("B", 12, 100, max_tokens=1))  # needs 3 blocks
    s.add_request(_req("C", 2, 200, max_tokens=1))  # needs 1 and would fit
    for _ in range(3):  # A takes its 3rd block; one is left, and C must not overtake B
        out, _ = _step(s)
        assert out.req_ids == ["A"] and [r.request_id for r in s.waiting] == ["B", "C"]
    assert a.is_finished()
    out, _ = _step(s)
    assert _view(out)[:3] == (["B", "C"], [0, 0], [12, 2])


def test_long_prefill_threshold_chunks_prompts():
    s = _make(threshold=4)
    s.add_request(_req("A", 10))
    s.add_request(_req("B", 3, 50))
    got = [_view(_step(s)[0])[:3] for _ in range(3)]
    assert got == [(["A", "B"], [0, 0], [4, 3]), (["A", "B"], [4, 3], [4, 1]), (["A", "B"], [8, 4], [2, 1])]


def test_preempt_most_recent_then_self_and_queue_order():
    # 3 usable blocks of 4 tokens; A, B, C hold one each after their prompts.
    s = _make(num_blocks=4)
    a, b, c = (_req(rid, 4, start, max_tokens=8) for rid, start in (("A", 0), ("B", 100), ("C", 200)))
    for r in (a, b, c):
        s.add_request(r)
    out, _ = _step(s)
    assert out.new_block_ids == [([1],), ([2],), ([3],)]  # one list per KV-cache group
    # step 2: A's 5th token needs a block: C (admitted last) is preempted and A gets C's
    # block 3; B then needs one too, and the newest running request is B itself.
    out, _ = _step(s, [8])
    assert _view(out) == (["A"], [4], [1], [True], [[3]], [False])
    assert out.preempted_req_ids == ["C", "B"]
    assert [r.request_id for r in s.waiting] == ["B", "C"], "the last preempted goes first"
    assert (b.status, b.num_computed_tokens, b.num_preemptions) == (RequestStatus.PREEMPTED, 0, 1)
    assert s.num_preemptions == 2 and s.kv_cache_manager.get_block_ids("B") == ([],)
    assert b.output_token_ids == [7] and c.output_token_ids == [7], "outputs survive preemption"
    # step 3: B hits its own cached block 2 but needs one more; none free -> nobody admitted.
    out, _ = _step(s)
    assert out.req_ids == ["A"] and out.preempted_req_ids == []


def test_preemption_step_admits_nobody_then_resume_hits_the_prefix_cache():
    # 4 usable blocks. A (6 tokens) and B (5) take two each; C waits for a block.
    s = _make(num_blocks=5)
    a, b, c = _req("A", 6, 0, max_tokens=4), _req("B", 5, 100, max_tokens=10), _req("C", 4, 200, max_tokens=1)
    s.add_request(a)
    s.add_request(b)
    out, _ = _step(s)
    assert out.new_block_ids == [([1, 2],), ([3, 4],)]
    s.add_request(c)
    for _ in range(2):  # A reaches 9 tokens, B 8; C stays queued: no free block
        out, _ = _step(s)
        assert out.req_ids == ["A", "B"]
    # step 4: A's 9th token needs a 3rd block -> B (newest) is preempted; its unhashed
    # tail block 4 goes to the head of the free queue and A takes it. B is now first in
    # line, ahead of C.
    out, res = _step(s, [9])
    assert _view(out) == (["A"], [8], [1], [True], [[4]], [False])
    assert out.preempted_req_ids == ["B"] and [r.request_id for r in s.waiting] == ["B", "C"]
    assert res[0].finish_reason == "length" and a.status == RequestStatus.FINISHED_LENGTH_CAPPED
    # step 5: A's blocks were freed (free queue [4, 3*, 2*, 1*]). B resumes with its 8 tokens
    # (5 prompt + 3 output): the lookup hits block 3 (4 tokens), and B takes block 4 for the
    # rest; C takes block 2, evicting A's hash.
    out, _ = _step(s)
    assert out.finished_req_ids == ["A"]
    assert _view(out) == (["B", "C"], [4, 0], [4, 4], [True, True], [[3, 4], [2]], [True, True])
    assert b.num_cached_tokens == 0, "TTFT hit counts the first schedule only"
    assert c.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_a_step_that_preempted_admits_nobody():
    # Without prefix caching, a chunk of 4 tokens (the threshold) needs one block, so the
    # preempted B could restart in the block it just freed; the rule makes it wait a step.
    s = _make(num_blocks=4, caching=False, threshold=4)
    s.add_request(_req("A", 4, max_tokens=8))
    s.add_request(_req("B", 6, 100, max_tokens=2))
    out, _ = _step(s)
    assert _view(out) == (["A", "B"], [0, 0], [4, 4], [True, False], [[1], [2]], [True, True])
    # step 2: A takes the last free block 3; B's prompt tail needs a 2nd block -> B, the
    # newest running request, preempts itself and frees block 2.
    out, _ = _step(s)
    assert _view(out) == (["A"], [4], [1], [True], [[3]], [False]) and out.preempted_req_ids == ["B"]
    assert s.kv_cache_manager.get_num_free_blocks() == 1 and [r.request_id for r in s.waiting] == ["B"]
    # step 3: B restarts from scratch in block 2.
    out, _ = _step(s)
    assert _view(out) == (["A", "B"], [5, 0], [1, 4], [True, False], [[], [2]], [False, True])


def test_prefix_hit_at_admission_sets_num_cached_tokens():
    s = _make()
    s.add_request(_req("A", 10))
    _step(s)
    s.add_request(_req("B", 11))  # shares A's first 8 tokens (two full blocks)
    out, res = _step(s)
    assert _view(out)[:3] == (["A", "B"], [10, 8], [1, 3])
    assert out.new_block_ids[1][0][:2] == [1, 2] and res[1].num_cached_tokens == 8


@pytest.mark.parametrize(
    "params,eos,tokens,reason,stop_reason,num_out",
    [
        ({}, 5, [1, 5, 2], "stop", None, 2),
        ({"ignore_eos": True}, 5, [1, 5, 2], "length", None, 3),
        ({"stop_token_ids": (4, 9)}, 5, [1, 9, 2], "stop", 9, 2),
        ({}, None, [1, 2, 3], "length", None, 3),
    ],
)
def test_stop_conditions(params, eos, tokens, reason, stop_reason, num_out):
    s = _make()
    r = Request("r", [10, 11], SamplingParams(temperature=0.0, max_tokens=3, **params), eos_token_id=eos)
    s.add_request(r)
    results = [_step(s, [t])[1] for t in tokens[:num_out]]
    assert [x[0].finish_reason for x in results] == [None] * (num_out - 1) + [reason]
    assert results[-1][0].stop_reason == stop_reason and r.output_token_ids == tokens[:num_out]
    assert not s.has_unfinished_requests() and s.kv_cache_manager.get_num_free_blocks() == 63
    assert s.schedule().finished_req_ids == ["r"]


def test_max_model_len_caps_generation():
    s = _make(max_model_len=12)
    r = _req("r", 10)
    s.add_request(r)
    _step(s)
    _, res = _step(s)
    assert r.num_tokens == 12 and res[0].finish_reason == "length"


def test_logprobs_only_for_requests_that_ask():
    s = _make()
    s.add_request(_req("a", 3, params={"logprobs": True}))
    s.add_request(_req("b", 3, 50))
    out = s.schedule()
    res = s.update_from_output(out, np.array([1, 2, 0, 0]), np.array([-0.5, -1.5, 0.0, 0.0], np.float32))
    assert res[0].new_logprobs == [-0.5] and res[1].new_logprobs is None


def test_abort_frees_blocks_wherever_the_request_is():
    s = _make(budget=8)
    for r in (_req("A", 8), _req("B", 6, 100), _req("C", 4, 200)):
        s.add_request(r)
    out = s.schedule()
    assert out.req_ids == ["A"]
    assert s.abort_request("A") and s.abort_request("C")
    assert not s.abort_request("A") and not s.abort_request("nope")
    # the aborted A is skipped by update: nothing appended, nothing returned
    assert s.update_from_output(out, [3]) == []
    assert s.kv_cache_manager.get_num_free_blocks() == 63 and s.num_aborted == 2
    out, _ = _step(s)
    assert out.finished_req_ids == ["A", "C"] and out.req_ids == ["B"]
    assert s.abort_request("B") and not s.has_unfinished_requests()
    assert s.kv_cache_manager.get_num_free_blocks() == 63


def test_rejects_requests_that_can_never_run():
    s = _make(num_blocks=5, max_model_len=32)  # 4 usable blocks = 16 slots
    s.kv_cache_manager.check_request(_req("ok", 10, max_tokens=7))  # 16 slots: the 17th token is never computed
    with pytest.raises(ValueError, match="whole pool has 4"):
        s.add_request(_req("big", 10, max_tokens=8))
    with pytest.raises(ValueError, match="max_model_len"):
        s.add_request(_req("long", 33))
    s.add_request(_req("x", 4, max_tokens=4))
    with pytest.raises(ValueError, match="already in use"):
        s.add_request(_req("x", 4, max_tokens=4))
    capped = _make(num_blocks=5, max_model_len=16)  # max_model_len caps the need at 4 blocks
    capped.add_request(_req("y", 10, max_tokens=100))
    assert [r.request_id for r in s.waiting] == ["x"]


def test_constructor_checks():
    kv = KVCacheManager(CacheConfig(4, 8, 32))
    with pytest.raises(ValueError, match="max_model_len=64 differs from the KV cache's 32"):
        Scheduler(SchedulerConfig(4, 16, 64), kv)
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(0, 16, 32)
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        SchedulerConfig(4, 16, 32, long_prefill_token_threshold=-1)


def _simulate(seed, *, num_blocks, budget, max_num_seqs, caching, threshold, num_reqs):
    """Runs random requests through scheduler + builder against a paged 'KV store' that
    holds token ids; the fake model's next token hashes the context it reads back through
    the block table, so a wrong slot, a stale block or a bad prefix hit changes the output.
    Compared with the same function applied to the true sequence (an unbatched reference)."""
    rng = np.random.default_rng(seed)
    bs, max_model_len = 4, 48
    s = _make(num_blocks=num_blocks, budget=budget, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
              caching=caching, threshold=threshold)
    builder = StepInputsBuilder(s.kv_cache_manager.config, s.config, seed=0)
    store = np.full(num_blocks * bs, -1, np.int64)
    shared = rng.integers(0, 50, 12).tolist()

    def model(context):
        return int(sum((i + 1) * t for i, t in enumerate(context)) * 2654435761 % 97)

    reqs = []
    for i in range(num_reqs):
        prompt = (shared[: rng.integers(0, 13)] if rng.random() < 0.6 else []) + rng.integers(0, 50, rng.integers(1, 14)).tolist()
        r = Request(f"q{i}", prompt, SamplingParams(temperature=0.0, max_tokens=int(rng.integers(1, 12))), eos_token_id=96)
        s.add_request(r)
        reqs.append(r)
    steps = 0
    while s.has_unfinished_requests():
        out = s.schedule()
        assert out.total_num_scheduled_tokens <= budget and out.num_seqs <= max_num_seqs
        inputs = builder.build(out)
        n = out.total_num_scheduled_tokens
        attention = inputs.attention.for_group(0)
        store[attention.slot_mapping[:n]] = inputs.model.token_ids[:n]  # the step writes every K/V first
        sampled = []
        for i in range(out.num_seqs):
            length = int(attention.seq_lens[i])
            table = attention.block_tables[i]
            slots = table[np.arange(length) // bs] * bs + np.arange(length) % bs
            sampled.append(model(store[slots].tolist()))
        s.update_from_output(out, sampled)
        steps += 1
        assert steps < 2000, "the scheduler made no progress"
    for r in reqs:
        seq = list(r.prompt_token_ids)
        for _ in range(r.max_tokens):
            seq.append(model(seq))
            if seq[-1] == 96:
                break
        assert r.all_token_ids == seq, f"{r.request_id} diverged from the unbatched reference"
    assert s.kv_cache_manager.get_num_free_blocks() == num_blocks - 1, "blocks leaked"
    s.kv_cache_manager.check_invariants()
    return s, reqs


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("caching", [True, False])
def test_random_simulation_matches_unbatched_reference(seed, caching):
    s, reqs = _simulate(seed, num_blocks=64, budget=32, max_num_seqs=6, caching=caching, threshold=0, num_reqs=24)
    assert s.num_finished == 24
    hits = sum(r.num_cached_tokens for r in reqs)
    assert hits > 0 if caching else hits == 0


@pytest.mark.parametrize("seed", range(6))
def test_random_simulation_with_preemption_and_chunking(seed):
    s, _ = _simulate(seed, num_blocks=14, budget=8, max_num_seqs=8, caching=True, threshold=5, num_reqs=24)
    assert s.num_preemptions > 0, "the small pool must force preemption"


def test_a_request_blocked_at_the_head_is_counted_once():
    # 5 usable blocks of 4: A (12 tokens + 6 outputs) grows to all 5, so B waits at the head
    # of the queue, looked up every step, until A finishes; the prefix-cache stats count
    # each request once, when it is admitted (2 requests, 12 + 9 tokens looked up).
    s = _make(num_blocks=6)
    s.add_request(_req("A", 12, max_tokens=6))
    s.add_request(_req("B", 9, 100, max_tokens=1))
    steps_waited = 0
    while s.has_unfinished_requests():
        out, _ = _step(s)
        steps_waited += "B" not in out.req_ids and s.requests.get("B") is not None
    stats = s.kv_cache_manager.prefix_cache_stats
    assert steps_waited >= 4, "B never waited: the test would not see a recount"
    assert (stats.requests, stats.queries, stats.hits) == (2, 12 + 9, 0)
    s.kv_cache_manager.check_invariants()
