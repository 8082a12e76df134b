"""Data parallelism: data_parallel_size engine replicas behind one LLM, routed by cached prefix.

Each replica is a whole LLMEngine (its own block pool, scheduler and compiled programs) on
its own tensor_parallel_size devices: replica i runs on devices [i * tp, (i + 1) * tp). The
weights are loaded once and placed on each replica's devices.

Routing (vLLM's prefix-aware routing, by hash lookup): a request goes to the replica that
holds the longest prefix of its full blocks, else to the least loaded one (fewest live
requests; ties to the lowest index). A replica "holds" a block when the block's hash is in
its pool's prefix cache, or when a live request routed to it has that block: requests
sharing a system prompt that arrive together (before any of them ran) then still land on
the same replica. All replicas share one hash-chain root (hash_seed), so the router hashes
a prompt once and looks the hashes up in every pool. There is no load cap: one very hot
prefix keeps its requests on one replica (vLLM's router weighs load in; that is a later step).

A step steps every replica that has work, each on its own thread (the host side is Python;
the device programs release the GIL and run concurrently), and returns their outputs.
One process only: across processes, one engine spans the hosts with tensor parallelism
(paged_jax/multiprocess.py).
"""

from __future__ import annotations

import collections
import dataclasses
import secrets
from concurrent.futures import ThreadPoolExecutor

import jax

from paged_jax.core.request import Request, SamplingParams
from paged_jax.engine import LLMEngine


