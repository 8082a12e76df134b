"""ModelRunner: buckets, warm-up, no compilation while serving, donated KV caches.

Compilations are counted twice: by the runner's own counter (traces of the step) and,
independently, by jax's backend-compile monitoring event, which fires for every XLA
compilation in the process whatever triggered it.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import math
import threading

import jax
import numpy as np
import pytest
from flax import nnx

from engine_reference import (BLOCK_SIZE, MAX_MODEL_LEN, assert_no_leak, dense_greedy, get_engine, model,
                              run_to_completion)
from hand_step_inputs import hand_step_inputs
from models.kv_cache_spec import init_kv_caches
from models.llama import LlamaConfig, LlamaForCausalLM
from paged_jax import SamplingParams
from paged_jax.engine import LLMEngine
from paged_jax.engine_config import EngineConfig, ResolvedConfig
from paged_jax.core.config import MIN_SEQ_BUCKET, MIN_TOKEN_BUCKET, CacheConfig, SchedulerConfig
from paged_jax.compile_manager import stop_background_work
from paged_jax.kv_pool import CPU_KV_CACHE_BYTES, num_blocks_for_budget
from paged_jax.runner import ModelRunner, pack_step_inputs, unpack_step_inputs
from paged_jax.runner import _default_layers_per_program as layers_per_program

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@pytest.fixture
def backend_compiles():
    """A list that grows by one entry per XLA compilation while the test runs."""
    stop_background_work()  # other runners' threads (pool zeroing, warm-up) compile no more
    events = []

    def listener(name, duration, **kwargs):
        if name == BACKEND_COMPILE_EVENT:
            events.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listener)
    yield events
    jax.monitoring.unregister_event_duration_listener(listener)


def make_runner(num_blocks, max_num_seqs, max_num_batched_tokens, max_model_len=MAX_MODEL_LEN,
                min_token_bucket=MIN_TOKEN_BUCKET, **kwargs):
    return ModelRunner(model(), ResolvedConfig(EngineConfig(**kwargs),
                                               CacheConfig(BLOCK_SIZE, num_blocks, max_model_len),
                                               SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len,
                                                               min_token_bucket=min_token_bucket)))


def _smallest_at_least(buckets, n):
    return buckets[bisect.bisect_left(buckets, n)]


@pytest.mark.parametrize("max_num_seqs,max_num_batched_tokens", [(8, 64), (16, 32), (5, 100), (64, 512), (1, 16),
                                                                 (3, 2), (40, 24)])
def test_bucket_shapes_cover_every_reachable_step(max_num_seqs, max_num_batched_tokens):
    runner = make_runner(2, max_num_seqs, max_num_batched_tokens)
    shapes = runner.bucket_shapes()
    assert len(set(shapes)) == len(shapes)
    token_buckets = runner.scheduler_config.token_buckets
    seq_buckets = runner.scheduler_config.seq_buckets
    assert token_buckets[-1] == max_num_batched_tokens and seq_buckets[-1] == max_num_seqs
    assert token_buckets[0] == min(MIN_TOKEN_BUCKET, max_num_batched_tokens)

    def own_bucket(t, s):  # the rule, restated: sequences pad to the token bucket below MIN_SEQ_BUCKET
        tb = _smallest_at_least(token_buckets, t)
        floor = max(s, min(tb, MIN_SEQ_BUCKET))
        return tb, seq_buckets[min(bisect.bisect_left(seq_buckets, floor), len(seq_buckets) - 1)]

    # every step the scheduler can produce: t tokens over 1..min(t, max_num_seqs) sequences
    reachable = {own_bucket(t, s) for t in range(1, max_num_batched_tokens + 1) for s in range(1, min(t, max_num_seqs) + 1)}
    assert {runner.compiler.bucket_for(t, s) for t in range(1, max_num_batched_tokens + 1)
            for s in range(1, min(t, max_num_seqs) + 1)} == reachable
    assert reachable == set(shapes), "warm-up compiles a shape no step uses, or misses one a step needs"
    assert runner.num_compilations == 0  # nothing compiles before warm_up or a step


def test_warm_up_compiled_each_bucket_once(backend_compiles):
    runner = get_engine("chunked").runner  # built (and warmed up) on first use
    compiled_before = len(backend_compiles)
    shapes = runner.bucket_shapes()
    assert shapes == [(1, 1), (2, 2), (4, 4), (8, 8), (16, 8), (16, 16), (32, 8), (32, 16)]
    assert runner.num_compilations == len(shapes)
    assert runner.warm_up() == len(shapes)  # again: every shape is cached
    assert runner.num_compilations == len(shapes) and len(backend_compiles) == compiled_before


def test_serving_after_warm_up_compiles_nothing(backend_compiles, monkeypatch):
    engine = get_engine("chunked")  # built (and warmed up) on first use
    runner = engine.runner
    compilations, compiled_before = runner.num_compilations, len(backend_compiles)
    seen = set()
    build = engine.input_builder.build

    def recording_build(scheduler_output, *args):
        inputs = build(scheduler_output, *args)
        seen.add((inputs.model.token_ids.shape[0], inputs.attention.block_tables.shape[1]))
        return inputs

    monkeypatch.setattr(engine.input_builder, "build", recording_build)
    rng = np.random.default_rng(5)
    num_requests = 120
    for i in range(num_requests):
        n = int(rng.choice([1, 2, 5, 15, 16, 17, 31, 32, 33, 64, 100, 150, 200]) if i % 3 else rng.integers(1, 230))
        kind = i % 4
        params = SamplingParams(
            max_tokens=int(rng.integers(1, 17)), ignore_eos=True, logprobs=kind == 1,
            temperature=0.0 if kind in (0, 1) else 0.9, top_k=20 if kind == 2 else -1,
            top_p=0.8 if kind == 3 else 1.0, seed=i if kind == 3 else None)
        engine.add_request(f"nocompile-{i}", rng.integers(0, 512, n).tolist(), params)
        if i % 10 == 9:  # arrivals interleave with steps, so batches keep changing shape
            engine.step()
        if i % 40 == 39:
            engine.abort_request(f"nocompile-{i - 1}")
    finished = run_to_completion(engine)
    assert len(finished) >= num_requests - 3 - 10  # all but the aborted (and those finished in the loop)

    new_compiles = len(backend_compiles) - compiled_before
    assert new_compiles == 0, f"{new_compiles} XLA compilations while serving"
    assert runner.num_compilations == compilations
    assert seen <= set(runner.bucket_shapes())
    assert len(seen) >= 3 and any(s == 16 for _, s in seen), f"the run only used {seen}"
    assert_no_leak(engine)


def test_donated_caches_update_in_place():
    """For every bucket, the compiled layer program aliases its layers' cache buffers to its
    outputs and its temporaries are far smaller than one layer's cache: no second cache-sized
    buffer. The embed and head programs never see a cache. A copy of the layer program
    without donation shows what a copy looks like (so the check can fail)."""
    runner = make_runner(4097, 8, 64)
    cache_bytes = runner.pool.kv_cache_bytes
    config = model().config
    assert cache_bytes == 2 * config.num_layers * 4097 * BLOCK_SIZE * config.num_kv_heads * config.head_dim * 4
    layer_cache_bytes = cache_bytes // config.num_layers
    k = runner.layers_per_program
    assert 1 <= k <= config.num_layers and config.num_layers % k == 0
    assert runner.bucket_shapes() == [(1, 1), (2, 2), (4, 4), (8, 8), (16, 8), (32, 8), (64, 8)]
    for t, s in runner.bucket_shapes():
        memory = runner.compiled_memory(t, s)
        layer = memory["layer"]
        assert layer.alias_size_in_bytes == k * layer_cache_bytes, (t, s)
        assert layer.temp_size_in_bytes < layer_cache_bytes / 4, (t, s)
        assert layer.output_size_in_bytes - layer.alias_size_in_bytes < layer_cache_bytes / 4, (t, s)
        for name in ("embed", "head"):
            stats = memory[name]
            assert stats.alias_size_in_bytes == 0 and stats.temp_size_in_bytes < layer_cache_bytes / 4, (name, t, s)
            assert stats.argument_size_in_bytes < layer_cache_bytes / 4, (name, t, s)

    inputs = runner.dummy_inputs(64, 8)
    x = jax.ShapeDtypeStruct((64, config.hidden_size), config.dtype)
    layer_fn = functools.partial(runner._layer_fn, kind=runner.layer_groups(64).kinds[0])
    copying = jax.jit(layer_fn).lower(runner.layer_params[:k], x, runner.kv_caches[:k], inputs.model.positions,
                                      inputs.attention)
    copied = copying.compile().memory_analysis()
    assert copied.alias_size_in_bytes == 0 and copied.output_size_in_bytes >= layer_cache_bytes


def test_step_deletes_the_previous_cache_arrays():
    engine = get_engine("big")
    runner = engine.runner
    before = [a for pair in runner.kv_caches for a in pair]
    assert not any(a.is_deleted() for a in before)
    engine.add_request("donate", [5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0))
    engine.step()
    assert all(a.is_deleted() for a in before), "the step kept the old caches alive: donation did not happen"
    after = [a for pair in runner.kv_caches for a in pair]
    assert not any(a.is_deleted() for a in after)
    assert [a.shape for a in after] == [a.shape for a in before]
    run_to_completion(engine)
    assert_no_leak(engine)


def test_idle_step_runs_nothing():
    engine = get_engine("big")
    steps = engine.runner.num_steps
    assert engine.step() == []
    assert engine.runner.num_steps == steps


def test_num_blocks_for_budget():
    config: LlamaConfig = model().config
    specs, bf16_specs = model().kv_cache_specs(), model().kv_cache_specs("bfloat16")
    per_block = 2 * config.num_layers * BLOCK_SIZE * config.num_kv_heads * config.head_dim * 4  # f32
    kwargs = dict(max_num_seqs=8, max_model_len=MAX_MODEL_LEN)
    assert num_blocks_for_budget(specs, BLOCK_SIZE, num_blocks=7, **kwargs) == 7
    assert num_blocks_for_budget(specs, BLOCK_SIZE, kv_cache_memory_bytes=10 * per_block + 5, **kwargs) == 10
    assert num_blocks_for_budget(bf16_specs, BLOCK_SIZE, kv_cache_memory_bytes=10 * per_block, **kwargs) == 20
    with pytest.raises(ValueError, match=rf"holds 1 blocks of {per_block} bytes; give at least {2 * per_block}"):
        num_blocks_for_budget(specs, BLOCK_SIZE, kv_cache_memory_bytes=per_block, **kwargs)
    if "bytes_limit" not in (jax.devices()[0].memory_stats() or {}):
        # the CPU: room for every sequence at full length, up to CPU_KV_CACHE_BYTES, never less than one
        per_seq = math.ceil(MAX_MODEL_LEN / BLOCK_SIZE)
        assert num_blocks_for_budget(specs, BLOCK_SIZE, **kwargs) == 8 * per_seq + 1
        budget_blocks = CPU_KV_CACHE_BYTES // per_block
        many = dict(max_num_seqs=10 * budget_blocks // per_seq, max_model_len=MAX_MODEL_LEN)
        assert num_blocks_for_budget(specs, BLOCK_SIZE, **many) == budget_blocks + 1
        long = dict(max_num_seqs=8, max_model_len=2 * BLOCK_SIZE * budget_blocks)
        assert num_blocks_for_budget(specs, BLOCK_SIZE, **long) == 2 * budget_blocks + 1


def test_runner_rejects_unknown_attention_impl():
    with pytest.raises(ValueError, match="attention_impl='flash'"):
        make_runner(2, 1, 16, max_model_len=64, attention_impl="flash")


def test_layers_per_program():
    assert [layers_per_program(n) for n in (1, 2, 3, 7, 9, 16, 22, 30, 35)] == [1, 2, 3, 1, 3, 4, 2, 6, 5]


def test_choose_shape_pads_up_to_a_compiled_bucket():
    runner = make_runner(2, 16, 32, min_token_bucket=16)  # the padding rule on 16-token buckets
    assert runner.bucket_shapes() == [(16, 8), (16, 16), (32, 8), (32, 16)]
    # nothing compiled: the smallest bucket that fits (the step then waits for it)
    assert runner.compiler.choose_shape(3, 2) == (16, 8)
    assert runner.compiler.choose_shape(17, 9) == (32, 16)
    runner.compiler._programs[(32, 16)] = None  # stands for compiled programs: choose_shape only looks at the keys
    # With no warm-up thread running, a step never pads up: its own bucket compiles on first use.
    assert runner.compiler.choose_shape(3, 2) == (16, 8)
    runner.compiler._warming_up = True  # stands for the warm-up thread at work: now it pads up
    assert runner.compiler.choose_shape(3, 2) == (32, 16)  # the only compiled bucket that fits
    assert runner.compiler.choose_shape(17, 9) == (32, 16)
    runner.compiler._programs[(16, 16)] = None
    assert runner.compiler.choose_shape(3, 2) == (16, 16)  # fewest tokens first
    assert runner.compiler.choose_shape(17, 2) == (32, 16)
    runner.compiler._programs[(16, 8)] = None
    assert runner.compiler.choose_shape(3, 2) == (16, 8)
    assert runner.compiler.choose_shape(16, 8) == (16, 8) and runner.compiler.choose_shape(16, 9) == (16, 16)


def test_a_step_runs_in_a_larger_compiled_bucket_unchanged():
    """While its own bucket is not compiled, a step runs in the smallest compiled one that fits
    (its inputs padded further): the same tokens and logprobs as in its own bucket."""
    runner = make_runner(16, 16, 32)
    tokens = np.random.default_rng(5).integers(0, 512, 12)
    width = runner.cache_config.max_blocks_per_seq
    small = hand_step_inputs([(tokens, [3], 0, 12), (tokens[:5], [6], 0, 5)], BLOCK_SIZE, width, 32, 8)
    runner._programs_for((32, 16))  # only the larger bucket is compiled
    runner.compiler._warming_up = True  # and the warm-up thread would compile the step's own next
    assert runner.compiler.choose_shape(32, 8) == (32, 16)
    big_ids, big_logprobs = runner.execute(small)
    assert runner.compiler.num_compiled_shapes == 1, "the step compiled its own bucket instead of padding up"
    own_ids, own_logprobs = make_runner(16, 16, 32).execute(small)
    np.testing.assert_array_equal(big_ids[:2], own_ids[:2])
    np.testing.assert_allclose(big_logprobs[:2], own_logprobs[:2], rtol=1e-6)


def test_without_warm_up_a_decode_compiles_its_own_bucket():
    """warm_up="none": each bucket compiles on first use. After a prefill compiled a large
    bucket, the decodes must not keep running padded up in it (no warm-up thread will ever
    compile theirs): they compile and run in their own."""
    base = get_engine("big")
    config = EngineConfig(model="tiny", max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE, max_num_seqs=8,
                          max_num_batched_tokens=64, warm_up="none")
    engine = LLMEngine(config, model=base.model, tokenizer=base.tokenizer)
    ran = []
    programs_for = engine.runner._programs_for
    engine.runner._programs_for = lambda shape: ran.append(shape) or programs_for(shape)
    prompt = list(range(3, 53))  # 50 tokens: the (64, 8) bucket
    engine.add_request("r", prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    finished = run_to_completion(engine)
    assert ran == [(64, 8)] + [(1, 1)] * 3, ran
    assert finished["r"].token_ids == dense_greedy([prompt], [4])[0][0]
    assert_no_leak(engine)


def test_background_warm_up_never_compiles_on_the_serving_thread():
    """The smallest bucket compiles before the engine is ready, every other one on the warm-up
    thread, smallest first unless a step asks for its own, while requests run; what they
    generate is the dense reference's."""
    base = get_engine("big")
    config = EngineConfig(model="tiny", max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE, max_num_seqs=16,
                          max_num_batched_tokens=32, warm_up="none")
    engine = LLMEngine(config, model=base.model, tokenizer=base.tokenizer)
    runner = engine.runner
    assert runner.num_compilations == 0
    compiled_on, compile_shape = [], runner.compiler._compile_fn

    def recording_compile(num_tokens, num_seqs):
        compiled_on.append((threading.current_thread(), (num_tokens, num_seqs)))
        return compile_shape(num_tokens, num_seqs)

    runner.compiler._compile_fn = recording_compile
    runner.start_warm_up()
    # the smallest bucket and a 16-token prompt's, then nothing more on the serving thread
    first = [(threading.main_thread(), (1, 1)), (threading.main_thread(), runner.compiler.bucket_for(16, 1))]
    assert compiled_on == first and runner.num_compilations == 2

    rng = np.random.default_rng(11)
    prompts = [rng.integers(3, 512, n).tolist() for n in (5, 40, 17, 3, 90, 12, 33, 8, 2, 60)]
    max_tokens = [6, 3, 9, 12, 2, 7, 5, 10, 4, 3]
    for i, (prompt, n) in enumerate(zip(prompts, max_tokens)):
        engine.add_request(f"bg-{i}", prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    finished = run_to_completion(engine)
    runner.compiler.wait_warm_up()

    shapes = runner.bucket_shapes()
    assert sorted(shape for _, shape in compiled_on) == sorted(shapes)  # each bucket once
    assert all(thread is not threading.main_thread() for thread, _ in compiled_on[2:])
    assert runner.num_compilations == len(shapes)
    reference, _ = dense_greedy(prompts, max_tokens)
    assert [finished[f"bg-{i}"].token_ids for i in range(len(prompts))] == reference
    assert_no_leak(engine)


@pytest.mark.parametrize("num_layers, per_program", [(3, None), (7, None), (4, 4)])  # 3, 1, and all 4 a program
def test_grouped_layer_programs_match_the_model(num_layers, per_program):
    """Two steps (a prefill, then a decode reading its cache) through the runner's programs give
    the logprobs of the model's own forward (all layers in one call, tested against dense
    attention in test_llama.py), for layer counts that group differently."""
    config = dataclasses.replace(model().config, num_layers=num_layers)
    llama = LlamaForCausalLM(config, rngs=nnx.Rngs(3))
    runner = ModelRunner(llama, ResolvedConfig(EngineConfig(layers_per_program=per_program),
                                               CacheConfig(BLOCK_SIZE, 9, 64), SchedulerConfig(8, 16, 64)))
    assert runner.layers_per_program == {3: 3, 7: 1, 4: 4}[num_layers]
    caches = init_kv_caches(llama.kv_cache_specs(), 9, BLOCK_SIZE)
    reference = jax.jit(lambda inputs, caches: llama(inputs.model, caches, inputs.attention.for_group(0),
                                                     runner.attention))
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, 20)
    width = runner.cache_config.max_blocks_per_seq
    for start, end in ((0, 13), (13, 14)):
        inputs = hand_step_inputs([(tokens, [4, 2], start, end)], BLOCK_SIZE, width, 16, 8)
        token_ids, logprobs = runner.execute(inputs)
        logits, caches = reference(inputs, caches)
        log_softmax = np.asarray(jax.nn.log_softmax(logits[0]))
        assert token_ids[0] == int(np.argmax(log_softmax)), (start, end)  # greedy row
        np.testing.assert_allclose(logprobs[0], log_softmax[token_ids[0]], rtol=1e-5, atol=1e-5)


def test_layers_per_program_must_divide_the_layers():
    with pytest.raises(ValueError, match="layers_per_program=3 must divide the model's 2 layers"):
        ModelRunner(model(), ResolvedConfig(EngineConfig(layers_per_program=3), CacheConfig(BLOCK_SIZE, 9, 64),
                                            SchedulerConfig(8, 16, 64)))


def test_packed_step_inputs_round_trip_bit_for_bit():
    """The one-copy packing keeps every field's bits (f32 and u32 fields are bitcast, not cast)."""
    runner = get_engine("big").runner
    inputs = runner.dummy_inputs(16, 8)
    rng = np.random.default_rng(0)
    inputs = jax.tree.map(lambda a: rng.integers(-2**31, 2**31 - 1, a.shape, np.int64).astype(np.int32).view(a.dtype),
                          inputs)
    like = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), inputs)
    out = jax.jit(lambda packed: unpack_step_inputs(packed, like))(pack_step_inputs(inputs))
    for got, want in zip(jax.tree.leaves(out), jax.tree.leaves(inputs), strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(np.asarray(got).view(np.int32), want.view(np.int32))
