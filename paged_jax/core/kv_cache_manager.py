"""KVCacheManager: which blocks hold each request's tokens; prefix-cache lookups and stats.

The scheduler's view of the KV cache (vLLM v1 names and semantics, one full-attention
group). Per step a waiting request goes get_computed_blocks -> allocate_slots(hits) and a
running one allocate_slots(num_new_tokens); a finished or preempted one goes to free().
Running out of blocks is not an error: allocate_slots returns None and changes nothing,
and the scheduler decides (wait, or preempt someone). Imports no jax.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from paged_jax.core.block_pool import BlockPool
from paged_jax.core.config import CacheConfig
from paged_jax.core.hashing import BlockHasher, get_hash_fn_by_name, make_none_hash
from paged_jax.core.kv_cache_block import KVCacheBlock
from paged_jax.core.request import Request


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups since the manager was created (vLLM's PrefixCacheStats, cumulative).

    Lookups of preempted requests (resuming with most of their own blocks) are counted
    apart, so they do not inflate the hit rate of fresh requests. Reading them changes
    nothing; a caller that wants intervals subtracts two snapshots (`copy()`).
    """

    num_resets: int = 0  # reset_prefix_cache() calls that succeeded
    requests: int = 0
    queries: int = 0  # tokens looked up
    hits: int = 0  # tokens found
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits

    def copy(self) -> PrefixCacheStats:
        return dataclasses.replace(self)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    """Block tables of all live requests over one BlockPool.

    Args:
      config: the resolved CacheConfig (block_size, num_blocks incl. the null block 0,
        max_model_len, enable_prefix_caching, hash_algo, hash_seed).
      offload: optional OffloadManager (core/offload.py): evicted blocks go down to its
        tiers, lookups continue in them, swap_out() preempts into them.
      kv_events: optional KVEventLog: device-tier BlockStored / BlockRemoved.

    State: req_to_blocks[request_id] is the request's block table (append-only while it
    lives); num_cached_block[request_id] counts its leading blocks already in the cache.
    The root of this manager's hash chains is its own (block_hasher.none_hash, from
    config.hash_seed): two managers share prefixes only when they share the seed.
    """

    def __init__(self, config: CacheConfig, offload=None, kv_events=None):
        self.config = config
        self.block_size = config.block_size
        self.max_model_len = config.max_model_len
        self.enable_caching = config.enable_prefix_caching
        self.block_pool = BlockPool(config.num_blocks, self.enable_caching)
        hash_fn = get_hash_fn_by_name(config.hash_algo)
        # Attached to every request this manager sees; with caching off it hashes nothing.
        self.block_hasher = BlockHasher(self.block_size, hash_fn, make_none_hash(hash_fn, config.hash_seed),
                                        enabled=self.enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_block: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()
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

    def check_request(self, request: Request) -> None:
        """Raises ValueError for a request that could never run, even alone in the pool: a
        prompt past max_model_len, or more blocks than the whole pool has (the scheduler
        asks before queueing it)."""
        self._check_prompt_len(request)
        # The last sampled token is never computed, so its slot is never needed.
        max_slots = min(request.num_prompt_tokens + request.max_tokens - 1, self.max_model_len)
        need = -(-max_slots // self.block_size)
        usable = self.config.num_usable_blocks
        if need > usable:
            raise ValueError(
                f"request {request.request_id!r} may need {need} KV blocks ({max_slots} tokens at block_size="
                f"{self.block_size}) but the whole pool has {usable}; lower max_tokens, shorten the prompt or "
                f"give the cache more blocks"
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
    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of request's full blocks; changes nothing but the stats.

        Walks the request's block hashes from block 0 and stops at the first miss. Uses at
        most (num_tokens - 1) // block_size blocks: the last token must be computed to
        produce logits, so a fully cached prompt still recomputes its last block.

        With an offload manager the lookup continues past the last device hit in the host
        and disk tiers (and through a swapped-out request's own pages); those hits get new
        blocks in allocate_slots and their pages are copied up before the step.

        Returns:
          (device hit blocks in order, number of hit tokens: len(blocks) * block_size, plus
          the tokens found in the offload tiers).
        """
        self._admit(request)
        num_tokens = request.num_tokens
        max_num_blocks = (num_tokens - 1) // self.block_size
        blocks = []
        if self.enable_caching:
            blocks = self.block_pool.cached_block_hash_to_block.get_prefix_blocks(request.block_hashes,
                                                                                  max_num_blocks)
            self.prefix_cache_stats.record(num_tokens, len(blocks) * self.block_size, request.num_preemptions > 0)
        if self.offload is not None:
            return blocks, self.offload.find(request, len(blocks), max_num_blocks if self.enable_caching else 0)
        return blocks, len(blocks) * self.block_size

    # ------------------------------------------------------------------ allocation
    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: list[KVCacheBlock] = ()) -> int:
        """Free blocks needed to hold num_tokens tokens of the request.

        Hit blocks with ref_cnt 0 count as needed: touching them takes them out of the free
        queue just like an allocation does.
        """
        num_required_blocks = -(-num_tokens // self.block_size)
        num_held = len(self.req_to_blocks.get(request_id, ()))
        num_new_blocks = num_required_blocks - len(new_computed_blocks) - num_held
        num_evictable_computed = sum(1 for b in new_computed_blocks if b.ref_cnt == 0 and not b.is_null)
        return num_new_blocks + num_evictable_computed

    def allocate_slots(self, request: Request, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: list[KVCacheBlock] | None = None,
                       num_lookahead_tokens: int = 0) -> list[KVCacheBlock] | None:
        """Make room for num_new_tokens more tokens of request; all or nothing.

        Token layout of the request after this call:

          | computed | new_computed | new | lookahead |
          computed      request.num_computed_tokens, already in its blocks
          new_computed  prefix-cache hits (new_computed_blocks), for a request holding none
          new           tokens to compute this step
          lookahead     slots reserved for speculative tokens (allocated, never cached)

        Slots are capped at max_model_len. Hit blocks are touched before new blocks are
        taken, so the allocation never evicts the request's own hits. Full blocks among
        computed + new_computed + new are cached.

        Args:
          request: the request (its hasher is attached on first sight).
          num_new_tokens: tokens to compute this step (>= 0).
          num_new_computed_tokens: tokens covered by new_computed_blocks (>= 0).
          new_computed_blocks: blocks from get_computed_blocks, or None.
          num_lookahead_tokens: extra slots for speculative decoding (>= 0).
        Returns:
          The newly allocated blocks (possibly []), or None when they do not fit, in which
          case nothing changed.
        """
        if request.block_hasher is not self.block_hasher:
            self._admit(request)
        if (num_new_tokens | num_new_computed_tokens | num_lookahead_tokens) < 0:
            raise ValueError(
                f"token counts must be >= 0, got num_new_tokens={num_new_tokens}, "
                f"num_new_computed_tokens={num_new_computed_tokens}, num_lookahead_tokens={num_lookahead_tokens}"
            )
        block_size = self.block_size
        request_id = request.request_id
        req_blocks = self.req_to_blocks.get(request_id)
        num_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        num_tokens_need_slot = num_computed_tokens + num_new_tokens + num_lookahead_tokens
        if num_tokens_need_slot > self.max_model_len:
            num_tokens_need_slot = self.max_model_len
        num_required_blocks = -(-num_tokens_need_slot // block_size)
        pool = self.block_pool

        if new_computed_blocks or req_blocks is None:
            # first allocation of this request (or of its resumption after preemption)
            if req_blocks is None:
                self._admit(request)
            new_computed_blocks = self._check_computed_blocks(request, req_blocks, new_computed_blocks)
            num_blocks_to_allocate = self.get_num_blocks_to_allocate(
                request_id, num_tokens_need_slot, new_computed_blocks)
            if num_blocks_to_allocate > pool.free_block_queue.num_free_blocks:
                if self.offload is not None:
                    self.offload.on_allocation_failed(request_id)
                return None
            if req_blocks is None:
                req_blocks = self.req_to_blocks[request_id] = []
            if new_computed_blocks:
                pool.touch(new_computed_blocks)
                req_blocks.extend(new_computed_blocks)
                self.num_cached_block[request_id] = len(new_computed_blocks)
            num_new_blocks = num_required_blocks - len(req_blocks)
            first_allocation = True
        else:
            first_allocation = False
            # decode fast path: usually the last block still has room
            num_new_blocks = num_required_blocks - len(req_blocks)
            if num_new_blocks > pool.free_block_queue.num_free_blocks:
                return None
        if num_new_blocks > 0:
            new_blocks = pool.get_new_blocks(num_new_blocks)
            req_blocks.extend(new_blocks)
        else:
            new_blocks = []

        if self.enable_caching:
            # Lookahead slots hold unverified tokens: never cache them.
            num_tokens_to_cache = num_computed_tokens + num_new_tokens
            num_tokens = len(request.all_token_ids)
            if num_tokens_to_cache > num_tokens:
                num_tokens_to_cache = num_tokens
            num_full_blocks = num_tokens_to_cache // block_size
            num_cached_blocks = self.num_cached_block.get(request_id, 0)
            if num_full_blocks > num_cached_blocks:
                pool.cache_full_blocks(request, req_blocks, num_cached_blocks, num_full_blocks, block_size)
                self.num_cached_block[request_id] = num_full_blocks
        if first_allocation and self.offload is not None:
            self.offload.on_allocated(request, req_blocks, len(new_computed_blocks))
        return new_blocks

    def _check_computed_blocks(self, request: Request, req_blocks, new_computed_blocks) -> list[KVCacheBlock]:
        if new_computed_blocks is None:
            return []
        blocks = list(new_computed_blocks)
        if blocks and not self.enable_caching:
            raise ValueError("new_computed_blocks given but prefix caching is disabled; pass None")
        if blocks and req_blocks:
            raise ValueError(
                f"request {request.request_id!r} already holds blocks; new_computed_blocks are only for a "
                f"request's first allocation (after get_computed_blocks)"
            )
        return blocks

    # ------------------------------------------------------------------ release
    def free(self, request: Request) -> None:
        """Return the request's blocks, tail first (its last blocks are evicted first).

        A no-op for a request that holds nothing.
        """
        if self.offload is not None:
            self.offload.release(request.request_id)
        self._free_blocks(request)

    def _free_blocks(self, request: Request) -> None:
        request_id = request.request_id
        req_blocks = self.req_to_blocks.pop(request_id, None)
        self.num_cached_block.pop(request_id, None)
        if req_blocks:
            self.block_pool.free_blocks(req_blocks[::-1])

    def swap_out(self, request: Request) -> bool:
        """Preempts by swap: the request's written pages go to the host tier (copied down
        before the next step runs) and its blocks are freed as free() does; on resumption
        get_computed_blocks finds them again. False (nothing changed) when the host tier
        cannot hold them: the caller preempts by recompute instead."""
        assert self.offload is not None, "swap preemption needs an offload manager (EngineConfig checks it)"
        blocks = self.req_to_blocks.get(request.request_id, [])
        if not self.offload.swap_out(request, blocks, request.num_computed_tokens):
            return False
        self._free_blocks(request)
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
    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table as ids ([] for a request holding nothing)."""
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        return list(self.req_to_blocks.get(request_id, ()))

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
        for request_id, blocks in self.req_to_blocks.items():
            ids = [b.block_id for b in blocks]
            assert len(set(ids)) == len(ids), f"request {request_id!r} holds a block twice: {ids}"
            assert 0 not in ids, f"request {request_id!r} holds the null block"
            for i in ids:
                holders[i] = holders.get(i, 0) + 1
        self.block_pool.check_invariants(holders)
        if self.offload is not None:
            self.offload.check_invariants()
        assert set(self.num_cached_block) <= set(self.req_to_blocks), "num_cached_block outlives a freed request"
        for request_id, num_cached in self.num_cached_block.items():
            blocks = self.req_to_blocks[request_id]
            assert num_cached <= len(blocks), f"request {request_id!r} has more cached blocks than blocks"
            for b in blocks[:num_cached]:
                assert b.block_hash is not None, f"request {request_id!r}: counted-as-cached block {b.block_id} has no hash"
            if requests is not None and request_id in requests:
                hashes = requests[request_id].block_hashes
                for i, b in enumerate(blocks[:num_cached]):
                    assert b.block_hash == hashes[i], (
                        f"request {request_id!r} block {i} (id {b.block_id}) is cached under another prefix's hash"
                    )
