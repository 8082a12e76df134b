"""The offload tiers in the engine, against the dense reference generation loop.

- Heavy preemption (11 usable blocks for 8 running requests of up to 11 blocks each) with
  preemption by recompute over a host tier, by swap, and by swap over a host tier too small
  for most swaps (recompute fallback): greedy outputs equal dense_greedy's; afterwards the
  device pool and the host tier hold no request's state (no leaks).
- A prompt evicted from the device and found in the host tier: its pages come back
  bit-identical (or, stored as int8 / fp8, equal to the format's round trip), and its
  outputs are unchanged.
- A quantized device pool (kv_cache_dtype="int8", per-token scales: the scales are cache
  leaves beside the pages): with heavy preemption over a host tier, greedy outputs equal the
  same quantized engine's without offload (quantization changes tokens, so not dense_greedy's),
  and pages back from the host tier are bit-identical, scales included.
- The MLA latent pool (a random tiny DeepSeek-V2, "tiny-mla"): with heavy preemption over a
  host tier, greedy outputs equal the same engine's without offload.
- A restart: a fresh engine over the same disk directory skips the prefill of a system
  prompt the first one computed; a directory of another setup is refused.
- KV events replayed into an index agree with what each tier holds.
- Sliding-window groups (a random tiny Gemma 3: five sliding groups, one full): with heavy
  preemption over a host tier, by recompute and by swap, greedy outputs equal the same
  model's with a pool that never preempts; KV events name each group (its index, attention
  type and window) with plain chain hashes, and replayed per group agree with each tier.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from engine_reference import (BLOCK_SIZE, MAX_MODEL_LEN, assert_no_leak, big_llm, dense_greedy, greedy_params,
                              make_prompts, run_to_completion)
from models.registry import build_preset, load_model
from paged_jax.core.block_pool import split_group_id
from paged_jax.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from paged_jax.core.request import Request, SamplingParams
from paged_jax.engine import LLMEngine
from paged_jax.engine_config import EngineConfig

SMALL_POOL = dict(max_num_seqs=8, max_num_batched_tokens=64, num_blocks=12)
BLOCK_BYTES = 8192  # one block of the tiny model's pages: 2 layers x (k, v) x 16 x 2 heads x 16 x f32
# int8 pages and a f32 scale per (token, KV head): 2 layers x (k, v) x 16 x 2 heads x (16 x 1 + 4)
QUANT_BLOCK_BYTES = 2560
# the latent pool: 2 layers x 16 x (32 latent + 8 rope dims) x f32
MLA_BLOCK_BYTES = 5120


def offload_engine(model_object=None, **overrides) -> LLMEngine:
    base = big_llm().engine
    config = EngineConfig(**{"model": "tiny", "max_model_len": MAX_MODEL_LEN, "block_size": BLOCK_SIZE,
                             "warm_up": "none", **SMALL_POOL, **overrides})
    return LLMEngine(config, model=model_object or base.model, tokenizer=base.tokenizer)


@functools.cache
def workload():
    prompts, max_tokens = make_prompts(5, num=20)
    return prompts, max_tokens, dense_greedy(prompts, max_tokens)[0]


def generate(engine, prompts, max_tokens, prefix="r"):
    for i, (p, m) in enumerate(zip(prompts, max_tokens)):
        engine.add_request(f"{prefix}{i}", p, greedy_params(m))
    finished = run_to_completion(engine)
    return [finished[f"{prefix}{i}"].token_ids for i in range(len(prompts))]


def assert_tiers_idle(engine):
    """No request's state is left anywhere; a prefix-cache reset then returns the device pool
    and the host tier to their initial state (every block free and unhashed, nothing held)."""
    assert_no_leak(engine)
    engine.offload.check_invariants(idle=True)
    assert engine.offload.host.num_bytes <= engine.config.offload_host_bytes
    assert engine.reset_prefix_cache()
    pool = engine.kv_cache_manager.block_pool
    assert len(pool.cached_block_hash_to_block) == 0 and not any(b.block_hash for b in pool.blocks)
    assert len(engine.offload.host) == 0 and engine.offload.host.num_bytes == 0


def assert_offload_worked(engine, mode: str) -> dict:
    """The workload preempted, and each preemption went through the tier its mode uses: the
    host tier's prefix hits (recompute) or a swap out and in per preemption with nothing
    recomputed (swap, a host tier large enough). Returns the engine's stats."""
    stats = engine.get_stats()
    assert stats["num_preemptions"] >= 3, "the workload did not preempt: the test would prove nothing"
    if mode == "recompute":
        assert stats["host_cache_hits"] > 0 and stats["num_swap_outs"] == 0
    else:
        assert stats["num_swap_outs"] == stats["num_preemptions"] == stats["num_swap_ins"] > 0
        assert stats["num_recomputed_tokens"] == 0 and stats["num_swap_fallbacks"] == 0
    return stats


