"""The engine against the dense reference generation loop (tests/engine_reference.py).

Every configuration (big pool, preempting pool, prefix cache on / off, chunked prefill)
must produce exactly the greedy token ids of full recomputation with model.dense_forward,
and the logprobs it reports must be log_softmax of those dense logits. Streaming use
(add_request / step / abort_request), seeded sampling across batches and preemption, and
the block pool coming back whole after every run are checked here too.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from engine_reference import (
    ENGINE_CONFIGS,
    MAX_MODEL_LEN,
    assert_no_leak,
    big_llm,
    dense_greedy,
    get_engine,
    greedy_params,
    make_prompts,
    model,
    run_to_completion,
)
from paged_jax import SamplingParams
from paged_jax.engine import LLMEngine
from paged_jax.engine_config import EngineConfig

LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module")
def reference():
    prompts, max_tokens = make_prompts(seed=0)
    tokens, logprobs = dense_greedy(prompts, max_tokens)
    return prompts, max_tokens, tokens, logprobs


def _run_engine(engine, prompts, params, prefix):
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"{prefix}-{i}", p, sp)
    finished = run_to_completion(engine)
    return [finished[f"{prefix}-{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("name", ["big", "no_cache", "small_pool", "chunked"])
def test_greedy_matches_dense_reference(name, reference):
    prompts, max_tokens, ref_tokens, ref_logprobs = reference
    assert len(prompts) >= 32
    engine = get_engine(name)
    params = [greedy_params(m, logprobs=True) for m in max_tokens]
    before = engine.get_stats()
    if name == "big":  # the offline API, shaped like vLLM's LLM.generate
        outputs = big_llm().generate(prompts, params, use_tqdm=False)
    else:  # the streaming API
        outputs = _run_engine(engine, prompts, params, f"greedy-{name}")
    after = engine.get_stats()

    assert [o.token_ids for o in outputs] == ref_tokens
    for o, ref in zip(outputs, ref_logprobs):
        np.testing.assert_allclose(o.outputs[0].logprobs, ref, atol=LOGPROB_TOL, rtol=0)
    assert all(o.finished and o.finish_reason == "length" for o in outputs)
    assert [o.prompt_token_ids for o in outputs] == prompts

    hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
    preemptions = after["num_preemptions"] - before["num_preemptions"]
    if name == "no_cache":
        assert hits == 0 and all(o.metrics.num_cached_tokens == 0 for o in outputs)
    elif name in ("big", "chunked"):
        # the shared system prompt (two full blocks) is found in the cache
        assert hits > 0 and any(o.metrics.num_cached_tokens >= 32 for o in outputs[1::2])
    if name == "small_pool":
        assert preemptions > 0 and any(o.metrics.num_preemptions > 0 for o in outputs)
        assert after["peak_kv_cache_usage"] > 0.8  # it preempted because the pool was full
    else:
        assert preemptions == 0
    if name == "chunked":
        budget = ENGINE_CONFIGS["chunked"]["max_num_batched_tokens"]
        assert sum(len(p) > budget for p in prompts) >= 8, "too few prompts need chunked prefill"
    assert after["num_compilations"] == before["num_compilations"]
    assert_no_leak(engine)


def test_generate_text_prompt_and_single_prompt_forms():
    llm = big_llm()
    text = "The paged cache keeps blocks"
    ids = llm.tokenizer.encode(text)
    (ref,), _ = dense_greedy([ids], [10])
    (out,) = llm.generate(text, greedy_params(10), use_tqdm=False)
    assert out.prompt == text and out.prompt_token_ids == ids
    assert out.token_ids == ref and out.text == llm.tokenizer.decode(ref)
    assert out.outputs[0].logprobs is None  # not asked for
    (out_ids,) = llm.generate(ids, greedy_params(10))  # one token-id prompt, default progress bar
    assert out_ids.prompt is None and out_ids.token_ids == ref
    (out_np,) = llm.generate(np.asarray(ids), greedy_params(10), use_tqdm=False)  # numpy ids work too
    assert out_np.token_ids == ref
    assert llm.generate([], greedy_params(10), use_tqdm=False) == []
    assert out.metrics.time_to_first_token > 0
    assert_no_leak(llm.engine)


def test_stops_at_max_model_len():
    """A sequence ends when it reaches max_model_len, whatever max_tokens says; a prompt of
    exactly max_model_len still gets its one token (vLLM's rule)."""
    engine = get_engine("big")
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 512, n).tolist() for n in (MAX_MODEL_LEN - 6, MAX_MODEL_LEN - 1, MAX_MODEL_LEN)]
    ref, _ = dense_greedy(prompts, [20, 20, 20], max_model_len=MAX_MODEL_LEN)
    assert [len(r) for r in ref] == [6, 1, 1]
    outputs = _run_engine(engine, prompts, [greedy_params(20)] * 3, "cap")
    assert [o.token_ids for o in outputs] == ref
    assert all(o.finish_reason == "length" for o in outputs)
    assert_no_leak(engine)