class DataParallelEngine:
    """The EngineClient protocol (paged_jax/engine_client.py), as LLMEngine implements it,
    over config.data_parallel_size replicas.

    Args:
      config: an EngineConfig; every replica gets it with data_parallel_size=1 and one
        shared hash_seed (a random one if it has none).
      warm_up_progress: as LLMEngine's, reported by the first replica.
      devices: the devices to split into replicas (default jax.devices()).
    """

    def __init__(self, config, *, warm_up_progress=None, devices=None):
        dp, tp = config.data_parallel_size, config.tensor_parallel_size
        if jax.process_count() > 1:
            raise ValueError(f"data_parallel_size={dp} runs replicas in one process; across processes use "
                             "tensor_parallel_size (one engine over every host's devices)")
        devices = list(jax.devices() if devices is None else devices)
        if dp * tp > len(devices):
            raise ValueError(f"data_parallel_size={dp} x tensor_parallel_size={tp} needs {dp * tp} devices; jax sees "
                             f"{len(devices)} ({jax.default_backend()})")
        seed = config.hash_seed if config.hash_seed is not None else secrets.token_hex(16)
        replica_config = dataclasses.replace(config, data_parallel_size=1, hash_seed=seed)
        first = LLMEngine(replica_config, devices=devices[:tp], warm_up_progress=warm_up_progress)
        self.replicas = [first] + [
            LLMEngine(replica_config, model=first.model, tokenizer=first.tokenizer,
                      devices=devices[i * tp: (i + 1) * tp]) for i in range(1, dp)]
        self.config = config
        self.model, self.tokenizer = first.model, first.tokenizer
        # Same seed, so this hasher's hashes are every replica's.
        self._hasher = first.kv_cache_manager.block_hasher
        self._replica_of: dict[str, int] = {}  # live request -> its replica
        self._block_hashes: dict[str, list[bytes]] = {}  # live request -> its prompt's full-block hashes
        # Per replica: block hash -> live routed requests whose prompt has that block.
        self._routed_hashes = [collections.Counter() for _ in self.replicas]
        self.num_routed_by_prefix = 0  # requests sent where their prefix was, not to the least loaded
        self._threads = ThreadPoolExecutor(dp, thread_name_prefix="paged-jax-dp")

    # routing
    def _num_held_blocks(self, replica: int, block_hashes: list[bytes]) -> int:
        is_cached = self.replicas[replica].kv_cache_manager.has_cached_block
        routed = self._routed_hashes[replica]
        n = 0
        for block_hash in block_hashes:
            if not routed[block_hash] and not is_cached(block_hash):
                break
            n += 1
        return n

    def _choose_replica(self, block_hashes: list[bytes]) -> int:
        held = [self._num_held_blocks(r, block_hashes) for r in range(len(self.replicas))]
        load = collections.Counter(self._replica_of.values())
        best = max(held)
        if best > 0:
            self.num_routed_by_prefix += 1
        # Longest held prefix first, then the fewest live requests, then the lowest index.
        return min((r for r in range(len(self.replicas)) if held[r] == best), key=lambda r: (load[r], r))

    def replica_of(self, request_id: str) -> int | None:
        """The replica a live request was routed to (None once it finished or if unknown)."""
        return self._replica_of.get(request_id)

    # LLMEngine's interface
    def add_request(self, request_id: str, prompt, sampling_params: SamplingParams | None = None, *,
                    cache_salt: str | None = None, arrival_time: float | None = None) -> None:
        """Routes one request (see the module docstring) and queues it there; ValueError as
        LLMEngine.add_request (and for an id that is already live on any replica)."""
        if request_id in self._replica_of:
            raise ValueError(f"request_id={request_id!r} is already running; give each request a unique id")
        try:
            token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
            probe = Request(request_id, token_ids, SamplingParams(), cache_salt=cache_salt)
            probe.set_block_hasher(self._hasher)
            block_hashes = list(probe.block_hashes)
        except (TypeError, ValueError):  # bad input: the replica's add_request says what is wrong
            block_hashes = []
        replica = self._choose_replica(block_hashes)
        self.replicas[replica].add_request(request_id, prompt, sampling_params, cache_salt=cache_salt,
                                           arrival_time=arrival_time)
        self._replica_of[request_id] = replica
        self._block_hashes[request_id] = block_hashes
        self._routed_hashes[replica].update(block_hashes)

    def _release(self, request_id: str) -> None:
        replica = self._replica_of.pop(request_id)
        self._routed_hashes[replica].subtract(self._block_hashes.pop(request_id))
        self._routed_hashes[replica] += collections.Counter()  # drops the zero counts

    def abort_request(self, request_id: str) -> bool:
        replica = self._replica_of.get(request_id)
        if replica is None or not self.replicas[replica].abort_request(request_id):
            return False
        self._release(request_id)
        return True

    def has_unfinished_requests(self) -> bool:
        return any(engine.has_unfinished_requests() for engine in self.replicas)

    def step(self) -> list:
        """One step of every replica with work, concurrently; their outputs, replica by replica."""
        busy = [engine for engine in self.replicas if engine.has_unfinished_requests()]
        outputs = [out for outs in self._threads.map(lambda engine: engine.step(), busy) for out in outs]
        for out in outputs:
            if out.finished and out.request_id in self._replica_of:
                self._release(out.request_id)
        return outputs

    def chat_prompt(self, messages, *, add_generation_prompt: bool = True, chat_template: str | None = None,
                    sampling_params: SamplingParams | None = None) -> tuple[list[int], SamplingParams]:
        return self.replicas[0].chat_prompt(messages, add_generation_prompt=add_generation_prompt,
                                            chat_template=chat_template, sampling_params=sampling_params)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.replicas[0].eos_token_ids

    @property
    def max_model_len(self) -> int:
        return self.replicas[0].max_model_len

    def reset_prefix_cache(self) -> bool:
        """Every replica's (see LLMEngine.reset_prefix_cache); True only if each one reset.
        A replica with requests still holding blocks keeps its cache while the idle ones drop theirs."""
        return all([engine.reset_prefix_cache() for engine in self.replicas])  # a list: no short circuit

    def shutdown(self) -> None:
        """Every replica's shutdown, then the step threads'. Idempotent."""
        for engine in self.replicas:
            engine.shutdown()
        self._threads.shutdown(wait=True)

    def get_stats(self) -> dict:
        """Totals over the replicas (prefix hit rate over all their lookups), and each one's stats."""
        per_replica = [engine.get_stats() for engine in self.replicas]
        total = {key: sum(stats[key] for stats in per_replica)
                 for key in ("num_running_reqs", "num_waiting_reqs", "num_preemptions", "num_finished", "num_aborted",
                             "prefix_cache_queries", "prefix_cache_hits", "num_compilations", "num_generated_tokens",
                             "num_prompt_tokens_computed",
                             "num_blocks", "kv_cache_bytes")}
        queries = total["prefix_cache_queries"]
        return {
            **total,
            "prefix_cache_hit_rate": total["prefix_cache_hits"] / queries if queries else 0.0,
            "data_parallel_size": len(self.replicas),
            "tensor_parallel_size": self.config.tensor_parallel_size,
            "num_routed_by_prefix": self.num_routed_by_prefix,
            "replicas": per_replica,
        }
