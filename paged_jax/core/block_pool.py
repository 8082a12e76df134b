"""BlockPool: every block, the free queue and the prefix cache's hash -> block map.

Invariants (check_invariants asserts each one):
- free_block_queue holds exactly the non-null blocks with ref_cnt == 0, in eviction order:
  the head is taken first. There is no separate set of cached blocks: a freed block keeps
  its hash in the queue and stays hit-able until it is popped for reuse, which is when it
  loses the hash (eviction is a side effect of allocation, LRU by construction).
- A block has a hash iff cached_block_hash_to_block maps that hash to it. The key is the
  chain hash tagged with the block's KV-cache group (hash_with_group_id): each group's
  layers hold their own pages of a prefix, so each group caches its own blocks of it.
- The null block (block 0) is taken at start and never freed, cached, touched or queued.
  Block tables may hold it (a sliding-window group's blocks that slid out of the window):
  free_blocks, touch and cache_full_blocks pass over it.

Listeners (optional, for the offload tiers and KV events): on_cached(pairs) hears of hashes
newly on the device, on_evicted(pairs) of hashes that left it (no device block holds them
any more); pairs are (block_hash, block_id), one call per cache_full_blocks / get_new_blocks.
Imports no jax.
"""

from __future__ import annotations

from collections.abc import Iterable

from paged_jax.core.kv_cache_block import FreeKVCacheBlockQueue, KVCacheBlock


def hash_with_group_id(block_hash: bytes, kv_cache_group_id: int) -> bytes:
    """The prefix-cache key of a block of group kv_cache_group_id (vLLM's BlockHashWithGroupId).

    Group 0's key is the chain hash itself, so a one-group model (every model before groups)
    keys, evicts and reports exactly the hashes it always did (the offload tiers, KV events and
    the data-parallel router read them); group g > 0 appends g as 4 big-endian bytes.
    """
    return block_hash if kv_cache_group_id == 0 else block_hash + kv_cache_group_id.to_bytes(4, "big")


def split_group_id(key: bytes, hash_nbytes: int) -> tuple[bytes, int]:
    """(chain hash, KV-cache group id) of a key made by hash_with_group_id, whose chain hashes
    are hash_nbytes long."""
    if len(key) == hash_nbytes:
        return key, 0
    assert len(key) == hash_nbytes + 4, f"a key of {len(key)} bytes is no {hash_nbytes}-byte hash with a group tag"
    return key[:hash_nbytes], int.from_bytes(key[hash_nbytes:], "big")


class BlockHashToBlockMap:
    """hash -> the block(s) cached under it.

    Identical full blocks of different requests are not de-duplicated (a block table never
    changes a block it already handed out), so one hash may map to several blocks. The
    usual single block is stored bare and a dict {block_id: block} only when there are
    more; dicts keep insertion order, so a lookup returns the earliest-inserted block still
    cached. len() counts hashes, as vLLM's does.
    """

    __slots__ = ("_cache",)

    def __init__(self):
        self._cache: dict[bytes, KVCacheBlock | dict[int, KVCacheBlock]] = {}

    def get_one_block(self, block_hash: bytes) -> KVCacheBlock | None:
        blocks = self._cache.get(block_hash)
        if blocks is None or type(blocks) is KVCacheBlock:
            return blocks
        return next(iter(blocks.values()))

    def get_prefix_blocks(self, block_hashes: list[bytes], max_num_blocks: int) -> list[KVCacheBlock]:
        """Cached blocks for block_hashes[0], [1], ... up to the first miss or max_num_blocks."""
        cache = self._cache
        hits = []
        for i in range(min(max_num_blocks, len(block_hashes))):
            blocks = cache.get(block_hashes[i])
            if blocks is None:
                break
            hits.append(blocks if type(blocks) is KVCacheBlock else next(iter(blocks.values())))
        return hits

    def insert(self, block_hash: bytes, block: KVCacheBlock) -> None:
        blocks = self._cache.get(block_hash)
        if blocks is None:
            self._cache[block_hash] = block
        elif type(blocks) is KVCacheBlock:
            self._cache[block_hash] = {blocks.block_id: blocks, block.block_id: block}
        else:
            blocks[block.block_id] = block

    def pop(self, block_hash: bytes, block_id: int) -> KVCacheBlock | None:
        """Remove block block_id from under block_hash; None if it was not cached there."""
        blocks = self._cache.get(block_hash)
        if blocks is None:
            return None
        if type(blocks) is KVCacheBlock:
            if blocks.block_id != block_id:
                return None
            del self._cache[block_hash]
            return blocks
        block = blocks.pop(block_id, None)
        if not blocks:
            del self._cache[block_hash]
        return block

    def items(self):
        """(hash, block) for every cached block."""
        for block_hash, blocks in self._cache.items():
            if type(blocks) is KVCacheBlock:
                yield block_hash, blocks
            else:
                for block in blocks.values():
                    yield block_hash, block

    def num_blocks(self) -> int:
        return sum(1 for _ in self.items())

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._cache

    def __len__(self) -> int:
        return len(self._cache)


