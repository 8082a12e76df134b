"""Stateful property test of the offload tiers: scheduler + manager + host tier on a fake device.

The fake device keeps one page per block whose slots hold TOKEN IDS instead of K/V: a step
writes each scheduled token's id into its slot, after checking that every earlier position
of the request already holds the request's own token there. That is the whole correctness
condition of paging, prefix hits, copy-down / copy-up and swap: the KV a request attends to
is the KV of its own tokens. The reference is the request's token list; no offload code
computes it.

Random interleavings of add / step / abort on tiny pools (heavy eviction and preemption)
with preemption by recompute or swap and a host tier of a few blocks (LRU eviction, swap
fallbacks). After every step: the block pool's invariants and the host tier's (never past
its cap, pins only on held entries). At teardown every request ends and the device pool and
host tier hold nothing but evictable prefix cache: no pins, no private swap pages, no
planned copies.
"""

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from paged_jax.core.config import CacheConfig, SchedulerConfig
from paged_jax.core.kv_cache_manager import KVCacheManager
from paged_jax.core.offload import OffloadConfig, OffloadManager
from paged_jax.core.page_codec import PageCodec, PageLeaf
from paged_jax.core.request import Request, RequestStatus, SamplingParams
from paged_jax.core.scheduler import Scheduler

BS = 4
MAX_LEN = 40
PREFIXES = [[], [7] * 8, [7] * 4 + [9] * 6, [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]]
EMPTY = -1.0


class FakeDevice:
    """Pages of token ids, [num_blocks, block_size, 1, 1] float32 (one leaf)."""

    def __init__(self, num_blocks):
        self.pages = np.full((num_blocks, BS, 1, 1), EMPTY, np.float32)
        self.num_stored = self.num_loaded = 0

    def execute(self, out, copies, kv):
        if copies is not None:
            if copies.store_block_ids.size:
                copies.store([self.pages[copies.store_block_ids].copy()])
                self.num_stored += copies.store_block_ids.size
            if copies.load_block_ids.size:
                self.pages[copies.load_block_ids] = copies.load()[0]
                self.num_loaded += copies.load_block_ids.size
        for request, computed, num_new in zip(out.requests, out.num_computed_tokens, out.num_scheduled_tokens):
            (table,) = kv.get_block_ids(request.request_id)
            tokens = request.all_token_ids
            have = [self.pages[table[p // BS], p % BS, 0, 0] for p in range(computed)]
            assert have == [float(t) for t in tokens[:computed]], (
                f"{request.request_id} attends to KV of other tokens: {have} vs {tokens[:computed]}")
            for p in range(computed, computed + num_new):
                self.pages[table[p // BS], p % BS] = tokens[p]
        # the next token depends on the whole sequence, so a wrong context changes outputs too
        return [(sum(r.all_token_ids) * 7 + r.num_tokens) % 50 for r in out.requests]


class OffloadMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(6, 14), host_blocks=st.integers(1, 16), swap=st.booleans(),
                 caching=st.booleans())
    def setup(self, num_blocks, host_blocks, swap, caching):
        codec = PageCodec([PageLeaf((BS, 1, 1), "float32")])
        self.offload = OffloadManager(OffloadConfig(host_blocks * codec.nbytes), codec, BS)
        self.kv = KVCacheManager(CacheConfig(BS, num_blocks, MAX_LEN, enable_prefix_caching=caching,
                                             hash_seed=0), self.offload)
        self.scheduler = Scheduler(SchedulerConfig(4, 12, MAX_LEN, preemption_mode="swap" if swap else "recompute"),
                                   self.kv)
        self.device = FakeDevice(num_blocks)
        self.next_id = 0

    @rule(prefix=st.sampled_from(PREFIXES), suffix=st.lists(st.integers(0, 49), min_size=1, max_size=14),
          max_tokens=st.integers(1, 12))
    def add(self, prefix, suffix, max_tokens):
        request = Request(f"r{self.next_id}", prefix + suffix, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        self.next_id += 1
        try:
            self.scheduler.add_request(request)
        except ValueError:
            pass  # can never fit this pool: refused up front, nothing changed

    @rule()
    def step(self):
        out = self.scheduler.schedule()
        tokens = self.device.execute(out, self.kv.take_step_copies(), self.kv)
        self.scheduler.update_from_output(out, tokens)

    @precondition(lambda self: self.scheduler.requests)
    @rule(data=st.data())
    def abort(self, data):
        request_id = data.draw(st.sampled_from(sorted(self.scheduler.requests)))
        self.scheduler.abort_request(request_id)

    @invariant()
    def pools_are_consistent(self):
        self.kv.check_invariants(dict(self.scheduler.requests))
        for request in self.scheduler.requests.values():
            assert request.status in (RequestStatus.WAITING, RequestStatus.RUNNING, RequestStatus.PREEMPTED)

    def teardown(self):
        for _ in range(400):
            if not self.scheduler.has_unfinished_requests():
                break
            self.step()
        for request_id in list(self.scheduler.requests):  # if the budget ran out
            self.scheduler.abort_request(request_id)
        self.step()  # a last schedule releases the aborted requests
        assert self.kv.get_num_free_blocks() == self.kv.config.num_usable_blocks
        self.kv.check_invariants({})
        self.offload.check_invariants(idle=True)


# ~60 steps per example; the example count comes from the conftest profile (ci: 200).
OffloadMachine.TestCase.settings = settings(stateful_step_count=60, deadline=None)
TestOffloadProperties = OffloadMachine.TestCase
