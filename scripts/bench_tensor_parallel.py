"""Tensor and data parallelism: agreement, memory per device, step throughput, routing.

    python scripts/bench_tensor_parallel.py [--quick] [--model smollm2-135m-instruct] [--tp 1 3]
    python scripts/bench_tensor_parallel.py --native --tp 1      # on the GPU machine (scripts/gpu_check.sh)

Without --native the script runs on 8 host CPU devices (XLA_FLAGS, set before jax loads):
the devices share this machine's cores, so throughput there measures the sharded programs'
overhead, not a speed-up. Tables:

1. tensor parallelism, per tp: greedy tokens identical to tp=1 (a mixed batch with a
   shared system prompt), decode-heavy tokens/s (median of interleaved repetitions, ratio
   to tp=1), weight and KV bytes per device, and the pool's blocks for a fixed per-device
   KV budget;
2. embeddings and lm_head split over the vocabulary (the default, vLLM's vocab-parallel
   layout) against replicated, at the largest tp: weight bytes per device and tokens/s;
3. data parallelism (when the devices allow two replicas): prefix-cache hit rate and
   outputs at dp=1, dp=2 with prefix-aware routing, and dp=2 routed to the least loaded
   replica only (the routing switched off), for requests sharing a system prompt.

Writes results/bench_tensor_parallel[_quick].json (or --out DIR).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

NUM_HOST_DEVICES = 8


def _parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--tp", type=int, nargs="+", default=None, help="tensor parallel sizes (default: 1 and the "
                   "largest that divides the model's heads, up to the devices)")
    p.add_argument("--quick", action="store_true", help="the tiny model, fewer repetitions")
    p.add_argument("--native", action="store_true", help="the machine's own devices (GPU), not 8 host CPU devices")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default=None, help="directory for the JSON (default: results/)")
    return p.parse_args()


ARGS = _parse()
if not ARGS.native:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={NUM_HOST_DEVICES}")
    os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from _bench_common import command_line, machine_info, median, print_table, write_json  # noqa: E402
from models.llama import LlamaForCausalLM  # noqa: E402
from paged_jax import LLM, SamplingParams  # noqa: E402
from paged_jax import sharding  # noqa: E402
from paged_jax.data_parallel import DataParallelEngine  # noqa: E402

# warm_up "none": the untimed first generate() compiles the buckets the workload uses, and the
# timed repetitions of the same workload land in the same buckets.
ENGINE = dict(block_size=16, max_model_len=512, max_num_seqs=8, max_num_batched_tokens=64, warm_up="none",
              compile_cache_dir=None, hash_seed=0)
KV_BUDGET_PER_DEVICE = 64 << 20  # bytes: the pool-size column


def workload(vocab: int, quick: bool):
    """8 prompts, the first 4 behind a shared 64-token system prompt (alternating replicas
    would split them); greedy, ignore EOS."""
    rng = np.random.default_rng(0)
    system = rng.integers(3, vocab, 64).tolist()
    prompts = [(system if i < 4 else []) + rng.integers(3, vocab, int(n)).tolist()
               for i, n in enumerate(rng.integers(8, 96, 8))]
    return prompts, SamplingParams(max_tokens=16 if quick else 48, temperature=0.0, ignore_eos=True)


def bytes_per_device(arrays) -> int:
    return sum(a.addressable_shards[0].data.nbytes for a in jax.tree.leaves(arrays))


def measure_tp(tps, prompts, params, reps, vocab_split_off_at=None):
    """Builds one LLM per configuration, then times generate() round-robin (interleaved)."""
    configs = {}
    for tp in tps:
        configs[f"tp={tp}"] = dict(tensor_parallel_size=tp)
        if tp == 1:  # the sharded programs (shard_map, explicit shardings) on a one-device mesh
            configs["tp=1 on a mesh"] = dict(tensor_parallel_size=1, devices=jax.devices()[:1])
    if vocab_split_off_at is not None:
        configs[f"tp={vocab_split_off_at} vocab replicated"] = dict(tensor_parallel_size=vocab_split_off_at,
                                                                    _replicate_vocab=True)
    llms, tokens = {}, {}
    for name, cfg in configs.items():
        saved = LlamaForCausalLM.param_partition_rules
        if cfg.pop("_replicate_vocab", False):
            LlamaForCausalLM.param_partition_rules = {**saved, "embed_tokens": P(), "lm_head": P()}
        try:
            start = time.perf_counter()
            llms[name] = LLM(ARGS.model if not ARGS.quick else "tiny", **ENGINE, **cfg)
            print(f"{name}: built in {time.perf_counter() - start:.1f} s", flush=True)
        finally:
            LlamaForCausalLM.param_partition_rules = saved
        tokens[name] = [o.token_ids for o in llms[name].generate(prompts, params, use_tqdm=False)]
    times = {name: [] for name in configs}
    for _ in range(reps):
        for name, llm in llms.items():
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            times[name].append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start))
    rows = {}
    for name, llm in llms.items():
        runner = llm.engine.runner
        weights = bytes_per_device([runner.head_params, runner.layer_params])
        blocks = KV_BUDGET_PER_DEVICE // (runner.pool.kv_cache_bytes_per_device // runner.pool.num_blocks)
        reference = tokens[f"tp={tps[0]}"]
        same = sum(a == b for a, b in zip(tokens[name], reference))
        rows[name] = {"identical_to_tp1": f"{same}/{len(reference)}", "tok_s": median(times[name]),
                      "tok_s_runs": times[name], "weight_mib_per_device": weights / 2**20,
                      "kv_mib_per_device": runner.pool.kv_cache_bytes_per_device / 2**20,
                      "kv_head_replicas": runner.pool.kv_head_replicas, "blocks_in_64_mib_per_device": int(blocks)}
    return rows


def measure_dp(prompts, params):
    """Hit rate and outputs at dp=1, dp=2 routed by prefix, dp=2 routed by load only."""
    model = ARGS.model if not ARGS.quick else "tiny"
    results, outputs = {}, {}
    for name, dp, by_prefix in (("dp=1", 1, True), ("dp=2 prefix-aware", 2, True), ("dp=2 least-loaded", 2, False)):
        llm = LLM(model, **ENGINE, data_parallel_size=dp)
        if not by_prefix:
            llm.engine._num_held_blocks = lambda replica, block_hashes: 0  # the ablation: load only
        outputs[name] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        stats = llm.stats()
        per_replica = ([r["num_finished"] for r in stats["replicas"]] if isinstance(llm.engine, DataParallelEngine)
                       else [stats["num_finished"]])
        results[name] = {"prefix_hit_rate": stats["prefix_cache_hit_rate"], "requests_per_replica": per_replica,
                         "identical_to_dp1": f"{sum(a == b for a, b in zip(outputs[name], outputs['dp=1']))}"
                                             f"/{len(prompts)}"}
    return results


def _fits(model, tp: int) -> bool:
    try:
        sharding.check_tensor_parallel(model, tp)
    except ValueError:
        return False
    return True


def main() -> int:
    devices = jax.devices()
    llm0 = LLM(ARGS.model if not ARGS.quick else "tiny", **{**ENGINE, "warm_up": "none"})
    model = llm0.engine.model
    config = model.config
    tps = ARGS.tp or [1] + [t for t in range(len(devices), 1, -1) if _fits(model, t)][:1]
    del llm0, model
    prompts, params = workload(config.vocab_size, ARGS.quick)
    reps = 2 if ARGS.quick else ARGS.reps
    tp_rows = measure_tp(tps, prompts, params, reps, vocab_split_off_at=max(tps) if max(tps) > 1 else None)
    base = tp_rows[f"tp={tps[0]}"]["tok_s"]
    print_table(f"tensor parallelism ({ARGS.model if not ARGS.quick else 'tiny'}, {jax.default_backend()}, "
                f"{len(devices)} devices; {len(prompts)} prompts x {params.max_tokens} tokens, median of {reps})",
                ["config", "greedy = tp1", "tok/s", "vs tp1", "weights MiB/dev", "KV MiB/dev", "KV head copies",
                 "blocks in 64 MiB/dev"],
                [[name, r["identical_to_tp1"], f"{r['tok_s']:.1f}", f"{r['tok_s'] / base:.2f}",
                  f"{r['weight_mib_per_device']:.1f}", f"{r['kv_mib_per_device']:.2f}", r["kv_head_replicas"],
                  r["blocks_in_64_mib_per_device"]] for name, r in tp_rows.items()])
    dp_rows = None
    if len(devices) >= 2:
        dp_rows = measure_dp(prompts, params)
        print_table("data parallelism (requests sharing a 64-token system prompt)",
                    ["config", "prefix hit rate", "requests per replica", "greedy = dp1"],
                    [[name, f"{r['prefix_hit_rate']:.1%}", r["requests_per_replica"], r["identical_to_dp1"]]
                     for name, r in dp_rows.items()])
    out_dir = ARGS.out or os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results")
    name = "bench_tensor_parallel" + ("_quick" if ARGS.quick else "") + ("_native" if ARGS.native else "")
    write_json(os.path.join(out_dir, name + ".json"), {
        "command": command_line(), "machine": machine_info(), "backend": jax.default_backend(),
        "num_devices": len(devices), "tensor_parallel": tp_rows, "data_parallel": dp_rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
