"""One KV-cache group's block tables over the shared BlockPool (vLLM v1's SingleTypeKVCacheManager).

A model's layers fall into KV-cache groups (core/config.py KVCacheGroupSpec: layers with one
cache spec share a block table); the KVCacheCoordinator keeps one manager per group, each of
the class its attention type names in MANAGER_TYPES. A manager knows how its type keeps
blocks and which cached prefixes it accepts:

- full attention keeps every block of a request and accepts any cached prefix;
- a sliding window of W tokens (vLLM's SlidingWindowManager) lets a query see its own token
  and the W - 1 before it, so once a request has computed n tokens the first
  get_num_skipped_tokens(n) = max(0, n - W + 1) are never read again: remove_skipped_blocks
  frees the blocks wholly inside them and puts the null block in their place. A cached
  prefix of L blocks is a hit when the sliding_window_contiguous_blocks = cdiv(W - 1,
  block_size) blocks before position L are cached (the earlier ones are null in the hit), or
  when all L are.

Invariants of every table (KVCacheManager.check_invariants asserts them): its null entries
are a prefix of it (none at all in a full-attention table); its non-null blocks are distinct
and each holds one reference; num_cached_block[request_id] <= len(table), and each of those
leading non-null blocks carries its hash. A sliding table holds at most
max_blocks_per_request(...) non-null blocks. Imports no jax.
"""

from __future__ import annotations

from paged_jax.core.block_pool import BlockPool, hash_with_group_id
from paged_jax.core.config import KVCacheGroupSpec, check_int
from paged_jax.core.kv_cache_block import KVCacheBlock


