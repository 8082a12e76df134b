"""The transfer connector's worker side: KV pages between engines over JAX's transfer server.

Transport: `jax.experimental.transfer` (what vLLM's JAX backend uses between hosts; it runs
on CPU too). A producer's pages are gathered on its device and offered with `await_pull`
under a fresh uuid; the consumer `pull`s them straight onto its device and scatters them
into the blocks its scheduler gave the external zone (donated caches, one program per
power-of-two chunk: KVPool.put_page_arrays).

Control: a small side channel per producer (stdlib multiprocessing.connection, JSON
messages, never pickle), as vLLM's NIXL connector has its ZMQ side channel:
- {"op": "hello", "meta": ...}: the consumer compares what both sides' pages and hashes depend on
  (block size, hash algorithm and chain root, page layout, KV-cache groups, KV format and
  scales, the model's weights); a difference is a ValueError naming each field, at start-up
  for the configured peers (kv_peers) and before any page moves otherwise.
- {"op": "fetch", "transfer_id", "blocks": [[group, index], ...], "num_tokens", "digest"}:
  the producer checks the consumer's tokens (sha256) against its own, gathers exactly those
  blocks (only what the consumer's prefix cache missed) under the engine's lock (no step
  donates the caches meanwhile), offers them and answers their uuids.
- {"op": "release", "transfer_id"}: the consumer has its pages; the producer's scheduler
  frees the pinned blocks at its next step. An offer nobody releases expires after
  kv_transfer_timeout.

Threads: the producer's side channel accepts on one thread and serves each connection on
its own; a consumer pulls each request on a thread of its own. Pages reach the pool only
in get_finished(), called by the engine between steps, and only for loads still wanted
(an aborted or timed-out load's pages are dropped). A pull that never completes is given
up after the timeout: its thread stops waiting, but the transfer server keeps the pull
pending until the producer's connection closes (this jax version's pull ignores its own
timeout), and a process that exits with a pull pending aborts.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import logging
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection

import jax
import numpy as np
from jax.experimental import transfer

from paged_jax.core.hashing import get_hash_fn_by_name, make_none_hash
from paged_jax.core.kv_connector import (KVConnectorMetadata, KVConnectorOutput, KVTransferConfig, Offer,
                                         check_peer_address, tokens_digest)
from paged_jax.kv_pool import MAX_PAGE_COPY

logger = logging.getLogger(__name__)

_MAX_MESSAGE_BYTES = 1 << 22


class TransferError(Exception):
    """A pull that cannot complete (the request then prefills locally)."""


def transfer_meta(cache_config, pool, fingerprint: str) -> dict:
    """What a peer's pages and hashes must agree on, as JSON values (the hello message)."""
    hash_fn = get_hash_fn_by_name(cache_config.hash_algo)
    statics = {name: hashlib.sha256(np.asarray(value).tobytes()).hexdigest()
               for name, value in sorted(pool.layer_inputs.items())}
    return {
        "block_size": cache_config.block_size,
        "hash_algo": cache_config.hash_algo,
        "chain_root": make_none_hash(hash_fn, cache_config.hash_seed).hex(),
        "page_leaves": [[list(shape), dtype] for shape, dtype in pool.page_leaves()],
        "kv_cache_groups": [[group.attention_type, group.sliding_window, list(group.layer_ids)]
                            for group in cache_config.kv_cache_groups],
        "kv_static_inputs": statics,
        "model": fingerprint,
    }


def check_meta(ours: dict, theirs: dict, peer: str) -> None:
    """ValueError naming every field in which a peer's pages or hashes differ from ours."""
    diffs = [name for name in ours if ours[name] != theirs.get(name)]
    if diffs:
        detail = "; ".join(f"{name}: here {_short(ours[name])}, there {_short(theirs.get(name))}" for name in diffs)
        raise ValueError(f"KV transfer peer {peer} cannot share pages with this engine ({detail}); run both with the "
                         "same model and weights, block_size, kv_cache_dtype (and scales) and hash_algo / hash_seed")


