"""The device side of the engine: weights, KV caches and one jitted step per bucket.

The step takes the whole KV pytree as a donated argument and returns it, so XLA updates the
caches in place (no second cache-sized buffer; tests check the compiled executable). Shapes
are bucketed by token count and sequence count (block-table width is fixed), every reachable
bucket is compiled in warm_up(), and `num_compilations` counts traces so a test can prove
that serving compiles nothing new.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from flax import nnx

from models.llama import LlamaForCausalLM, init_kv_caches, kv_cache_bytes_per_block
from paged_jax.batch import StepInputs, make_buckets
from paged_jax.sampler import sample

# Smallest token / sequence buckets: below these, padding costs less than another compile.
MIN_TOKEN_BUCKET = 16
MIN_SEQ_BUCKET = 8
# A memory-derived pool never exceeds this many blocks (4M tokens at block_size 16): the
# host keeps one Python object per block, and only tiny models on big GPUs reach it (a
# Llama-3.1-8B in 100 GB of bf16 KV is ~50k blocks).
MAX_AUTO_BLOCKS = 1 << 18


def default_attention_impl() -> str:
    """"pallas" on GPUs (the Triton kernel), "xla" elsewhere (the gather path is the fast CPU one)."""
    return "pallas" if jax.default_backend() == "gpu" else "xla"


def num_blocks_for_budget(config, block_size: int, kv_cache_dtype, *, num_blocks=None, kv_cache_memory_bytes=None,
                          gpu_memory_utilization=0.9, max_num_seqs: int, max_model_len: int) -> int:
    """How many KV blocks (null block included) the pool gets.

    Precedence: num_blocks, else kv_cache_memory_bytes // bytes per block, else
    gpu_memory_utilization of the device's free memory (at most MAX_AUTO_BLOCKS). Devices
    that report no memory statistics (the CPU) get room for max_num_seqs full-length
    sequences, the most the scheduler can ever hold at once, so nothing is preempted there
    unless asked for.
    """
    per_block = kv_cache_bytes_per_block(config, block_size, kv_cache_dtype)
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
    return max_num_seqs * math.ceil(max_model_len / block_size) + 1


class ModelRunner:
    """Owns the weights and the KV caches on device and runs one jitted step.

    Args:
      model: an NNX LlamaForCausalLM (its state is split off once; the graph is static).
      num_blocks: KV blocks including the null block 0.
      block_size, max_model_len: the cache geometry; tables are cdiv(max_model_len, block_size) wide.
      max_num_seqs, max_num_batched_tokens: the largest sequence / token buckets.
      attention_impl: "xla" or "pallas"; interpret runs the Pallas kernel in interpret mode.
      kv_cache_dtype: defaults to the model's compute dtype.
    """

    def __init__(self, model: LlamaForCausalLM, *, num_blocks: int, block_size: int, max_model_len: int,
                 max_num_seqs: int, max_num_batched_tokens: int, attention_impl: str = "xla",
                 interpret: bool = False, kv_cache_dtype=None):
        if attention_impl not in ("xla", "pallas"):
            raise ValueError(f"{attention_impl=} must be 'xla' (CPU) or 'pallas' (GPU kernel)")
        self.config = model.config
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_blocks_per_seq = math.ceil(max_model_len / block_size)
        self.attention_impl = attention_impl
        self.interpret = interpret
        self.token_buckets = make_buckets(max_num_batched_tokens, min(MIN_TOKEN_BUCKET, max_num_batched_tokens))
        self.seq_buckets = make_buckets(max_num_seqs, min(MIN_SEQ_BUCKET, max_num_seqs))
        self.graphdef, self.params = nnx.split(model)
        self.kv_caches = init_kv_caches(model.config, num_blocks, block_size, kv_cache_dtype)
        self.kv_cache_bytes = sum(k.nbytes + v.nbytes for k, v in self.kv_caches)
        self.num_compilations = 0
        self.num_steps = 0
        self._step = jax.jit(self._step_fn, donate_argnums=(1,))

    def _step_fn(self, params, kv_caches, inputs: StepInputs):
        self.num_compilations += 1  # Python runs here only while jax traces a new shape
        model = nnx.merge(self.graphdef, params)
        logits, kv_caches = model(inputs.token_ids, inputs.positions, kv_caches, inputs,
                                  impl=self.attention_impl, interpret=self.interpret)
        token_ids, logprobs = sample(logits, inputs.temperature, inputs.top_k, inputs.top_p, inputs.rng_keys)
        return token_ids, logprobs, kv_caches

    def execute(self, inputs: StepInputs) -> tuple[np.ndarray, np.ndarray]:
        """Runs one step; returns (sampled token ids i32[S], their logprobs f32[S]) on the host.

        Rows past inputs.num_seqs are padding. A step with no sequences (only finished or
        aborted requests to release) runs nothing.
        """
        if int(inputs.num_seqs[0]) == 0:
            return np.zeros(0, np.int32), np.zeros(0, np.float32)
        token_ids, logprobs, self.kv_caches = self._step(self.params, self.kv_caches, inputs)
        self.num_steps += 1
        return np.asarray(token_ids), np.asarray(logprobs)

    def bucket_shapes(self) -> list[tuple[int, int]]:
        """Every (token bucket, sequence bucket) a step can land in: a step of t tokens has
        between 1 and min(t, max_num_seqs) sequences."""
        shapes = []
        for t in self.token_buckets:
            most = min(t, self.seq_buckets[-1])
            top = next(s for s in self.seq_buckets if s >= most)
            shapes += [(t, s) for s in self.seq_buckets if s <= top]
        return shapes

    def dummy_inputs(self, num_tokens: int, num_seqs: int) -> StepInputs:
        """A padded step of the given bucket whose tokens all write the null block."""
        s = num_seqs
        query_start_loc = np.zeros(s + 1, np.int32)
        query_start_loc[1:] = 1  # sequence 0 has the one real token, the rest are empty
        return StepInputs(
            token_ids=np.zeros(num_tokens, np.int32), positions=np.zeros(num_tokens, np.int32),
            slot_mapping=np.zeros(num_tokens, np.int32),
            block_tables=np.zeros((s, self.max_blocks_per_seq), np.int32),
            seq_lens=np.eye(1, s, dtype=np.int32)[0], query_start_loc=query_start_loc,
            num_seqs=np.ones(1, np.int32), logits_indices=np.zeros(s, np.int32),
            temperature=np.ones(s, np.float32), top_k=np.full(s, 8, np.int32), top_p=np.full(s, 0.9, np.float32),
            rng_keys=np.zeros((s, 2), np.uint32),
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

