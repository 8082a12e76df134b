"""The EngineClient protocol (paged_jax/engine_client.py): LLMEngine and DataParallelEngine
implement every member with the protocol's signature; shutdown() stops background work and is
idempotent; reset_prefix_cache() drops the prefix cache only when no request holds blocks.
(The data-parallel engine on two devices: tests/test_data_parallel.py.)"""

from __future__ import annotations

import inspect
import threading
import time

import pytest

from engine_reference import BLOCK_SIZE, MAX_MODEL_LEN, big_llm, greedy_params, run_to_completion
from paged_jax.data_parallel import DataParallelEngine
from paged_jax.engine import LLMEngine
from paged_jax.engine_client import EngineClient
from paged_jax.engine_config import EngineConfig

PROTOCOL_MEMBERS = ["tokenizer", "eos_token_ids", "max_model_len", "add_request", "step", "abort_request",
                    "has_unfinished_requests", "get_stats", "chat_prompt", "reset_prefix_cache", "shutdown"]


def _signature(member) -> list[tuple]:
    params = list(inspect.signature(member).parameters.values())
    return [(p.name, p.kind, p.default) for p in params]


@pytest.mark.parametrize("engine_class", [LLMEngine, DataParallelEngine])
def test_engines_implement_every_member_with_its_signature(engine_class):
    declared = [name for name in vars(EngineClient) if not name.startswith("_")]
    assert sorted(declared) == sorted(PROTOCOL_MEMBERS)
    for name in PROTOCOL_MEMBERS:
        if name == "tokenizer":  # an attribute set in __init__; isinstance(engine, EngineClient) checks it
            continue
        expected, actual = getattr(EngineClient, name), getattr(engine_class, name, None)
        assert actual is not None, f"{engine_class.__name__} lacks {name}"
        if isinstance(expected, property):
            assert isinstance(actual, property), f"{engine_class.__name__}.{name} should be a property"
        else:
            assert _signature(actual) == _signature(expected), f"{engine_class.__name__}.{name}"


def _engine(warm_up_progress=None, **config) -> LLMEngine:
    base = big_llm().engine
    args = dict(max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE, max_num_seqs=8, max_num_batched_tokens=64,
                warm_up="none")
    return LLMEngine(EngineConfig(model="tiny", **{**args, **config}), model=base.model, tokenizer=base.tokenizer,
                     warm_up_progress=warm_up_progress)


def test_reset_prefix_cache_waits_for_idle_and_then_forgets_every_block():
    engine = _engine()
    assert isinstance(engine, EngineClient)
    prompt = list(range(3, 3 + 2 * BLOCK_SIZE + 5))  # two full blocks

    def num_cached(request_id: str) -> int:
        engine.add_request(request_id, prompt, greedy_params(2))
        return run_to_completion(engine)[request_id].metrics.num_cached_tokens

    assert num_cached("first") == 0
    assert num_cached("second") == 2 * BLOCK_SIZE  # the cache serves the prompt's full blocks
    engine.add_request("running", prompt, greedy_params(50))
    engine.step()
    assert engine.reset_prefix_cache() is False  # a request holds blocks: nothing changes
    engine.abort_request("running")
    assert num_cached("third") == 2 * BLOCK_SIZE
    assert engine.reset_prefix_cache() is True
    assert num_cached("fourth") == 0  # forgotten
    assert engine.get_stats()["num_running_reqs"] == 0


def test_shutdown_stops_the_warm_up_thread_and_is_idempotent():
    # Every bucket compiled on the warm-up thread reports slowly, so the thread is still at
    # work when shutdown() comes: it must drop the rest and join it.
    def slow_progress(done: int, total: int) -> None:
        if threading.current_thread().name == "paged-jax-warm-up":
            time.sleep(0.2)

    def warm_up_threads() -> int:
        return sum(t.name == "paged-jax-warm-up" for t in threading.enumerate())

    before = warm_up_threads()
    engine = _engine(slow_progress, warm_up="background", max_num_seqs=16, max_num_batched_tokens=256)
    total = len(engine.runner.bucket_shapes())
    assert warm_up_threads() == before + 1, "the warm-up thread should still be compiling"
    engine.shutdown()
    assert warm_up_threads() == before
    compiled = engine.runner.compiler.num_compiled_shapes
    assert compiled < total, "shutdown should drop the buckets not compiled yet"
    time.sleep(0.3)
    assert engine.runner.compiler.num_compiled_shapes == compiled
    engine.shutdown()  # idempotent
    assert engine.get_stats()["num_compilations"] >= 1  # stats still read
    with pytest.raises(RuntimeError, match="shut down"):
        engine.add_request("late", [5, 6, 7], greedy_params(2))


def test_shutdown_writes_the_disk_tiers_queue_and_stops_its_writer(tmp_path):
    def disk_writers() -> int:
        return sum(t.name == "paged-jax-disk-tier" for t in threading.enumerate())

    before = disk_writers()
    engine = _engine(offload_host_bytes=1 << 20, offload_disk_dir=str(tmp_path), hash_seed=0)
    assert disk_writers() == before + 1
    engine.add_request("r", list(range(3, 3 + 2 * BLOCK_SIZE + 1)), greedy_params(2))
    run_to_completion(engine)
    engine.shutdown()
    assert disk_writers() == before
    assert len(list(tmp_path.glob("*.kv"))) == 2  # the prompt's two full blocks, written out
    engine.shutdown()
