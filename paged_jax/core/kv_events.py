"""KV events: what is cached where, for an external indexer (vLLM's KV events).

Every tier reports when a block hash starts and stops being held by it:
- BlockStored(block_hashes, tier): the hashes are now held by the tier ("device", "host",
  "disk"); on the device, only when no other device block already held the hash.
- BlockRemoved(block_hashes, tier): the tier no longer holds them.
- AllBlocksCleared(tier): the tier forgot everything (a prefix-cache reset).
A router that keeps a hash -> tiers map from these events knows where each prefix lives.
Swap entries (private to one preempted request) are not prefix-cache content and are not
reported. Imports no jax.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

TIERS = ("device", "host", "disk")


@dataclass(frozen=True)
class BlockStored:
    block_hashes: tuple[bytes, ...]
    tier: str


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: tuple[bytes, ...]
    tier: str


@dataclass(frozen=True)
class AllBlocksCleared:
    tier: str


class KVEventLog:
    """Collects events: subscribers are called as each happens, and a bounded queue keeps
    the latest max_queued for polling (`get_events` drains it).

    Thread-safe: the disk tier reports from its writer thread.
    """

    def __init__(self, max_queued: int = 100_000):
        self._queue: deque = deque(maxlen=max_queued)
        self._subscribers: list = []
        self._lock = threading.Lock()

    def subscribe(self, callback) -> None:
        """callback(event) for every future event (from the thread that caused it)."""
        self._subscribers.append(callback)

    def stored(self, block_hashes, tier: str) -> None:
        if block_hashes:
            self._emit(BlockStored(tuple(block_hashes), tier))

    def removed(self, block_hashes, tier: str) -> None:
        if block_hashes:
            self._emit(BlockRemoved(tuple(block_hashes), tier))

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
