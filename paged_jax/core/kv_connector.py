"""KV connectors: KV blocks that arrive from another engine (the seed's `external` zone).

Prefill/decode disaggregation runs prompts on one engine (the producer) and decodes them on
another (the consumer), so long prompts stop stalling other users' decode steps. The split
is vLLM v1's KVConnectorBase_V1:

- scheduler side (this module, jax-free, called by the Scheduler):
  `get_num_new_matched_tokens(request, num_computed_tokens)` -> (external tokens, load async):
    how many prompt tokens past the local prefix hit the remote side already holds;
  `update_state_after_alloc(request, tables, num_computed_tokens, num_external_tokens)`:
    the blocks allocate_slots gave the external zone, to be filled by the worker;
  `request_finished(request, tables)` -> (delay free, kv_transfer_params): a producer keeps a
    finished prompt's blocks pinned and returns where to pull them from;
  `build_connector_meta()` -> KVConnectorMetadata: what the worker must start this step;
  `transfer_done(transfer_id)`: the request whose pinned blocks may be freed now.
- worker side (paged_jax/kv_transfer.py, next to the KV pool): `start_load_kv(metadata)`
  starts the pulls before the step, `get_finished()` -> KVConnectorOutput puts the pages
  that arrived into their blocks (in the engine's thread, between steps) and says which
  loads finished or failed and which offers were pulled or expired.

The token layout of a consumer's request (KVCacheManager.allocate_slots):

    | computed (local prefix hit) | external (pulled) | new (computed here) |

A request with external tokens waits in RequestStatus.WAITING_FOR_REMOTE_KVS, holding its
blocks, until the pull lands (then its num_computed_tokens covers them and its full blocks
are cached) or fails (then it frees them and prefills locally, counted, never a wrong
token). External blocks are never cached before their pages are in.

The offload tiers stay their own path (core/offload.py): they copy pages synchronously
inside a step, keyed by hash, where a connector's transfers are asynchronous and keyed by
request; folding one into the other would make the tiers wait on a protocol they do not need.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

KV_ROLES = ("producer", "consumer", "both")


def check_peer_address(name: str, address) -> tuple[str, int]:
    """'host:port' -> (host, port); ValueError naming `name` otherwise."""
    if not isinstance(address, str) or address.count(":") != 1:
        raise ValueError(f"{name}={address!r} must be 'host:port', e.g. '127.0.0.1:8600'")
    host, port = address.split(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{name}={address!r} must be 'host:port' with a port in 1..65535")
    return host, int(port)


@dataclass(frozen=True)
class KVTransferConfig:
    """How an engine takes part in disaggregation (EngineConfig's kv_* fields).

    Attributes:
      kv_role: "producer" (offers its finished prompts' KV), "consumer" (pulls KV for
        requests that bring kv_transfer_params) or "both".
      host: where the producer's side channel listens (and its transfer server binds).
      port: the side channel's port (0: any free one; it travels in kv_transfer_params).
      peers: producers ('host:port' side channels) a consumer checks at start-up, so a
        mismatched page geometry or hash chain fails there and not on the first request.
      timeout: seconds a consumer waits for a pull before it prefills locally, and a
        producer keeps an offer pinned before it frees the blocks.
    """

    kv_role: str
    host: str = "127.0.0.1"
    port: int = 0
    peers: tuple[str, ...] = ()
    timeout: float = 30.0

    def __post_init__(self):
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_role={self.kv_role!r} must be one of {KV_ROLES}, or None to turn disaggregation off")
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"kv_host={self.host!r} must be a host name or address, e.g. '127.0.0.1'")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port < 65536:
            raise ValueError(f"kv_port={self.port!r} must be a port in 0..65535 (0: any free port)")
        for peer in self.peers:
            check_peer_address("kv_peers", peer)
        if self.peers and not self.can_consume:
            raise ValueError("kv_peers are the producers a consumer pulls from; set kv_role='consumer' or 'both'")
        if isinstance(self.timeout, bool) or not isinstance(self.timeout, (int, float)) or not self.timeout > 0:
            raise ValueError(f"kv_transfer_timeout={self.timeout!r} must be a number of seconds > 0")

    @property
    def can_produce(self) -> bool:
        return self.kv_role in ("producer", "both")

    @property
    def can_consume(self) -> bool:
        return self.kv_role in ("consumer", "both")


def tokens_digest(token_ids) -> str:
    """sha256 of token ids: both sides compare it, so pages are only ever put under the
    very tokens they were computed for (a proxy that mixed up two requests gets an error)."""
    return hashlib.sha256(",".join(map(str, token_ids)).encode()).hexdigest()


class LoadJob(NamedTuple):
    """One request's pull: the blocks (per block: group, index in its table, local block id)
    that the external zone gave it, filled from the remote transfer."""

    request_id: str
    remote: tuple[str, int]  # the producer's side channel
    transfer_id: str
    blocks: tuple[tuple[int, int, int], ...]
    num_tokens: int  # tokens the pulled pages cover (local hit + external)
    digest: str  # tokens_digest of those tokens
    deadline: float  # time.monotonic() past which the load fails


class Offer(NamedTuple):
    """A finished prompt's pinned blocks, offered until pulled or deadline."""

    transfer_id: str
    tables: tuple[tuple[int, ...], ...]  # block id per group per block index (0: null)
    num_tokens: int
    digest_tokens: tuple[int, ...]  # the tokens whose KV the blocks hold
    deadline: float


@dataclass
class KVConnectorMetadata:
    """What the worker starts this step."""

    loads: list[LoadJob] = field(default_factory=list)
    offers: list[Offer] = field(default_factory=list)
    cancelled_loads: list[str] = field(default_factory=list)  # request ids aborted while loading
    releases: list[tuple[tuple[str, int], str]] = field(default_factory=list)  # (producer, transfer id) not needed


@dataclass
class KVConnectorOutput:
    """What the worker finished since the last call."""

    finished_recving: list[str] = field(default_factory=list)  # request ids whose pages are in
    failed_recving: list[tuple[str, str]] = field(default_factory=list)  # (request id, reason)
    finished_sending: list[str] = field(default_factory=list)  # transfer ids pulled or expired


class KVConnectorWorker(Protocol):
    """The worker side (paged_jax/kv_transfer.py)."""

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None: ...

    def get_finished(self) -> KVConnectorOutput: ...


@dataclass
class KVTransferStats:
    """Cumulative counters of both roles (tokens and blocks)."""

    num_remote_loads: int = 0  # consumer: requests whose KV was pulled
    num_remote_load_failures: int = 0  # ... that fell back to local prefill
    num_external_tokens: int = 0  # ... prompt tokens pulled instead of computed
    num_offers: int = 0  # producer: finished prompts offered (expiries: the worker's stats)


class TransferConnectorScheduler:
    """The scheduler side of the transfer connector (paged_jax/kv_transfer.py's worker).

    Args:
      config: the KVTransferConfig.
      block_size: tokens per block.
      address: (host, port) of this engine's side channel (a producer's, put in the
        kv_transfer_params it returns); None for a consumer only.
      sliding_windows: per KV-cache group, its window (None for full attention).
      clock: time.monotonic, or a test's.
    """

    def __init__(self, config: KVTransferConfig, block_size: int, address: tuple[str, int] | None = None,
                 sliding_windows: tuple[int | None, ...] = (None,), clock=time.monotonic):
        self.config = config
        self.block_size = block_size
        self.sliding_windows = tuple(sliding_windows)
        self.address = address
        self.clock = clock
        self.stats = KVTransferStats()
        self._meta = KVConnectorMetadata()
        self._loading: dict[str, LoadJob] = {}
        self._pinned: dict[str, object] = {}  # transfer id -> the finished request holding the blocks

    # ------------------------------------------------------------------ consumer
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        """(tokens past num_computed_tokens the remote side holds, whether they load
        asynchronously): the prompt minus its last token (computed here, for its logits),
        as far as the producer computed it."""
        params = request.remote_kv
        if params is None or not self.config.can_consume:
            return 0, False
        end = min(int(params["num_tokens"]), request.num_tokens - 1)
        return max(0, end - num_computed_tokens), True

    def update_state_after_alloc(self, request, tables, num_computed_tokens: int, num_external_tokens: int) -> None:
        """Plans the pull of the external zone's blocks (tables: the request's blocks per
        group, hits and new ones). A sliding-window group pulls only the blocks inside the
        window of the next token: the others are freed (KVCacheManager.cache_blocks) before
        anything could read them, as the producer freed its own."""
        params = request.remote_kv
        bs = self.block_size
        end = num_computed_tokens + num_external_tokens
        last = -(-end // bs)
        blocks = []
        for g, (table, window) in enumerate(zip(tables, self.sliding_windows)):
            first = num_computed_tokens // bs
            if window is not None:
                first = max(first, max(0, end - window + 1) // bs)
            blocks += [(g, i, table[i].block_id) for i in range(first, last) if not table[i].is_null]
        blocks = tuple(blocks)
        job = LoadJob(request.request_id, (str(params["remote_host"]), int(params["remote_port"])),
                      str(params["transfer_id"]), blocks, end, tokens_digest(request.all_token_ids[:end]),
                      self.clock() + self.config.timeout)
        self._loading[request.request_id] = job
        self._meta.loads.append(job)

    def load_finished(self, request_id: str, num_local_tokens: int | None) -> int:
        """The request's pull ended, its pages in (num_local_tokens: its local prefix hit)
        or failed (None). Returns the tokens the pages cover (local hit + external)."""
        job = self._loading.pop(request_id)
        if num_local_tokens is None:
            self.stats.num_remote_load_failures += 1
        else:
            self.stats.num_remote_loads += 1
            self.stats.num_external_tokens += job.num_tokens - num_local_tokens
        return job.num_tokens

    def release_unused(self, request) -> None:
        """The request will not pull what its kv_transfer_params offer (its prefix was all
        here, or it ended first): the producer is told, so it frees the blocks at once
        instead of at the offer's timeout."""
        params = request.remote_kv
        request.remote_kv = None
        if params is not None and self.config.can_consume:
            self._meta.releases.append(((str(params["remote_host"]), int(params["remote_port"])),
                                        str(params["transfer_id"])))

    def cancel_load(self, request_id: str) -> None:
        """An aborted request: its pull's pages must never be put."""
        if self._loading.pop(request_id, None) is not None:
            self._meta.cancelled_loads.append(request_id)

    # ------------------------------------------------------------------ producer
    def request_finished(self, request, tables) -> tuple[bool, dict | None]:
        """(keep the blocks pinned, the kv_transfer_params to return) for a finished request."""
        params = request.sampling_params.transfer_params
        if (not self.config.can_produce or params is None or not params.get("do_remote_decode")
                or request.get_finished_reason() == "abort" or self.address is None):
            return False, None
        num_tokens = min(request.num_computed_tokens, request.num_prompt_tokens)
        transfer_id = uuid.uuid4().hex
        offer = Offer(transfer_id, tuple(tuple(block.block_id for block in table) for table in tables), num_tokens,
                      tuple(request.all_token_ids[:num_tokens]), self.clock() + self.config.timeout)
        self._pinned[transfer_id] = request
        self._meta.offers.append(offer)
        self.stats.num_offers += 1
        host, port = self.address
        return True, {"do_remote_prefill": True, "remote_host": host, "remote_port": port,
                      "transfer_id": transfer_id, "num_tokens": num_tokens}

    def transfer_done(self, transfer_id: str):
        """The request an offer pinned (None if unknown): pulled or expired, free it now."""
        return self._pinned.pop(transfer_id, None)

    @property
    def num_pinned(self) -> int:
        return len(self._pinned)

    @property
    def num_loading(self) -> int:
        return len(self._loading)

    # ------------------------------------------------------------------ per step
    def build_connector_meta(self) -> KVConnectorMetadata:
        meta, self._meta = self._meta, KVConnectorMetadata()
        return meta


def remote_kv_params(sampling_params) -> dict | None:
    """A consumer request's kv_transfer_params, checked (ValueError naming the key), or
    None when it asks for no remote prefill."""
    params = sampling_params.transfer_params
    if params is None or not params.get("do_remote_prefill"):
        return None
    for key in ("remote_host", "remote_port", "transfer_id", "num_tokens"):
        if key not in params:
            raise ValueError(f"kv_transfer_params with do_remote_prefill lacks {key!r}; pass what the producer "
                             "returned, whole")
    check_peer_address("kv_transfer_params remote_host:remote_port", f"{params['remote_host']}:{params['remote_port']}")
    if isinstance(params["num_tokens"], bool) or not isinstance(params["num_tokens"], int) or params["num_tokens"] < 0:
        raise ValueError(f"kv_transfer_params num_tokens={params['num_tokens']!r} must be an int >= 0")
    return params
