"""CacheConfig and SchedulerConfig: the engine's sizes, resolved once and passed down.

The engine turns the user's EngineConfig (where the pool size and max_model_len may be
left open) into these two frozen records once, after the model is loaded; the KV cache
manager, the scheduler, the step-input builder and the model runner all read their sizes
from them instead of taking loose keywords. Each field is validated here, in
__post_init__, and nowhere downstream (downstream code asserts, since a bad value there is
a bug). The derived sizes (table width, shape buckets) are properties, computed in one
place. Imports no jax.
"""

from __future__ import annotations

from dataclasses import dataclass

from paged_jax.core.hashing import get_hash_fn_by_name

# Smallest token bucket: a single decode runs a 1-token program (padding it to 16 tokens made
# every layer's matmuls work for 16 rows: 1.8x the step, docs/BENCHMARKS.md section 17). Each
# bucket is a few more compiled programs, and each compiled XLA:CPU program holds ~150 memory
# maps of a process's 65530 (vm.max_map_count): tests/conftest.py releases each test module's
# engines. Steps of fewer tokens than MIN_SEQ_BUCKET pad their sequences to the token bucket
# (a decode batch of n has n of each); larger ones to at least MIN_SEQ_BUCKET.
MIN_TOKEN_BUCKET = 1
MIN_SEQ_BUCKET = 8


def check_int(name: str, value, minimum: int, fix: str = "") -> None:
    """ValueError unless value is an int (not a bool) >= minimum; `fix` says what to do."""
    what = "an int " if isinstance(value, bool) or not isinstance(value, int) else ""
    if what or value < minimum:
        raise ValueError(f"{name}={value!r} must be {what}>= {minimum}{': ' + fix if fix else ''}")


def check_power_of_two(name: str, value, fix: str = "16 is vLLM's default") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or value & (value - 1):
        raise ValueError(f"{name}={value!r} must be a power of two ({fix})")


