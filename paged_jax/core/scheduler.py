"""Token-budget scheduler: continuous batching, chunked prefill, prefix caching, preemption.

vLLM v1's policy (one queue of waiting requests, one list of running ones, no prefill or
decode phases): each step has a budget of max_num_batched_tokens tokens and at most
max_num_seqs running requests.

1. Running requests, in admission order, each get what they still need (1 token for a
   decode; min(remaining prompt, budget) for a request still prefilling: chunked prefill).
   When allocate_slots cannot cover one, the most recently admitted running request is
   preempted by recompute (blocks freed, num_computed_tokens = 0, FRONT of the waiting
   queue), which may be the request itself; then the allocation is retried. With
   preemption_mode="swap" its pages go to the host tier first (KVCacheManager.swap_out) and
   its lookup on resumption finds them; recompute when the tier has no room.
2. Only in a step that preempted nothing: waiting requests in FCFS order, each after a
   prefix-cache lookup; the first that does not fit in the budget gets a chunk, the first
   whose blocks do not fit stops admission (no skipping ahead: FCFS).

num_computed_tokens advances in schedule(), as in vLLM: the step's tokens are as good as
computed once scheduled. A request samples when its scheduled tokens reach the end of
its known tokens; a chunk that ends mid-prompt samples nothing.

Speculative decoding (core/spec_decode.py): a decoding request's proposals
(request.spec_token_ids) ride along with its last token, as many as the budget leaves room
for; their slots are lookahead slots (never cached). update_from_output appends the tokens
the target accepted plus its own, one at a time through the stop checks (an EOS or
max_tokens inside an accepted run ends the request there), and rolls num_computed_tokens
back past the rejected proposals. With a draft model every allocation also reserves
SchedulerConfig.num_lookahead_tokens slots past the scheduled tokens, where the draft writes
its KV while it proposes for the next step.

Disaggregation (core/kv_connector.py): with a KV connector, a waiting request whose
kv_transfer_params point at a producer gets blocks for its external zone after its local
prefix hit, and waits in `remote_waiting` (WAITING_FOR_REMOTE_KVS) until the worker reports
the pull done (back to the front of the queue, its blocks cached, only the tokens past the
pulled ones left to compute) or failed (its blocks freed, prefilled locally). A producer's
request that finishes with do_remote_decode keeps its blocks until the connector says they
were pulled or the offer expired. Imports no jax.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

from paged_jax.core.batch import needs_logits_processing
from paged_jax.core.config import SchedulerConfig
from paged_jax.core.kv_cache_manager import KVCacheManager
from paged_jax.core.request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    """Who runs in one step. Index i of every list is sequence i of the step: running
    requests first (admission order), then newly admitted or resumed ones.

    Attributes:
      requests: the scheduled requests.
      num_computed_tokens: tokens already in the KV cache BEFORE this step.
      num_scheduled_tokens: tokens computed this step (positions computed .. computed + n - 1).
      samples: whether the step's last token yields a sampled next token.
      new_block_ids: newly admitted / resumed (is_new): the whole block table, one list per
        KV-cache group; else the blocks allocated this step, one list per group, or () when
        the step allocated none (most decodes).
      is_new: whether new_block_ids is a whole table (a fresh start for the request).
      preempted_req_ids: requests preempted in this step (they hold no blocks now).
      finished_req_ids: requests finished or aborted since the previous schedule().
      spec_token_ids: per request, the proposals scheduled after its last token (the last
        len(...) of its num_scheduled_tokens); empty for most.
      num_steps: decode steps the step may run (SchedulerConfig.num_scheduler_steps, when
        every scheduled request decodes one token and none waits that max_num_seqs would
        admit; else 1): each request holds slots for num_steps - 1 tokens past its own, and
        update_from_output takes up to num_steps tokens a request.
    """

    requests: list[Request] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    samples: list[bool] = field(default_factory=list)
    new_block_ids: list[tuple[list[int], ...]] = field(default_factory=list)
    is_new: list[bool] = field(default_factory=list)
    preempted_req_ids: list[str] = field(default_factory=list)
    finished_req_ids: list[str] = field(default_factory=list)
    spec_token_ids: list[list[int]] = field(default_factory=list)
    total_num_scheduled_tokens: int = 0
    num_steps: int = 1

    @property
    def num_seqs(self) -> int:
        return len(self.requests)

    @property
    def req_ids(self) -> list[str]:
        return [r.request_id for r in self.requests]

    def _add(self, request: Request, num_tokens: int, block_ids: tuple[list[int], ...], is_new: bool,
             spec_token_ids: list[int] = ()) -> None:
        self.spec_token_ids.append(list(spec_token_ids))
        self.requests.append(request)
        self.num_computed_tokens.append(request.num_computed_tokens)
        self.num_scheduled_tokens.append(num_tokens)
        self.samples.append(request.num_computed_tokens + num_tokens >= request.num_tokens)
        self.new_block_ids.append(block_ids)
        self.is_new.append(is_new)
        self.total_num_scheduled_tokens += num_tokens


class EngineCoreOutput(NamedTuple):
    """What one request got from one step (vLLM's name)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[float] | None  # only when the request asked for logprobs
    finish_reason: str | None  # "stop" / "length", None while running
    stop_reason: int | None  # the stop_token_ids entry that ended it, if any
    num_cached_tokens: int  # prefix-cache hit tokens at its first schedule (pulled ones included)
    kv_transfer_params: dict | None = None  # a producer's finished request: where to pull its KV


class Scheduler:
    """Decides, each step, which requests run and how many tokens each computes.

    Invariants: every request in `running` holds blocks covering num_computed_tokens;
    `waiting` requests hold none; `requests` maps the id of every unfinished request.
    """

    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager, connector=None):
        if config.max_model_len != kv_cache_manager.max_model_len:
            raise ValueError(f"the scheduler's max_model_len={config.max_model_len} differs from the KV cache's "
                             f"{kv_cache_manager.max_model_len}; resolve both from one EngineConfig")
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = config.max_model_len
        self.long_prefill_token_threshold = config.long_prefill_token_threshold
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Disaggregation: the KV connector's scheduler side (core/kv_connector.py), requests
        # whose external KV is still arriving, and finished requests whose blocks it pins.
        self.connector = connector
        self.remote_waiting: dict[str, Request] = {}
        self._pinned_req_ids: set[str] = set()
        self.num_prompt_tokens_computed = 0  # prompt tokens scheduled for compute (not hit, not pulled)
        self._finished_req_ids: list[str] = []
        self.num_preemptions = 0
        self.num_swap_preemptions = 0
        self.num_recomputed_tokens = 0  # tokens computed again after a preemption lost them
        self._num_lost_tokens: dict[str, int] = {}  # preempted request -> tokens it had computed
        self.num_finished = 0
        self.num_aborted = 0
        self.num_steps = 0
        self.peak_kv_cache_usage = 0.0
        # Speculative decoding's counters (core/spec_decode.py), when the engine proposes.
        self.spec_stats = None

    # admission
    def add_request(self, request: Request) -> None:
        """Queues a request (FCFS). ValueError if it is a duplicate or could never fit."""
        if request.request_id in self.requests or request.request_id in self._pinned_req_ids:
            raise ValueError(f"request id {request.request_id!r} is already in use; give each request a unique id")
        self.kv_cache_manager.check_request(request, self.max_num_batched_tokens)
        assert request.status == RequestStatus.WAITING and request.num_computed_tokens == 0, (
            f"{request!r} was already scheduled elsewhere: a request object is single use"
        )
        self.requests[request.request_id] = request
        self.waiting.append(request)

    # one step
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_req_ids=self._finished_req_ids)
        self._finished_req_ids = []
        kv = self.kv_cache_manager
        budget = self.max_num_batched_tokens
        threshold = self.long_prefill_token_threshold

        num_steps = self.config.num_scheduler_steps
        if num_steps > 1 and not self._window_opens(num_steps):
            num_steps = 1

        # running requests first
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = request.num_tokens - request.num_computed_tokens
            if 0 < threshold < num_new:
                num_new = threshold
            num_new = min(num_new, budget)  # stop checks keep num_tokens <= max_model_len
            assert num_new > 0, f"{request!r} is running with nothing to compute: a missed stop check"
            spec = request.spec_token_ids
            if spec:  # a decode's proposals, as many as the budget and the context allow
                room = min(budget - num_new, self.max_model_len - request.num_tokens) if num_new == 1 else 0
                spec = spec[:room] if room < len(spec) else spec
            lookahead = len(spec) + self._draft_lookahead(request.num_computed_tokens + num_new + len(spec))
            lookahead += num_steps - 1
            while (new_blocks := kv.allocate_slots(request, num_new, num_lookahead_tokens=lookahead)) is None:
                victim = self.running.pop()  # the most recently admitted; never one already scheduled
                self._preempt(victim)
                out.preempted_req_ids.append(victim.request_id)
                if victim is request:
                    break
            if new_blocks is None:
                break  # the request preempted itself, and everything after it went first
            num_new += len(spec)
            out._add(request, num_new, new_blocks.get_block_ids() if new_blocks else (), is_new=False,
                     spec_token_ids=spec)
            budget -= num_new
            i += 1

        # then waiting requests, FCFS, unless this step had to preempt
        while not out.preempted_req_ids and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            num_held = request.num_computed_tokens  # > 0: its remote KV landed; it holds those blocks
            if num_held:
                hit_blocks, num_hit_tokens = None, num_held
            else:
                hit_blocks, num_hit_tokens = kv.get_computed_blocks(request)
                if request.remote_kv is not None and self.connector is not None:
                    num_external, _ = self.connector.get_num_new_matched_tokens(request, num_hit_tokens)
                    if num_external:
                        if not self._start_remote_load(request, hit_blocks, num_hit_tokens, num_external):
                            break  # FCFS: its blocks do not fit yet
                        continue
                    self.connector.release_unused(request)  # every pullable token is a local hit
            num_new = request.num_tokens - num_hit_tokens
            if 0 < threshold < num_new:
                num_new = threshold
            num_new = min(num_new, budget)
            lookahead = self._draft_lookahead(num_hit_tokens + num_new)
            if kv.allocate_slots(request, num_new, num_hit_tokens - num_held, hit_blocks, lookahead) is None:
                break  # FCFS: nobody overtakes the head of the queue
            self.waiting.popleft()
            lost = self._num_lost_tokens.pop(request.request_id, 0)
            self.num_recomputed_tokens += max(0, lost - num_hit_tokens)
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit_tokens
            if request.num_cached_tokens < 0:  # first schedule: the hit that saves time to first token
                request.num_cached_tokens = num_hit_tokens
            out._add(request, num_new, kv.get_block_ids(request.request_id), is_new=True)
            budget -= num_new

        for request, num_tokens in zip(out.requests, out.num_scheduled_tokens):
            prompt_left = request.num_prompt_tokens - request.num_computed_tokens
            if prompt_left > 0:
                self.num_prompt_tokens_computed += min(prompt_left, num_tokens)
            request.num_computed_tokens += num_tokens
        out.num_steps = num_steps
        self.num_steps += 1
        # Usage peaks here: this step's blocks are allocated, finished requests not yet freed.
        self.peak_kv_cache_usage = max(self.peak_kv_cache_usage, kv.usage)
        return out

    # disaggregation
    def _start_remote_load(self, request: Request, hit_blocks, num_hit_tokens: int, num_external: int) -> bool:
        """Allocates the external zone of the head of the queue and hands it to the
        connector; False (nothing changed) if the blocks do not fit."""
        kv = self.kv_cache_manager
        if kv.allocate_slots(request, num_external, num_hit_tokens, hit_blocks, delay_cache_blocks=True) is None:
            return False
        self.waiting.popleft()
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        request.num_computed_tokens = num_hit_tokens
        self.remote_waiting[request.request_id] = request
        self.connector.update_state_after_alloc(request, kv.get_blocks(request.request_id).blocks, num_hit_tokens,
                                                num_external)
        return True

    def update_connector_output(self, output) -> None:
        """Applies what the connector's worker finished (a KVConnectorOutput): landed pulls
        go back to the front of the queue with their tokens computed and cached; failed
        ones free their blocks and prefill locally; pulled or expired offers free theirs."""
        connector = self.connector
        back = []
        for request_id in output.finished_recving:
            request = self.remote_waiting.pop(request_id, None)
            if request is None:
                continue  # aborted while its pages were on their way
            request.num_computed_tokens = connector.load_finished(request_id, request.num_computed_tokens)
            self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)
            back.append(request)
        for request_id, _reason in output.failed_recving:
            request = self.remote_waiting.pop(request_id, None)
            if request is None:
                continue
            connector.load_finished(request_id, None)
            self.kv_cache_manager.free(request)
            request.num_computed_tokens = 0
            back.append(request)
        for request in back:
            request.remote_kv = None  # pulled, or failed: never again
            request.status = RequestStatus.WAITING
        self.waiting.extendleft(reversed(back))
        for transfer_id in output.finished_sending:
            request = connector.transfer_done(transfer_id)
            if request is not None:
                self._pinned_req_ids.discard(request.request_id)
                self.kv_cache_manager.free(request)

    def _window_opens(self, num_steps: int) -> bool:
        """Whether this step may run num_steps decode steps (multi-step scheduling): nobody
        waits who could be admitted now (max_num_seqs is not full), so no arrival waits for a
        window where it could have started, and every running request can take the window: it
        decodes one token (no proposals, no prompt left), its last step's position stays within
        max_model_len, and its sampling reads nothing the host updates between steps (a
        grammar, penalties)."""
        if not self.running or (self.waiting and len(self.running) < self.max_num_seqs):
            return False
        return all(r.num_tokens - r.num_computed_tokens == 1 and not r.spec_token_ids
                   and r.num_tokens + num_steps - 1 <= self.max_model_len and not needs_logits_processing(r)
                   for r in self.running)

    def _draft_lookahead(self, num_tokens: int) -> int:
        """Slots a draft model needs past a request's first num_tokens (its scheduled ones):
        num_lookahead_tokens, capped at max_model_len."""
        return max(0, min(self.config.num_lookahead_tokens, self.max_model_len - num_tokens))

    def _preempt(self, request: Request) -> None:
        self._num_lost_tokens[request.request_id] = request.num_computed_tokens
        if self.config.preemption_mode == "swap" and self.kv_cache_manager.swap_out(request):
            self.num_swap_preemptions += 1
        else:
            self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    def update_from_output(self, scheduler_output: SchedulerOutput, sampled_token_ids, logprobs=None,
                           num_accepted=None, num_steps: int = 1):
        """Appends each sampling request's tokens, applies the stop checks and frees the
        finished ones.

        Args:
          scheduler_output: what schedule() returned for this step.
          sampled_token_ids: i32[>= num_seqs] (padded device output is fine), or with
            num_accepted i32[>= num_seqs, 1 + k] (a verification step: row i's tokens are its
            first num_accepted[i] + 1); row i belongs to scheduled request i; rows of requests
            that do not sample are ignored.
          logprobs: optional, the sampled tokens' logprobs, shaped as sampled_token_ids.
          num_accepted: i32[>= num_seqs] proposals the target accepted per row, or None (a
            step without proposals).
          num_steps: decode steps the step ran (at most scheduler_output.num_steps); above 1,
            sampled_token_ids is i32[>= num_seqs, num_steps] (row i: its request's tokens in
            order, whose KV the steps wrote but the last one's), taken up to a stop.
        Returns:
          list[EngineCoreOutput], one per request that got tokens this step.
        """
        tokens = sampled_token_ids.tolist() if hasattr(sampled_token_ids, "tolist") else list(sampled_token_ids)
        if logprobs is not None and hasattr(logprobs, "tolist"):
            logprobs = logprobs.tolist()
        if num_accepted is not None:
            num_accepted = num_accepted.tolist() if hasattr(num_accepted, "tolist") else list(num_accepted)
        spec_lists = scheduler_output.spec_token_ids
        outputs, any_finished = [], False
        for i, (request, samples) in enumerate(zip(scheduler_output.requests, scheduler_output.samples)):
            if not samples or request.status != RequestStatus.RUNNING:
                continue  # mid-prompt chunk, or aborted between schedule and update
            request.spec_token_ids = []
            if num_steps > 1:
                assert num_accepted is None and num_steps <= scheduler_output.num_steps, "steps it has no slots for"
                request.num_computed_tokens += num_steps - 1  # the steps after the scheduled one
                row = tokens[i][:num_steps]
                row_logprobs = logprobs[i][:num_steps] if logprobs is not None else None
            elif num_accepted is None:
                row, row_logprobs = [tokens[i]], [logprobs[i]] if logprobs is not None else None
            else:
                accepted = int(num_accepted[i])
                num_spec = len(spec_lists[i]) if spec_lists else 0
                assert accepted <= num_spec, f"{accepted} proposals accepted of {num_spec} scheduled"
                if num_spec:
                    request.num_computed_tokens -= num_spec - accepted  # the rejected ones' slots
                    if self.spec_stats is not None:
                        self.spec_stats.record(num_spec, accepted)
                row = tokens[i][: accepted + 1]
                row_logprobs = logprobs[i][: accepted + 1] if logprobs is not None else None
            new_token_ids, stop_reason = [], None
            for token in row:
                request.append_output_token_ids(int(token))
                new_token_ids.append(int(token))
                stop_reason = self._check_stop(request)
                if request.is_finished():
                    break
            transfer_params = None
            if request.is_finished():
                any_finished = True
                transfer_params = self._free_request(request)
                self.num_finished += 1
            want_logprobs = row_logprobs is not None and request.sampling_params.logprobs
            outputs.append(EngineCoreOutput(
                request.request_id, new_token_ids,
                [float(x) for x in row_logprobs[: len(new_token_ids)]] if want_logprobs else None,
                request.get_finished_reason(), stop_reason, request.num_cached_tokens, transfer_params,
            ))
        if any_finished:
            self.running = [r for r in self.running if r.status == RequestStatus.RUNNING]
        return outputs

    def _check_stop(self, request: Request) -> int | None:
        """Sets a finished status when the request must stop (vLLM's check_stop order:
        length, EOS, stop tokens). Returns the stop token that ended it, if any."""
        if request.num_tokens >= self.max_model_len or request.num_output_tokens >= request.max_tokens:
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return None
        params = request.sampling_params
        last = request.output_token_ids[-1]
        if not params.ignore_eos and last == request.eos_token_id:
            request.status = RequestStatus.FINISHED_STOPPED
            return None
        if last in params.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            return last
        return None

    def _free_request(self, request: Request) -> dict | None:
        """Frees a finished request's blocks, unless a producer's connector pins them for a
        consumer to pull; returns the kv_transfer_params that say where (or None)."""
        self._num_lost_tokens.pop(request.request_id, None)
        delay_free, transfer_params = False, None
        if self.connector is not None:
            delay_free, transfer_params = self.connector.request_finished(
                request, self.kv_cache_manager.get_blocks(request.request_id).blocks)
        if delay_free:
            self._pinned_req_ids.add(request.request_id)
        else:
            self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        self._finished_req_ids.append(request.request_id)
        return transfer_params

    def abort_request(self, request_id: str) -> bool:
        """Stops a request wherever it is and frees its blocks; False if it is unknown or
        already finished."""
        request = self.requests.get(request_id)
        if request is None:
            return False
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            del self.remote_waiting[request_id]
            self.connector.cancel_load(request_id)
        else:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED_ABORTED
        if self.connector is not None:
            self.connector.release_unused(request)  # aborted before it pulled
        self._free_request(request)
        self.num_aborted += 1
        return True

    # state
    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self.waiting or self.remote_waiting)

    def get_num_unfinished_requests(self) -> int:
        return len(self.running) + len(self.waiting) + len(self.remote_waiting)

    def get_stats(self) -> dict:
        return {
            "num_running_reqs": len(self.running),
            "num_waiting_reqs": len(self.waiting),
            "num_waiting_for_remote_kvs": len(self.remote_waiting),
            "num_prompt_tokens_computed": self.num_prompt_tokens_computed,
            "num_preemptions": self.num_preemptions,
            "num_swap_preemptions": self.num_swap_preemptions,
            "num_recomputed_tokens": self.num_recomputed_tokens,
            "num_finished": self.num_finished,
            "num_aborted": self.num_aborted,
            "num_steps": self.num_steps,
            "kv_cache_usage": self.kv_cache_manager.usage,
            "peak_kv_cache_usage": self.peak_kv_cache_usage,
            **(self.spec_stats.as_dict() if self.spec_stats is not None else {}),
        }
