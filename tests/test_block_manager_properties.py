"""Stateful property test: the manager against a naive list-based model of the same rules.

Random add / lookup+allocate (whole or chunked prefill, with lookahead) / decode / finish /
preempt / abort / reset steps on a small pool. After every step:
- check_invariants(): the free queue holds exactly the ref_cnt == 0 non-null blocks, every
  ref_cnt equals the number of live requests holding the block, every cached hash maps to
  a block carrying it;
- the model agrees on every block table, the exact free-queue order, every ref_cnt, the
  number of cached hashes and every hit.
The model keys its cache by the full token prefix (plus salt) instead of chain hashes, and
keeps its free queue in a Python list, so it shares no code with the manager. At teardown
every request ends and nothing may leak.

A second machine drives a full-attention + sliding-window pair of groups the same way and,
after every operation, checks the invariants (nulls a prefix of a sliding table, none in a
full one), that a sliding table holds no more than max_blocks_per_request, exactly the nulls
vLLM's rule puts there, and that every hit is the longest prefix both groups accept (found
by trying every length, not by the right-to-left search).
"""

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from paged_jax.core.config import CacheConfig, KVCacheGroupSpec
from paged_jax.core.kv_cache_manager import KVCacheManager
from paged_jax.core.request import Request
from paged_jax.core.single_type_kv_cache_manager import max_blocks_per_request

BS = 4
MAX_LEN = 48
PREFIXES = [[1] * 12, [1] * 8 + [2] * 4, [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8]]