def check_hash_seed(value) -> None:
    """ValueError unless value is an int, a str or None (a prefix-cache chain root seed)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, str))):
        raise ValueError(f"hash_seed={value!r} must be an int, a str or None (None: a random root per engine)")


def make_buckets(max_value: int, min_value: int = 1) -> list[int]:
    """Powers of two from the first one >= min_value, capped by max_value (always the last).

    make_buckets(100, 8) == [8, 16, 32, 64, 100]. Each bucket is one compiled shape, so the
    count stays logarithmic while padding wastes at most half of a step.
    """
    check_int("max_value", max_value, 1)
    check_int("min_value", min_value, 1)
    if min_value > max_value:
        raise ValueError(f"min_value={min_value} must be <= max_value={max_value}")
    buckets, size = [], 1
    while size < min_value:
        size *= 2
    while size < max_value:
        buckets.append(size)
        size *= 2
    buckets.append(max_value)
    return buckets


# Attention types a KV-cache group can have, each with its single-type manager
# (core/single_type_kv_cache_manager.py); a model's cache spec names its type.
ATTENTION_TYPES = ("full_attention", "sliding_window")


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """One KV-cache group: layers whose caches have the same spec share one block table
    (vLLM's KVCacheGroupSpec). The host never learns what a block holds, only how a group
    of its type keeps blocks: a full-attention group keeps every one; a sliding-window group
    frees the blocks no later query can see and keeps the null block in their place.

    Attributes:
      layer_ids: the model's layers in this group (empty in host-only configs that have no
        model: then the group stands for every layer).
      attention_type: one of ATTENTION_TYPES; picks the group's single-type manager.
      sliding_window: for "sliding_window", the tokens a query sees, itself included (a
        positive int); None for every other type.
    """

    layer_ids: tuple[int, ...] = ()
    attention_type: str = "full_attention"
    sliding_window: int | None = None

    def __post_init__(self):
        if self.attention_type not in ATTENTION_TYPES:
            raise ValueError(f"attention_type={self.attention_type!r} must be one of {ATTENTION_TYPES}")
        if not isinstance(self.layer_ids, tuple) or not all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in self.layer_ids):
            raise ValueError(f"layer_ids={self.layer_ids!r} must be a tuple of layer indices (ints >= 0)")
        window = self.sliding_window
        if self.attention_type == "sliding_window":
            if isinstance(window, bool) or not isinstance(window, int) or window < 1:
                raise ValueError(f"sliding_window={window!r} must be a positive int for attention_type="
                                 f"'sliding_window' (the tokens a query sees, itself included)")
        elif window is not None:
            raise ValueError(f"sliding_window={window!r} is only for attention_type='sliding_window'; pass "
                             f"sliding_window=None for attention_type={self.attention_type!r}, or make the group "
                             f"a sliding-window one")


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache as the host sees it (the device layout is the model's cache spec).

    Attributes:
      block_size: tokens per block, a power of two.
      num_blocks: blocks in the pool including the null block 0 (so >= 2).
      max_model_len: longest sequence (prompt + output); slots past it are never allocated.
      enable_prefix_caching: reuse full blocks across requests through their chain hashes.
      hash_algo: "sha256" (canonical CBOR, default) or "xxhash" (xxh3-128).
      hash_seed: seeds the root of every hash chain (NONE_HASH); None: PYTHONHASHSEED if set,
        else random, so another tenant cannot predict our chains. Fix it to share chains
        across processes (a persistent tier, replicas routed by prefix).
      kv_cache_groups: the model's layers by cache spec, one block table per group per
        request, all drawn from the one pool (default: one full-attention group of every
        layer, as every model had before groups).
    """

    block_size: int
    num_blocks: int
    max_model_len: int
    enable_prefix_caching: bool = True
    hash_algo: str = "sha256"
    hash_seed: int | str | None = None
    kv_cache_groups: tuple[KVCacheGroupSpec, ...] = (KVCacheGroupSpec(),)

    def __post_init__(self):
        check_power_of_two("block_size", self.block_size)
        check_int("num_blocks", self.num_blocks, 2, "block 0 is the null block; give the cache more blocks")
        check_int("max_model_len", self.max_model_len, 1)
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching={self.enable_prefix_caching!r} must be True or False")
        get_hash_fn_by_name(self.hash_algo)  # ValueError naming the known ones
        check_hash_seed(self.hash_seed)
        groups = self.kv_cache_groups
        if not isinstance(groups, tuple) or not groups or not all(isinstance(g, KVCacheGroupSpec) for g in groups):
            raise ValueError(f"kv_cache_groups={groups!r} must be a non-empty tuple of KVCacheGroupSpec")
        layer_ids = [i for g in groups for i in g.layer_ids]
        if len(set(layer_ids)) != len(layer_ids):
            raise ValueError(f"kv_cache_groups put a layer in two groups: {[g.layer_ids for g in groups]}")

    @property
    def num_kv_cache_groups(self) -> int:
        return len(self.kv_cache_groups)

    @property
    def max_blocks_per_seq(self) -> int:
        """Width of every block table: cdiv(max_model_len, block_size)."""
        return -(-self.max_model_len // self.block_size)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step limits, and the shape buckets they imply.

    Attributes:
      max_num_seqs: sequences in one step (and running at once).
      max_num_batched_tokens: tokens in one step (the token budget).
      max_model_len: as in CacheConfig.
      long_prefill_token_threshold: cap on one request's tokens per step (0 = off).
      min_token_bucket, min_seq_bucket: the smallest compiled token / sequence counts.
      preemption_mode: "recompute" (free the victim's blocks; it recomputes what the
        prefix cache lost) or "swap" (its pages go to the host tier and come back; needs
        an offload tier; recompute when the tier is full).
      num_spec_tokens: proposals a decoding sequence may bring (speculative decoding's k;
        0: none). A verification step has 1 + k tokens per sequence, so a step of T tokens
        pads its sequences to at least T // (1 + k) rather than T, and 1 + k is a token
        bucket: one sequence verifying 4 proposals runs in a (5, 1) bucket, not (8, 8) (8 rows
        of logits for 1, and 3 padding rows in every matmul).
      num_lookahead_tokens: slots reserved past every request's scheduled tokens (vLLM's
        num_lookahead_tokens): a draft model writes its KV for its next proposals there within
        the step (its k; 0 without a draft model). Capped at max_model_len, never cached.
      num_scheduler_steps: decode steps one engine step may run on the device (vLLM V0's
        multi-step scheduling): when every running request is decoding and none waits that
        max_num_seqs would admit, the scheduler reserves num_scheduler_steps - 1 slots past
        each one's token and the runner feeds each step's sampled token to the next within
        one program (1: off).
    """

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    long_prefill_token_threshold: int = 0
    min_token_bucket: int = MIN_TOKEN_BUCKET
    min_seq_bucket: int = MIN_SEQ_BUCKET
    preemption_mode: str = "recompute"
    num_spec_tokens: int = 0
    num_lookahead_tokens: int = 0
    num_scheduler_steps: int = 1

    def __post_init__(self):
        check_int("max_num_seqs", self.max_num_seqs, 1)
        check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        check_int("max_model_len", self.max_model_len, 1)
        check_int("long_prefill_token_threshold", self.long_prefill_token_threshold, 0, "0 turns it off")
        check_int("min_token_bucket", self.min_token_bucket, 1)
        check_int("min_seq_bucket", self.min_seq_bucket, 1)
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode={self.preemption_mode!r} must be 'recompute' or 'swap'")
        check_int("num_spec_tokens", self.num_spec_tokens, 0, "0 without speculative decoding")
        check_int("num_lookahead_tokens", self.num_lookahead_tokens, 0, "0 without a draft model")
        check_int("num_scheduler_steps", self.num_scheduler_steps, 1, "1 runs one step a call")
        if self.num_scheduler_steps > 1 and (self.num_spec_tokens or self.num_lookahead_tokens):
            raise ValueError(f"num_scheduler_steps={self.num_scheduler_steps} with speculative decoding: a "
                             "verification step needs the host between steps; use one or the other")

    @property
    def token_buckets(self) -> list[int]:
        """Padded token counts a step can have (each one compiled shape): powers of two, and
        with speculation 1 + num_spec_tokens too, so that one sequence verifying k proposals
        computes its 1 + k rows and not the next power of two (on a CPU a verification step's
        matmuls cost about their rows)."""
        buckets = make_buckets(self.max_num_batched_tokens, min(self.min_token_bucket, self.max_num_batched_tokens))
        verify = 1 + self.num_spec_tokens
        if self.num_spec_tokens and verify < self.max_num_batched_tokens and verify not in buckets:
            buckets = sorted([*buckets, verify])
        return buckets

    @property
    def seq_buckets(self) -> list[int]:
        """Padded sequence counts a step can have (bucket_for says which one a step gets)."""
        return make_buckets(self.max_num_seqs, 1)

    def bucket_for(self, num_tokens: int, num_seqs: int) -> tuple[int, int]:
        """The (T, S) a step of num_tokens tokens over num_seqs sequences pads to: T the
        smallest token bucket >= num_tokens, S the smallest sequence bucket >= num_seqs and
        >= min(max(1, T // (1 + num_spec_tokens)), min_seq_bucket). A function of the batch alone."""
        t = next(b for b in self.token_buckets if b >= num_tokens)
        floor = max(num_seqs, min(max(1, t // (1 + self.num_spec_tokens)), self.min_seq_bucket))
        s = next((b for b in self.seq_buckets if b >= floor), self.max_num_seqs)
        return t, s

    def bucket_shapes(self) -> list[tuple[int, int]]:
        """Every (T, S) bucket_for can return: a step of t tokens has between 1 and
        min(t, max_num_seqs) sequences."""
        shapes = []
        for t in self.token_buckets:
            lowest = self.bucket_for(t, 1)[1]
            highest = self.bucket_for(t, min(t, self.max_num_seqs))[1]
            shapes += [(t, s) for s in self.seq_buckets if lowest <= s <= highest]
        return shapes
