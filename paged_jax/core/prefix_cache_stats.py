"""PrefixCacheStats: the prefix cache's lookup counters (vLLM's PrefixCacheStats). Imports no jax."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups since the manager was created (vLLM's PrefixCacheStats, cumulative).

    A lookup counts once, when its request is admitted (KVCacheManager.allocate_slots), however
    many steps the request waited at the head of the queue. Lookups of preempted requests (resuming with most of their own blocks) are counted
    apart, so they do not inflate the hit rate of fresh requests. Reading them changes
    nothing; a caller that wants intervals subtracts two snapshots (`copy()`).
    """

    num_resets: int = 0  # reset_prefix_cache() calls that succeeded
    requests: int = 0
    queries: int = 0  # tokens looked up
    hits: int = 0  # tokens found
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits

    def copy(self) -> PrefixCacheStats:
        return dataclasses.replace(self)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0
