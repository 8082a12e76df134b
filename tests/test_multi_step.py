"""Multi-step decoding (num_scheduler_steps, vLLM V0's multi-step scheduling): k decode steps
in one program give the tokens of one step at a time (greedy, seeded, logprobs, stops), hold
their lookahead slots in the pool without leaking them, and are not taken where they cannot be."""

import jax
import numpy as np
import pytest

from engine_reference import assert_no_leak
from paged_jax import LLM, SamplingParams
from paged_jax.core.batch import StepInputsBuilder
from paged_jax.core.config import CacheConfig, SchedulerConfig
from paged_jax.core.kv_cache_manager import KVCacheManager
from paged_jax.core.request import Request
from paged_jax.core.request import SamplingParams as CoreParams
from paged_jax.core.scheduler import Scheduler
from paged_jax.engine_config import EngineConfig

PROMPTS = [[5, 9, 2, 7, 7, 1], [3, 4], [8] * 20, list(range(3, 40)), [11] * 9, [7, 3, 5]]


def _llm(num_scheduler_steps: int, weight_dtype: str = "int8", max_model_len: int = 64) -> LLM:
    return LLM("tiny", weight_dtype=weight_dtype, max_model_len=max_model_len, max_num_seqs=4,
               max_num_batched_tokens=32, block_size=16, warm_up="none", num_scheduler_steps=num_scheduler_steps)


def _generate(llm: LLM, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert_no_leak(llm.engine)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs, o.outputs[0].finish_reason) for o in outs]


def _params(stop_token: int | None = None) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=13, temperature=0.0, ignore_eos=True,
                           stop_token_ids=[] if stop_token is None else [stop_token]),
            SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True),
            SamplingParams(max_tokens=21, temperature=0.8, top_k=40, seed=11, ignore_eos=True, logprobs=True),
            SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),
            SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=12, ignore_eos=True),
            SamplingParams(max_tokens=18, temperature=0.0, ignore_eos=True, logprobs=True)]


@pytest.mark.parametrize("weight_dtype", ["int8", "float32"])  # the native layer calls, and the XLA layers
def test_steps_give_the_tokens_of_one_step_at_a_time(weight_dtype):
    reference = _generate(_llm(1, weight_dtype), PROMPTS, _params())
    stop = reference[0][0][5]  # prompt 0's sixth token stops it inside a window of 4
    expected = _generate(_llm(1, weight_dtype), PROMPTS, _params(stop))
    assert expected[0][2] == "stop" and len(expected[0][0]) <= 6
    llm = _llm(4, weight_dtype)
    got = _generate(llm, PROMPTS, _params(stop))
    for (tokens, logprobs, reason), (want, want_logprobs, want_reason) in zip(got, expected):
        assert tokens == want and reason == want_reason
        if want_logprobs:
            np.testing.assert_allclose(logprobs, want_logprobs, rtol=1e-5, atol=1e-6)
    engine = llm.engine
    # Six prompts on four sequences: windows ran once the queue emptied, single steps before.
    assert engine.runner.num_steps > engine.scheduler.num_steps


def test_lookahead_slots_stay_in_the_pool_and_come_back():
    llm = _llm(4)
    engine = llm.engine
    kv = engine.kv_cache_manager
    for i, prompt in enumerate(PROMPTS[:4]):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    windows = 0
    while engine.has_unfinished_requests():
        engine.step()
        kv.check_invariants()  # lookahead blocks are held like any other
        windows += engine.scheduler.num_steps < engine.runner.num_steps
    assert windows
    assert_no_leak(engine)


def test_no_window_past_max_model_len_or_for_penalties():
    # A request whose window of 4 would pass max_model_len (64) takes single steps: after its
    # 62-token prompt it holds 63 tokens, and a window's last position would be 65.
    prompt = list(range(3, 3 + 62))
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    want = _generate(_llm(1), [prompt], [params])
    llm = _llm(4)
    assert _generate(llm, [prompt], [params]) == want and want[0][2] == "length"
    assert llm.engine.runner.num_steps == llm.engine.scheduler.num_steps
    # Penalties count the tokens sampled so far on the host: no windows either.
    params = SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True, repetition_penalty=1.3)
    want = _generate(_llm(1), PROMPTS[:2], [params, params])
    llm = _llm(4)
    assert _generate(llm, PROMPTS[:2], [params, params]) == want
    assert llm.engine.runner.num_steps == llm.engine.scheduler.num_steps