def _short(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _call(conn, message: dict, deadline: float) -> dict:
    """Sends one message and waits (until deadline, time.monotonic()) for its answer."""
    conn.send_bytes(json.dumps(message).encode())
    if not conn.poll(max(0.0, deadline - time.monotonic())):
        raise TransferError(f"the producer did not answer {message['op']!r} in time")
    reply = json.loads(conn.recv_bytes(_MAX_MESSAGE_BYTES))
    if not reply.get("ok"):
        raise TransferError(reply.get("error", "the producer refused"))
    return reply


def _wait_ready(arrays, deadline: float) -> None:
    """Waits until pulled arrays hold their data (pull returns at once, its arrays filled as
    the bytes arrive; a step that read them early would stall the device). Raises if the
    transfer failed, TransferError past the deadline (the thread then ends; the arrays are
    never used)."""
    leaves = jax.tree.leaves(arrays)
    pause = 1e-4
    while not all(leaf.is_ready() for leaf in leaves):
        if time.monotonic() > deadline:
            raise TransferError("the pages did not arrive before kv_transfer_timeout")
        time.sleep(pause)
        pause = min(pause * 2, 5e-3)
    jax.block_until_ready(leaves)  # a failed transfer's arrays raise here


@dataclass
class TransferStats:
    """Cumulative worker counters."""

    blocks_sent: int = 0
    bytes_sent: int = 0
    blocks_received: int = 0
    bytes_received: int = 0
    pull_seconds: float = 0.0  # summed over pulls (fetch, gather and transfer)
    num_offers_expired: int = 0


class _Load:
    """One request's pull in flight (state written by its thread, read by get_finished)."""

    def __init__(self, job, chunks):
        self.job = job
        self.chunks = chunks  # [(local block ids, page array specs)]
        self.pages = None  # per chunk, the pulled arrays
        self.error: str | None = None
        self.done = False


class TransferKVWorker:
    """The worker side of the transfer connector (KVConnectorWorker).

    Args:
      config: the KVTransferConfig.
      pool: the engine's KVPool.
      meta: transfer_meta of this engine.
      lock: the engine's lock (held by every step): the producer gathers pages under it.
    """

    def __init__(self, config: KVTransferConfig, pool, meta: dict, lock):
        self.config = config
        self.pool = pool
        self.meta = meta
        self.lock = lock
        self.stats = TransferStats()
        self._page_bytes = sum(int(np.prod(shape)) * np.dtype(dtype).itemsize for shape, dtype in pool.page_leaves())
        client = jax.devices()[0].client
        self.server = transfer.start_transfer_server(client, f"{config.host}:0", [f"{config.host}:0"])
        self._state_lock = threading.Lock()
        self._offers: dict[str, Offer] = {}  # under self.lock
        self._released: set[str] = set()  # under _state_lock
        self._loads: dict[str, _Load] = {}  # under _state_lock
        self._connections: dict[str, tuple] = {}  # transfer address -> (TransferConnection, lock)
        self._checked_peers: set[tuple[str, int]] = set()
        self.progress = threading.Event()  # set when a pull ends or an offer is released
        self._closed = False
        self.address = None
        self._listener = None
        if config.can_produce:
            # A plain listening socket (its accepted ones wrapped as multiprocessing
            # Connections): shutdown() wakes its accept, which Listener.close() does not.
            self._listener = socket.create_server((config.host, config.port))
            self.address = self._listener.getsockname()[:2]
            threading.Thread(target=self._accept, name="paged-jax-kv-side-channel", daemon=True).start()
        for peer in config.peers:
            self.check_peer(check_peer_address("kv_peers", peer))

    def close(self) -> None:
        """Stops answering peers (offers not pulled yet fail on the consumer's side)."""
        self._closed = True
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._listener.close()

    # ------------------------------------------------------------------ consumer
    def check_peer(self, remote: tuple[str, int]) -> None:
        """Hello to a producer at start-up: ValueError if its pages differ from ours; a
        producer not up yet is checked before its first pull instead."""
        try:
            with Client(remote) as conn:
                self._hello(conn, remote, time.monotonic() + self.config.timeout)
        except (ConnectionError, OSError) as error:
            logger.warning("KV transfer peer %s:%s not reachable yet (%s); checked at its first pull", *remote, error)
        except TransferError as error:
            raise ValueError(f"KV transfer peer {remote[0]}:{remote[1]}: {error}") from None

    def _hello(self, conn, remote, deadline) -> dict:
        reply = _call(conn, {"op": "hello", "meta": self.meta}, deadline)
        check_meta(self.meta, reply["meta"], f"{remote[0]}:{remote[1]}")
        self._checked_peers.add(remote)
        return reply

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        """Registers this step's offers and starts its pulls (called by the engine, before the step)."""
        for offer in metadata.offers:
            self._offers[offer.transfer_id] = offer
        with self._state_lock:
            for request_id in metadata.cancelled_loads:
                self._loads.pop(request_id, None)
        if metadata.releases:
            threading.Thread(target=self._release, args=(metadata.releases,), name="paged-jax-kv-release",
                             daemon=True).start()
        for job in metadata.loads:
            ids = [block_id for _, _, block_id in job.blocks]
            chunks = [(ids[s: s + MAX_PAGE_COPY], self.pool.page_array_specs(len(ids[s: s + MAX_PAGE_COPY])))
                      for s in range(0, len(ids), MAX_PAGE_COPY)]
            load = _Load(job, chunks)
            with self._state_lock:
                self._loads[job.request_id] = load
            threading.Thread(target=self._pull, args=(load,), name="paged-jax-kv-pull", daemon=True).start()

    @staticmethod
    def _release(releases) -> None:
        """Tells producers which offers will never be pulled (best effort: an offer nobody
        releases expires on its own)."""
        for remote, transfer_id in releases:
            try:
                with Client(remote) as conn:
                    conn.send_bytes(json.dumps({"op": "release", "transfer_id": transfer_id}).encode())
            except (OSError, EOFError):
                pass

    def _pull(self, load: _Load) -> None:
        job = load.job
        start = time.monotonic()
        address = None
        try:
            with Client(job.remote) as conn:
                try:
                    address = self._hello(conn, job.remote, job.deadline)["transfer_address"]
                    fetched = _call(conn, {"op": "fetch", "transfer_id": job.transfer_id,
                                           "blocks": [[g, i] for g, i, _ in job.blocks],
                                           "num_tokens": job.num_tokens, "digest": job.digest}, job.deadline)
                    connection, connection_lock = self._connection(address)
                    pages = []
                    with connection_lock:
                        for chunk, (_, specs) in zip(fetched["chunks"], load.chunks):
                            pages.append(connection.pull(int(chunk["uuid"]), specs))
                    _wait_ready(pages, job.deadline)
                finally:  # pulled, or refused: either way the producer may free the blocks now
                    with contextlib.suppress(OSError):
                        conn.send_bytes(json.dumps({"op": "release", "transfer_id": job.transfer_id}).encode())
            load.pages = pages
        except Exception as error:  # noqa: BLE001 -- any failure: the request prefills locally
            load.error = f"{type(error).__name__}: {error}"
            if address is not None:
                with self._state_lock:
                    self._connections.pop(address, None)  # a dead producer: reconnect next time
        finally:
            load.done = True
            with self._state_lock:
                self.stats.pull_seconds += time.monotonic() - start
            self.progress.set()

    def _connection(self, address: str):
        with self._state_lock:
            entry = self._connections.get(address)
            if entry is None:
                entry = self._connections[address] = (self.server.connect(address), threading.Lock())
            return entry

    # ------------------------------------------------------------------ both
    def has_events(self) -> bool:
        """Whether get_finished has something to report (a pull ended, an offer was released
        or expired): the engine's loop steps for it even with no request to run."""
        now = time.monotonic()
        with self._state_lock:
            if self._released or any(load.done or now > load.job.deadline for load in self._loads.values()):
                return True
        return any(offer.deadline < now for offer in list(self._offers.values()))

    def get_finished(self) -> KVConnectorOutput:
        """Puts the pages that arrived into their blocks and reports what ended (called by
        the engine between steps, holding its lock)."""
        out = KVConnectorOutput()
        now = time.monotonic()
        with self._state_lock:
            ended = [(rid, load) for rid, load in self._loads.items() if load.done or now > load.job.deadline]
            for rid, _ in ended:
                del self._loads[rid]
            released, self._released = self._released, set()
        for rid, load in ended:
            if load.done and load.error is None:
                for (ids, _), arrays in zip(load.chunks, load.pages):
                    self.pool.put_page_arrays(ids, arrays)
                self.stats.blocks_received += len(load.job.blocks)
                self.stats.bytes_received += len(load.job.blocks) * self._page_bytes
                out.finished_recving.append(rid)
            else:
                reason = load.error or f"no pages after kv_transfer_timeout={self.config.timeout}s"
                logger.warning("KV pull for request %s failed (%s); prefilling it locally", rid, reason)
                out.failed_recving.append((rid, reason))
        for transfer_id, offer in list(self._offers.items()):
            if transfer_id in released or offer.deadline < now:
                del self._offers[transfer_id]
                if transfer_id not in released:
                    self.stats.num_offers_expired += 1
                out.finished_sending.append(transfer_id)
        self.progress.clear()
        return out

    # ------------------------------------------------------------------ producer
    def _accept(self) -> None:
        while not self._closed:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return  # closed
            conn = Connection(sock.detach())
            threading.Thread(target=self._serve, args=(conn,), name="paged-jax-kv-peer", daemon=True).start()

    def _serve(self, conn) -> None:
        with conn:
            while not self._closed:
                try:
                    message = json.loads(conn.recv_bytes(_MAX_MESSAGE_BYTES))
                except (EOFError, OSError):
                    return
                except ValueError:
                    conn.send_bytes(json.dumps({"ok": False, "error": "not a JSON message"}).encode())
                    continue
                op = message.get("op") if isinstance(message, dict) else None
                if op == "release":
                    with self._state_lock:
                        self._released.add(str(message.get("transfer_id")))
                    self.progress.set()
                    continue  # no answer: the consumer has what it needs
                try:
                    if op == "hello":  # the consumer compares (its error names its own values "here")
                        reply = {"ok": True, "meta": self.meta, "transfer_address": self.server.address()}
                    elif op == "fetch":
                        reply = {"ok": True, "chunks": self._offer_pages(message)}
                    else:
                        reply = {"ok": False, "error": f"unknown op {op!r}"}
                except (ValueError, TransferError, KeyError, TypeError) as error:
                    reply = {"ok": False, "error": str(error)}
                try:
                    conn.send_bytes(json.dumps(reply).encode())
                except OSError:
                    return

    def _offer_pages(self, message: dict) -> list[dict]:
        """Gathers the blocks a fetch names and offers them; their uuids, chunk by chunk."""
        transfer_id, num_tokens = str(message["transfer_id"]), int(message["num_tokens"])
        with self.lock:  # the engine's: no step donates the caches while we read them
            offer = self._offers.get(transfer_id)
            if offer is None:
                raise TransferError(f"transfer {transfer_id} is unknown here, released or expired")
            if num_tokens > offer.num_tokens or tokens_digest(offer.digest_tokens[:num_tokens]) != message["digest"]:
                raise TransferError(f"transfer {transfer_id} holds other tokens than the consumer's request")
            ids = []
            for g, i in message["blocks"]:
                table = offer.tables[g] if 0 <= g < len(offer.tables) else ()
                if not 0 <= i < len(table) or table[i] == 0:
                    raise TransferError(f"transfer {transfer_id} has no block {i} in KV-cache group {g}")
                ids.append(table[i])
            chunks = []
            timeout = datetime.datetime.now() + datetime.timedelta(seconds=self.config.timeout)
            for start in range(0, len(ids), MAX_PAGE_COPY):
                part = ids[start: start + MAX_PAGE_COPY]
                uuid = secrets.randbits(62)
                self.server.await_pull(uuid, self.pool.gather_page_arrays(np.asarray(part, np.int32)), timeout=timeout)
                chunks.append({"uuid": uuid, "num_blocks": len(part)})
            self.stats.blocks_sent += len(ids)
            self.stats.bytes_sent += len(ids) * self._page_bytes
        return chunks

    def as_dict(self) -> dict:
        return {
            "kv_transfer_blocks_sent": self.stats.blocks_sent,
            "kv_transfer_bytes_sent": self.stats.bytes_sent,
            "kv_transfer_blocks_received": self.stats.blocks_received,
            "kv_transfer_bytes_received": self.stats.bytes_received,
            "kv_transfer_pull_seconds": self.stats.pull_seconds,
            "kv_transfer_offers_expired": self.stats.num_offers_expired,
            "kv_transfer_offers_pinned": len(self._offers),
        }
