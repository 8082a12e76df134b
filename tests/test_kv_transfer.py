"""Prefill/decode disaggregation in one process: a producer engine and a consumer engine
with their own pools, talking over the side channel and JAX's transfer server on
127.0.0.1, checked against one engine that prefills and decodes alone (the reference).

Faults are injected at the seams a real deployment breaks at: a producer that is gone, a
producer that answers but never offers the pages (the pull never completes), an offer
nobody pulls, a consumer request aborted while its pages are on their way, tokens that
differ from the producer's, and peers whose pages or hashes cannot agree.
"""

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from models.registry import build_preset, load_model, load_tokenizer
from paged_jax.core.request import RequestStatus, SamplingParams
from paged_jax.engine import LLMEngine
from paged_jax.engine_config import EngineConfig

ENGINE_ARGS = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, hash_seed=7, warm_up="none",
                   num_blocks=96)
GREEDY = SamplingParams(max_tokens=8, temperature=0)
PREFILL = SamplingParams(max_tokens=1, temperature=0, kv_transfer_params={"do_remote_decode": True})

_models: dict = {}


def engine(model="tiny", **kwargs) -> LLMEngine:
    """An engine over `model`'s random weights (loaded once per module: every engine of a
    model shares them, as producer and consumer must)."""
    if model not in _models:
        _models[model] = load_model(model) if model == "tiny" else build_preset(model, dtype="float32")
    return LLMEngine(EngineConfig(**(ENGINE_ARGS | kwargs)), model=_models[model], tokenizer=load_tokenizer("tiny"))


def run(eng: LLMEngine, requests: dict, timeout: float = 120) -> dict:
    """Adds {request_id: (prompt ids, SamplingParams)} and steps until all finish; the
    finished RequestOutputs by id."""
    for request_id, (prompt, params) in requests.items():
        eng.add_request(request_id, prompt, params)
    done, deadline = {}, time.time() + timeout
    while eng.has_unfinished_requests():
        assert time.time() < deadline, "requests did not finish"
        for output in eng.step():
            if output.finished:
                done[output.request_id] = output
    return done


def settle(eng: LLMEngine, timeout: float = 10) -> None:
    """Steps until the engine pins no offer (its releases, sent by a consumer's threads,
    arrive in their own time) and has no transfer event left to apply."""
    deadline = time.time() + timeout
    while eng.has_unfinished_requests() or eng.get_stats()["num_kv_pinned_requests"]:
        assert time.time() < deadline, "transfer events never settled"
        eng.step()
        time.sleep(0.01)


def check_idle(eng: LLMEngine) -> None:
    """No request, no pinned block, no block held: every block is free (or cached, evictable)."""
    stats = eng.get_stats()
    assert stats.get("num_kv_pinned_requests", 0) == 0 and stats.get("kv_transfer_offers_pinned", 0) == 0
    assert eng.kv_cache_manager.get_num_free_blocks() == eng.cache_config.num_blocks - 1, "blocks leaked"
    eng.kv_cache_manager.check_invariants({})


def disaggregated(producer, consumer, prompts, params=GREEDY) -> dict:
    """Each prompt prefilled on the producer (max_tokens=1), decoded on the consumer with
    the producer's kv_transfer_params: the consumer's outputs by id."""
    offered = run(producer, {f"p{i}": (prompt, PREFILL) for i, prompt in enumerate(prompts)})
    transfers = {}
    for i, prompt in enumerate(prompts):
        transfer = offered[f"p{i}"].kv_transfer_params
        assert transfer is not None and transfer["do_remote_prefill"] and transfer["num_tokens"] == len(prompt)
        transfers[f"c{i}"] = (prompt, dataclasses.replace(params, kv_transfer_params=transfer))
    return run(consumer, transfers)


def prompts_of(lengths, seed=0, vocab=500):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab, n).tolist() for n in lengths]


@contextlib.contextmanager
def fresh_pair(model="tiny", **kwargs):
    """A producer and a consumer of their own; on a clean exit both must be idle (every
    offer released, every block back), and both are shut down however it exits."""
    producer, consumer = engine(model, kv_role="producer", **kwargs), engine(model, kv_role="consumer", **kwargs)
    try:
        yield producer, consumer
        settle(producer)
        check_idle(producer)
        check_idle(consumer)
    finally:
        producer.shutdown()
        consumer.shutdown()


@pytest.fixture(scope="module")
def pair():
    producer, consumer = engine(kv_role="producer"), engine(kv_role="consumer")
    yield producer, consumer
    producer.shutdown()
    consumer.shutdown()


@pytest.fixture(scope="module")
def reference():
    return engine()


