"""Host cost of one engine step without the device: schedule() -> build() -> update().

    python scripts/bench_host_step.py [--num-seqs 256] [--steps 200]

num_seqs requests (prompts of 300-700 random tokens, block_size 16, a pool large enough for
all) are prefilled, then timed over `steps` decode steps in which every request computes one
token. A second case adds a 2048-token prompt prefilled in 512-token chunks alongside.
Prints median / p90 microseconds per call (target for build(): 256 decodes well under 1 ms).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from paged_jax.batch import StepInputsBuilder, make_buckets
from paged_jax.kv_cache_manager import KVCacheManager
from paged_jax.request import Request, SamplingParams
from paged_jax.scheduler import Scheduler


def _run(num_seqs: int, steps: int, block_size: int, with_prefill: bool) -> dict[str, list[float]]:
    rng = np.random.default_rng(0)
    max_model_len, budget, max_tokens = 4096, num_seqs + 512, steps + 1000
    kv = KVCacheManager(num_seqs * -(-(700 + max_tokens) // block_size) + 1024, block_size, max_model_len)
    sched = Scheduler(kv, num_seqs + 1, budget, max_model_len, block_size, long_prefill_token_threshold=512)
    builder = StepInputsBuilder(block_size=block_size, max_blocks_per_seq=max_model_len // block_size,
                                token_buckets=make_buckets(budget, 16), seq_buckets=make_buckets(num_seqs + 1, 8))
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=max_tokens)
    for i in range(num_seqs):
        prompt = rng.integers(0, 32000, int(rng.integers(300, 700))).tolist()
        sched.add_request(Request(f"r{i}", prompt, params))
    times = {"schedule": [], "build": [], "update": []}
    prefill_added = False
    while len(times["build"]) < steps:
        assert sched.has_unfinished_requests(), "requests finished before the decode steps were timed"
        if with_prefill and not prefill_added and sched.waiting == type(sched.waiting)():
            sched.add_request(Request("long", rng.integers(0, 32000, 2048).tolist(), SamplingParams(max_tokens=1)))
            prefill_added = True
        t0 = time.perf_counter()
        out = sched.schedule()
        t1 = time.perf_counter()
        builder.build(out)
        t2 = time.perf_counter()
        sched.update_from_output(out, rng.integers(0, 32000, out.num_seqs))
        t3 = time.perf_counter()
        if out.num_seqs >= num_seqs and all(n == 1 for n in out.num_scheduled_tokens[:num_seqs]):
            for name, dt in zip(times, (t1 - t0, t2 - t1, t3 - t2)):
                times[name].append(dt * 1e6)
            if with_prefill and not sched.waiting and "long" not in sched.requests:
                prefill_added = False  # queue another long prompt
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    print(f"{'case':<34} {'call':<10} {'median us':>10} {'p90 us':>10}")
    for name, with_prefill in ((f"{args.num_seqs} decodes", False), (f"{args.num_seqs} decodes + 512-token chunk", True)):
        for call, t in _run(args.num_seqs, args.steps, args.block_size, with_prefill).items():
            print(f"{name:<34} {call:<10} {np.median(t):>10.1f} {np.percentile(t, 90):>10.1f}")


if __name__ == "__main__":
    main()