@pytest.mark.parametrize("mode,host_blocks", [("recompute", 64), ("swap", 64), ("swap", 3)])
def test_heavy_preemption_matches_dense_greedy(mode, host_blocks):
    prompts, max_tokens, reference = workload()
    engine = offload_engine(preemption_mode=mode, offload_host_bytes=host_blocks * BLOCK_BYTES)
    assert generate(engine, prompts, max_tokens) == reference
    if host_blocks == 64:
        stats = assert_offload_worked(engine, mode)
    else:  # a host tier of 3 blocks: most swaps fall back to recompute; it stays at its cap
        stats = engine.get_stats()
        assert stats["num_preemptions"] >= 3, "the workload did not preempt: the test would prove nothing"
        assert stats["num_swap_fallbacks"] > 0 and stats["num_recomputed_tokens"] > 0
        assert stats["num_host_evictions"] > 0 and stats["host_tier_bytes"] == 3 * BLOCK_BYTES
    assert stats["bytes_device_to_host"] > 0 and stats["bytes_host_to_device"] > 0
    assert_tiers_idle(engine)


def chain_hashes(engine, tokens):
    request = Request("hashes", tokens, SamplingParams())
    request.set_block_hasher(engine.kv_cache_manager.block_hasher)
    return list(request.block_hashes)


def device_pages(engine, hashes):
    pool = engine.kv_cache_manager.block_pool
    blocks = [pool.get_cached_block(h) for h in hashes]
    assert None not in blocks, "a block expected on the device is not cached there"
    return engine.runner.pool.gather_pages(np.array([b.block_id for b in blocks]))


@pytest.mark.parametrize("storage", [None, "int8", "fp8"])
def test_host_tier_hit_brings_the_pages_back(storage):
    engine = offload_engine(offload_host_bytes=64 * BLOCK_BYTES, offload_dtype=storage)
    rng = np.random.default_rng(11)
    prompt = rng.integers(0, 512, 100).tolist()  # 6 full blocks, the last 4 tokens in a 7th
    first = generate(engine, [prompt], [4], prefix="a")[0]
    hashes = chain_hashes(engine, prompt)[:6]
    before = device_pages(engine, hashes)
    fillers = [rng.integers(0, 512, 150).tolist() for _ in range(2)]  # 10 blocks each: evict the prompt
    generate(engine, fillers, [2, 2], prefix="f")
    pool = engine.kv_cache_manager.block_pool
    assert not any(pool.get_cached_block(h) for h in hashes), "the prompt's blocks were not evicted"
    assert all(h in engine.offload.host for h in hashes), "evicted blocks did not reach the host tier"
    hits = engine.get_stats()["host_cache_hits"]
    again = generate(engine, [prompt], [4], prefix="b")[0]
    assert engine.get_stats()["host_cache_hits"] - hits == 6 * BLOCK_SIZE
    after = device_pages(engine, hashes)
    expected = before if storage is None else engine.offload.codec.decode(engine.offload.codec.encode(before))
    for x, y in zip(expected, after):
        assert x.tobytes() == y.tobytes(), "pages changed on their way through the host tier"
    if storage is None:
        assert again == first == dense_greedy([prompt], [4])[0][0]
        assert engine.offload.codec.nbytes == BLOCK_BYTES
    else:
        assert engine.offload.codec.nbytes < 0.4 * BLOCK_BYTES
    assert_tiers_idle(engine)


@functools.cache
def quantized_reference():
    """The int8 engine's own greedy outputs on the workload, without offload (same small pool,
    preemption by recompute)."""
    prompts, max_tokens, _ = workload()
    return generate(offload_engine(kv_cache_dtype="int8"), prompts, max_tokens)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_quantized_pool_with_heavy_preemption_matches_it_without_offload(mode):
    prompts, max_tokens, dense = workload()
    assert quantized_reference() != dense, "int8 changes no token here: the float reference would have done"
    engine = offload_engine(kv_cache_dtype="int8", preemption_mode=mode,
                            offload_host_bytes=64 * QUANT_BLOCK_BYTES)
    assert engine.offload.codec.nbytes == QUANT_BLOCK_BYTES
    assert generate(engine, prompts, max_tokens) == quantized_reference()
    assert_offload_worked(engine, mode)
    assert_tiers_idle(engine)


