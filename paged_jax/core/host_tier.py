"""HostKVTier: a byte-capped LRU pool of block buffers in host memory.

Keys are block hashes (bytes: prefix-cache content any request may hit) or swap keys
(("swap", request_id, block_index): one preempted request's private pages). Every entry
has the same size (PageCodec.nbytes), so the byte cap is a cap on entries.

Invariants (check_invariants asserts each one):
- len(entries) * entry_nbytes <= capacity_bytes: reserve() evicts LRU entries first and
  fails (returns False) rather than grow;
- a pinned entry (pin count > 0: a swapped request's pages, a copy planned for this step)
  is never evicted; pins name existing entries;
- an entry is reserved (value None) between the schedule that plans its copy-down and the
  step that fills it; a reserved entry evicted before then is simply not filled.
Imports no jax.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np


class HostKVTier:
    """Block buffers in host memory, least recently used evicted first.

    Args:
      capacity_bytes: the cap (>= entry_nbytes).
      entry_nbytes: bytes of one block's buffer.
      kv_events: optional KVEventLog (tier "host"; hash keys only).
    """

    def __init__(self, capacity_bytes: int, entry_nbytes: int, kv_events=None):
        assert capacity_bytes >= entry_nbytes > 0, (
            f"{capacity_bytes=} cannot hold one block of {entry_nbytes} bytes (OffloadConfig checks it)")
        self.capacity_bytes = capacity_bytes
        self.entry_nbytes = entry_nbytes
        self.max_entries = capacity_bytes // entry_nbytes
        self.kv_events = kv_events
        self._entries: OrderedDict = OrderedDict()  # key -> uint8[entry_nbytes] or None (reserved); LRU first
        self._pins: dict = {}
        self.num_evictions = 0

    def __contains__(self, key) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_bytes(self) -> int:
        return len(self._entries) * self.entry_nbytes

    def keys(self) -> list:
        """Every key, least recently used first."""
        return list(self._entries)

    def is_pinned(self, key) -> bool:
        return key in self._pins

    @property
    def num_pinned(self) -> int:
        return len(self._pins)

    def pin(self, key) -> None:
        assert key in self._entries, f"pinning {key!r}, which the host tier does not hold"
        self._pins[key] = self._pins.get(key, 0) + 1

    def unpin(self, key) -> None:
        count = self._pins.get(key, 0)
        assert count > 0, f"unpinning {key!r} more often than it was pinned"
        if count == 1:
            del self._pins[key]
        else:
            self._pins[key] = count - 1

    def touch(self, key) -> None:
        self._entries.move_to_end(key)

    def can_reserve(self, num_entries: int) -> bool:
        """Whether num_entries new entries fit once every unpinned entry may be evicted."""
        return num_entries <= self.max_entries - len(self._pins)

    def reserve(self, key) -> bool:
        """Makes room for key (evicting unpinned LRU entries); True if it is held now.

        A key already held is only marked most recently used.
        """
        if key in self._entries:
            self._entries.move_to_end(key)
            return True
        if len(self._entries) >= self.max_entries:
            victims = []
            need = len(self._entries) - self.max_entries + 1
            for old in self._entries:
                if old not in self._pins:
                    victims.append(old)
                    if len(victims) == need:
                        break
            if len(victims) < need:
                return False
            for old in victims:
                self.pop(old)
            self.num_evictions += len(victims)
        self._entries[key] = None
        return True

    def fill(self, key, buffer: np.ndarray) -> bool:
        """Stores a reserved entry's data; False if the entry was evicted meanwhile."""
        if key not in self._entries:
            return False
        assert buffer.shape == (self.entry_nbytes,) and buffer.dtype == np.uint8, (
            f"a block buffer of shape {buffer.shape} and dtype {buffer.dtype}")
        newly = self._entries[key] is None
        self._entries[key] = buffer
        if newly and self.kv_events is not None and isinstance(key, bytes):
            self.kv_events.stored([key], "host")
        return True

    def get(self, key) -> np.ndarray:
        buffer = self._entries[key]
        assert buffer is not None, f"reading host entry {key!r} before its copy-down filled it"
        return buffer

    def is_filled(self, key) -> bool:
        return self._entries.get(key) is not None

    def pop(self, key) -> None:
        assert key not in self._pins, f"dropping pinned host entry {key!r}"
        buffer = self._entries.pop(key)
        if buffer is not None and self.kv_events is not None and isinstance(key, bytes):
            self.kv_events.removed([key], "host")

    def clear(self) -> None:
        """Forgets every entry (none may be pinned)."""
        assert not self._pins, f"clearing a host tier with {len(self._pins)} pinned entries"
        self._entries.clear()
        if self.kv_events is not None:
            self.kv_events.cleared("host")

    def check_invariants(self) -> None:
        assert len(self._entries) <= self.max_entries, (
            f"host tier holds {len(self._entries)} entries, past its cap of {self.max_entries}")
        assert self.num_bytes <= self.capacity_bytes, "host tier grew past its byte cap"
        for key, count in self._pins.items():
            assert count > 0, f"pin count {count} for {key!r}"
            assert key in self._entries, f"pinned key {key!r} is not held"
        for key, buffer in self._entries.items():
            assert buffer is None or buffer.nbytes == self.entry_nbytes, f"entry {key!r} has the wrong size"