def test_consumer_decodes_what_one_engine_does_computing_one_prompt_token_each(pair, reference):
    producer, consumer = pair
    prompts = prompts_of([2, 15, 16, 17, 40, 100, 130])
    want = run(reference, {f"c{i}": (p, GREEDY) for i, p in enumerate(prompts)})
    before = consumer.get_stats()
    got = disaggregated(producer, consumer, prompts)
    for request_id in want:
        assert got[request_id].token_ids == want[request_id].token_ids, request_id
    stats = consumer.get_stats()
    # Only each prompt's last token was computed here: the rest arrived as pages.
    assert stats["num_prompt_tokens_computed"] - before["num_prompt_tokens_computed"] == len(prompts)
    assert stats["num_external_tokens"] - before["num_external_tokens"] == sum(len(p) - 1 for p in prompts)
    assert stats["num_remote_loads"] - before["num_remote_loads"] == len(prompts)
    assert stats["num_remote_load_failures"] == 0
    # Every offer was released: the producer's pool is idle again.
    settle(producer)
    check_idle(producer)
    check_idle(consumer)
    assert producer.get_stats()["kv_transfer_blocks_sent"] == stats["kv_transfer_blocks_received"]


def test_a_partial_hit_in_the_consumers_cache_pulls_only_the_missing_blocks(pair, reference):
    producer, consumer = pair
    (shared,) = prompts_of([64], seed=1)
    local, remote = shared + prompts_of([20], seed=2)[0], shared + prompts_of([50], seed=3)[0]
    run(consumer, {"local": (local, GREEDY)})  # caches the 4 shared blocks here
    received = consumer.get_stats()["kv_transfer_blocks_received"]
    got = disaggregated(producer, consumer, [remote])["c0"]
    assert got.token_ids == run(reference, {"r": (remote, GREEDY)})["r"].token_ids
    bs = consumer.cache_config.block_size
    # blocks 4 .. of the 113 - 1 pulled tokens: the shared 64 tokens were hits
    assert consumer.get_stats()["kv_transfer_blocks_received"] - received == -(-(len(remote) - 1) // bs) - 64 // bs
    assert got.metrics.num_cached_tokens == len(remote) - 1
    settle(producer)
    check_idle(producer)


def test_a_landed_request_allocates_only_what_it_computes():
    """A pull that fills 32 of a 40-block pool: the request then needs one block more, not its
    pulled tokens counted twice (it could never be scheduled)."""
    (prompt,) = prompts_of([513], seed=13)
    with fresh_pair(num_blocks=40, max_model_len=1024, max_num_batched_tokens=512) as (producer, consumer):
        got = disaggregated(producer, consumer, [prompt], SamplingParams(max_tokens=3, temperature=0))["c0"]
        alone = engine(max_model_len=1024, max_num_batched_tokens=512)
        assert got.token_ids == run(alone, {"r": (prompt, SamplingParams(max_tokens=3, temperature=0))})["r"].token_ids
        assert consumer.get_stats()["peak_kv_cache_usage"] == pytest.approx(33 / 39)


def test_pulled_blocks_enter_the_consumers_prefix_cache(pair, reference):
    producer, consumer = pair
    (prompt,) = prompts_of([80], seed=4)
    disaggregated(producer, consumer, [prompt])
    computed = consumer.get_stats()["num_prompt_tokens_computed"]
    again = run(consumer, {"again": (prompt, GREEDY)})["again"]  # no kv_transfer_params: a local hit
    assert again.metrics.num_cached_tokens == (len(prompt) - 1) // 16 * 16
    assert consumer.get_stats()["num_prompt_tokens_computed"] - computed == len(prompt) - again.metrics.num_cached_tokens
    assert again.token_ids == run(reference, {"r": (prompt, GREEDY)})["r"].token_ids
    settle(producer)


@pytest.mark.parametrize("model,kwargs", [("tiny", {"kv_cache_dtype": "int8"}), ("tiny-gemma3", {}),
                                          ("tiny-mla", {})],
                         ids=["int8-pool", "sliding-window", "mla"])
def test_quantized_sliding_window_and_mla_pools(model, kwargs):
    reference = engine(model, **kwargs)
    with fresh_pair(model, **kwargs) as (producer, consumer):
        prompts = prompts_of([9, 33, 70], seed=5, vocab=250)
        want = run(reference, {f"c{i}": (p, GREEDY) for i, p in enumerate(prompts)})
        got = disaggregated(producer, consumer, prompts)
        assert {k: v.token_ids for k, v in got.items()} == {k: v.token_ids for k, v in want.items()}
        assert consumer.get_stats()["num_prompt_tokens_computed"] == len(prompts)


def test_a_producer_that_is_gone_means_a_local_prefill(reference):
    producer, consumer = engine(kv_role="producer"), engine(kv_role="consumer", kv_transfer_timeout=5)
    (prompt,) = prompts_of([60], seed=6)
    transfer = run(producer, {"p": (prompt, PREFILL)})["p"].kv_transfer_params
    producer.shutdown()  # its side channel closes
    got = run(consumer, {"c": (prompt, dataclasses.replace(GREEDY, kv_transfer_params=transfer))})["c"]
    assert got.token_ids == run(reference, {"r": (prompt, GREEDY)})["r"].token_ids
    stats = consumer.get_stats()
    assert stats["num_remote_load_failures"] == 1 and stats["num_remote_loads"] == 0
    assert stats["num_prompt_tokens_computed"] == len(prompt)
    check_idle(consumer)
    consumer.shutdown()


@contextlib.contextmanager
def fake_producer(like: LLMEngine, mode: str, tmp_path):
    """tests/kv_fake_producer.py in its own process, posing as a producer of `like`'s pages;
    yields the kv_transfer_params that point at it and its process; killed on exit."""
    meta = tmp_path / "meta.json"
    meta.write_text(json.dumps(like.kv_worker.meta))
    process = subprocess.Popen([sys.executable, str(Path(__file__).with_name("kv_fake_producer.py")), str(meta), mode],
                               stdout=subprocess.PIPE, text=True, env=os.environ | {"JAX_PLATFORMS": "cpu"})
    try:
        port = int(process.stdout.readline())
        yield lambda num_tokens: {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": port,
                                  "transfer_id": "never", "num_tokens": num_tokens}, process
    finally:
        process.kill()
        process.wait(30)


@pytest.mark.parametrize("mode", ["never", "silent"])
def test_a_transfer_that_never_completes_times_out_into_a_local_prefill(mode, reference, tmp_path):
    consumer = engine(kv_role="consumer", kv_transfer_timeout=1.0)
    (prompt,) = prompts_of([50], seed=7)
    with fake_producer(consumer, mode, tmp_path) as (params, process):
        start = time.time()
        got = run(consumer, {"c": (prompt, dataclasses.replace(GREEDY, kv_transfer_params=params(50)))})["c"]
        assert process.stdout.readline().strip() == "fetch" and time.time() - start < 30
    assert got.token_ids == run(reference, {"r": (prompt, GREEDY)})["r"].token_ids
    stats = consumer.get_stats()
    assert stats["num_remote_load_failures"] == 1 and stats["num_prompt_tokens_computed"] == len(prompt)
    check_idle(consumer)
    consumer.shutdown()


def test_a_producer_killed_while_its_pages_are_pulled_means_a_local_prefill(reference, tmp_path):
    consumer = engine(kv_role="consumer", kv_transfer_timeout=60)
    (prompt,) = prompts_of([80], seed=12)
    with fake_producer(consumer, "never", tmp_path) as (params, process):
        consumer.add_request("c", prompt, dataclasses.replace(GREEDY, kv_transfer_params=params(80)))
        consumer.step()
        assert process.stdout.readline().strip() == "fetch"  # the pull is issued and pending
        start = time.time()
        process.kill()  # its transfer connection closes under the pending pull
        done = {}
        while consumer.has_unfinished_requests():
            assert time.time() - start < 30, "the pull outlived its producer"
            done.update({o.request_id: o for o in consumer.step() if o.finished})
    assert done["c"].token_ids == run(reference, {"r": (prompt, GREEDY)})["r"].token_ids
    assert consumer.get_stats()["num_remote_load_failures"] == 1
    check_idle(consumer)
    consumer.shutdown()


def test_an_abort_while_the_pages_are_on_their_way_frees_the_blocks(tmp_path):
    consumer = engine(kv_role="consumer", kv_transfer_timeout=30)
    (prompt,) = prompts_of([70], seed=8)
    with fake_producer(consumer, "never", tmp_path) as (params, process):
        consumer.add_request("c", prompt, dataclasses.replace(GREEDY, kv_transfer_params=params(70)))
        consumer.step()
        request = consumer.scheduler.remote_waiting["c"]
        assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        assert consumer.kv_cache_manager.get_num_free_blocks() < consumer.cache_config.num_blocks - 1
        assert process.stdout.readline().strip() == "fetch"
        assert consumer.abort_request("c")
        assert not consumer.has_unfinished_requests()
        check_idle(consumer)
    consumer.shutdown()


def test_an_offer_nobody_pulls_expires_and_frees_its_blocks():
    producer = engine(kv_role="producer", kv_transfer_timeout=0.5)
    (prompt,) = prompts_of([90], seed=9)
    run(producer, {"p": (prompt, PREFILL)})
    assert producer.get_stats()["num_kv_pinned_requests"] == 1
    assert producer.kv_cache_manager.get_num_free_blocks() < producer.cache_config.num_blocks - 1
    time.sleep(0.6)
    settle(producer)
    assert producer.get_stats()["kv_transfer_offers_expired"] == 1
    check_idle(producer)
    producer.shutdown()


def test_tokens_that_differ_from_the_producers_are_refused(pair, reference):
    producer, consumer = pair
    prompt, other = prompts_of([40, 40], seed=10)
    transfer = run(producer, {"p": (prompt, PREFILL)})["p"].kv_transfer_params
    failures = consumer.get_stats()["num_remote_load_failures"]
    got = run(consumer, {"c": (other, dataclasses.replace(GREEDY, kv_transfer_params=transfer))})["c"]
    assert got.token_ids == run(reference, {"r": (other, GREEDY)})["r"].token_ids
    assert consumer.get_stats()["num_remote_load_failures"] == failures + 1
    settle(producer)  # the refused consumer released the offer: no timeout to wait for
    check_idle(producer)


def test_a_request_whose_prefix_is_all_here_releases_the_offer_unpulled(pair, reference):
    producer, consumer = pair
    (prompt,) = prompts_of([48], seed=11)
    run(consumer, {"local": (prompt + [5], GREEDY)})  # caches all 3 blocks of the prompt here
    transfer = run(producer, {"p": (prompt + [5], PREFILL)})["p"].kv_transfer_params
    received = consumer.get_stats()["kv_transfer_blocks_received"]
    got = run(consumer, {"c": (prompt + [5], dataclasses.replace(GREEDY, kv_transfer_params=transfer))})["c"]
    assert got.token_ids == run(reference, {"r": (prompt + [5], GREEDY)})["r"].token_ids
    assert consumer.get_stats()["kv_transfer_blocks_received"] == received  # nothing pulled
    settle(producer)
    check_idle(producer)
    assert producer.get_stats()["kv_transfer_offers_expired"] == 0


def test_peers_that_cannot_share_pages_fail_at_start_up(pair):
    producer, _ = pair
    peer = "%s:%d" % producer.kv_worker.address
    with pytest.raises(ValueError, match="block_size: here 8, there 16"):
        engine(kv_role="consumer", kv_peers=peer, block_size=8)
    with pytest.raises(ValueError, match="chain_root"):
        engine(kv_role="consumer", kv_peers=peer, hash_seed=8)
    with pytest.raises(ValueError, match="page_leaves"):
        engine(kv_role="consumer", kv_peers=peer, kv_cache_dtype="int8")
    engine(kv_role="consumer", kv_peers=peer).shutdown()  # the same geometry passes


@pytest.mark.parametrize("kwargs,match", [
    ({"kv_role": "prefill"}, "kv_role='prefill' must be one of"),
    ({"kv_role": "consumer", "hash_seed": None}, "needs a fixed hash_seed"),
    ({"kv_peers": "127.0.0.1:9"}, "set kv_role='consumer'"),
    ({"kv_role": "producer", "kv_peers": "127.0.0.1:9"}, "set kv_role='consumer'"),
    ({"kv_role": "consumer", "kv_peers": "localhost"}, "kv_peers='localhost' must be 'host:port'"),
    ({"kv_role": "consumer", "kv_transfer_timeout": 0}, "kv_transfer_timeout=0 must be"),
    ({"kv_role": "consumer", "tensor_parallel_size": 2}, "tensor_parallel_size=1"),
])
def test_bad_kv_transfer_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**(ENGINE_ARGS | kwargs))


def test_bad_kv_transfer_params(pair):
    _, consumer = pair
    with pytest.raises(ValueError, match="kv_transfer_params.*must be a JSON object"):
        SamplingParams(kv_transfer_params=[1])
    with pytest.raises(ValueError, match="lacks 'transfer_id'"):
        consumer.add_request("bad", [1, 2, 3], SamplingParams(kv_transfer_params={
            "do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 1, "num_tokens": 2}))
    with pytest.raises(ValueError, match="num_tokens=-1"):
        consumer.add_request("bad", [1, 2, 3], SamplingParams(kv_transfer_params={
            "do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 1, "num_tokens": -1,
            "transfer_id": "x"}))
    assert not consumer.has_unfinished_requests()  # nothing half-added
