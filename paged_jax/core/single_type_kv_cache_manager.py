"""One KV-cache group's block tables over the shared BlockPool (vLLM v1's SingleTypeKVCacheManager).

A model's layers fall into KV-cache groups (core/config.py KVCacheGroupSpec: layers with one
cache spec share a block table); the KVCacheCoordinator keeps one manager per group, each of
the class its attention type names in MANAGER_TYPES. A manager knows how its type keeps
blocks: a full-attention group keeps every block of a request and accepts any cached prefix.
A new attention type (a sliding window that frees the blocks that slid out of it) adds a
subclass and a row. Imports no jax.
"""

from __future__ import annotations

from paged_jax.core.block_pool import BlockPool, hash_with_group_id
from paged_jax.core.kv_cache_block import KVCacheBlock


class SingleTypeKVCacheManager:
    """The block tables of one KV-cache group.

    Args:
      block_pool: the pool every group draws from.
      block_size: tokens per block.
      kv_cache_group_id: this group's index (its cached blocks' keys carry it).

    State: req_to_blocks[request_id] is the request's block table in this group (append-only
    while it lives); num_cached_block[request_id] counts its leading blocks already cached.
    """

    # Whether remove_skipped_blocks can free anything (the coordinator calls only those that can).
    frees_skipped_blocks = False

    def __init__(self, block_pool: BlockPool, block_size: int, kv_cache_group_id: int):
        self.block_pool = block_pool
        self.block_size = block_size
        self.kv_cache_group_id = kv_cache_group_id
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_block: dict[str, int] = {}

    def find_longest_cache_hit(self, block_hashes: list[bytes], max_num_blocks: int) -> list[KVCacheBlock]:
        """This group's cached blocks for the longest prefix of block_hashes it accepts (at
        most max_num_blocks); changes nothing."""
        raise NotImplementedError

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: list[KVCacheBlock]) -> int:
        """Free blocks this group needs to hold num_tokens tokens of the request.

        Hit blocks with ref_cnt 0 count as needed: touching them takes them out of the free
        queue just like an allocation does.
        """
        num_required_blocks = -(-num_tokens // self.block_size)
        num_new_blocks = num_required_blocks - len(new_computed_blocks) - len(self.req_to_blocks.get(request_id, ()))
        return num_new_blocks + sum(1 for b in new_computed_blocks if b.ref_cnt == 0 and not b.is_null)

    def save_new_computed_blocks(self, request_id: str, new_computed_blocks: list[KVCacheBlock]) -> None:
        """Start the request's table with its (already touched) prefix hits."""
        assert request_id not in self.req_to_blocks, f"request {request_id!r} already has a table in this group"
        self.req_to_blocks[request_id] = list(new_computed_blocks)
        if new_computed_blocks:
            self.num_cached_block[request_id] = len(new_computed_blocks)

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
        """Return the request's blocks, tail first (its last blocks are evicted first)."""
        req_blocks = self.req_to_blocks.pop(request_id, None)
        self.num_cached_block.pop(request_id, None)
        if req_blocks:
            self.block_pool.free_blocks(req_blocks[::-1])

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Free the blocks no later token will attend to (none for full attention)."""


class FullAttentionManager(SingleTypeKVCacheManager):
    """Every token attends to every earlier one: a request keeps all its blocks, and any
    cached prefix is a hit (walk from block 0, stop at the first miss)."""

    def find_longest_cache_hit(self, block_hashes: list[bytes], max_num_blocks: int) -> list[KVCacheBlock]:
        group_id = self.kv_cache_group_id
        if group_id:
            block_hashes = [hash_with_group_id(h, group_id) for h in block_hashes[:max_num_blocks]]
        return self.block_pool.cached_block_hash_to_block.get_prefix_blocks(block_hashes, max_num_blocks)


# attention type (KVCacheGroupSpec.attention_type) -> the manager of a group of that type
MANAGER_TYPES: dict[str, type[SingleTypeKVCacheManager]] = {
    "full_attention": FullAttentionManager,
}