def test_stop_token_ends_the_request(reference):
    prompts, _, _, _ = reference
    engine = get_engine("big")
    (ref,), _ = dense_greedy([prompts[6]], [20])
    stop = ref[4]
    want = ref[: ref.index(stop) + 1]  # the stop token is kept
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, stop_token_ids=(stop,))
    (out,) = _run_engine(engine, [prompts[6]], [params], "stop")
    assert out.token_ids == want
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop
    assert_no_leak(engine)


def test_streaming_and_abort(reference):
    prompts, max_tokens, ref_tokens, _ = reference
    engine = get_engine("big")
    n = 14
    before = engine.get_stats()
    ids = [f"stream-{i}" for i in range(n)]
    for i in range(n):
        engine.add_request(ids[i], prompts[i], greedy_params(max_tokens[i]))
    latest, lengths, finished_early = {}, {}, {}
    for _ in range(4):
        for out in engine.step():
            # streaming: one new token per step for each request that sampled
            assert len(out.token_ids) == lengths.get(out.request_id, 0) + 1
            lengths[out.request_id] = len(out.token_ids)
            latest[out.request_id] = out
            if out.finished:
                finished_early[out.request_id] = out
    scheduler = engine.scheduler
    decoding = next(r.request_id for r in scheduler.running if r.num_output_tokens > 0)
    waiting = scheduler.waiting[-1].request_id
    assert waiting not in latest, "the waiting request already produced a token"
    for request_id in (decoding, waiting):
        assert engine.abort_request(request_id)
        assert not engine.abort_request(request_id)  # already gone
    assert not engine.abort_request("no-such-request")
    aborted = latest[decoding]
    assert aborted.finished and aborted.finish_reason == "abort"
    assert aborted.text == engine.tokenizer.decode(aborted.token_ids)
    assert engine.kv_cache_manager.get_block_ids(decoding) == ([],)  # freed at once

    finished = run_to_completion(engine)
    assert decoding not in finished and waiting not in finished
    finished.update(finished_early)
    assert aborted.finish_reason == "abort" and len(aborted.token_ids) == lengths[decoding]
    for i, request_id in enumerate(ids):
        if request_id not in (decoding, waiting):
            assert finished[request_id].token_ids == ref_tokens[i]
            assert finished[request_id].finish_reason == "length"
    assert engine.get_stats()["num_aborted"] - before["num_aborted"] == 2
    assert_no_leak(engine)


def test_abort_everything_mid_run_frees_every_block(reference):
    prompts, _, _, _ = reference
    engine = get_engine("small_pool")
    for i, p in enumerate(prompts[:12]):
        engine.add_request(f"abort-all-{i}", p, greedy_params(20))
    for _ in range(5):
        engine.step()
    assert engine.kv_cache_manager.get_num_free_blocks() < engine.kv_cache_manager.config.num_usable_blocks
    for i in range(12):
        assert engine.abort_request(f"abort-all-{i}")
    assert engine.step() == []  # releases the aborted rows; nothing to run
    assert_no_leak(engine)


SEEDED = [
    SamplingParams(max_tokens=12, temperature=0.8, top_k=40, seed=11, ignore_eos=True),
    SamplingParams(max_tokens=12, temperature=1.0, seed=12, ignore_eos=True),
    SamplingParams(max_tokens=12, temperature=0.7, top_p=0.9, seed=13, ignore_eos=True),
    SamplingParams(max_tokens=12, temperature=1.3, top_k=20, top_p=0.8, seed=14, ignore_eos=True, logprobs=True),
]