@pytest.mark.parametrize("storage", [None, "int8"])
def test_quantized_pool_pages_and_scales_come_back_bit_identical(storage):
    """offload_dtype quantizes float leaves only: an int8 pool's pages and f32 scales [16, 2]
    are stored as they are whatever it says."""
    engine = offload_engine(kv_cache_dtype="int8", offload_host_bytes=64 * QUANT_BLOCK_BYTES, offload_dtype=storage)
    assert [dtype for _, dtype in engine.runner.pool.page_leaves()] == ["int8", "int8", "float32", "float32"] * 2
    assert engine.offload.codec.nbytes == QUANT_BLOCK_BYTES
    rng = np.random.default_rng(11)
    prompt = rng.integers(0, 512, 100).tolist()  # 6 full blocks
    first = generate(engine, [prompt], [4], prefix="a")[0]
    hashes = chain_hashes(engine, prompt)[:6]
    before = device_pages(engine, hashes)
    for scale in before[2::4] + before[3::4]:  # per token and head: a stale or zeroed scale would show
        assert len(np.unique(scale)) > 0.9 * scale.size
    fillers = [rng.integers(0, 512, 150).tolist() for _ in range(2)]  # evict the prompt
    generate(engine, fillers, [2, 2], prefix="f")
    pool = engine.kv_cache_manager.block_pool
    assert not any(pool.get_cached_block(h) for h in hashes), "the prompt's blocks were not evicted"
    hits = engine.get_stats()["host_cache_hits"]
    again = generate(engine, [prompt], [4], prefix="b")[0]
    assert engine.get_stats()["host_cache_hits"] - hits == 6 * BLOCK_SIZE
    for x, y in zip(before, device_pages(engine, hashes)):
        assert x.dtype == y.dtype and x.tobytes() == y.tobytes(), f"a {x.dtype} leaf changed through the host tier"
    assert again == first
    assert_tiers_idle(engine)


@functools.cache
def mla_reference():
    """A random tiny DeepSeek-V2 (MLA: one latent pool of c_kv and k_rope per layer) and its
    greedy outputs on the workload without offload (same small pool, recompute)."""
    model = build_preset("tiny-mla")
    prompts, max_tokens, _ = workload()
    return model, generate(offload_engine(model), prompts, max_tokens)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_mla_latent_pool_with_heavy_preemption_matches_it_without_offload(mode):
    prompts, max_tokens, dense = workload()
    model, reference = mla_reference()
    assert reference != dense, "the MLA model's outputs equal the tiny llama's: the wrong model was loaded"
    engine = offload_engine(model, preemption_mode=mode, offload_host_bytes=64 * MLA_BLOCK_BYTES)
    assert engine.runner.pool.specs[0].kv_lora_rank == 32
    assert engine.offload.codec.nbytes == MLA_BLOCK_BYTES
    assert generate(engine, prompts, max_tokens) == reference
    assert_offload_worked(engine, mode)
    assert_tiers_idle(engine)


@pytest.mark.slow
def test_restart_reads_the_disk_tier(tmp_path):
    rng = np.random.default_rng(12)
    system = rng.integers(0, 512, 120).tolist()  # 7 full blocks
    questions = [rng.integers(0, 512, 9).tolist() for _ in range(2)]
    settings = dict(offload_host_bytes=16 * BLOCK_BYTES, offload_disk_dir=str(tmp_path), hash_seed=7)
    first = offload_engine(**settings)
    generate(first, [system + questions[0]], [3], prefix="a")
    first.offload.disk.flush()
    assert len(first.offload.disk) >= 7 and first.get_stats()["bytes_to_disk"] > 0
    first.offload.disk.close()

    restarted = offload_engine(**settings)  # a fresh pool, host tier and hash chain root (seeded)
    assert restarted.offload.stats.disk_hit_tokens == 0
    out = generate(restarted, [system + questions[1]], [6], prefix="b")[0]
    stats = restarted.get_stats()
    assert stats["disk_cache_hits"] == 7 * BLOCK_SIZE and stats["bytes_from_disk"] == 7 * BLOCK_BYTES
    assert out == dense_greedy([system + questions[1]], [6])[0][0]
    assert_tiers_idle(restarted)
    restarted.offload.disk.close()

    with pytest.raises(ValueError, match="block_size: 16 in the directory, 32 here"):
        offload_engine(**{**settings, "block_size": 32})
    with pytest.raises(ValueError, match="chain_root"):
        offload_engine(**{**settings, "hash_seed": 8})
    with pytest.raises(ValueError, match="model: "):
        offload_engine(**settings, model_object=load_model("tiny", seed=1))


