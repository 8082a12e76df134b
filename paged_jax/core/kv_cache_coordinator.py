"""KVCacheCoordinator: one single-type manager per KV-cache group, over one BlockPool.

vLLM v1's KVCacheCoordinator: every operation of the KVCacheManager goes to each group's
manager (core/single_type_kv_cache_manager.py) and the results travel as one tuple entry per
group, in group order. All groups draw from the same pool, so a request's allocation either
fits in every group or in none. A prefix hit is the longest prefix every group accepts.
Imports no jax.
"""

from __future__ import annotations

from paged_jax.core.block_pool import BlockPool
from paged_jax.core.config import CacheConfig
from paged_jax.core.kv_cache_block import KVCacheBlock
from paged_jax.core.single_type_kv_cache_manager import MANAGER_TYPES, SingleTypeKVCacheManager


class KVCacheCoordinator:
    """The single-type managers of config.kv_cache_groups, in group order."""

    def __init__(self, config: CacheConfig, block_pool: BlockPool):
        self.block_pool = block_pool
        self.managers: tuple[SingleTypeKVCacheManager, ...] = tuple(
            MANAGER_TYPES[group.attention_type](block_pool, config.block_size, group_id)
            for group_id, group in enumerate(config.kv_cache_groups))
        self.num_groups = len(self.managers)
        # The managers whose remove_skipped_blocks can free anything (none for full attention,
        # so a decode pays nothing for the call).
        self.skipping_managers = tuple(m for m in self.managers if m.frees_skipped_blocks)

    def find_longest_cache_hit(self, block_hashes: list[bytes],
                               max_num_blocks: int) -> tuple[list[KVCacheBlock], ...]:
        """Each group's hit blocks for the longest prefix (at most max_num_blocks blocks) that
        every group accepts: asked again with the shortest answer until all agree (at once for
        full attention, whose hits are closed under taking a prefix)."""
        managers = self.managers
        if self.num_groups == 1:
            return (managers[0].find_longest_cache_hit(block_hashes, max_num_blocks),)
        while True:
            hits = tuple(m.find_longest_cache_hit(block_hashes, max_num_blocks) for m in managers)
            num_blocks = min(len(h) for h in hits)
            if all(len(h) == num_blocks for h in hits):
                return hits
            max_num_blocks = num_blocks

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: tuple[list[KVCacheBlock], ...]) -> int:
        return sum(m.get_num_blocks_to_allocate(request_id, num_tokens, hit)
                   for m, hit in zip(self.managers, new_computed_blocks))

    def save_new_computed_blocks(self, request_id: str, new_computed_blocks: tuple[list[KVCacheBlock], ...]) -> None:
        for m, hit in zip(self.managers, new_computed_blocks):
            m.save_new_computed_blocks(request_id, hit)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> tuple[list[KVCacheBlock], ...]:
        return tuple(m.allocate_new_blocks(request_id, num_tokens) for m in self.managers)

    def cache_blocks(self, request, num_tokens: int) -> None:
        for m in self.managers:
            m.cache_blocks(request, num_tokens)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        for m in self.skipping_managers:
            m.remove_skipped_blocks(request_id, num_computed_tokens)

    def free(self, request_id: str) -> None:
        for m in self.managers:
            m.free(request_id)

    def get_blocks(self, request_id: str) -> tuple[list[KVCacheBlock], ...]:
        return tuple(m.req_to_blocks.get(request_id, []) for m in self.managers)