def test_seeded_sampling_is_batch_and_preemption_invariant(reference):
    prompts, max_tokens, ref_tokens, _ = reference
    seeded_prompts = [prompts[i] for i in (3, 5, 7, 9)]  # 48..100 tokens: they crowd the small pool
    big = get_engine("big")
    alone = [_run_engine(big, [p], [sp], f"alone-{k}")[0].token_ids
             for k, (p, sp) in enumerate(zip(seeded_prompts, SEEDED))]
    greedy_of_seeded, _ = dense_greedy(seeded_prompts, [12] * 4)
    assert alone != greedy_of_seeded, "temperature > 0 sampled exactly the greedy tokens"
    assert len({tuple(t) for t in alone}) == 4

    # the same requests among 32 greedy ones, on the big pool and on the preempting pool
    mixed_prompts = list(prompts[:32])
    mixed_params = [greedy_params(m) for m in max_tokens[:32]]
    slots = [3, 9, 17, 30]
    for slot, p, sp in zip(slots, seeded_prompts, SEEDED):
        mixed_prompts.insert(slot, p)
        mixed_params.insert(slot, sp)
    for name in ("big", "small_pool"):
        engine = get_engine(name)
        outputs = _run_engine(engine, mixed_prompts, mixed_params, f"mixed-{name}")
        seeded_out = [outputs[s] for s in slots]
        assert [o.token_ids for o in seeded_out] == alone, name
        greedy_out = [o for i, o in enumerate(outputs) if i not in slots]
        assert [o.token_ids for o in greedy_out] == ref_tokens[:32], name  # sampled rows leave greedy ones alone
        assert seeded_out[3].outputs[0].logprobs is not None and len(seeded_out[3].outputs[0].logprobs) == 12
        if name == "small_pool":
            assert any(o.metrics.num_preemptions > 0 for o in seeded_out), "no seeded request was preempted"
        assert_no_leak(engine)


def test_seeded_logprobs_are_raw_dense_logprobs():
    """For a sampled (not argmax) token the logprob is still log_softmax of the unprocessed
    logits (vLLM's raw logprobs): one dense forward over the sampled continuation checks it."""
    engine = get_engine("big")
    prompt = make_prompts(seed=4, num=12)[0][10]
    (out,) = _run_engine(engine, [prompt], [SEEDED[3]], "seeded-logprobs")
    seq = np.asarray([prompt + out.token_ids], np.int32)
    logits = nnx.jit(lambda m, t: m.dense_forward(t))(model(), seq)[0]
    logp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    rows = logp[len(prompt) - 1 : len(prompt) - 1 + len(out.token_ids)]
    assert np.any(rows.argmax(-1) != out.token_ids), "every sampled token was the argmax"
    want = rows[np.arange(len(out.token_ids)), out.token_ids]
    np.testing.assert_allclose(out.outputs[0].logprobs, want, atol=LOGPROB_TOL, rtol=0)
    assert_no_leak(engine)


def test_pallas_kernel_path_matches_dense_reference():
    """The GPU attention path (the Pallas kernel, here in interpret mode) behind the same
    engine: prefill chunks, decodes and mixed steps give the reference tokens. max_model_len
    is not a multiple of block_size, so the last table column is a partial block."""
    base = big_llm().engine
    max_model_len = 200
    config = EngineConfig(attention_impl="triton", interpret=True, max_num_seqs=8, max_num_batched_tokens=32,
                          max_model_len=max_model_len, warm_up=False)
    engine = LLMEngine(config, model=base.model, tokenizer=base.tokenizer)
    assert engine.cache_config.max_blocks_per_seq == 13
    prompts, _ = make_prompts(seed=9, num=12)
    prompts = [p[:60] for p in prompts[:6]]  # 1..60 tokens: chunked at 32, mixed with decodes
    prompts.append(np.random.default_rng(9).integers(0, 512, max_model_len - 4).tolist())  # runs into the cap
    ref, _ = dense_greedy(prompts, [6] * 7, max_model_len=max_model_len)
    assert len(ref[-1]) == 4
    outputs = _run_engine(engine, prompts, [greedy_params(6)] * 7, "triton")
    assert [o.token_ids for o in outputs] == ref
    assert engine.get_stats()["attention_impl"] == "triton"
    assert_no_leak(engine)