def test_kv_events_track_what_each_tier_holds():
    prompts, max_tokens, _ = workload()
    engine = offload_engine(offload_host_bytes=6 * BLOCK_BYTES, enable_kv_events=True)
    index: dict[str, set] = {"device": set(), "host": set()}
    seen = []
    engine.kv_events.subscribe(seen.append)
    generate(engine, prompts, max_tokens)
    queued = engine.kv_events.get_events()
    assert queued == seen and engine.kv_events.get_events() == []
    for event in queued:
        if isinstance(event, BlockStored):
            assert not index[event.tier] & set(event.block_hashes), "stored twice without a removal"
            index[event.tier] |= set(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            assert set(event.block_hashes) <= index[event.tier], "removed a hash the tier never stored"
            index[event.tier] -= set(event.block_hashes)
    device = {h for h, _ in engine.kv_cache_manager.block_pool.cached_block_hash_to_block.items()}
    host = {k for k in engine.offload.host.keys() if isinstance(k, bytes)}
    assert index["device"] == device and index["host"] == host
    assert any(isinstance(e, BlockRemoved) and e.tier == "host" for e in queued), "the host tier never evicted"
    assert_tiers_idle(engine)
    assert engine.kv_events.get_events() == [AllBlocksCleared("device"), AllBlocksCleared("host")]


@pytest.mark.parametrize("memory", ["pinned_host", "numpy"])
def test_page_copies_round_trip_and_update_in_place(monkeypatch, memory):
    """Both transfer paths: through jax's pinned host memory kind (the CPU backend has one,
    as GPUs do) and through plain numpy arrays (backends without it)."""
    if memory == "numpy":
        monkeypatch.setattr("paged_jax.kv_pool.KVPool._pinned_page_shardings", lambda self: None)
    engine = offload_engine(offload_host_bytes=4 * BLOCK_BYTES, num_blocks=24)
    runner = engine.runner
    rng = np.random.default_rng(0)
    ids = rng.permutation(np.arange(1, 24))[:19]
    pages = [rng.normal(size=(19, *shape)).astype(dtype) for shape, dtype in runner.pool.page_leaves()]
    monkeypatch.setattr("paged_jax.kv_pool.MAX_PAGE_COPY", 8)  # 19 blocks: chunks of 8 + 8 + 3
    runner.pool.put_pages(ids, pages)
    order = rng.permutation(19)
    got = runner.pool.gather_pages(ids[order])
    for page, back in zip(pages, got):
        np.testing.assert_array_equal(back, page[order])
    assert runner.pool.page_copy_memory_kind == memory
    put = runner.pool._page_programs_for(8)[1].memory_analysis()
    assert put.alias_size_in_bytes == runner.pool.kv_cache_bytes, "the page scatter did not update the caches in place"
    assert put.temp_size_in_bytes < runner.pool.kv_cache_bytes / 4


def test_offload_arguments_are_checked():
    with pytest.raises(ValueError, match="need a host tier"):
        EngineConfig(preemption_mode="swap")
    with pytest.raises(ValueError, match="preemption_mode='evict'"):
        EngineConfig(preemption_mode="evict")
    with pytest.raises(ValueError, match="needs a fixed hash_seed"):
        EngineConfig(offload_host_bytes=1 << 20, offload_disk_dir="/tmp/x")
    with pytest.raises(ValueError, match="offload_dtype='int4'"):
        EngineConfig(offload_host_bytes=1 << 20, offload_dtype="int4")
    with pytest.raises(ValueError, match="offload_dtype='float8_e4m3fn' must be one of"):
        EngineConfig(offload_host_bytes=1 << 20, offload_dtype="float8_e4m3fn")  # kv_cache_dtype's names only
    EngineConfig(offload_host_bytes=1 << 20, offload_dtype="fp8_e5m2")
    with pytest.raises(ValueError, match="cannot hold one block"):
        offload_engine(offload_host_bytes=100)


def test_disk_tier_of_a_quantized_pool_belongs_to_its_key_offsets(tmp_path):
    """A quantized pool's pages hold keys less the layer's offsets: a disk directory written
    with one set of kv_key_offsets is refused by an engine with another (or with none), and
    accepted with the same ones."""
    offsets = np.full((2, 2, 16), 0.25, np.float32)
    settings = dict(kv_cache_dtype="int8", offload_host_bytes=16 * QUANT_BLOCK_BYTES, offload_disk_dir=str(tmp_path),
                    hash_seed=7)
    offload_engine(**settings, kv_key_offsets=offsets).offload.disk.close()
    offload_engine(**settings, kv_key_offsets=offsets.copy()).offload.disk.close()
    for other in (offsets + 0.5, None):
        with pytest.raises(ValueError, match="kv_key_offsets: '[0-9a-f]{64}' in the directory, "):
            offload_engine(**settings, kv_key_offsets=other)


# ---------------------------------------------------------------- sliding-window groups
# A random tiny Gemma 3 (tests/test_gemma3.py checks it against transformers): five
# sliding-window groups (window 8: every prompt here slides past it) and one full group, one
# layer each. One request holds at most 16 full blocks and 6 per sliding group (64-token
# chunks), 46 in all: 59 usable blocks hold one, so 8 running requests preempt constantly.
GEMMA_POOL = dict(num_blocks=60)
GEMMA_BLOCK_BYTES = 4096  # one layer x (k, v) x 16 tokens x 1 KV head x 32 x f32


@functools.cache
def gemma_reference():
    """The tiny Gemma 3 and its greedy outputs on the workload with a pool that never preempts."""
    model = build_preset("tiny-gemma3")
    prompts, max_tokens, _ = workload()
    engine = offload_engine(model, num_blocks=1024)
    outputs = generate(engine, prompts, max_tokens)
    assert engine.get_stats()["num_preemptions"] == 0
    return model, outputs


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_sliding_window_groups_with_heavy_preemption_match_it_without(mode):
    prompts, max_tokens, dense = workload()
    model, reference = gemma_reference()
    assert reference != dense, "the Gemma model's outputs equal the tiny llama's: the wrong model was loaded"
    engine = offload_engine(model, preemption_mode=mode, offload_host_bytes=256 * GEMMA_BLOCK_BYTES, **GEMMA_POOL)
    groups = engine.cache_config.kv_cache_groups
    assert [g.sliding_window for g in groups] == [8] * 5 + [None]
    assert engine.offload.codec.nbytes == GEMMA_BLOCK_BYTES
    assert generate(engine, prompts, max_tokens) == reference
    assert_offload_worked(engine, mode)
    assert_tiers_idle(engine)


def test_kv_events_name_each_group_and_track_what_it_holds():
    prompts, max_tokens, _ = workload()
    model, reference = gemma_reference()
    engine = offload_engine(model, offload_host_bytes=48 * GEMMA_BLOCK_BYTES, enable_kv_events=True, **GEMMA_POOL)
    assert generate(engine, prompts, max_tokens) == reference
    events = engine.kv_events.get_events()
    index: dict[tuple[str, int], set] = {}
    for event in events:
        group = engine.cache_config.kv_cache_groups[event.group_idx]
        assert (event.kv_cache_spec_kind, event.kv_cache_spec_sliding_window) == (group.attention_type,
                                                                                  group.sliding_window)
        held = index.setdefault((event.tier, event.group_idx), set())
        if isinstance(event, BlockStored):
            assert not held & set(event.block_hashes), "stored twice without a removal"
            held |= set(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            assert set(event.block_hashes) <= held, "removed a hash the tier never stored"
            held -= set(event.block_hashes)
    assert {g for tier, g in index if tier == "device"} == set(range(6)), "a group never reported"
    # The hashes are the plain chain hashes: the pool's keys carry the group; the events say it.
    nbytes = len(engine.kv_cache_manager.block_hasher.none_hash)
    device, host = set(), set()
    for key, _ in engine.kv_cache_manager.block_pool.cached_block_hash_to_block.items():
        device.add(split_group_id(key, nbytes)[::-1])
    for key in engine.offload.host.keys():
        host.add(split_group_id(key, nbytes)[::-1])
    assert {(g, h) for (tier, g), hashes in index.items() if tier == "device" for h in hashes} == device
    assert {(g, h) for (tier, g), hashes in index.items() if tier == "host" for h in hashes} == host
    assert any(isinstance(e, BlockRemoved) and e.tier == "host" for e in events), "the host tier never evicted"
    assert_tiers_idle(engine)
