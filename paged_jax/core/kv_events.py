"""KV events: what is cached where, for an external indexer (vLLM's KV events).

Every tier reports when a block hash starts and stops being held by it:
- BlockStored(block_hashes, tier): the hashes are now held by the tier ("device", "host",
  "disk"); on the device, only when no other device block already held the hash.
- BlockRemoved(block_hashes, tier): the tier no longer holds them.
- AllBlocksCleared(tier): the tier forgot everything (a prefix-cache reset).
A router that keeps a hash -> tiers map from these events knows where each prefix lives.
Swap entries (private to one preempted request) are not prefix-cache content and are not
reported.

Per KV-cache group (vLLM's group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window):
each group caches its own blocks of a prefix, so each event names one group and carries the
plain chain hashes (the pool's keys carry the group, block_pool.hash_with_group_id; the log
takes it off). A prefix is reusable on a tier when every group that needs it holds it there:
a full-attention group every block, a sliding-window group the blocks of its window.
Imports no jax.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

from paged_jax.core.block_pool import split_group_id

TIERS = ("device", "host", "disk")


@dataclass(frozen=True)
class BlockStored:
    """block_hashes: chain hashes now held by the tier in group group_idx (its attention type
    and window beside it; None when the log was not told the groups)."""

    block_hashes: tuple[bytes, ...]
    tier: str
    group_idx: int = 0
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: tuple[bytes, ...]
    tier: str
    group_idx: int = 0
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


@dataclass(frozen=True)
class AllBlocksCleared:
    tier: str


class KVEventLog:
    """Collects events: subscribers are called as each happens, and a bounded queue keeps
    the latest max_queued for polling (`get_events` drains it).

    Thread-safe: the disk tier reports from its writer thread.

    Args:
      max_queued: the most events kept for polling.
      kv_cache_groups: the cache's KVCacheGroupSpecs; with them each event names its group
        (the keys' group tags are taken off). Without them keys are reported as given.
      hash_nbytes: bytes of one chain hash (hashing.digest_nbytes), to find a key's tag.
    """

    def __init__(self, max_queued: int = 100_000, kv_cache_groups=None, hash_nbytes: int | None = None):
        if kv_cache_groups is not None and hash_nbytes is None:
            raise ValueError("kv_cache_groups needs hash_nbytes (hashing.digest_nbytes of the hash algorithm)")
        self._queue: deque = deque(maxlen=max_queued)
        self._subscribers: list = []
        self._lock = threading.Lock()
        self._groups = None if kv_cache_groups is None else tuple(
            (g.attention_type, g.sliding_window) for g in kv_cache_groups)
        self._hash_nbytes = hash_nbytes

    def subscribe(self, callback) -> None:
        """callback(event) for every future event (from the thread that caused it)."""
        self._subscribers.append(callback)

    def stored(self, keys, tier: str) -> None:
        """keys: the tier's keys (chain hashes, tagged with their group) now held."""
        self._report(BlockStored, keys, tier)

    def removed(self, keys, tier: str) -> None:
        self._report(BlockRemoved, keys, tier)

    def _report(self, kind, keys, tier: str) -> None:
        if not keys:
            return
        if self._groups is None:
            self._emit(kind(tuple(keys), tier))
            return
        by_group: dict[int, list[bytes]] = {}
        for key in keys:
            block_hash, group_id = split_group_id(key, self._hash_nbytes)
            by_group.setdefault(group_id, []).append(block_hash)
        for group_id in sorted(by_group):
            attention_type, window = self._groups[group_id]
            self._emit(kind(tuple(by_group[group_id]), tier, group_id, attention_type, window))

    def cleared(self, tier: str) -> None:
        self._emit(AllBlocksCleared(tier))

    def _emit(self, event) -> None:
        assert getattr(event, "tier") in TIERS, f"unknown tier {event.tier!r}"
        with self._lock:
            self._queue.append(event)
        for callback in self._subscribers:
            callback(event)

    def get_events(self) -> list:
        """The queued events, oldest first; the queue is empty afterwards."""
        with self._lock:
            events = list(self._queue)
            self._queue.clear()
        return events