def test_scheduler_reserves_the_window_hand_trace():
    """block_size 4, windows of 3: the window's positions are reserved, never cached early, and
    the steps' slot mappings read them from the table."""
    kv = KVCacheManager(CacheConfig(4, 32, 64, enable_prefix_caching=True))
    config = SchedulerConfig(4, 16, 64, min_token_bucket=4, min_seq_bucket=1, num_scheduler_steps=3)
    sched, builder = Scheduler(config, kv), StepInputsBuilder(kv.config, config)
    a = Request("A", [0, 1, 2, 3, 4], CoreParams(temperature=0.0, max_tokens=100, stop_token_ids=[61]))
    sched.add_request(a)
    out = sched.schedule()  # A waited at the start of the step: its prefill, one step
    builder.build(out)
    assert out.num_steps == 1 and out.new_block_ids == [([1, 2],)]
    sched.update_from_output(out, np.asarray([50], np.int32))
    # positions 5, 6, 7: all in block 2
    out = sched.schedule()
    inputs = builder.build(out)
    assert out.num_steps == 3 and out.num_scheduled_tokens == [1] and out.new_block_ids == [()]
    np.testing.assert_array_equal(builder.step_slot_mappings(inputs, 3)[:, 0, :1].ravel(), [9, 10, 11])
    sched.update_from_output(out, np.asarray([[51, 52, 53]], np.int32), num_steps=3)
    assert a.output_token_ids == [50, 51, 52, 53] and a.num_computed_tokens == 8
    # positions 8, 9, 10: a new block (3) for the window; padding rows write slot 0
    out = sched.schedule()
    inputs = builder.build(out)
    assert out.num_steps == 3 and out.new_block_ids == [([3],)]
    slots = builder.step_slot_mappings(inputs, 3)
    assert slots.shape == (3, 1, 4)
    np.testing.assert_array_equal(slots[:, 0], [[12, 0, 0, 0], [13, 0, 0, 0], [14, 0, 0, 0]])
    # A stop inside the window ends the request there; its blocks come back.
    sched.update_from_output(out, np.asarray([[60, 61, 62]], np.int32), num_steps=3)
    assert a.output_token_ids[-2:] == [60, 61] and a.is_finished()
    assert kv.get_num_free_blocks() == kv.config.num_usable_blocks
    # A waiting request turns windows off for the step.
    b, c = (Request(r, [9, 9, 9], CoreParams(temperature=0.0, max_tokens=100)) for r in "BC")
    sched.add_request(b)
    out = sched.schedule()
    builder.build(out)
    sched.update_from_output(out, np.asarray([70], np.int32))
    sched.add_request(c)
    assert sched.schedule().num_steps == 1


def test_a_full_batch_takes_windows_while_others_wait():
    """With max_num_seqs full a waiting request could not start anyway: the running one takes
    its window; once a sequence is free the waiting one is admitted (one step)."""
    kv = KVCacheManager(CacheConfig(4, 32, 64, enable_prefix_caching=True))
    sched = Scheduler(SchedulerConfig(1, 16, 64, min_token_bucket=4, min_seq_bucket=1, num_scheduler_steps=4), kv)
    a = Request("A", [0, 1, 2], CoreParams(temperature=0.0, max_tokens=5))
    b = Request("B", [5, 6], CoreParams(temperature=0.0, max_tokens=3))
    sched.add_request(a)
    sched.update_from_output(sched.schedule(), np.asarray([10], np.int32))
    sched.add_request(b)
    out = sched.schedule()
    assert out.req_ids == ["A"] and out.num_steps == 4
    sched.update_from_output(out, np.asarray([[11, 12, 13, 14]], np.int32), num_steps=4)
    assert a.is_finished() and a.output_token_ids == [10, 11, 12, 13, 14]
    out = sched.schedule()
    assert out.req_ids == ["B"] and out.num_steps == 1 and out.is_new == [True]


def test_bad_num_scheduler_steps_raise_value_errors():
    with pytest.raises(ValueError, match="num_scheduler_steps=0"):
        EngineConfig(num_scheduler_steps=0)
    with pytest.raises(ValueError, match="num_scheduler_steps=4 with speculative_config"):
        EngineConfig(num_scheduler_steps=4, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="num_scheduler_steps=2 with speculative decoding"):
        SchedulerConfig(4, 16, 64, num_spec_tokens=2, num_scheduler_steps=2)


def test_steps_program_updates_the_caches_in_place():
    llm = _llm(4)
    llm.generate(PROMPTS[:1], SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True), use_tqdm=False)
    runner = llm.engine.runner
    program, used = runner._programs_for((1, 1)).steps
    cache_bytes = sum(a.nbytes for t in used for a in jax.tree.leaves(runner.kv_caches[t]))
    memory = program.memory_analysis()
    # The donated caches come back as the program's outputs: no second cache-sized buffer.
    assert memory.alias_size_in_bytes >= cache_bytes and memory.temp_size_in_bytes < cache_bytes / 2