class BlockPool:
    """All blocks of the KV cache, their free queue and the prefix cache.

    Args:
      num_blocks: blocks in the cache, the null block 0 included (num_blocks - 1 usable).
      enable_caching: keep full blocks' hashes for prefix-cache hits.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True):
        # CacheConfig validates the user's value; here a wrong one is a caller's bug.
        assert num_blocks >= 2, f"{num_blocks=}: the pool needs the null block plus one (see CacheConfig)"
        self.num_gpu_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks: list[KVCacheBlock] = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        # Padding target of every block table; its ref_cnt is not maintained.
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        self.on_cached = None  # callable(list[(block_hash, block_id)]) or None
        self.on_evicted = None

    @property
    def num_blocks(self) -> int:
        return self.num_gpu_blocks

    def get_cached_block(self, block_hash: bytes, kv_cache_group_id: int = 0) -> KVCacheBlock | None:
        """The earliest-inserted block of the group still cached under block_hash, or None."""
        return self.cached_block_hash_to_block.get_one_block(hash_with_group_id(block_hash, kv_cache_group_id))

    def get_cached_blocks(self, block_hash: bytes, kv_cache_group_ids: tuple[int, ...]) -> list[KVCacheBlock] | None:
        """One cached block under block_hash per group of kv_cache_group_ids (in their order),
        or None unless every one of them has one (vLLM's get_cached_block over group ids:
        groups of one spec are looked up together)."""
        get_one_block = self.cached_block_hash_to_block.get_one_block
        blocks = []
        for group_id in kv_cache_group_ids:
            block = get_one_block(hash_with_group_id(block_hash, group_id))
            if block is None:
                return None
            blocks.append(block)
        return blocks

    def cache_full_blocks(self, request, blocks: list[KVCacheBlock], num_cached_blocks: int,
                          num_full_blocks: int, block_size: int, kv_cache_group_id: int = 0) -> None:
        """Register blocks[num_cached_blocks:num_full_blocks] under request.block_hashes.

        Args:
          request: supplies block_hashes (at least num_full_blocks of them).
          blocks: the request's block table in this group.
          num_cached_blocks: leading blocks already cached (prefix hits or earlier steps).
          num_full_blocks: leading blocks that are full after this step.
          block_size: tokens per block (the hashes must be for this size).
          kv_cache_group_id: the group the blocks belong to (their keys are tagged with it).
        """
        if num_cached_blocks >= num_full_blocks:
            return
        block_hashes = request.block_hashes
        assert len(block_hashes) >= num_full_blocks, (
            f"request {request.request_id!r} has {len(block_hashes)} block hashes but {num_full_blocks} full "
            f"blocks of size {block_size}: its hasher fell behind its tokens"
        )
        insert = self.cached_block_hash_to_block.insert
        on_cached = self.on_cached
        new = [] if on_cached is not None else None
        for i in range(num_cached_blocks, min(num_full_blocks, len(blocks))):
            block = blocks[i]
            if block.is_null:
                continue
            assert block.block_hash is None, f"caching block {block.block_id} twice: it already has a hash"
            block_hash = hash_with_group_id(block_hashes[i], kv_cache_group_id)
            block.block_hash = block_hash
            if new is not None and block_hash not in self.cached_block_hash_to_block:
                new.append((block_hash, block.block_id))
            insert(block_hash, block)
        if new:
            on_cached(new)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop num_blocks from the head of the free queue with ref_cnt 1; evicts their hashes.

        Raises ValueError if fewer are free (callers check first: running out is not an
        error for them, it is a None from allocate_slots).
        """
        if num_blocks > self.free_block_queue.num_free_blocks:
            raise ValueError(
                f"cannot get {num_blocks} blocks: only {self.free_block_queue.num_free_blocks} are free"
            )
        ret = self.free_block_queue.popleft_n(num_blocks)
        on_evicted = self.on_evicted
        evicted = [] if on_evicted is not None else None
        for block in ret:
            if block.block_hash is not None:
                block_hash = block.block_hash
                self._maybe_evict_cached_block(block)
                if evicted is not None and block_hash not in self.cached_block_hash_to_block:
                    evicted.append((block_hash, block.block_id))
            assert block.ref_cnt == 0, f"block {block.block_id} was in the free queue with ref_cnt {block.ref_cnt}"
            block.ref_cnt = 1
        if evicted:
            on_evicted(evicted)
        return ret

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> bool:
        """Drop block's hash from the cache (it is about to hold other tokens)."""
        block_hash = block.block_hash
        if block_hash is None:
            return False
        popped = self.cached_block_hash_to_block.pop(block_hash, block.block_id)
        assert popped is block, f"block {block.block_id} carries a hash the cache does not map to it"
        block.block_hash = None
        return True

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take hit blocks for one more request: ref_cnt + 1, out of the free queue if free."""
        remove = self.free_block_queue.remove
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; the given order is the eviction order.

        Blocks reaching ref_cnt 0 keep the given order: hashed ones go to the tail (kept as
        long as possible for prefix hits), unhashed ones to the head (nothing to keep).
        """
        to_head = []
        to_tail = []
        for block in ordered_blocks:
            if block.is_null:
                continue
            ref_cnt = block.ref_cnt - 1
            assert ref_cnt >= 0, f"block {block.block_id} freed more often than it was taken"
            block.ref_cnt = ref_cnt
            if ref_cnt == 0:
                (to_head if block.block_hash is None else to_tail).append(block)
        if to_head:
            self.free_block_queue.prepend_n(to_head)
        if to_tail:
            self.free_block_queue.append_n(to_tail)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; False (and nothing changes) while any block is in use.

        The free queue keeps its order. Used after a weight update, or between benchmark runs.
        """
        if self.num_gpu_blocks - self.free_block_queue.num_free_blocks != 1:  # the null block
            return False
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        for block in self.blocks:
            block.block_hash = None
        return True

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of usable blocks (all but the null block) held by requests."""
        return 1.0 - self.free_block_queue.num_free_blocks / (self.num_gpu_blocks - 1)

    def check_invariants(self, holders: dict[int, int] | None = None) -> None:
        """Assert every invariant of the pool; each message names the bug it would mean.

        Args:
          holders: block_id -> number of live requests holding it, when the caller knows;
            every non-null block's ref_cnt must equal it (absent means 0).
        """
        blocks = self.blocks
        null = self.null_block
        assert null is blocks[0] and null.is_null, "block 0 is not the null block"
        assert not any(b.is_null for b in blocks[1:]), "a block other than 0 is marked null"
        assert null.block_hash is None, "the null block was cached"
        assert null.prev_free_block is None and null.next_free_block is None, "the null block is in the free queue"
        # Walk the queue, bounded so a cycle fails instead of hanging.
        queue = self.free_block_queue
        head, tail = queue.fake_free_list_head, queue.fake_free_list_tail
        assert head.prev_free_block is None and tail.next_free_block is None, "sentinels linked outside the queue"
        seen = []
        prev, block = head, head.next_free_block
        while block is not tail:
            assert block is not None, "free queue broken: a link is None before the tail"
            assert len(seen) < len(blocks), "free queue has a cycle or holds foreign blocks"
            assert block.prev_free_block is prev, f"block {block.block_id}: prev link does not match the walk"
            seen.append(block)
            prev, block = block, block.next_free_block
        assert tail.prev_free_block is prev, "tail sentinel's prev link is stale"
        assert len(seen) == queue.num_free_blocks, (
            f"num_free_blocks={queue.num_free_blocks} but the queue holds {len(seen)} blocks"
        )
        seen_ids = {b.block_id for b in seen}
        assert len(seen_ids) == len(seen), "a block is in the free queue twice"
        for b in seen:
            assert blocks[b.block_id] is b, f"block {b.block_id} in the queue is not the pool's block"
        for b in blocks[1:]:
            in_queue = b.block_id in seen_ids
            assert (b.ref_cnt == 0) == in_queue, (
                f"block {b.block_id} ref_cnt={b.ref_cnt} but {'in' if in_queue else 'not in'} the free queue"
            )
            if not in_queue:
                assert b.prev_free_block is None and b.next_free_block is None, (
                    f"block {b.block_id} is out of the queue but keeps stale links"
                )
            if holders is not None:
                assert b.ref_cnt == holders.get(b.block_id, 0), (
                    f"block {b.block_id} ref_cnt={b.ref_cnt} but {holders.get(b.block_id, 0)} live requests hold it"
                )
        # Hash map <-> block hashes, both directions.
        cached = list(self.cached_block_hash_to_block.items())
        for block_hash, b in cached:
            assert b.block_hash == block_hash, f"cache maps a hash to block {b.block_id}, which carries another"
            assert not b.is_null, "the null block is in the prefix cache"
        cached_ids = [b.block_id for _, b in cached]
        assert len(set(cached_ids)) == len(cached_ids), "a block is cached under two hashes"
        hashed_ids = {b.block_id for b in blocks if b.block_hash is not None}
        assert hashed_ids == set(cached_ids), (
            f"blocks {sorted(hashed_ids ^ set(cached_ids))} carry a hash the cache lacks, or the reverse"
        )
        if not self.enable_caching:
            assert not hashed_ids, "prefix caching is off but blocks were cached"
