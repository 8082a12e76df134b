"""KVCacheCoordinator: one single-type manager per KV-cache group, over one BlockPool.

vLLM v1's KVCacheCoordinator: every operation of the KVCacheManager goes to each group's
manager (core/single_type_kv_cache_manager.py) and the results travel as one tuple entry per
group, in group order. All groups draw from the same pool, so a request's allocation either
fits in every group or in none. A prefix hit is the longest prefix every group accepts
(vLLM's HybridKVCacheCoordinator): groups of one spec (attention type and window) are looked
up together, a block counting only when every one of them has it cached; full attention is
asked first (its hit bounds the others'), then each other spec with the hit so far, again
until the length is stable. Every group's hit then has the same number of blocks, a sliding
group's starting with null blocks. Imports no jax.
"""

from __future__ import annotations

from paged_jax.core.block_pool import BlockPool
from paged_jax.core.config import CacheConfig
from paged_jax.core.kv_cache_block import KVCacheBlock
from paged_jax.core.single_type_kv_cache_manager import MANAGER_TYPES, FullAttentionManager, SingleTypeKVCacheManager


class KVCacheCoordinator:
    """The single-type managers of config.kv_cache_groups, in group order.

    lookup_groups: (manager, group ids) per distinct group spec, full attention first, then
    in order of first appearance; the manager (that of the first id) looks up all the ids.
    """

    def __init__(self, config: CacheConfig, block_pool: BlockPool):
        self.block_pool = block_pool
        self.managers: tuple[SingleTypeKVCacheManager, ...] = tuple(
            MANAGER_TYPES[group.attention_type](group, block_pool, config.block_size, group_id)
            for group_id, group in enumerate(config.kv_cache_groups))
        self.num_groups = len(self.managers)
        # The managers whose remove_skipped_blocks can free anything (none for full attention,
        # so a decode pays nothing for the call).
        self.skipping_managers = tuple(m for m in self.managers if m.frees_skipped_blocks)
        ids_by_spec: dict[tuple, list[int]] = {}
        for group_id, group in enumerate(config.kv_cache_groups):
            ids_by_spec.setdefault((group.attention_type, group.sliding_window), []).append(group_id)
        self.lookup_groups: tuple[tuple[SingleTypeKVCacheManager, tuple[int, ...]], ...] = tuple(sorted(
            ((self.managers[ids[0]], tuple(ids)) for ids in ids_by_spec.values()),
            key=lambda entry: not isinstance(entry[0], FullAttentionManager)))
        # One full-attention spec and one other: a single round finds the hit (vLLM's simple hybrid).
        self._one_round = (len(self.lookup_groups) == 2 and isinstance(self.lookup_groups[0][0], FullAttentionManager))

    def find_longest_cache_hit(self, block_hashes: list[bytes],
                               max_num_blocks: int) -> tuple[list[KVCacheBlock], ...]:
        """Each group's hit blocks for the longest prefix (at most max_num_blocks blocks) that
        every group accepts, all of one length.

        Each lookup group in turn is asked with the length so far (a full-attention group
        once: its hits are closed under taking a prefix, so later rounds cut its first answer);
        rounds repeat until one leaves the length unchanged.
        """
        if self.num_groups == 1:
            return self.managers[0].find_longest_cache_hit(block_hashes, max_num_blocks, (0,))
        hits_by_group: list[list[KVCacheBlock] | None] = [None] * self.num_groups
        num_blocks = max_num_blocks
        while True:
            curr_num_blocks = num_blocks
            for manager, group_ids in self.lookup_groups:
                if isinstance(manager, FullAttentionManager) and hits_by_group[group_ids[0]] is not None:
                    continue  # cut to the final length below
                hits = manager.find_longest_cache_hit(block_hashes, curr_num_blocks, group_ids)
                curr_num_blocks = len(hits[0])
                for group_id, group_hits in zip(group_ids, hits):
                    hits_by_group[group_id] = group_hits
            if curr_num_blocks >= num_blocks:
                break
            num_blocks = curr_num_blocks
            if self._one_round:
                break
        for group_hits in hits_by_group:
            del group_hits[num_blocks:]
        return tuple(hits_by_group)

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: tuple[list[KVCacheBlock], ...],
                                   num_computed_tokens: int = 0) -> int:
        """Free blocks all groups together need (see SingleTypeKVCacheManager's)."""
        return sum(m.get_num_blocks_to_allocate(request_id, num_tokens, hit, num_computed_tokens)
                   for m, hit in zip(self.managers, new_computed_blocks))

    def save_new_computed_blocks(self, request_id: str, new_computed_blocks: tuple[list[KVCacheBlock], ...],
                                 num_computed_tokens: int = 0) -> None:
        """Every group's hits are touched here, before any group takes a new block."""
        for m, hit in zip(self.managers, new_computed_blocks):
            m.save_new_computed_blocks(request_id, hit, num_computed_tokens)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> tuple[list[KVCacheBlock], ...]:
        return tuple(m.allocate_new_blocks(request_id, num_tokens) for m in self.managers)

    def cache_blocks(self, request, num_tokens: int) -> None:
        for m in self.managers:
            m.cache_blocks(request, num_tokens)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        for m in self.skipping_managers:
            m.remove_skipped_blocks(request_id, num_computed_tokens)

    def free(self, request_id: str) -> None:
        """Each group in order frees its table, tail first."""
        for m in self.managers:
            m.free(request_id)

    def get_blocks(self, request_id: str) -> tuple[list[KVCacheBlock], ...]:
        return tuple(m.req_to_blocks.get(request_id, []) for m in self.managers)
