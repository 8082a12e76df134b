"""Where a decode step's time goes: one jitted step of the throughput benchmark's model, timed
as it is and with attention replaced by the identity, then jax's profiler's top thunks.

    python scripts/profile_step.py [--seqs 24] [--context 500 1000] [--top 12]

The runner is bench_throughput's engine geometry (block 16, max_model_len 2048, 2176 blocks,
64 sequence slots); the step decodes --seqs sequences whose contexts are drawn from
[--context), each sequence's pages a run of consecutive block ids (as the free queue hands
them out), padded to the runner's buckets. Greedy sampling. Prints medians of 15 steps.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import gzip
import json
import sys
import tempfile
import time

import jax
import numpy as np

from _bench_common import bench_model_dir

from models.llama import load_hf_checkpoint
from paged_jax.attention import XlaAttention
from paged_jax.core.config import CacheConfig, SchedulerConfig
from paged_jax.core.step_inputs import ModelInputs, SamplingMetadata, StepAttentionMetadata, StepInputs
from paged_jax.engine_config import EngineConfig, ResolvedConfig
from paged_jax.runner import ModelRunner


@dataclasses.dataclass(frozen=True)
class KVWriteOnly(XlaAttention):
    """The XLA backend's KV write with the attention replaced by the identity: the rest of the step."""

    def _attend(self, q, *args, sm_scale):
        return q


def decode_inputs(runner: ModelRunner, num_seqs: int, context: tuple[int, int], rng) -> StepInputs:
    """One decode token per sequence; the last token of each context is this step's."""
    t, s = runner.compiler.bucket_for(num_seqs, num_seqs)
    bs = runner.cache_config.block_size
    seq_lens = np.zeros(s, np.int32)
    seq_lens[:num_seqs] = rng.integers(*context, num_seqs)
    tables = np.zeros((s, runner.cache_config.max_blocks_per_seq), np.int32)
    next_block = 1
    for i in rng.permutation(num_seqs):
        pages = -(-int(seq_lens[i]) // bs)
        tables[i, :pages] = np.arange(next_block, next_block + pages)
        next_block += pages
    if next_block > runner.pool.num_blocks:
        sys.exit(f"{num_seqs} sequences of {context} keys need {next_block} blocks; the pool has "
                 f"{runner.pool.num_blocks}")
    positions = np.zeros(t, np.int32)
    positions[:num_seqs] = seq_lens[:num_seqs] - 1
    slots = np.zeros(t, np.int32)
    slots[:num_seqs] = tables[np.arange(num_seqs), positions[:num_seqs] // bs] * bs + positions[:num_seqs] % bs
    query_start_loc = np.full(s + 1, num_seqs, np.int32)
    query_start_loc[:num_seqs + 1] = np.arange(num_seqs + 1)
    logits_indices = np.zeros(s, np.int32)
    logits_indices[:num_seqs] = np.arange(num_seqs)
    return StepInputs(
        ModelInputs(token_ids=rng.integers(3, 32000, t).astype(np.int32), positions=positions,
                    logits_indices=logits_indices),
        StepAttentionMetadata(slot_mapping=slots[None], block_tables=tables[None], seq_lens=seq_lens,
                              query_start_loc=query_start_loc, num_seqs=np.array([num_seqs], np.int32)),
        SamplingMetadata(temperature=np.zeros(s, np.float32), top_k=np.full(s, -1, np.int32),
                         top_p=np.ones(s, np.float32), rng_keys=np.zeros((s, 2), np.uint32)))


def median_ms(runner: ModelRunner, inputs: StepInputs, repeats: int = 15) -> float:
    for _ in range(3):
        runner.execute(inputs)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        runner.execute(inputs)
        times.append(time.perf_counter() - start)
    return 1e3 * float(np.median(times))


def top_thunks(runner: ModelRunner, inputs: StepInputs, steps: int = 5) -> list[tuple[str, float, int]]:
    """(thunk name, ms per step, calls per step) of the compiled step's thunks, busiest first."""
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            for _ in range(steps):
                runner.execute(inputs)
        (path,) = glob.glob(f"{trace_dir}/**/perfetto_trace.json.gz", recursive=True)
        with gzip.open(path) as fh:
            events = json.load(fh)["traceEvents"]
    total, calls = collections.Counter(), collections.Counter()
    for event in events:
        name = event.get("name", "")
        # Python frames, the executor's own spans and end markers are not thunks.
        if event.get("ph") != "X" or name.startswith(("$", "ThunkExecutor", "PjitFunction", "end:")):
            continue
        total[name] += event["dur"]
        calls[name] += 1
    return [(name, us / steps / 1e3, calls[name] // steps) for name, us in total.most_common()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=24)
    parser.add_argument("--context", type=int, nargs=2, default=(500, 1000), metavar=("LO", "HI"))
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    with bench_model_dir(None) as model_dir:
        model = load_hf_checkpoint(model_dir, dtype="float32")
    geometry = (CacheConfig(block_size=16, num_blocks=2176, max_model_len=2048),
                SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=1024, max_model_len=2048))
    runner = ModelRunner(model, ResolvedConfig(EngineConfig(), *geometry))
    inputs = decode_inputs(runner, args.seqs, tuple(args.context), np.random.default_rng(0))
    # The same step with attention replaced by the identity (the KV write stays): the rest of
    # the model.
    without_attention = ModelRunner(model, ResolvedConfig(EngineConfig(), *geometry))
    without_attention.attention_backends = [KVWriteOnly(without_attention.attention.spec)]
    rest_ms = median_ms(without_attention, inputs)
    del without_attention
    step_ms = median_ms(runner, inputs)
    thunks = top_thunks(runner, inputs)
    bucket = (len(inputs.model.token_ids), len(inputs.attention.seq_lens))
    print(f"decode step, {args.seqs} sequences of {args.context[0]}-{args.context[1]} keys, bucket {bucket}, "
          f"jax {jax.__version__}")
    print(f"  whole step            {step_ms:7.1f} ms")
    print(f"  without attention     {rest_ms:7.1f} ms")
    print(f"  attention (8 layers)  {step_ms - rest_ms:7.1f} ms ({(step_ms - rest_ms) / step_ms:.0%})")
    print("top thunks under the profiler (which slows the step), ms per step, calls per step:")
    for name, ms, calls in thunks[:args.top]:
        print(f"  {ms:7.2f} ms  x{calls:<4d} {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
