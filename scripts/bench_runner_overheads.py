"""Two host-side costs of the runner, measured where they are claimed (paged_jax/runner.py):

- a step's inputs to the device: jax.device_put of the 13-field StepInputs tree vs one
  packed i32 vector (pack_step_inputs + one device_put), at the SmolLM2 serving shape
  (T 512 tokens, S 32 sequences, 128 blocks a table);
- zeroing a new KV pool: init_kv_caches for a SmolLM2-shaped pool (30 layers, 3 KV heads x
  64, f32) of max_num_seqs 32 x max_model_len 2048 tokens (3 GB), the time jax blocks for.

    python scripts/bench_runner_overheads.py [--reps 2000] [--pool-reps 3]

Writes results/bench_runner_overheads.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench_common import REPO, command_line, machine_info, median, print_table, write_json  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=2000, help="transfers timed per variant")
    parser.add_argument("--pool-reps", type=int, default=3, help="pools zeroed")
    args = parser.parse_args()

    import jax
    import numpy as np

    from models.kv_cache_spec import FullAttentionSpec, init_kv_caches
    from paged_jax.core.step_inputs import ModelInputs, SamplingMetadata, StepAttentionMetadata, StepInputs
    from paged_jax.runner import pack_step_inputs

    t, s, w = 512, 32, 128
    i32 = lambda *shape: np.zeros(shape, np.int32)  # noqa: E731
    inputs = StepInputs(ModelInputs(i32(t), i32(t), i32(s)),
                        StepAttentionMetadata(i32(1, t), i32(1, s, w), i32(s), i32(s + 1), i32(1)),
                        SamplingMetadata(np.ones(s, np.float32), i32(s), np.ones(s, np.float32),
                                         np.zeros((s, 2), np.uint32)))

    def per_call_us(fn) -> float:
        jax.block_until_ready(fn())
        times = []
        for _ in range(5):  # the median of five batches
            start = time.perf_counter()
            for _ in range(args.reps // 5):
                out = fn()
            jax.block_until_ready(out)
            times.append((time.perf_counter() - start) / (args.reps // 5) * 1e6)
        return median(times)

    tree_us = per_call_us(lambda: jax.device_put(inputs))
    packed_us = per_call_us(lambda: jax.device_put(pack_step_inputs(inputs)))

    specs = [FullAttentionSpec(3, 64, "float32")] * 30
    num_blocks, block_size = 32 * 2048 // 16 + 1, 16
    pool_s = []
    for _ in range(args.pool_reps):
        start = time.perf_counter()
        caches = init_kv_caches(specs, num_blocks, block_size)
        jax.block_until_ready(caches)
        pool_s.append(time.perf_counter() - start)
        pool_bytes = sum(a.nbytes for a in jax.tree.leaves(caches))
        del caches

    print_table("runner host costs", ["what", "median"], [
        ["device_put of the StepInputs tree (13 arrays)", f"{tree_us:.0f} us"],
        ["pack_step_inputs + device_put of one vector", f"{packed_us:.0f} us"],
        [f"zeroing a {pool_bytes / 2**30:.1f} GiB KV pool (init_kv_caches)", f"{median(pool_s):.2f} s"],
    ])
    write_json(os.path.join(REPO, "results", "bench_runner_overheads.json"),
               {"command": command_line(), "machine": machine_info(), "device_put_tree_us": tree_us,
                "device_put_packed_us": packed_us, "pool_bytes": pool_bytes, "pool_zero_s": pool_s})


if __name__ == "__main__":
    main()