class SingleTypeKVCacheManager:
    """The block tables of one KV-cache group.

    Args:
      group_spec: the group (its attention type picked this class; a sliding group's window).
      block_pool: the pool every group draws from.
      block_size: tokens per block.
      kv_cache_group_id: this group's index (its cached blocks' keys carry it).

    State: req_to_blocks[request_id] is the request's block table in this group (append-only
    while it lives, except that remove_skipped_blocks may replace leading blocks by the null
    block); num_cached_block[request_id] counts its leading blocks already cached (nulls
    included).
    """

    # Whether remove_skipped_blocks can free anything (the coordinator calls only those that can).
    frees_skipped_blocks = False

    def __init__(self, group_spec: KVCacheGroupSpec, block_pool: BlockPool, block_size: int,
                 kv_cache_group_id: int):
        self.group_spec = group_spec
        self.block_pool = block_pool
        self.block_size = block_size
        self.kv_cache_group_id = kv_cache_group_id
        self.null_block = block_pool.null_block
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_block: dict[str, int] = {}

    @classmethod
    def get_max_num_blocks(cls, group_spec: KVCacheGroupSpec, block_size: int, num_tokens: int,
                           max_num_new_tokens: int) -> int:
        """The most non-null blocks one request of num_tokens slots holds in a group of this
        type, when a step adds at most max_num_new_tokens slots (see max_blocks_per_request)."""
        return -(-num_tokens // block_size)

    def find_longest_cache_hit(self, block_hashes: list[bytes], max_num_blocks: int,
                               kv_cache_group_ids: tuple[int, ...]) -> tuple[list[KVCacheBlock], ...]:
        """Cached blocks for the longest prefix of block_hashes (at most max_num_blocks) that
        every group of kv_cache_group_ids (all of this manager's spec) accepts: one list per
        group, all of one length, skipped blocks as the null block. Changes nothing."""
        raise NotImplementedError

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Leading tokens no query after the first num_computed_tokens attends to (none for
        full attention)."""
        return 0

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: list[KVCacheBlock], num_computed_tokens: int = 0) -> int:
        """Free blocks this group needs to hold num_tokens tokens of the request.

        Args:
          request_id: the request.
          num_tokens: its slots after this step (computed, hits, new and lookahead tokens).
          new_computed_blocks: its prefix hits in this group (only on its first allocation).
          num_computed_tokens: its computed tokens including the hits: the hits' leading
            get_num_skipped_tokens(num_computed_tokens) // block_size blocks are skipped (the
            null block takes their place: not needed, not touched).
        Hit blocks with ref_cnt 0 that are not skipped count as needed: touching them takes
        them out of the free queue just like an allocation does.
        """
        num_required_blocks = -(-num_tokens // self.block_size)
        num_req_blocks = len(self.req_to_blocks.get(request_id, ()))
        num_skipped_blocks = self.get_num_skipped_tokens(num_computed_tokens) // self.block_size
        num_new_blocks = num_required_blocks - max(num_skipped_blocks, len(new_computed_blocks) + num_req_blocks)
        num_skipped_hits = max(0, num_skipped_blocks - num_req_blocks)
        num_evictable = sum(1 for b in new_computed_blocks[num_skipped_hits:] if b.ref_cnt == 0 and not b.is_null)
        return max(num_new_blocks, 0) + num_evictable

    def save_new_computed_blocks(self, request_id: str, new_computed_blocks: list[KVCacheBlock],
                                 num_computed_tokens: int = 0) -> None:
        """Start the request's table with its prefix hits (vLLM's allocate_new_computed_blocks):
        the skipped ones (see get_num_blocks_to_allocate) become the null block, the others are
        touched. The caller checked they fit."""
        assert request_id not in self.req_to_blocks, f"request {request_id!r} already has a table in this group"
        num_skipped_blocks = self.get_num_skipped_tokens(num_computed_tokens) // self.block_size
        if num_skipped_blocks > 0:
            new_computed_blocks = new_computed_blocks[num_skipped_blocks:]
        if new_computed_blocks:
            self.block_pool.touch(new_computed_blocks)
        table = [self.null_block] * num_skipped_blocks if num_skipped_blocks > 0 else []
        table.extend(new_computed_blocks)
        self.req_to_blocks[request_id] = table
        if table:  # hits and the nulls before them are cached already: cache_blocks starts after them
            self.num_cached_block[request_id] = len(table)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        """Blocks taken from the pool so the table covers num_tokens tokens (the caller checked
        they are free)."""
        req_blocks = self.req_to_blocks[request_id]
        num_new_blocks = -(-num_tokens // self.block_size) - len(req_blocks)
        if num_new_blocks <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        req_blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request, num_tokens: int) -> None:
        """Cache the request's blocks that the first num_tokens tokens fill."""
        request_id = request.request_id
        num_full_blocks = num_tokens // self.block_size
        num_cached_blocks = self.num_cached_block.get(request_id, 0)
        if num_full_blocks > num_cached_blocks:
            self.block_pool.cache_full_blocks(request, self.req_to_blocks[request_id], num_cached_blocks,
                                              num_full_blocks, self.block_size, self.kv_cache_group_id)
            self.num_cached_block[request_id] = num_full_blocks

    def free(self, request_id: str) -> None:
        """Return the request's blocks, tail first (its last blocks are evicted first); the
        pool passes over the null entries."""
        req_blocks = self.req_to_blocks.pop(request_id, None)
        self.num_cached_block.pop(request_id, None)
        if req_blocks:
            self.block_pool.free_blocks(req_blocks[::-1])

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Free the blocks wholly inside the first get_num_skipped_tokens(num_computed_tokens)
        tokens, right to left (the last one is evicted first), stopping at the first null
        block (those before it were freed by an earlier call); each becomes the null block in
        the table. They stay in the prefix cache until evicted. A no-op for full attention and
        for a request holding no table."""
        num_skipped_tokens = self.get_num_skipped_tokens(num_computed_tokens)
        if num_skipped_tokens <= 0:
            return
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        null_block = self.null_block
        removed = []
        for i in range(min(num_skipped_tokens // self.block_size, len(blocks)) - 1, -1, -1):
            block = blocks[i]
            if block is null_block:
                break
            removed.append(block)
            blocks[i] = null_block
        if removed:
            self.block_pool.free_blocks(removed)


class FullAttentionManager(SingleTypeKVCacheManager):
    """Every token attends to every earlier one: a request keeps all its blocks, and any
    cached prefix is a hit (walk from block 0, stop at the first block some group misses)."""

    def find_longest_cache_hit(self, block_hashes: list[bytes], max_num_blocks: int,
                               kv_cache_group_ids: tuple[int, ...]) -> tuple[list[KVCacheBlock], ...]:
        if len(kv_cache_group_ids) == 1:  # one group: the map's own prefix walk
            group_id = kv_cache_group_ids[0]
            if group_id:
                block_hashes = [hash_with_group_id(h, group_id) for h in block_hashes[:max_num_blocks]]
            return (self.block_pool.cached_block_hash_to_block.get_prefix_blocks(block_hashes, max_num_blocks),)
        hits = tuple([] for _ in kv_cache_group_ids)
        get_cached_blocks = self.block_pool.get_cached_blocks
        for block_hash in block_hashes[:max_num_blocks]:
            cached = get_cached_blocks(block_hash, kv_cache_group_ids)
            if cached is None:
                break
            for group_hits, block in zip(hits, cached):
                group_hits.append(block)
        return hits


class SlidingWindowManager(SingleTypeKVCacheManager):
    """A query sees its own token and the sliding_window - 1 before it (vLLM's
    SlidingWindowManager): blocks before the window are freed as the request advances, and a
    hit needs only the window's blocks before the hit point.

    sliding_window_contiguous_blocks = cdiv(sliding_window - 1, block_size): the cached blocks
    right before a hit point that the next token's window reads.
    """

    frees_skipped_blocks = True

    def __init__(self, group_spec: KVCacheGroupSpec, block_pool: BlockPool, block_size: int,
                 kv_cache_group_id: int):
        super().__init__(group_spec, block_pool, block_size, kv_cache_group_id)
        assert group_spec.sliding_window is not None, "a sliding-window group without a window (see KVCacheGroupSpec)"
        self.sliding_window = group_spec.sliding_window
        self.sliding_window_contiguous_blocks = -(-(self.sliding_window - 1) // block_size)

    @classmethod
    def get_max_num_blocks(cls, group_spec: KVCacheGroupSpec, block_size: int, num_tokens: int,
                           max_num_new_tokens: int) -> int:
        # A step from c computed tokens adding n <= C slots holds tokens [max(0, c - W + 1), c + n):
        # at most W - 1 + C of them, which touch at most cdiv(W + C - 2, block_size) + 1 blocks
        # (the span starting at the last token of a block). Never more than full attention holds.
        num_new = min(max_num_new_tokens, num_tokens)
        full = -(-num_tokens // block_size)
        return min(full, -(-(group_spec.sliding_window + num_new - 2) // block_size) + 1)

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        # The next query (token num_computed_tokens) sees tokens [n - W + 1, n]: all before are skipped.
        return max(0, num_computed_tokens - self.sliding_window + 1)

    def find_longest_cache_hit(self, block_hashes: list[bytes], max_num_blocks: int,
                               kv_cache_group_ids: tuple[int, ...]) -> tuple[list[KVCacheBlock], ...]:
        # Right to left: the first run of sliding_window_contiguous_blocks cached blocks (in every
        # group) ends the hit there, nulls before it; with no such run, the cached blocks from
        # block 0 up to the first miss are the hit (a prefix shorter than the window).
        max_num_blocks = min(max_num_blocks, len(block_hashes))
        null_block = self.null_block
        hits = tuple([null_block] * max_num_blocks for _ in kv_cache_group_ids)
        get_cached_blocks = self.block_pool.get_cached_blocks
        num_needed = self.sliding_window_contiguous_blocks
        num_contiguous = 0
        for i in range(max_num_blocks - 1, -1, -1):
            cached = get_cached_blocks(block_hashes[i], kv_cache_group_ids)
            if cached is None:
                num_contiguous = 0
                continue
            for group_hits, block in zip(hits, cached):
                group_hits[i] = block
            num_contiguous += 1
            if num_contiguous >= num_needed:
                for group_hits in hits:
                    del group_hits[i + num_contiguous:]
                return hits
        for group_hits in hits:
            del group_hits[num_contiguous:]
        return hits


# attention type (KVCacheGroupSpec.attention_type) -> the manager of a group of that type
MANAGER_TYPES: dict[str, type[SingleTypeKVCacheManager]] = {
    "full_attention": FullAttentionManager,
    "sliding_window": SlidingWindowManager,
}


def max_blocks_per_request(group_spec: KVCacheGroupSpec, block_size: int, num_tokens: int,
                           max_num_batched_tokens: int) -> int:
    """The most non-null blocks one request holds at once in a group (what pool sizing and
    KVCacheManager.check_request count per group).

    Full attention: cdiv(num_tokens, block_size). A sliding window of W tokens: a step from c
    computed tokens adding n slots frees the blocks before token c - W + 1 first, so it holds
    the window before the step plus the step's tokens: at most cdiv(W + C - 2, block_size) + 1
    blocks for steps of up to C = min(max_num_batched_tokens, num_tokens) slots (decode, C = 1:
    cdiv(W - 1, block_size) + 1), and never more than full attention. An upper bound that
    some step sequence reaches once num_tokens >= W + C + block_size (chunked prefill puts
    chunk boundaries anywhere).

    Args:
      group_spec: the KV-cache group.
      block_size: tokens per block.
      num_tokens: the request's most slots (max_model_len for any request).
      max_num_batched_tokens: the most slots one step adds to one request (the scheduler's
        token budget, plus any lookahead slots); num_tokens when steps are unbounded.
    Returns:
      The block count (>= 1 for num_tokens >= 1).
    """
    if not isinstance(group_spec, KVCacheGroupSpec):
        raise ValueError(f"group_spec={group_spec!r} must be a KVCacheGroupSpec (one of CacheConfig.kv_cache_groups)")
    check_int("block_size", block_size, 1)
    check_int("num_tokens", num_tokens, 0)
    check_int("max_num_batched_tokens", max_num_batched_tokens, 1)
    if num_tokens == 0:
        return 0
    return MANAGER_TYPES[group_spec.attention_type].get_max_num_blocks(group_spec, block_size, num_tokens,
                                                                       max_num_batched_tokens)
