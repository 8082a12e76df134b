"""DiskKVTier: a persistent tier under the host tier, one file per block hash.

A directory holds the KV of exactly one setup, written down in its meta.json: the model's
fingerprint, the page geometry and storage dtype (PageCodec.describe()), block_size, the
hash algorithm and the root of the hash chains (from hash_seed). Opening a directory
whose meta.json says otherwise raises a ValueError naming each field that differs, since
its files would be read back as the wrong KV.

Crash safety: a block is written to a temporary file, fsynced, then renamed over its final
name (atomic on POSIX), and its header carries the payload's length and sha256. A read
checks both; a torn or corrupted file is deleted and reported as a miss, never returned.
Temporary files left by a crash are removed when the directory is opened.

Writes happen on one background thread (put() only queues the buffer; a queued block is
already readable); flush() waits for them, and so does the interpreter's exit (atexit: a
process that ends normally leaves every queued block on disk). With capacity_bytes the
oldest files (by write time) are deleted past the cap. Imports no jax.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import queue
import struct
import threading
import weakref
from collections import OrderedDict
from pathlib import Path

import numpy as np

MAGIC = b"PJKVBLK1"
_HEADER = struct.Struct("<8sQ32s")  # magic, payload length, sha256(payload)
META_FORMAT = "paged-jax-kv-disk/1"

# Tiers whose writer may hold queued blocks: each is flushed and closed at exit.
_OPEN_TIERS: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_open_tiers() -> None:
    for tier in list(_OPEN_TIERS):
        tier.close()


class DiskKVTier:
    """Blocks on disk keyed by block hash.

    Args:
      directory: where the files live (created if missing).
      meta: the setup (model fingerprint, geometry, hash settings); must equal the
        directory's meta.json if it has one.
      entry_nbytes: payload bytes of every block (PageCodec.nbytes).
      capacity_bytes: optional cap on the payload bytes kept (oldest deleted first).
      kv_events: optional KVEventLog (tier "disk").
    """

    def __init__(self, directory, meta: dict, entry_nbytes: int, capacity_bytes: int | None = None,
                 kv_events=None):
        self.directory = Path(directory)
        self.entry_nbytes = entry_nbytes
        self.capacity_bytes = capacity_bytes
        self.kv_events = kv_events
        self.directory.mkdir(parents=True, exist_ok=True)
        self._check_meta({"format": META_FORMAT, **meta})
        for stray in self.directory.glob("*.tmp"):
            stray.unlink(missing_ok=True)
        files = sorted(self.directory.glob("*.kv"), key=lambda p: p.stat().st_mtime)
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, None] = OrderedDict((bytes.fromhex(p.stem), None) for p in files)
        self._pending: dict[bytes, np.ndarray] = {}  # queued, not yet on disk (readable from here)
        self._queue: queue.Queue = queue.Queue()
        self.num_written = self.num_read = self.num_corrupt = 0
        self._thread = threading.Thread(target=self._writer, name="paged-jax-disk-tier", daemon=True)
        self._thread.start()
        _OPEN_TIERS.add(self)

    def _check_meta(self, meta: dict) -> None:
        path = self.directory / "meta.json"
        if path.exists():
            found = json.loads(path.read_text())
            differ = [f"{k}: {found.get(k)!r} in the directory, {meta.get(k)!r} here"
                      for k in sorted(set(found) | set(meta)) if found.get(k) != meta.get(k)]
            if differ:
                raise ValueError(f"offload_disk_dir={str(self.directory)!r} holds KV of another model, cache "
                                 f"geometry or hash setting ({'; '.join(differ)}); use another directory or "
                                 "the settings it was written with")
            return
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(meta, indent=1, sort_keys=True))
        os.replace(tmp, path)

    def _path(self, key: bytes) -> Path:
        return self.directory / f"{key.hex()}.kv"

    def __contains__(self, key) -> bool:
        with self._lock:
            return key in self._index or key in self._pending

    def __len__(self) -> int:
        with self._lock:
            return len(self._index) + len(self._pending)

    def put(self, key: bytes, buffer: np.ndarray) -> None:
        """Queues one block (uint8[entry_nbytes]) for writing; a no-op if it is held already."""
        assert buffer.shape == (self.entry_nbytes,), f"a block buffer of shape {buffer.shape}"
        with self._lock:
            if key in self._index or key in self._pending:
                return
            self._pending[key] = buffer
        self._queue.put(key)

    def get(self, key: bytes) -> np.ndarray | None:
        """The block's buffer, or None if it is not here or its file fails the checks."""
        with self._lock:
            buffer = self._pending.get(key)
            if buffer is not None:
                return buffer
            if key not in self._index:
                return None
        path = self._path(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            data = b""
        payload = self._verify(data)
        if payload is None:
            self.num_corrupt += 1
            path.unlink(missing_ok=True)
            with self._lock:
                self._index.pop(key, None)
            if self.kv_events is not None:
                self.kv_events.removed([key], "disk")
            return None
        self.num_read += 1
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
        return np.frombuffer(payload, np.uint8).copy()

    def _verify(self, data: bytes) -> bytes | None:
        if len(data) < _HEADER.size:
            return None
        magic, length, digest = _HEADER.unpack_from(data)
        payload = data[_HEADER.size :]
        if magic != MAGIC or length != len(payload) or length != self.entry_nbytes:
            return None
        if hashlib.sha256(payload).digest() != digest:
            return None
        return payload

    def _writer(self) -> None:
        while True:
            key = self._queue.get()
            try:
                if key is None:
                    return
                with self._lock:
                    buffer = self._pending.get(key)
                if buffer is not None:
                    self._write(key, buffer)
            finally:
                self._queue.task_done()

    def _write(self, key: bytes, buffer: np.ndarray) -> None:
        payload = buffer.tobytes()
        path = self._path(key)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(_HEADER.pack(MAGIC, len(payload), hashlib.sha256(payload).digest()))
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        with self._lock:
            self._pending.pop(key, None)
            self._index[key] = None
            evicted = []
            if self.capacity_bytes is not None:
                while len(self._index) * self.entry_nbytes > self.capacity_bytes:
                    evicted.append(self._index.popitem(last=False)[0])
        for old in evicted:
            self._path(old).unlink(missing_ok=True)
        self.num_written += 1
        if self.kv_events is not None:
            self.kv_events.stored([key], "disk")
            self.kv_events.removed(evicted, "disk")

    def flush(self) -> None:
        """Returns once every queued block is on disk."""
        self._queue.join()

    def close(self) -> None:
        """Flushes and stops the writer thread."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
