"""The device side of the engine: weights, KV caches and one jitted step per bucket.

The step takes the whole KV pytree as a donated argument and returns it, so XLA updates the
caches in place (no second cache-sized buffer; tests check the compiled executable). Shapes
are bucketed by token count and sequence count (block-table width is fixed), every reachable
bucket is compiled in warm_up(), and `num_compilations` counts traces so a test can prove
that serving compiles nothing new.
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from models.kv_cache_spec import init_kv_caches, kv_cache_bytes_per_token
from paged_jax.attention import make_attention_backend
from paged_jax.core.config import CacheConfig, SchedulerConfig
from paged_jax.core.step_inputs import AttentionMetadata, ModelInputs, SamplingMetadata, StepInputs
from paged_jax.sampler import sample

# A memory-derived pool never exceeds this many blocks (4M tokens at block_size 16): the
# host keeps one Python object per block, and only tiny models on big GPUs reach it (a
# Llama-3.1-8B in 100 GB of bf16 KV is ~50k blocks).
MAX_AUTO_BLOCKS = 1 << 18


def num_blocks_for_budget(specs, block_size: int, *, num_blocks=None, kv_cache_memory_bytes=None,
                          gpu_memory_utilization=0.9, max_num_seqs: int, max_model_len: int) -> int:
    """How many KV blocks (null block included) the pool gets.

    Args:
      specs: the model's per-layer cache specs (their bytes per token size a block).
    Precedence: num_blocks, else kv_cache_memory_bytes // bytes per block, else
    gpu_memory_utilization of the device's free memory (at most MAX_AUTO_BLOCKS). Devices
    that report no memory statistics (the CPU) get room for max_num_seqs full-length
    sequences, the most the scheduler can ever hold at once, so nothing is preempted there
    unless asked for.
    """
    per_block = kv_cache_bytes_per_token(specs) * block_size
    if num_blocks is not None:
        return num_blocks
    if kv_cache_memory_bytes is not None:
        n = kv_cache_memory_bytes // per_block
        if n < 2:
            raise ValueError(f"{kv_cache_memory_bytes=} holds {n} blocks of {per_block} bytes; give at least "
                             f"{2 * per_block} bytes (the null block plus one)")
        return int(n)
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
        return max(2, min(int(free * gpu_memory_utilization) // per_block, MAX_AUTO_BLOCKS))
    return max_num_seqs * -(-max_model_len // block_size) + 1


class ModelRunner:
    """Owns the weights and the KV caches on device and runs one jitted step.

    Args:
      model: a registered model (models/registry.py); its state is split off once and its
        graph is static.
      cache_config: block_size, num_blocks (null block included), max_model_len.
      scheduler_config: the step limits, whose buckets are the compiled shapes.
      attention_impl: "xla", "pallas" or None (pallas on GPU, xla elsewhere); interpret runs
        the Pallas kernel in interpret mode. Turned into one backend for the model's cache spec.
      kv_cache_dtype: defaults to the model's compute dtype.
    """

    def __init__(self, model, cache_config: CacheConfig, scheduler_config: SchedulerConfig, *,
                 attention_impl: str | None = None, interpret: bool = False, kv_cache_dtype=None):
        self.config = model.config
        self.cache_config = cache_config
        self.scheduler_config = scheduler_config
        self.num_blocks = cache_config.num_blocks
        specs = model.kv_cache_specs(kv_cache_dtype)
        if len(set(specs)) != 1:
            raise ValueError("layers with different cache specs need one backend each; this runner builds one")
        self.kv_cache_specs = specs
        self.attention = make_attention_backend(specs[0], attention_impl, interpret=interpret)
        self.attention_impl = self.attention.name
        self.token_buckets = scheduler_config.token_buckets
        self.seq_buckets = scheduler_config.seq_buckets
        self.graphdef, self.params = nnx.split(model)
        self.kv_caches = init_kv_caches(specs, cache_config.num_blocks, cache_config.block_size)
        self.kv_cache_bytes = sum(a.nbytes for a in jax.tree.leaves(self.kv_caches))
        self.num_compilations = 0
        self.num_steps = 0
        self._step = jax.jit(self._step_fn, donate_argnums=(1,))

    def _step_fn(self, params, kv_caches, inputs: StepInputs):
        self.num_compilations += 1  # Python runs here only while jax traces a new shape
        model = nnx.merge(self.graphdef, params)
        logits, kv_caches = model(inputs.model, kv_caches, inputs.attention, self.attention)
        token_ids, logprobs = sample(logits, inputs.sampling)
        return token_ids, logprobs, kv_caches

    def execute(self, inputs: StepInputs) -> tuple[np.ndarray, np.ndarray]:
        """Runs one step; returns (sampled token ids i32[S], their logprobs f32[S]) on the host.

        Rows past inputs.num_seqs are padding. A step with no sequences (only finished or
        aborted requests to release) runs nothing.
        """
        if inputs.num_seqs == 0:
            return np.zeros(0, np.int32), np.zeros(0, np.float32)
        token_ids, logprobs, self.kv_caches = self._step(self.params, self.kv_caches, inputs)
        self.num_steps += 1
        return np.asarray(token_ids), np.asarray(logprobs)

    def bucket_shapes(self) -> list[tuple[int, int]]:
        """Every (token bucket, sequence bucket) a step can land in (SchedulerConfig.bucket_shapes)."""
        return self.scheduler_config.bucket_shapes()

    def dummy_inputs(self, num_tokens: int, num_seqs: int) -> StepInputs:
        """A padded step of the given bucket whose tokens all write the null block."""
        s = num_seqs
        query_start_loc = np.zeros(s + 1, np.int32)
        query_start_loc[1:] = 1  # sequence 0 has the one real token, the rest are empty
        return StepInputs(
            ModelInputs(token_ids=np.zeros(num_tokens, np.int32), positions=np.zeros(num_tokens, np.int32),
                        logits_indices=np.zeros(s, np.int32)),
            AttentionMetadata(slot_mapping=np.zeros(num_tokens, np.int32),
                              block_tables=np.zeros((s, self.cache_config.max_blocks_per_seq), np.int32),
                              seq_lens=np.eye(1, s, dtype=np.int32)[0], query_start_loc=query_start_loc,
                              num_seqs=np.ones(1, np.int32)),
            # Sampling rows that filter and draw, so the compiled step holds every branch.
            SamplingMetadata(temperature=np.ones(s, np.float32), top_k=np.full(s, 8, np.int32),
                             top_p=np.full(s, 0.9, np.float32), rng_keys=np.zeros((s, 2), np.uint32)),
        )
    def warm_up(self, progress=None) -> int:
        """Compiles every bucket (one padded step each; they only touch the null block).

        Returns the number of shapes compiled. `progress`, if given, is called after each.
        """
        shapes = self.bucket_shapes()
        for t, s in shapes:
            _, _, self.kv_caches = self._step(self.params, self.kv_caches, self.dummy_inputs(t, s))
            if progress is not None:
                progress()
        jax.block_until_ready(self.kv_caches)
        return len(shapes)

    def compiled_memory(self, num_tokens: int, num_seqs: int):
        """The compiled step's memory analysis for one bucket (tests use it to show that the
        donated caches are updated in place)."""
        lowered = self._step.lower(self.params, self.kv_caches, self.dummy_inputs(num_tokens, num_seqs))
        return lowered.compile().memory_analysis()

