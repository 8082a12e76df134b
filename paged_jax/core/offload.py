"""OffloadManager: the host (and disk) tiers under the block pool, and the copies of each step.

Where it hooks in (all host-side bookkeeping; the runner only moves the pages it is told to):
- Eviction: when the block pool pops a cached block for reuse and no other device block
  holds its hash, `on_blocks_evicted` reserves a host entry for the hash and plans a
  copy-down of the block's pages. The pages are still intact: the block is overwritten only
  by the step that follows, and the copies run before it.
- Lookup: KVCacheManager.get_computed_blocks asks `find` to continue the hash chain past
  the device's last hit, in the host tier and then on disk (a disk hit is read into the
  host tier). Found entries are pinned until allocate_slots either succeeds (`on_allocated`:
  a copy-up into the request's new blocks is planned) or fails (`on_allocation_failed`).
- Swap preemption: `swap_out` reserves (and pins) an entry for every written block of the
  victim (its hash, or a private swap key for a block without one) and plans their
  copy-down; on resumption `find` follows those keys, so the request's pages come back
  through the same copy-up path. All or nothing: if the host tier cannot take them, the
  caller preempts by recompute instead (counted in num_swap_fallbacks).
- Persistence: with a disk tier, each newly cached block is written to disk after the step
  that computed it (`on_blocks_cached` plans it), so a restarted process finds it.

Per KV-cache group: a block belongs to one group at a time and its pages are the pool's
pages of that block id (every tensor of the pool, whatever group owns the block), so the
copies never need to know the group. The keys do: a group's cached blocks are keyed by
hash_with_group_id (block_pool.py), so each group's pages of a prefix are their own entries
here and on disk. A lookup past the device hit extends the prefix as far as every group
accepts it: a full-attention group needs every block, a sliding-window group only the
blocks inside the window before the hit point (those before it are null in its table and
never copied), as the device lookup asks (kv_cache_coordinator.py).

Per step, `take_step_copies()` hands the runner a StepCopies: copy-downs first (gathered
before anything else touches the pool), then copy-ups, then the step, then persists.
Imports no jax.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from paged_jax.core.block_pool import hash_with_group_id
from paged_jax.core.config import check_int
from paged_jax.core.host_tier import HostKVTier
from paged_jax.core.page_codec import PageCodec, get_storage_format

PREEMPTION_MODES = ("recompute", "swap")


@dataclass(frozen=True)
class OffloadConfig:
    """The tiers under the device pool.

    Attributes:
      host_bytes: byte cap of the host tier (> 0 turns it on).
      storage_dtype: how host and disk store pages: None (the cache's dtype, bit-identical),
        or a KV quantization format by its kv_cache_dtype name: "int8", "fp8_e4m3" (= "fp8"),
        "fp8_e5m2" (core/kv_quant.py; per token-and-head scales; page_codec.py).
      disk_dir: directory of the persistent tier (None: no disk tier).
      disk_bytes: optional cap on the disk tier's bytes (None: unbounded).
    """

    host_bytes: int
    storage_dtype: str | None = None
    disk_dir: str | None = None
    disk_bytes: int | None = None

    def __post_init__(self):
        check_int("offload_host_bytes", self.host_bytes, 1, "give the host tier a byte budget, or 0 to turn it off")
        get_storage_format(self.storage_dtype)  # ValueError naming offload_dtype and the choices
        if self.disk_dir is not None and not isinstance(self.disk_dir, str):
            raise ValueError(f"offload_disk_dir={self.disk_dir!r} must be a path string or None")
        if self.disk_bytes is not None:
            check_int("offload_disk_bytes", self.disk_bytes, 1, "or None for no cap")


@dataclass
class OffloadStats:
    """Cumulative counters (tokens and bytes)."""

    host_hit_tokens: int = 0  # prefix tokens found in the host tier (lookups)
    disk_hit_tokens: int = 0  # ... found on disk
    num_swap_outs: int = 0
    num_swap_ins: int = 0
    num_swap_fallbacks: int = 0  # swap preemptions that fell back to recompute (host tier full)
    num_host_stores_dropped: int = 0  # evicted device blocks the host tier had no room for
    bytes_device_to_host: int = 0  # device-format bytes copied down
    bytes_host_to_device: int = 0  # ... copied up
    bytes_to_disk: int = 0  # stored-format bytes queued for disk
    bytes_from_disk: int = 0

    def copy(self) -> OffloadStats:
        return dataclasses.replace(self)


@dataclass
class _SwapRecord:
    # per KV-cache group, per block of the request in order: its hash, its private swap key,
    # or None (a sliding-window group's block before the window: nothing to keep)
    keys: list[list]
    num_tokens: int  # tokens whose KV the keys hold

    def all_keys(self):
        return [key for group_keys in self.keys for key in group_keys if key is not None]


class StepCopies:
    """The page copies of one step, in the order the runner must run them.

    Attributes:
      store_block_ids: i32[n] blocks whose pages go down to the host tier BEFORE the step.
      load_block_ids: i32[m] blocks whose pages come up from the host tier, after the stores
        and before the step (`load()` gives the pages).
      persist_block_ids: i32[p] blocks written to disk AFTER the step.
    """

    def __init__(self, manager: OffloadManager, stores, loads, persists):
        self._manager = manager
        self._stores, self._loads, self._persists = stores, loads, persists
        self.store_block_ids = np.array([b for _, b in stores], np.int32)
        self.load_block_ids = np.array([b for _, b in loads], np.int32)
        self.persist_block_ids = np.array([b for _, b in persists], np.int32)

    def store(self, pages: list[np.ndarray]) -> None:
        """pages: one array per page leaf, [n, ...], of store_block_ids."""
        self._manager._finish_stores(self._stores, pages)

    def load(self) -> list[np.ndarray]:
        """One array per page leaf, [m, ...]: the pages of load_block_ids."""
        return self._manager._finish_loads(self._loads)

    def persist(self, pages: list[np.ndarray]) -> None:
        self._manager._finish_persists(self._persists, pages)


class OffloadManager:
    """Host tier (+ optional disk tier) keyed by block hash, and each step's copies.

    Args:
      config: OffloadConfig.
      codec: PageCodec of the device pool's pages in config.storage_dtype.
      block_size: tokens per block.
      disk: optional DiskKVTier (same codec).
      kv_events: optional KVEventLog.
      sliding_windows: per KV-cache group, its window (None for full attention); the
        default is one full-attention group.
    """

    def __init__(self, config: OffloadConfig, codec: PageCodec, block_size: int, disk=None, kv_events=None,
                 sliding_windows: tuple[int | None, ...] = (None,)):
        if config.host_bytes < codec.nbytes:
            raise ValueError(f"offload_host_bytes={config.host_bytes} cannot hold one block ({codec.nbytes} bytes "
                             f"in this format); give the host tier at least that")
        self.config = config
        self.codec = codec
        self.block_size = block_size
        self.sliding_windows = tuple(sliding_windows)
        assert self.sliding_windows, "no KV-cache groups"
        self._full_groups = [g for g, w in enumerate(self.sliding_windows) if w is None]
        self._sliding_groups = [(g, w) for g, w in enumerate(self.sliding_windows) if w is not None]
        self.host = HostKVTier(config.host_bytes, codec.nbytes, kv_events)
        self.disk = disk
        self.stats = OffloadStats()
        self._stores: list = []  # (key, block_id): copy down before this step
        self._loads: list = []  # (key, block_id): copy up before this step (keys pinned)
        self._persists: list = []  # (hash, block_id): write to disk after this step
        self._persist_keys: set = set()
        self._drop_after_load: set = set()  # private swap keys consumed by this step's loads
        # request_id -> (keys found and pinned: per group, for the blocks after the device hits,
        # None where the group needs none; host hit tokens, disk hit tokens) of its last lookup
        self._found: dict[str, tuple[list[list], int, int]] = {}
        self.swapped: dict[str, _SwapRecord] = {}

    # ------------------------------------------------------------------ block pool hooks
    def on_blocks_evicted(self, evicted) -> None:
        """(block_hash, block_id) of cached blocks being reused, whose hash left the device."""
        for block_hash, block_id in evicted:
            if block_hash in self.host:
                self.host.touch(block_hash)
            elif self.host.reserve(block_hash):
                self._stores.append((block_hash, block_id))
            else:
                self.stats.num_host_stores_dropped += 1

    def on_blocks_cached(self, cached) -> None:
        """(block_hash, block_id) of blocks just cached; with a disk tier, persist new hashes."""
        if self.disk is None:
            return
        for block_hash, block_id in cached:
            if block_hash not in self._persist_keys and block_hash not in self.disk:
                self._persist_keys.add(block_hash)
                self._persists.append((block_hash, block_id))

    # ------------------------------------------------------------------ lookup
    def find(self, request, num_device_blocks: int, max_num_blocks: int) -> int:
        """Continues request's prefix lookup past its num_device_blocks device hits (a hit
        every group accepted).

        Follows its swap record (if it was swapped out), else its block hashes up to
        max_num_blocks full blocks, through the host tier and the disk tier: the hit grows
        block by block while every full-attention group finds its key, then ends at the
        longest length for which every sliding-window group finds the keys inside its window
        before that point. The keys found are pinned until on_allocated /
        on_allocation_failed.

        Returns:
          The number of hit tokens counted from token 0 (num_device_blocks * block_size
          when nothing more is found).
        """
        self._unpin_found(request.request_id)  # an earlier lookup that never reached allocate_slots
        bs = self.block_size
        first = num_device_blocks
        record = self.swapped.get(request.request_id)
        if record is not None:
            num_tokens_at_end = record.num_tokens
            keys_at = [group_keys for group_keys in record.keys]
        else:
            hashes = request.block_hashes
            num_tokens_at_end = min(max_num_blocks, len(hashes)) * bs
            keys_at = [[hash_with_group_id(h, g) for h in hashes[:num_tokens_at_end // bs]]
                       for g in range(len(self.sliding_windows))]
        num_blocks_at_end = -(-num_tokens_at_end // bs)
        if num_blocks_at_end <= first:
            return first * bs

        def tokens_at(n: int) -> int:
            return min(n * bs, num_tokens_at_end)

        pinned: dict = {}  # key -> tier, pinned by this lookup
        # Full attention: every block, left to right, up to the first miss.
        end = first
        while end < num_blocks_at_end and all(self._fetch_pinned(keys_at[g][end], pinned) for g in self._full_groups):
            end += 1
        # Sliding windows: the longest n <= end whose window blocks (after the device hits) are
        # all here; a key that is listed but cannot be fetched is marked and the search redone.
        missing: set = set()

        def window_blocks(n: int):
            for g, window in self._sliding_groups:
                for i in range(max(first, max(0, tokens_at(n) - window + 1) // bs), n):
                    yield g, i

        while True:
            n = end
            while n > first and any(keys_at[g][i] is None or (g, i) in missing or not self._has(keys_at[g][i])
                                    for g, i in window_blocks(n)):
                n -= 1
            failed = [(g, i) for g, i in window_blocks(n) if not self._fetch_pinned(keys_at[g][i], pinned)]
            if not failed:
                break
            missing.update(failed)
        keys: list[list] = []
        for g, window in enumerate(self.sliding_windows):
            start = first if window is None else max(first, max(0, tokens_at(n) - window + 1) // bs)
            keys.append([keys_at[g][i] if i >= start else None for i in range(first, n)])
        needed = {key for group_keys in keys for key in group_keys if key is not None}
        for key in list(pinned):
            if key not in needed:
                self.host.unpin(key)
                del pinned[key]
        if n == first:
            return first * bs
        host_tokens = disk_tokens = 0  # counted in the stats once the request is admitted
        for i in range(first, n):
            block_tokens = tokens_at(i + 1) - i * bs
            if any(pinned.get(group_keys[i - first]) == "disk" for group_keys in keys):
                disk_tokens += block_tokens
            else:
                host_tokens += block_tokens
        self._found[request.request_id] = keys, host_tokens, disk_tokens
        return tokens_at(n)

    def _has(self, key) -> bool:
        """Whether the host or the disk tier lists key (nothing is read)."""
        return key in self.host or (self.disk is not None and isinstance(key, bytes) and key in self.disk)

    def _fetch_pinned(self, key, pinned: dict) -> bool:
        """Fetches key (see _fetch) and pins it once for this lookup; False if it is not here."""
        if key is None:
            return False
        if key in pinned:
            return True
        tier = self._fetch(key)
        if tier is None:
            return False
        self.host.pin(key)
        pinned[key] = tier
        return True

    def _fetch(self, key) -> str | None:
        """'host' if the host tier holds key, 'disk' if it was just read from disk into it."""
        if key in self.host:
            self.host.touch(key)
            return "host"
        if self.disk is None or not isinstance(key, bytes) or key not in self.disk:
            return None
        buffer = self.disk.get(key)
        if buffer is None or not self.host.reserve(key):
            return None
        self.host.fill(key, buffer)
        self.stats.bytes_from_disk += buffer.nbytes
        return "disk"

    def on_allocated(self, request, tables, num_device_blocks: int) -> None:
        """allocate_slots succeeded: plan the copy-up of the keys find() pinned into each
        group's blocks after the device hits (tables: the request's block table per group),
        and close the request's swap record."""
        request_id = request.request_id
        keys, host_tokens, disk_tokens = self._found.pop(request_id, ((), 0, 0))
        self.stats.host_hit_tokens += host_tokens
        self.stats.disk_hit_tokens += disk_tokens
        loaded = set()
        for group_keys, table in zip(keys, tables):
            assert len(table) >= num_device_blocks + len(group_keys), "host hits without blocks to copy them into"
            for key, block in zip(group_keys, table[num_device_blocks:]):
                if key is None:
                    continue
                assert not block.is_null, f"a host hit for block {block.block_id}, which the window skipped"
                self._loads.append((key, block.block_id))  # stays pinned until loaded
                loaded.add(key)
        record = self.swapped.pop(request_id, None)
        if record is not None:
            self.stats.num_swap_ins += 1
            self._release_record(record, loaded=loaded)

    def on_allocation_failed(self, request_id: str) -> None:
        """allocate_slots returned None: the keys find() pinned are released."""
        self._unpin_found(request_id)

    def _unpin_found(self, request_id: str) -> None:
        keys, _, _ = self._found.pop(request_id, ((), 0, 0))
        for group_keys in keys:
            for key in group_keys:
                if key is not None:
                    self.host.unpin(key)

    # ------------------------------------------------------------------ swap
    def swap_out(self, request, tables, num_computed_tokens: int) -> bool:
        """Plans the copy-down of the first cdiv(num_computed_tokens, block_size) blocks of
        each group (tables: the request's block table per group), but for a sliding-window
        group's blocks before the window of the next token (null, or about to be).

        Returns False (nothing changed) if the host tier cannot hold them all.
        """
        request_id = request.request_id
        bs = self.block_size
        num_blocks = -(-num_computed_tokens // bs)
        keys: list[list] = []
        blocks = []
        for g, (window, table) in enumerate(zip(self.sliding_windows, tables)):
            start = 0 if window is None else max(0, num_computed_tokens - window + 1) // bs
            group_keys = []
            for i, block in enumerate(table[:num_blocks]):
                if i < start or block.is_null:
                    group_keys.append(None)
                    continue
                key = block.block_hash if block.block_hash is not None else ("swap", request_id, g, i)
                group_keys.append(key)
                blocks.append((key, block))
            keys.append(group_keys)
        held = [key for key, _ in blocks if key in self.host]
        for key in held:
            self.host.pin(key)
        if not self.host.can_reserve(len(blocks) - len(held)):
            for key in held:
                self.host.unpin(key)
            self.stats.num_swap_fallbacks += 1
            return False
        for key, block in blocks:
            if key in self.host:
                continue
            reserved = self.host.reserve(key)
            assert reserved, "can_reserve promised room the host tier did not have"
            self.host.pin(key)
            self._stores.append((key, block.block_id))
        self.swapped[request_id] = _SwapRecord(keys, num_computed_tokens)
        self.stats.num_swap_outs += 1
        return True

    def _release_record(self, record: _SwapRecord, loaded=()) -> None:
        for key in record.all_keys():
            self.host.unpin(key)
            if isinstance(key, tuple):  # private pages: nobody else can use them
                if key in loaded:
                    self._drop_after_load.add(key)
                elif not self.host.is_pinned(key):
                    self.host.pop(key)

    def release(self, request_id: str) -> None:
        """Drops whatever the request still holds here (it finished or was aborted)."""
        self._unpin_found(request_id)
        record = self.swapped.pop(request_id, None)
        if record is not None:
            self._release_record(record)

    # ------------------------------------------------------------------ the step's copies
    def take_step_copies(self) -> StepCopies | None:
        """This step's copies (None if there are none); the plan starts empty again."""
        stores = [(k, b) for k, b in self._stores if k in self.host and not self.host.is_filled(k)]
        if not (stores or self._loads or self._persists):
            self._stores = []
            return None
        copies = StepCopies(self, stores, self._loads, self._persists)
        self._stores, self._loads, self._persists, self._persist_keys = [], [], [], set()
        return copies

    def _finish_stores(self, stores, pages) -> None:
        buffers = self.codec.encode(pages)
        for (key, _), buffer in zip(stores, buffers):
            self.host.fill(key, buffer.copy())  # a row of its own: the batch is not kept alive
        self.stats.bytes_device_to_host += len(stores) * self.codec.raw_nbytes

    def _finish_loads(self, loads) -> list[np.ndarray]:
        buffers = np.stack([self.host.get(key) for key, _ in loads])
        for key, _ in loads:
            self.host.unpin(key)
            if key in self._drop_after_load and not self.host.is_pinned(key):
                self._drop_after_load.discard(key)
                self.host.pop(key)
        self.stats.bytes_host_to_device += len(loads) * self.codec.raw_nbytes
        return self.codec.decode(buffers)

    def _finish_persists(self, persists, pages) -> None:
        buffers = self.codec.encode(pages)
        for (key, _), buffer in zip(persists, buffers):
            self.disk.put(key, buffer.copy())
        self.stats.bytes_to_disk += buffers.nbytes

    def is_idle(self) -> bool:
        """Nothing pinned, planned or swapped out: reset() may empty the host tier."""
        return not (self.host.num_pinned or self.swapped or self._found or self._stores or self._loads
                    or self._persists)

    def reset(self) -> None:
        """Empties the host tier (with the device's prefix cache, e.g. after a weight update,
        whose KV would be stale). The disk tier keeps its files: it belongs to the weights it
        was opened for (their fingerprint is in its meta.json)."""
        assert self.is_idle(), "resetting the host tier while requests hold entries in it"
        self.host.clear()

    # ------------------------------------------------------------------ checks
    def check_invariants(self, idle: bool = False) -> None:
        """The host tier's invariants; idle (no live requests, no step pending): nothing is
        pinned, planned or private, so every byte held is evictable prefix cache."""
        self.host.check_invariants()
        if idle:
            assert not self.swapped, f"swap records outlive their requests: {sorted(self.swapped)}"
            assert not self._found, f"lookups never allocated: {sorted(self._found)}"
            assert not (self._stores or self._loads or self._persists), "copies planned but never taken"
            assert self.host.num_pinned == 0, f"{self.host.num_pinned} host entries still pinned"
            private = [k for k in self.host.keys() if isinstance(k, tuple)]
            assert not private, f"private swap pages leaked: {private}"
            assert all(self.host.is_filled(k) for k in self.host.keys()), "a host entry was reserved, never filled"
