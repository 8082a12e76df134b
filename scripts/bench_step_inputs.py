"""Host cost of building StepInputs (batch.py), the per-step work between scheduler and device.

    python scripts/bench_step_inputs.py [--num-seqs 256] [--steps 300]

Decode: num_seqs running requests (prompt 500 +- 200 tokens), one token each per step, a new
block every block_size steps. Mixed: the same decodes plus one 512-token prefill chunk.
Prints the median and p90 microseconds per build() (target: 256 decodes well under 1 ms).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from paged_jax.batch import StepInputsBuilder, make_buckets
from paged_jax.request import Request, SamplingParams
from paged_jax.scheduler import SchedulerOutput


def _run(num_seqs: int, steps: int, block_size: int, prefill_chunk: int) -> list[float]:
    rng = np.random.default_rng(0)
    max_model_len = 4096
    builder = StepInputsBuilder(block_size=block_size, max_blocks_per_seq=max_model_len // block_size,
                                token_buckets=make_buckets(num_seqs + prefill_chunk, 16),
                                seq_buckets=make_buckets(num_seqs + 1, 8), seed=0)
    requests = [Request(f"r{i}", rng.integers(0, 32000, int(rng.integers(300, 700))).tolist(),
                        SamplingParams(temperature=0.8, top_p=0.95, seed=i)) for i in range(num_seqs)]
    next_block = 1
    tables = {}
    for r in requests:
        n = -(-(r.num_tokens + 1) // block_size)
        tables[r.request_id] = list(range(next_block, next_block + n))
        next_block += n
    big = Request("prefill", rng.integers(0, 32000, 4000).tolist())
    times, first = [], True
    for step in range(steps):
        out = SchedulerOutput()
        for r in requests:
            c = r.num_tokens - 1
            new = []
            if first:
                new = tables[r.request_id]
            elif c % block_size == 0:
                new = [next_block]
                next_block += 1
            out.requests.append(r)
            out.num_computed_tokens.append(c)
            out.num_scheduled_tokens.append(1)
            out.samples.append(True)
            out.new_block_ids.append(new)
            out.is_new.append(first)
        if prefill_chunk:
            start = (step * prefill_chunk) % 3000
            out.requests.append(big)
            out.num_computed_tokens.append(start)
            out.num_scheduled_tokens.append(prefill_chunk)
            out.samples.append(False)
            out.new_block_ids.append(list(range(1, -(-(start + prefill_chunk) // block_size) + 1)))
            out.is_new.append(True)
        t0 = time.perf_counter()
        builder.build(out)
        times.append((time.perf_counter() - t0) * 1e6)
        first = False
        for r in requests:
            r.append_output_token_ids(int(rng.integers(0, 32000)))
    return times[1:]  # the first build fills every table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    print(f"{'case':<28} {'median us':>10} {'p90 us':>10}")
    for name, chunk in ((f"{args.num_seqs} decodes", 0), (f"{args.num_seqs} decodes + 512 prefill", 512)):
        t = _run(args.num_seqs, args.steps, args.block_size, chunk)
        print(f"{name:<28} {np.median(t):>10.1f} {np.percentile(t, 90):>10.1f}")


if __name__ == "__main__":
    main()
