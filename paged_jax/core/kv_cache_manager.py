"""KVCacheManager: which blocks hold each request's tokens; prefix-cache lookups and stats.

The scheduler's view of the KV cache (vLLM v1 names and semantics). Per step a waiting
request goes get_computed_blocks -> allocate_slots(hits) and a running one
allocate_slots(num_new_tokens); a finished or preempted one goes to free(). Running out of
blocks is not an error: allocate_slots returns None and allocates nothing, and the scheduler
decides (wait, or preempt someone). Block tables are per KV-cache group (KVCacheBlocks holds
one list per group): a KVCacheCoordinator keeps one single-type manager per group over the
one BlockPool.

A sliding-window group's table starts with null blocks (block id 0) where the window has
moved on: allocate_slots first frees the blocks before the window of the request's computed
tokens, then allocates, so the freed ones serve this very step. A hit is the longest prefix
every group accepts; its skipped blocks are null in the new table, never touched and never
counted as needed. Imports no jax.
"""

from __future__ import annotations

from typing import NamedTuple

from paged_jax.core.block_pool import BlockPool, hash_with_group_id
from paged_jax.core.config import CacheConfig
from paged_jax.core.hashing import BlockHasher, get_hash_fn_by_name, make_none_hash
from paged_jax.core.kv_cache_block import KVCacheBlock
from paged_jax.core.kv_cache_coordinator import KVCacheCoordinator
from paged_jax.core.prefix_cache_stats import PrefixCacheStats
from paged_jax.core.request import Request
from paged_jax.core.single_type_kv_cache_manager import max_blocks_per_request


class KVCacheBlocks(NamedTuple):
    """Blocks of one request, one list per KV-cache group in group order (vLLM's KVCacheBlocks):
    what get_computed_blocks finds and allocate_slots hands out. A NamedTuple: one is made
    per running request per step, and a tuple is the cheapest record to make."""

    blocks: tuple[list[KVCacheBlock], ...]

    def get_block_ids(self) -> tuple[list[int], ...]:
        return tuple([b.block_id for b in group] for group in self.blocks)

    def __bool__(self) -> bool:
        return any(self.blocks)