class ModelManager:
    """The allocation rules written the slow, obvious way."""

    def __init__(self, num_blocks):
        self.free = list(range(1, num_blocks))  # head first
        self.ref = [0] * num_blocks
        self.key = [None] * num_blocks  # prefix key of a cached block
        self.cache = {}  # prefix key -> block ids, insertion order
        self.tables = {}
        self.num_cached = {}
        self.num_blocks = num_blocks

    @staticmethod
    def keys(req):
        toks = req.all_token_ids
        return [(req.cache_salt, tuple(toks[: (i + 1) * BS])) for i in range(len(toks) // BS)]

    def lookup(self, req):
        hits = []
        for k in self.keys(req)[: (req.num_tokens - 1) // BS]:
            if not self.cache.get(k):
                break
            hits.append(self.cache[k][0])
        return hits

    def allocate(self, req, num_new, num_new_computed, hits, lookahead):
        rid = req.request_id
        table = self.tables.get(rid, [])
        computed = req.num_computed_tokens + num_new_computed
        need = -(-min(computed + num_new + lookahead, MAX_LEN) // BS)
        evictable = sum(self.ref[b] == 0 for b in hits)
        if need - len(hits) - len(table) + evictable > len(self.free):
            return None
        table = self.tables.setdefault(rid, [])
        for b in hits:
            if self.ref[b] == 0:
                self.free.remove(b)
            self.ref[b] += 1
        table += hits
        if hits:
            self.num_cached[rid] = len(hits)
        new = []
        while len(table) < need:
            b = self.free.pop(0)
            if self.key[b] is not None:  # eviction
                self.cache[self.key[b]].remove(b)
                if not self.cache[self.key[b]]:
                    del self.cache[self.key[b]]
                self.key[b] = None
            self.ref[b] = 1
            new.append(b)
            table.append(b)
        full = min(computed + num_new, req.num_tokens) // BS
        keys = self.keys(req)
        for i in range(self.num_cached.get(rid, 0), full):
            self.key[table[i]] = keys[i]
            self.cache.setdefault(keys[i], []).append(table[i])
        self.num_cached[rid] = max(full, self.num_cached.get(rid, 0))
        return new

    def release(self, rid):
        head, tail = [], []
        for b in reversed(self.tables.pop(rid, [])):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                (head if self.key[b] is None else tail).append(b)
        self.num_cached.pop(rid, None)
        self.free = head + self.free + tail

    def reset(self):
        if len(self.free) != self.num_blocks - 1:
            return False
        self.cache.clear()
        self.key = [None] * self.num_blocks
        return True


def ids(blocks):
    """Block ids of the one KV-cache group's list in a KVCacheBlocks (None stays None)."""
    if blocks is None:
        return None
    (group,) = blocks.get_block_ids()
    return group


class BlockManagerMachine(RuleBasedStateMachine):
    # Few rules, each a whole scheduler action: Hypothesis switches rules off at random per
    # run ("swarm testing"), and with many small rules runs that only add or reset dominate.
    @initialize(num_blocks=st.integers(4, 16))
    def setup(self, num_blocks):
        self.mgr = KVCacheManager(CacheConfig(BS, num_blocks, MAX_LEN))
        self.model = ModelManager(num_blocks)
        self.waiting, self.running, self.requests = [], [], {}
        self.counter = 0

    # Few distinct prompts and position-determined outputs: requests often repeat each
    # other, so hits, duplicate cached blocks and their eviction all happen often.
    @precondition(lambda self: len(self.waiting) < 3)
    @rule(prefix=st.sampled_from(PREFIXES), cut=st.sampled_from([12, 12, 9, 8, 5, 1]),
          suffix=st.lists(st.integers(1, 3), max_size=6), salt=st.sampled_from([None, None, None, "s"]))
    def add(self, prefix, cut, suffix, salt):
        req = Request(f"r{self.counter}", prefix[:cut] + suffix, cache_salt=salt)
        self.counter += 1
        self.waiting.append(req)
        self.requests[req.request_id] = req

    @precondition(lambda self: self.waiting)
    @rule(data=st.data(), chunk=st.integers(1, 40), lookahead=st.integers(0, 3))
    def schedule_waiting(self, data, chunk, lookahead):
        """Lookup + first allocation (whole or chunked prefill) of a waiting request."""
        req = self.waiting[data.draw(st.integers(0, len(self.waiting) - 1))]
        blocks, num_hit = self.mgr.get_computed_blocks(req)
        model_hits = self.model.lookup(req)
        assert ids(blocks) == model_hits and num_hit == len(model_hits) * BS
        num_new = min(chunk, req.num_tokens - num_hit)
        new = self.mgr.allocate_slots(req, num_new, num_hit, blocks, lookahead)
        assert ids(new) == self.model.allocate(req, num_new, num_hit, model_hits, lookahead)
        if new is not None:
            self.waiting.remove(req)
            self.running.append(req)
            self._computed(req, num_hit + num_new)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), chunk=st.integers(1, 8), lookahead=st.integers(0, 2), repeat=st.integers(1, 6))
    def step(self, data, chunk, lookahead, repeat):
        """`repeat` engine steps; each advances the running requests a drawn mask selects."""
        mask = data.draw(st.lists(st.booleans(), min_size=len(self.running), max_size=len(self.running)))
        for _ in range(repeat):
            for req, go in zip(list(self.running), mask):
                if go and req in self.running:
                    num_new = min(chunk, req.num_tokens - req.num_computed_tokens)
                    new = self.mgr.allocate_slots(req, num_new, num_lookahead_tokens=lookahead)
                    assert ids(new) == self.model.allocate(req, num_new, 0, [], lookahead)
                    if new is not None:
                        self._computed(req, req.num_computed_tokens + num_new)
            self.agrees_with_model()

    def _computed(self, req, num_computed):
        req.num_computed_tokens = num_computed
        if num_computed == req.num_tokens:  # prefill done or a decode step: a token is sampled
            if req.num_tokens >= MAX_LEN:
                self._end(req)
            else:
                req.append_output_token_ids(1 + req.num_tokens % 3)

    def _end(self, req):
        self.mgr.free(req)
        self.model.release(req.request_id)
        self.running.remove(req)
        del self.requests[req.request_id]

    @rule(data=st.data(), kind=st.sampled_from(["finish", "finish", "preempt", "preempt", "abort", "reset"]))
    def interrupt(self, data, kind):
        """Finish or preempt a running request, abort a waiting one, or reset the cache."""
        if kind == "reset":
            assert self.mgr.reset_prefix_cache() == self.model.reset()
            return
        pool = self.running if kind != "abort" else self.waiting
        if not pool:
            return
        req = pool[data.draw(st.integers(0, len(pool) - 1))]
        if kind == "finish":
            self._end(req)
        elif kind == "preempt":  # recompute: free everything, back to the front of the queue
            self.running.remove(req)
            self.mgr.free(req)
            self.model.release(req.request_id)
            req.num_computed_tokens = 0
            req.num_preemptions += 1
            self.waiting.insert(0, req)
        else:
            self.waiting.remove(req)
            self.mgr.free(req)  # holds nothing: a no-op
            del self.requests[req.request_id]

    @invariant()
    def agrees_with_model(self):
        if not hasattr(self, "mgr"):
            return
        self.mgr.check_invariants(self.requests)
        pool = self.mgr.block_pool
        assert [b.block_id for b in pool.free_block_queue.get_all_free_blocks()] == self.model.free
        assert [b.ref_cnt for b in pool.blocks[1:]] == self.model.ref[1:]
        assert len(pool.cached_block_hash_to_block) == len(self.model.cache)
        for rid in self.requests:
            assert self.mgr.get_block_ids(rid) == (self.model.tables.get(rid, []),)

    def teardown(self):
        if not hasattr(self, "mgr"):
            return
        for req in list(self.running):
            self._end(req)
        self.mgr.check_invariants()
        assert self.mgr.get_num_free_blocks() == self.mgr.config.num_usable_blocks, "blocks leaked"
        assert all(b.ref_cnt == 0 for b in self.mgr.block_pool.blocks), "references leaked"
        managers = self.mgr.coordinator.managers
        assert not any(m.req_to_blocks or m.num_cached_block for m in managers), "per-request state leaked"


# ~50 steps per example: thousands of steps under the "ci" profile (200 examples), a couple of
# seconds under "dev" (30 examples).
BlockManagerMachine.TestCase.settings = settings(stateful_step_count=50, deadline=None)
TestBlockManager = BlockManagerMachine.TestCase


# ---------------------------------------------------------------- full + sliding window
MAX_CHUNK = 8  # tokens one step computes for a request
MAX_LOOKAHEAD = 2


class SlidingPairMachine(RuleBasedStateMachine):
    """Group 0 full attention, groups 1.. sliding windows of W tokens (one or two: two of one
    spec are looked up together), one pool."""

    @initialize(num_blocks=st.integers(6, 24), window=st.sampled_from([1, 5, 8, 12]), num_sliding=st.integers(1, 2))
    def setup(self, num_blocks, window, num_sliding):
        self.window = window
        self.groups = (KVCacheGroupSpec((0,)),) + tuple(
            KVCacheGroupSpec((g,), "sliding_window", sliding_window=window) for g in range(1, num_sliding + 1))
        self.mgr = KVCacheManager(CacheConfig(BS, num_blocks, MAX_LEN, kv_cache_groups=self.groups))
        # A table's coverage can run MAX_LOOKAHEAD past a step's own slots (an earlier step's lookahead).
        self.bound = max_blocks_per_request(self.groups[1], BS, MAX_LEN, MAX_CHUNK + 2 * MAX_LOOKAHEAD)
        self.waiting, self.running, self.requests = [], [], {}
        self.counter = 0

    def skipped_blocks(self, num_computed):
        return max(0, num_computed - self.window + 1) // BS

    def accepts(self, req, num_blocks):
        """Whether both groups can resume req after num_blocks cached blocks, by the rule: full
        attention needs all of them, the sliding group the max(1, cdiv(W - 1, 4)) before the
        hit point (all of them when there are fewer)."""
        if num_blocks == 0:
            return True
        pool = self.mgr.block_pool
        hashes = req.block_hashes
        num_needed = max(1, -(-(self.window - 1) // BS))
        return (all(pool.get_cached_block(hashes[i], 0) is not None for i in range(num_blocks))
                and all(pool.get_cached_block(hashes[i], g) is not None for g in range(1, len(self.groups))
                        for i in range(max(0, num_blocks - num_needed), num_blocks)))

    def check_hit(self, req, hits, num_hit):
        full, *windows = hits.blocks
        assert all(len(w) == len(full) for w in windows) and num_hit == len(full) * BS
        max_num_blocks = (req.num_tokens - 1) // BS
        expected = max(n for n in range(max_num_blocks + 1) if self.accepts(req, n))
        assert len(full) == expected, f"hit of {len(full)} blocks, but {expected} are accepted by both groups"
        pool = self.mgr.block_pool
        for i, b in enumerate(full):
            assert b is pool.get_cached_block(req.block_hashes[i], 0)
        for g, window in enumerate(windows, 1):
            for i, b in enumerate(window):
                assert b.is_null or b is pool.get_cached_block(req.block_hashes[i], g)

    def check_table(self, req, nulls_before):
        """After an allocation: the sliding nulls vLLM's rule leaves (every sliding group alike),
        within the bound."""
        full_ids, *windows = self.mgr.get_block_ids(req.request_id)
        assert 0 not in full_ids
        for window_ids in windows:
            num_nulls = window_ids.count(0)
            assert window_ids[:num_nulls] == [0] * num_nulls
            expected = max(nulls_before, min(self.skipped_blocks(req.num_computed_tokens), len(window_ids)))
            assert num_nulls == expected, f"{num_nulls} null blocks, expected {expected}: {window_ids}"
            assert len(window_ids) - num_nulls <= self.bound, f"{window_ids} holds more than {self.bound} blocks"
        self.mgr.check_invariants(self.requests)

    @precondition(lambda self: len(self.waiting) < 3)
    @rule(prefix=st.sampled_from(PREFIXES), cut=st.sampled_from([12, 12, 9, 8, 5, 1]),
          suffix=st.lists(st.integers(1, 3), max_size=6))
    def add(self, prefix, cut, suffix):
        req = Request(f"r{self.counter}", prefix[:cut] + suffix)
        self.counter += 1
        self.waiting.append(req)
        self.requests[req.request_id] = req

    @precondition(lambda self: self.waiting)
    @rule(data=st.data(), chunk=st.integers(1, MAX_CHUNK), lookahead=st.integers(0, MAX_LOOKAHEAD))
    def schedule_waiting(self, data, chunk, lookahead):
        req = self.waiting[data.draw(st.integers(0, len(self.waiting) - 1))]
        hits, num_hit = self.mgr.get_computed_blocks(req)
        self.check_hit(req, hits, num_hit)
        num_new = min(chunk, req.num_tokens - num_hit)
        new = self.mgr.allocate_slots(req, num_new, num_hit, hits, lookahead)
        if new is None:
            assert self.mgr.get_block_ids(req.request_id) == ([],) * len(self.groups)
            return
        # A new table: its hits before the window of the hit tokens are null.
        nulls = self.skipped_blocks(num_hit)
        req.num_computed_tokens = num_hit
        self.check_table(req, nulls)
        self.waiting.remove(req)
        self.running.append(req)
        self._computed(req, num_hit + num_new)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), chunk=st.integers(1, MAX_CHUNK), lookahead=st.integers(0, MAX_LOOKAHEAD),
          repeat=st.integers(1, 12))
    def step(self, data, chunk, lookahead, repeat):
        mask = data.draw(st.lists(st.booleans(), min_size=len(self.running), max_size=len(self.running)))
        for _ in range(repeat):
            for req, go in zip(list(self.running), mask):
                if go and req in self.running:
                    num_new = min(chunk, req.num_tokens - req.num_computed_tokens)
                    nulls_before = self.mgr.get_block_ids(req.request_id)[1].count(0)
                    if self.mgr.allocate_slots(req, num_new, num_lookahead_tokens=lookahead) is None:
                        # The window's blocks were freed even so (vLLM frees before checking room).
                        self.check_table(req, nulls_before)
                        self._preempt(req)
                        continue
                    self.check_table(req, nulls_before)
                    self._computed(req, req.num_computed_tokens + num_new)

    def _computed(self, req, num_computed):
        req.num_computed_tokens = num_computed
        if num_computed == req.num_tokens:
            if req.num_tokens >= MAX_LEN:
                self._end(req)
            else:
                req.append_output_token_ids(1 + req.num_tokens % 3)

    def _end(self, req):
        self.mgr.free(req)
        self.running.remove(req)
        del self.requests[req.request_id]

    def _preempt(self, req):
        self.running.remove(req)
        self.mgr.free(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.waiting.insert(0, req)

    @rule(data=st.data(), kind=st.sampled_from(["finish", "preempt", "preempt", "reset"]))
    def interrupt(self, data, kind):
        if kind == "reset":
            assert self.mgr.reset_prefix_cache() == (not self.running)
            return
        if not self.running:
            return
        req = self.running[data.draw(st.integers(0, len(self.running) - 1))]
        self._end(req) if kind == "finish" else self._preempt(req)

    @invariant()
    def invariants_hold(self):
        if hasattr(self, "mgr"):
            self.mgr.check_invariants(self.requests)

    def teardown(self):
        if not hasattr(self, "mgr"):
            return
        for req in list(self.running):
            self._end(req)
        self.mgr.check_invariants()
        assert self.mgr.get_num_free_blocks() == self.mgr.config.num_usable_blocks, "blocks leaked"
        assert all(b.ref_cnt == 0 for b in self.mgr.block_pool.blocks[1:]), "references leaked"
        assert not any(m.req_to_blocks or m.num_cached_block for m in self.mgr.coordinator.managers)


SlidingPairMachine.TestCase.settings = settings(stateful_step_count=50, deadline=None)
TestSlidingPair = SlidingPairMachine.TestCase
