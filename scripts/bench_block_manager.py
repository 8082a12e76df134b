"""Block-manager speed on a shared-prefix serving trace (host only, no jax).

Trace: 10,000 blocks of 16 tokens; 256 requests served 32 at a time, each a shared
2000-token system prompt plus a random 50-500-token suffix; per request a prefix-cache
lookup + allocate (prefill), then 300 decode steps of allocate_slots(req, 1) with one
appended token each, then free. The trace runs twice: once untimed for the wall time,
once with a timer around every call for the per-call medians (timers cost ~0.1 us/call).

    python scripts/bench_block_manager.py [--hash-algo xxhash] [--repeats 3]

Prints a table and writes results/bench_block_manager.json. Reference point from the issue:
vLLM 0.33's KVCacheManager takes ~5 us per decode allocate_slots and ~0.6 s for this trace
on the development machine.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import sys
import time

from paged_jax.core.config import CacheConfig
from paged_jax.core.kv_cache_manager import KVCacheManager
from paged_jax.core.request import Request

NUM_BLOCKS = 10_000
BLOCK_SIZE = 16
NUM_REQUESTS = 256
CONCURRENCY = 32
SYSTEM_PROMPT_LEN = 2000
SUFFIX_LEN = (50, 500)
DECODE_STEPS = 300
VOCAB = 32_000
MAX_MODEL_LEN = 4096


def make_prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(VOCAB) for _ in range(SYSTEM_PROMPT_LEN)]
    return [system + [rng.randrange(VOCAB) for _ in range(rng.randint(*SUFFIX_LEN))] for _ in range(NUM_REQUESTS)]


def run_trace(prompts, hash_algo: str, timed: bool) -> dict:
    """One pass over the trace; with timed=True, per-call timings in microseconds."""
    clock = time.perf_counter_ns
    mgr = KVCacheManager(CacheConfig(BLOCK_SIZE, NUM_BLOCKS, MAX_MODEL_LEN, hash_algo=hash_algo))
    hasher = mgr.block_hasher
    decode_us, prefill_us, free_us, hash_us_per_block = [], [], [], []
    next_token = 7
    t_start = time.perf_counter()
    for wave in range(0, NUM_REQUESTS, CONCURRENCY):
        running = []
        for i in range(wave, wave + CONCURRENCY):
            # block hashing: the engine builds each request with the manager's hasher
            t0 = clock()
            req = Request(f"r{i}", prompts[i], block_hasher=hasher)
            t1 = clock()
            blocks, num_hit = mgr.get_computed_blocks(req)
            new_blocks = mgr.allocate_slots(req, req.num_tokens - num_hit, num_hit, blocks)
            t2 = clock()
            assert new_blocks is not None, "the trace is sized to fit; an allocation failed"
            if timed:
                hash_us_per_block.append((t1 - t0) / 1e3 / len(req.block_hashes))
                prefill_us.append((t2 - t1) / 1e3)
            req.num_computed_tokens = req.num_tokens
            req.append_output_token_ids(next_token)
            running.append(req)
        for _ in range(DECODE_STEPS):
            for req in running:
                if timed:
                    t0 = clock()
                    ok = mgr.allocate_slots(req, 1)
                    decode_us.append((clock() - t0) / 1e3)
                else:
                    ok = mgr.allocate_slots(req, 1)
                assert ok is not None, "the trace is sized to fit; a decode allocation failed"
                req.num_computed_tokens += 1
                req.append_output_token_ids(next_token)
        for req in running:
            t0 = clock()
            mgr.free(req)
            if timed:
                free_us.append((clock() - t0) / 1e3)
    wall_s = time.perf_counter() - t_start
    mgr.check_invariants()
    assert mgr.get_num_free_blocks() == NUM_BLOCKS - 1, "blocks leaked at the end of the trace"
    stats = mgr.prefix_cache_stats
    out = {"wall_s": wall_s, "hit_rate": stats.hits / stats.queries}
    if timed:
        out.update(
            decode_allocate_us=statistics.median(decode_us),
            prefill_lookup_allocate_us=statistics.median(prefill_us),
            free_us=statistics.median(free_us),
            hash_us_per_block=statistics.median(hash_us_per_block),
        )
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hash-algo", default="sha256", choices=["sha256", "xxhash"])
    parser.add_argument("--repeats", type=int, default=3, help="runs of each pass; the best is reported")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="results/bench_block_manager.json")
    args = parser.parse_args(argv)

    prompts = make_prompts(args.seed)
    gc.collect()
    # GC pauses are part of serving, so they stay on; best-of-N removes scheduler noise.
    walls = [run_trace(prompts, args.hash_algo, timed=False) for _ in range(args.repeats)]
    timeds = [run_trace(prompts, args.hash_algo, timed=True) for _ in range(args.repeats)]
    best_wall = min(walls, key=lambda r: r["wall_s"])
    best = min(timeds, key=lambda r: r["decode_allocate_us"])
    result = {
        "hash_algo": args.hash_algo,
        "decode_allocate_us": best["decode_allocate_us"],
        "prefill_lookup_allocate_us": best["prefill_lookup_allocate_us"],
        "free_us": best["free_us"],
        "hash_us_per_block": best["hash_us_per_block"],
        "prefix_hit_rate": best_wall["hit_rate"],
        "trace_wall_s": best_wall["wall_s"],
        "trace_wall_s_all": [r["wall_s"] for r in walls],
        "targets": {"decode_allocate_us": 2.5, "trace_wall_s": 0.3},
        "config": {
            "num_blocks": NUM_BLOCKS, "block_size": BLOCK_SIZE, "num_requests": NUM_REQUESTS,
            "concurrency": CONCURRENCY, "system_prompt_len": SYSTEM_PROMPT_LEN, "suffix_len": SUFFIX_LEN,
            "decode_steps": DECODE_STEPS, "repeats": args.repeats, "seed": args.seed,
        },
        "python": sys.version.split()[0],
        "machine": platform.processor() or platform.machine(),
    }
    rows = [
        ("decode allocate_slots(req, 1)", f"{result['decode_allocate_us']:.2f} us", "<= 2.5 us (vLLM ~5)"),
        ("prefill lookup + allocate", f"{result['prefill_lookup_allocate_us']:.1f} us", ""),
        ("free (per request)", f"{result['free_us']:.1f} us", ""),
        (f"block hashing ({args.hash_algo}, per block)", f"{result['hash_us_per_block']:.2f} us", ""),
        ("prefix hit rate", f"{result['prefix_hit_rate']:.3f}", ""),
        ("whole trace wall time", f"{result['trace_wall_s']:.3f} s", "<= 0.3 s (vLLM ~0.6)"),
    ]
    try:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"block manager, {NUM_REQUESTS} requests x {DECODE_STEPS} decode steps (median)")
        for col in ("metric", "value", "target"):
            table.add_column(col)
        for row in rows:
            table.add_row(*row)
        Console().print(table)
    except ImportError:
        for name, value, target in rows:
            print(f"{name:40s} {value:>12s}  {target}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