class KVCacheManager:
    """Block tables of all live requests over one BlockPool, per KV-cache group.

    Args:
      config: the resolved CacheConfig (block_size, num_blocks incl. the null block 0,
        max_model_len, enable_prefix_caching, hash_algo, hash_seed, kv_cache_groups).
      offload: optional OffloadManager (core/offload.py): evicted blocks go down to its
        tiers, lookups continue in them, swap_out() preempts into them (every group).
      kv_events: optional KVEventLog: device-tier BlockStored / BlockRemoved.

    State: coordinator.managers[g].req_to_blocks[request_id] is the request's block table in
    group g (append-only while it lives, except that a sliding-window group replaces the
    blocks before its window by the null block: its nulls are always a prefix of it);
    num_cached_block beside it counts its leading blocks already in the cache. The root of
    this manager's hash chains is its own (block_hasher.none_hash, from config.hash_seed):
    two managers share prefixes only when they share the seed.
    """

    def __init__(self, config: CacheConfig, offload=None, kv_events=None):
        self.config = config
        self.block_size = config.block_size
        self.max_model_len = config.max_model_len
        self.enable_caching = config.enable_prefix_caching
        self.block_pool = BlockPool(config.num_blocks, self.enable_caching)
        self.coordinator = KVCacheCoordinator(config, self.block_pool)
        self.num_kv_cache_groups = self.coordinator.num_groups
        # No blocks in any group: what a lookup that found nothing and most decodes return
        # (immutable, so one value serves every call).
        self._no_blocks = KVCacheBlocks(((),) * self.num_kv_cache_groups)
        # For allocate_slots' fast path, looked up once: every group's manager, those that can
        # free skipped blocks (none for full attention: the loop costs nothing), and group 0's
        # tables (every group holds a table for the same requests: whether a request holds one
        # is a lookup there).
        self._managers = self.coordinator.managers
        self._skipping_managers = self.coordinator.skipping_managers
        self._tables_of_group0 = self._managers[0].req_to_blocks
        if offload is not None:
            windows = tuple(g.sliding_window for g in config.kv_cache_groups)
            assert offload.sliding_windows == windows, (
                f"the offload manager was built for groups of windows {offload.sliding_windows}, this cache has {windows}")
        hash_fn = get_hash_fn_by_name(config.hash_algo)
        # Attached to every request this manager sees; with caching off it hashes nothing.
        self.block_hasher = BlockHasher(self.block_size, hash_fn, make_none_hash(hash_fn, config.hash_seed),
                                        enabled=self.enable_caching)
        self.prefix_cache_stats = PrefixCacheStats()
        # request_id -> (tokens looked up, device hit tokens, preempted) of its latest lookup,
        # recorded when it is admitted (a request waiting at the head of the queue is looked
        # up again every step, but counted once, as vLLM counts)
        self._lookups: dict[str, tuple[int, int, bool]] = {}
        self.offload = offload
        self.kv_events = kv_events
        if offload is not None or kv_events is not None:
            self.block_pool.on_cached = self._on_blocks_cached
            self.block_pool.on_evicted = self._on_blocks_evicted

    def _on_blocks_cached(self, pairs) -> None:
        if self.kv_events is not None:
            self.kv_events.stored([h for h, _ in pairs], "device")
        if self.offload is not None:
            self.offload.on_blocks_cached(pairs)

    def _on_blocks_evicted(self, pairs) -> None:
        if self.kv_events is not None:
            self.kv_events.removed([h for h, _ in pairs], "device")
        if self.offload is not None:
            self.offload.on_blocks_evicted(pairs)

    # ------------------------------------------------------------------ admission
    def _check_prompt_len(self, request: Request) -> None:
        if request.num_prompt_tokens > self.max_model_len:
            raise ValueError(
                f"request {request.request_id!r}: prompt has {request.num_prompt_tokens} tokens, more than "
                f"max_model_len={self.max_model_len}; shorten the prompt or raise max_model_len"
            )

    def check_request(self, request: Request, max_num_batched_tokens: int | None = None) -> None:
        """Raises ValueError for a request that could never run, even alone in the pool: a
        prompt past max_model_len, or more blocks than the whole pool has (the scheduler
        asks before queueing it).

        Each group counts its own most blocks (max_blocks_per_request): every block of the
        request for full attention, the window plus one step's tokens for a sliding window.

        Args:
          request: the request.
          max_num_batched_tokens: the most tokens a step computes for one request (the
            scheduler's budget); None: the whole request in one step.
        """
        self._check_prompt_len(request)
        # The last sampled token is never computed, so its slot is never needed.
        max_slots = min(request.num_prompt_tokens + request.max_tokens - 1, self.max_model_len)
        max_step = max(1, max_slots) if max_num_batched_tokens is None else max_num_batched_tokens
        needs = [max_blocks_per_request(group, self.block_size, max_slots, max_step)
                 for group in self.config.kv_cache_groups]
        need = sum(needs)
        usable = self.config.num_usable_blocks
        if need > usable:
            if len(needs) == 1:
                where = ""
            elif len(set(needs)) == 1:
                where = f" in each of {len(needs)} KV-cache groups"
            else:
                where = f"; per KV-cache group {needs}"
            raise ValueError(
                f"request {request.request_id!r} may need {need} KV blocks ({max_slots} tokens at block_size="
                f"{self.block_size}{where}) but the whole pool has {usable}; lower max_tokens, shorten the prompt "
                f"or give the cache more blocks"
            )

    def _admit(self, request: Request) -> None:
        """Checks and hasher set-up for a request reaching the manager (cheap to repeat)."""
        self._check_prompt_len(request)
        hasher = request.block_hasher
        if hasher is self.block_hasher:
            return
        if self.block_hasher.is_compatible(hasher):
            request.block_hasher = self.block_hasher  # same hashes; swap so the `is` check passes
            return
        if hasher is None or not request.block_hashes:
            request.block_hashes.clear()
            request.set_block_hasher(self.block_hasher)
            return
        raise ValueError(
            f"request {request.request_id!r} was hashed with block_size={hasher.block_size} by another hasher; "
            f"create it with block_hasher=None or with this manager's block_hasher"
        )

    # ------------------------------------------------------------------ lookup
    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """Longest cached prefix of request's full blocks that every group accepts; changes
        nothing (the prefix-cache stats count the lookup once the request is admitted:
        allocate_slots). Every group's hit has the same length; a sliding-window group's
        starts with null blocks where the window of the hit tokens does not reach.

        Uses at most (num_tokens - 1) // block_size blocks: the last token must be computed
        to produce logits, so a fully cached prompt still recomputes its last block.

        With an offload manager the lookup continues past the last device hit in the host
        and disk tiers (and through a swapped-out request's own pages); those hits get new
        blocks in allocate_slots and their pages are copied up before the step.

        Returns:
          (device hit blocks per group, number of hit tokens: blocks per group * block_size,
          plus the tokens found in the offload tiers).
        """
        self._admit(request)
        num_tokens = request.num_tokens
        max_num_blocks = (num_tokens - 1) // self.block_size
        if not self.enable_caching:
            blocks = self._no_blocks
        else:
            blocks = KVCacheBlocks(self.coordinator.find_longest_cache_hit(request.block_hashes, max_num_blocks))
            self._lookups[request.request_id] = (num_tokens, len(blocks.blocks[0]) * self.block_size,
                                                 request.num_preemptions > 0)
        num_hit_blocks = len(blocks.blocks[0])
        if self.offload is not None:
            return blocks, self.offload.find(request, num_hit_blocks, max_num_blocks if self.enable_caching else 0)
        return blocks, num_hit_blocks * self.block_size

    # ------------------------------------------------------------------ allocation
    def allocate_slots(self, request: Request, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: KVCacheBlocks | None = None,
                       num_lookahead_tokens: int = 0, delay_cache_blocks: bool = False) -> KVCacheBlocks | None:
        """Make room for num_new_tokens more tokens of request in every group; all or nothing.

        Token layout of the request after this call:

          | computed | new_computed | new | lookahead |
          computed      request.num_computed_tokens, already in its blocks
          new_computed  prefix-cache hits (new_computed_blocks), for a request holding none
          new           tokens to compute this step
          lookahead     slots reserved for speculative tokens (allocated, never cached)

        Slots are capped at max_model_len. A sliding-window group first frees the blocks
        before the window of the computed tokens (they become null; this happens even when
        the allocation then does not fit, as in vLLM). Hit blocks are touched before new
        blocks are taken, so the allocation never evicts the request's own hits; hits before
        the window are skipped (null, not touched). Full blocks among computed + new_computed
        + new are cached.

        Args:
          request: the request (its hasher is attached on first sight).
          num_new_tokens: tokens to compute this step (>= 0).
          num_new_computed_tokens: tokens covered by new_computed_blocks (>= 0).
          new_computed_blocks: blocks from get_computed_blocks, or None.
          num_lookahead_tokens: extra slots for speculative decoding (>= 0).
          delay_cache_blocks: cache none of the new blocks now (the external zone of a
            remote prefill: its pages are not in yet; cache_blocks once they are).
        Returns:
          The newly allocated blocks per group (possibly all empty), or None when they do
          not fit, in which case nothing changed but the freeing of blocks before a window.
        """
        if request.block_hasher is not self.block_hasher:
            self._admit(request)
        if (num_new_tokens | num_new_computed_tokens | num_lookahead_tokens) < 0:
            raise ValueError(
                f"token counts must be >= 0, got num_new_tokens={num_new_tokens}, "
                f"num_new_computed_tokens={num_new_computed_tokens}, num_lookahead_tokens={num_lookahead_tokens}"
            )
        request_id = request.request_id
        num_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        num_tokens_need_slot = num_computed_tokens + num_new_tokens + num_lookahead_tokens
        if num_tokens_need_slot > self.max_model_len:
            num_tokens_need_slot = self.max_model_len
        holds_tables = request_id in self._tables_of_group0
        if holds_tables and not new_computed_blocks:
            # The fast path: a request that holds its tables and brings no hits (every decode
            # and later prefill chunk, once per running request per step). The general path's
            # steps for each group, inlined, without its first-allocation work.
            managers = self._managers
            for m in self._skipping_managers:
                m.remove_skipped_blocks(request_id, request.num_computed_tokens)
            num_required = -(-num_tokens_need_slot // self.block_size)
            num_new = 0
            for m in managers:
                need = num_required - len(m.req_to_blocks[request_id])
                if need > 0:
                    num_new += need
            if num_new > self.block_pool.free_block_queue.num_free_blocks:
                return None
            new_blocks = self._no_blocks if num_new == 0 else KVCacheBlocks(
                tuple(m.allocate_new_blocks(request_id, num_tokens_need_slot) for m in managers))
            if self.enable_caching:
                # Lookahead slots hold unverified tokens: never cache them.
                num_tokens_to_cache = num_computed_tokens + num_new_tokens
                num_tokens = len(request.all_token_ids)
                if num_tokens_to_cache > num_tokens:
                    num_tokens_to_cache = num_tokens
                num_full_blocks = num_tokens_to_cache // self.block_size
                for m in managers:
                    if num_full_blocks > m.num_cached_block.get(request_id, 0):
                        m.cache_blocks(request, num_tokens_to_cache)
            return new_blocks
        coordinator = self.coordinator
        pool = self.block_pool
        first_allocation = not holds_tables
        if first_allocation:  # of this request, or of its resumption after preemption
            self._admit(request)
        hits = self._check_computed_blocks(request, first_allocation, new_computed_blocks)
        coordinator.remove_skipped_blocks(request_id, num_computed_tokens)
        if coordinator.get_num_blocks_to_allocate(request_id, num_tokens_need_slot, hits,
                                                  num_computed_tokens) > pool.free_block_queue.num_free_blocks:
            if first_allocation and self.offload is not None:
                self.offload.on_allocation_failed(request_id)
            return None
        if first_allocation:
            coordinator.save_new_computed_blocks(request_id, hits, num_computed_tokens)
            lookup = self._lookups.pop(request_id, None)
            if lookup is not None:
                self.prefix_cache_stats.record(*lookup)
        new_blocks = coordinator.allocate_new_blocks(request_id, num_tokens_need_slot)

        if self.enable_caching and not delay_cache_blocks:
            # Lookahead slots hold unverified tokens: never cache them.
            num_tokens_to_cache = num_computed_tokens + num_new_tokens
            num_tokens = len(request.all_token_ids)
            coordinator.cache_blocks(request, num_tokens_to_cache if num_tokens_to_cache < num_tokens else num_tokens)
        if first_allocation and self.offload is not None:
            self.offload.on_allocated(request, coordinator.get_blocks(request_id), len(hits[0]))
        return KVCacheBlocks(new_blocks)

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Caches the request's full blocks among its first num_tokens tokens (a remote
        prefill's, once its pages are in), after a sliding-window group freed the blocks
        the window of token num_tokens no longer sees (never filled: nothing to keep)."""
        self.coordinator.remove_skipped_blocks(request.request_id, num_tokens)
        if self.enable_caching:
            self.coordinator.cache_blocks(request, min(num_tokens, len(request.all_token_ids)))

    def _check_computed_blocks(self, request: Request, first_allocation: bool,
                               new_computed_blocks: KVCacheBlocks | None) -> tuple:
        """The hit blocks per group (empty for a request that holds a table already: the
        decode fast path). ValueError for hits the manager cannot take."""
        if new_computed_blocks is not None and new_computed_blocks:
            if not isinstance(new_computed_blocks, KVCacheBlocks):
                raise ValueError(f"new_computed_blocks must be the KVCacheBlocks get_computed_blocks returned (one "
                                 f"list per KV-cache group), got {type(new_computed_blocks).__name__}")
            if not self.enable_caching:
                raise ValueError("new_computed_blocks given but prefix caching is disabled; pass None")
            if not first_allocation:
                raise ValueError(
                    f"request {request.request_id!r} already holds blocks; new_computed_blocks are only for a "
                    f"request's first allocation (after get_computed_blocks)"
                )
            if len(new_computed_blocks.blocks) != self.num_kv_cache_groups:
                raise ValueError(f"new_computed_blocks has {len(new_computed_blocks.blocks)} groups, this manager "
                                 f"{self.num_kv_cache_groups}; pass what its get_computed_blocks returned")
            return tuple(list(group) for group in new_computed_blocks.blocks)
        return self._no_blocks.blocks

    # ------------------------------------------------------------------ release
    def free(self, request: Request) -> None:
        """Return the request's blocks, tail first (its last blocks are evicted first).

        A no-op for a request that holds nothing.
        """
        if self.offload is not None:
            self.offload.release(request.request_id)
        self._lookups.pop(request.request_id, None)
        self.coordinator.free(request.request_id)

    def swap_out(self, request: Request) -> bool:
        """Preempts by swap: the request's written pages go to the host tier (copied down
        before the next step runs) and its blocks are freed as free() does; on resumption
        get_computed_blocks finds them again. False (nothing changed) when the host tier
        cannot hold them: the caller preempts by recompute instead."""
        assert self.offload is not None, "swap preemption needs an offload manager (EngineConfig checks it)"
        if not self.offload.swap_out(request, self.coordinator.get_blocks(request.request_id),
                                     request.num_computed_tokens):
            return False
        self.coordinator.free(request.request_id)
        return True

    def take_step_copies(self):
        """The page copies the runner makes around this step (offload.StepCopies), or None."""
        return self.offload.take_step_copies() if self.offload is not None else None

    def reset_prefix_cache(self) -> bool:
        """Forget all cached hashes (and empty the host tier); False while any request holds
        blocks or host-tier entries."""
        if self.offload is not None and not self.offload.is_idle():
            return False
        if not self.block_pool.reset_prefix_cache():
            return False
        if self.kv_events is not None:
            self.kv_events.cleared("device")
        if self.offload is not None:
            self.offload.reset()
        self.prefix_cache_stats.num_resets += 1
        return True

    # ------------------------------------------------------------------ queries
    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block table in each group, as ids (all [] for a request holding nothing)."""
        return tuple([b.block_id for b in blocks] for blocks in self.coordinator.get_blocks(request_id))

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        return KVCacheBlocks(tuple(list(blocks) for blocks in self.coordinator.get_blocks(request_id)))

    def has_cached_block(self, block_hash: bytes) -> bool:
        """Whether every KV-cache group holds a cached block under this chain hash (what a
        router asks of a replica: would a request with this block hit here)."""
        return self.block_pool.get_cached_blocks(block_hash, tuple(range(self.num_kv_cache_groups))) is not None

    def has_requests(self) -> bool:
        """Whether any request holds blocks."""
        return any(m.req_to_blocks for m in self.coordinator.managers)

    def get_num_free_blocks(self) -> int:
        return self.block_pool.free_block_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of usable blocks in use (0.0 .. 1.0)."""
        return self.block_pool.get_usage()

    def check_invariants(self, requests: dict[str, Request] | None = None) -> None:
        """Assert the pool's invariants plus the manager's; messages name the bug.

        Args:
          requests: live requests by id, when known: their cached blocks must carry their
            block hashes.
        """
        holders: dict[int, int] = {}
        managers = self.coordinator.managers
        for m in managers:
            assert set(m.req_to_blocks) == set(managers[0].req_to_blocks), (
                f"group {m.kv_cache_group_id} holds tables of other requests than group 0")
            for request_id, blocks in m.req_to_blocks.items():
                ids = [b.block_id for b in blocks if not b.is_null]
                assert len(set(ids)) == len(ids), f"request {request_id!r} holds a block twice: {ids}"
                num_nulls = len(blocks) - len(ids)
                assert all(b.is_null for b in blocks[:num_nulls]), (
                    f"request {request_id!r}: null blocks after real ones in group {m.kv_cache_group_id}: "
                    f"{[b.block_id for b in blocks]}")
                assert m.frees_skipped_blocks or num_nulls == 0, (
                    f"request {request_id!r}: a null block in the table of group {m.kv_cache_group_id}, "
                    f"which never skips blocks")
                for i in ids:
                    holders[i] = holders.get(i, 0) + 1
        for i in holders:
            assert i != 0, "a request holds the null block"
        self.block_pool.check_invariants(holders)
        if self.offload is not None:
            self.offload.check_invariants()
        for m in managers:
            group = f" in group {m.kv_cache_group_id}" if len(managers) > 1 else ""
            assert set(m.num_cached_block) <= set(m.req_to_blocks), "num_cached_block outlives a freed request"
            for request_id, num_cached in m.num_cached_block.items():
                blocks = m.req_to_blocks[request_id]
                assert num_cached <= len(blocks), f"request {request_id!r} has more cached blocks than blocks{group}"
                for b in blocks[:num_cached]:
                    assert b.is_null or b.block_hash is not None, (
                        f"request {request_id!r}: counted-as-cached block {b.block_id} has no hash{group}")
                if requests is not None and request_id in requests:
                    hashes = requests[request_id].block_hashes
                    for i, b in enumerate(blocks[:num_cached]):
                        assert b.is_null or b.block_hash == hash_with_group_id(hashes[i], m.kv_cache_group_id), (
                            f"request {request_id!r} block {i} (id {b.block_id}) is cached under another prefix's "
                            f"hash{group}"
                        )
