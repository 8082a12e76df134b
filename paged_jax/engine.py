"""LLMEngine: continuous batching over a paged KV cache (add_request / step / abort_request).

One step reads schedule -> run -> update; everything else (validation, detokenization,
metrics) happens around it. The config is paged_jax/engine_config.py, the outputs
paged_jax/outputs.py, the offline LLM facade paged_jax/llm.py.
"""

from __future__ import annotations

import dataclasses
import numbers
import os
import threading
import time

import jax
# backends_are_initialized: jax has no public way to ask whether its clients exist yet.
from jax._src import xla_bridge

from models.registry import load_model, load_tokenizer
from paged_jax.chat import chat_prompt
from paged_jax.compile_cache import enable_compile_cache
from paged_jax.core.batch import StepInputsBuilder, build_logits_processing
from paged_jax.core.hashing import digest_nbytes
from paged_jax.core.kv_cache_manager import KVCacheManager
from paged_jax.core.kv_connector import TransferConnectorScheduler, remote_kv_params
from paged_jax.core.kv_events import KVEventLog
from paged_jax.core.request import Request, SamplingParams
from paged_jax.core.scheduler import Scheduler
from paged_jax.core.spec_decode import SpecDecodeStats, proposal_budget, propose_ngram
from paged_jax.core.tokenizer import Tokenizer
from paged_jax.draft_proposer import DraftModelProposer, check_draft_model
from paged_jax.engine_config import EngineConfig
from paged_jax.multiprocess import check_multiprocess_config
from paged_jax.offload_tiers import build_offload_manager, model_fingerprint
from paged_jax.outputs import CompletionOutput, RequestMetrics, RequestOutput
from paged_jax.kv_pool import KVPool
from paged_jax.runner import ModelRunner
from paged_jax.sharding import check_tensor_parallel, make_mesh, param_placer
from paged_jax.structured_output import StructuredOutputManager


# The environment variable that sets jax_cpu_enable_async_dispatch (jax's config flag).
ASYNC_DISPATCH_ENV = "JAX_CPU_ENABLE_ASYNC_DISPATCH"


def set_cpu_dispatch(async_dispatch: bool | None) -> None:
    """jax's CPU dispatch mode for this process (EngineConfig.cpu_async_dispatch), set only
    while it can take effect: jax reads it once, when it creates its CPU client, and a value
    set after that would misstate the client's mode. None turns asynchronous dispatch off unless
    the environment sets JAX_CPU_ENABLE_ASYNC_DISPATCH (a user's own choice stands)."""
    if xla_bridge.backends_are_initialized():
        return
    if async_dispatch is None:
        if ASYNC_DISPATCH_ENV in os.environ:
            return
        async_dispatch = False
    jax.config.update("jax_cpu_enable_async_dispatch", async_dispatch)


class LLMEngine:
    """Continuous batching over a paged KV cache: add_request, step, abort_request (the
    EngineClient protocol, paged_jax/engine_client.py)."""

    _shut_down = False  # set by shutdown(); no new requests afterwards

    def __init__(self, config: EngineConfig, model=None, tokenizer: Tokenizer | None = None, *,
                 warm_up_progress=None, devices=None, draft_model=None):
        """Loads the model (unless given), sizes the pool and compiles as config.warm_up says.

        draft_model: the draft of speculative_config method 'draft_model' as a loaded model
        (default: loaded from the config's speculative_config model, as `model` is).

        warm_up_progress: optional callable(num_compiled, num_buckets), called after each
        bucket compiles (from the warm-up thread too, in "background" mode).
        devices: the tensor_parallel_size devices this engine runs on (a data-parallel
        replica's); default the first ones. With tensor_parallel_size > 1, several processes
        (jax.distributed) or explicit devices, the engine runs on a "tp" Mesh over them.
        """
        self.config = c = config
        set_cpu_dispatch(c.cpu_async_dispatch)  # before anything below starts jax's backends
        enable_compile_cache(c.compile_cache_dir, jax.process_count())
        self.mesh = None
        check_multiprocess_config(c.tensor_parallel_size, c.data_parallel_size)
        if c.tensor_parallel_size > 1 or devices is not None or jax.process_count() > 1:
            self.mesh = make_mesh(c.tensor_parallel_size, devices)
        if model is None:
            # On a mesh each checkpoint tensor goes to its devices, split, as it is read.
            place = None if self.mesh is None else param_placer(self.mesh)
            model = load_model(c.model, dtype=c.dtype, seed=c.seed, place=place, weight_dtype=c.weight_dtype,
                               activation_dtype=c.activation_dtype)
        self.model = model
        if self.mesh is not None:
            check_tensor_parallel(self.model, c.tensor_parallel_size)
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(c.model)
        mc = self.model.config
        local_device = None if self.mesh is None else next(
            d for d in self.mesh.devices.flat if d.process_index == jax.process_index())
        self.draft_model = self._draft_model(draft_model)
        self.resolved_config = c.resolve(self.model, local_device, self.draft_model)
        self.cache_config, self.scheduler_config = self.resolved_config.cache, self.resolved_config.scheduler
        pool = None
        if self.draft_model is not None:  # one pool holds both models' layers
            pool = KVPool(c.kv_cache_specs(self.model, self.draft_model), self.cache_config, self.mesh,
                          kv_scales=c.kv_scales, kv_key_offsets=c.kv_key_offsets)
        self.runner = ModelRunner(self.model, self.resolved_config, mesh=self.mesh, pool=pool)
        self.kv_events = KVEventLog(kv_cache_groups=self.cache_config.kv_cache_groups,
                                    hash_nbytes=digest_nbytes(self.cache_config.hash_algo)) if c.enable_kv_events else None
        self.offload = build_offload_manager(c, self.cache_config, self.runner.pool, self.model, self.kv_events)
        self.kv_cache_manager = KVCacheManager(self.cache_config, self.offload, self.kv_events)
        if self.offload is not None and c.warm_up != "none":
            self.runner.pool.warm_up_page_copies()
        # Disaggregation (core/kv_connector.py): the connector's two sides. Every step holds
        # self._lock; the producer's side channel gathers pages under it.
        self._lock = threading.RLock()
        self.kv_connector = self.kv_worker = None
        transfer_config = c.kv_transfer_config
        if transfer_config is not None:
            from paged_jax.kv_transfer import TransferKVWorker, transfer_meta  # jax.experimental.transfer

            meta = transfer_meta(self.cache_config, self.runner.pool, model_fingerprint(self.model))
            self.kv_worker = TransferKVWorker(transfer_config, self.runner.pool, meta, self._lock)
            self.kv_connector = TransferConnectorScheduler(
                transfer_config, self.cache_config.block_size, self.kv_worker.address,
                tuple(group.sliding_window for group in self.cache_config.kv_cache_groups))
        self.scheduler = Scheduler(self.scheduler_config, self.kv_cache_manager, self.kv_connector)
        self.spec_config = c.spec_config
        if self.spec_config is not None:
            self.scheduler.spec_stats = SpecDecodeStats(self.spec_config.num_speculative_tokens)
        self.input_builder = StepInputsBuilder(self.cache_config, self.scheduler_config, seed=c.seed)
        self.drafter = None if self.draft_model is None else DraftModelProposer(
            self.draft_model, self.resolved_config, self.runner.pool, len(self.model.layers), self.input_builder,
            self.mesh)
        # Generation stops on any of the model's EOS ids (Llama 3 instruct lists several).
        eos_ids = tuple(self.tokenizer.eos_token_ids) or mc.eos_token_ids
        self._eos_token_id = eos_ids[0] if eos_ids else None
        self._extra_eos_ids = tuple(eos_ids[1:])
        # Grammars of guided requests (built on first use: the token trie costs ~1 s on a 49k vocabulary).
        self.structured_output = StructuredOutputManager(self.tokenizer, mc.vocab_size, eos_ids)
        self._live: dict[str, tuple[Request, RequestOutput]] = {}
        self.num_generated_tokens = 0
        progress = None
        if warm_up_progress is not None:
            total = len(self.runner.bucket_shapes())
            progress = lambda: warm_up_progress(self.runner.compiler.num_compiled_shapes, total)  # noqa: E731
        # A multi-process run may warm up in the background too: step inputs depend on the batch
        # alone, and there each step waits for its own bucket (ModelRunner.choose_shape).
        warm_up = c.warm_up
        if warm_up == "full":
            self.runner.warm_up(progress)
            if self.drafter is not None:
                self.drafter.runner.warm_up()
        elif warm_up == "background":
            self.runner.start_warm_up(progress=progress)
            if self.drafter is not None:
                self.drafter.runner.start_warm_up()

    def _draft_model(self, draft_model):
        """The draft model of speculative_config method 'draft_model' (given, or loaded as the
        target is, in its weight format), checked against the target; None for other methods."""
        spec = self.config.spec_config
        if spec is None or spec.method != "draft_model":
            if draft_model is not None:
                raise ValueError("draft_model= is the draft of speculative_config method='draft_model'; set "
                                 "speculative_config={'method': 'draft_model', 'model': ..., "
                                 "'num_speculative_tokens': k} or drop it")
            return None
        if draft_model is None:
            c = self.config
            draft_model = load_model(spec.model, dtype=c.dtype, seed=c.seed, weight_dtype=c.weight_dtype)
        check_draft_model(draft_model, self.model, spec.model)
        return draft_model

    # requests
    def add_request(self, request_id: str, prompt: str | list[int], sampling_params: SamplingParams | None = None,
                    *, cache_salt: str | None = None, arrival_time: float | None = None) -> None:
        """Queues one request. Raises ValueError (naming the fix) for bad input; other
        requests are unaffected."""
        if self._shut_down:
            raise RuntimeError(f"request {request_id!r}: this engine was shut down; build a new one")
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id={request_id!r} must be a non-empty string")
        if sampling_params is not None and not isinstance(sampling_params, SamplingParams):
            raise ValueError(f"request {request_id!r}: sampling_params must be a SamplingParams, "
                             f"got {type(sampling_params).__name__}")
        if isinstance(prompt, str):
            text, prompt_token_ids = prompt, self.tokenizer.encode(prompt)
        else:
            # int() would silently truncate 3.7 or accept True; only integer ids are token ids.
            if not hasattr(prompt, "__iter__") or not all(
                    isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in prompt):
                raise ValueError(f"request {request_id!r}: the prompt must be a string or a list of int token "
                                 f"ids, got {type(prompt).__name__}")
            text, prompt_token_ids = None, [int(t) for t in prompt]
        # A string can encode to ids the model lacks too (a tokenizer bigger than the embedding).
        vocab = self.model.config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"request {request_id!r}: token ids {bad[:5]} are outside the vocabulary "
                             f"[0, {vocab}); tokenize with this model's tokenizer")
        params = sampling_params or SamplingParams()
        if self._extra_eos_ids and not params.ignore_eos:
            params = dataclasses.replace(params, stop_token_ids=tuple(params.stop_token_ids) + self._extra_eos_ids)
        request = Request(request_id, prompt_token_ids, params, cache_salt=cache_salt,
                          eos_token_id=self._eos_token_id, arrival_time=arrival_time)
        if self.kv_connector is not None and self.kv_connector.config.can_consume:
            request.remote_kv = remote_kv_params(params)  # ValueError naming a missing key
        if request_id in self._live:  # before touching the live request's matcher
            raise ValueError(f"request id {request_id!r} is already in use; give each request a unique id")
        if params.guided_decoding is not None:
            self.structured_output.add(request_id, params.guided_decoding)  # ValueError: a bad grammar
        try:
            self.scheduler.add_request(request)  # ValueError: duplicate id, too long, can never fit
        except ValueError:
            self.structured_output.remove(request_id)
            raise
        self._live[request_id] = request, RequestOutput(
            request_id, text, request.prompt_token_ids,
            [CompletionOutput(0, "", [], [] if params.logprobs else None, None)], False,
            RequestMetrics(request.arrival_time))

    def chat_prompt(self, messages, *, add_generation_prompt: bool = True, chat_template: str | None = None,
                    sampling_params: SamplingParams | None = None) -> tuple[list[int], SamplingParams]:
        """A conversation as prompt ids and the sampling params that also stop at the
        template's end-of-turn token (see chat_prompt)."""
        return chat_prompt(self.tokenizer, self.eos_token_ids, messages, add_generation_prompt=add_generation_prompt,
                           chat_template=chat_template, sampling_params=sampling_params)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The ids generation stops at (the tokenizer's, else the model config's)."""
        return () if self._eos_token_id is None else (self._eos_token_id, *self._extra_eos_ids)

    def abort_request(self, request_id: str) -> bool:
        """Stops a request and frees its blocks; False if it is unknown or already done."""
        if not self.scheduler.abort_request(request_id):
            return False
        if self.kv_worker is not None:  # a cancelled pull: its pages must not land in freed blocks
            with self._lock:
                self.kv_worker.start_load_kv(self.kv_connector.build_connector_meta())
        self.structured_output.remove(request_id)
        _, output = self._live.pop(request_id)
        completion = output.outputs[0]
        completion.finish_reason, output.finished = "abort", True
        completion.text = self.tokenizer.decode(completion.token_ids)  # what it had generated so far
        output.metrics.finished_time = time.time()
        return True

    def has_unfinished_requests(self) -> bool:
        """Requests to run, or a KV transfer's event to apply (a pull landed, an offer was
        released or expired): a step handles either."""
        return self.scheduler.has_unfinished_requests() or (self.kv_worker is not None and self.kv_worker.has_events())

    @property
    def max_model_len(self) -> int:
        return self.cache_config.max_model_len

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached block and empties the host tier (the disk tier keeps its files);
        False, changing nothing, while a request still holds blocks or host entries."""
        return self.kv_cache_manager.reset_prefix_cache()

    def shutdown(self) -> None:
        """Drops the buckets not compiled yet (waiting for the one compiling) and writes out
        the disk tier's queued blocks, stopping its writer. Idempotent; get_stats still reads."""
        if self._shut_down:
            return
        self._shut_down = True
        self.runner.stop()
        if self.drafter is not None:
            self.drafter.runner.stop()
        if self.offload is not None and self.offload.disk is not None:
            self.offload.disk.close()
        if self.kv_worker is not None:
            self.kv_worker.close()

    # one step
    def step(self) -> list[RequestOutput]:
        """Schedules, runs one jitted step and applies its tokens; returns the outputs of
        the requests that got a token (finished ones have finished=True).

        With a KV connector the step first applies what its worker finished, and a step
        with nothing to run while pulls are in flight waits briefly for one to land."""
        with self._lock:
            outputs, num_seqs = self._step()
        if num_seqs == 0 and self.scheduler.remote_waiting:
            self.kv_worker.progress.wait(0.02)
        return outputs

    def _step(self) -> tuple[list[RequestOutput], int]:
        worker = self.kv_worker
        if worker is not None:
            self.scheduler.update_connector_output(worker.get_finished())
        scheduler_output = self.scheduler.schedule()
        if worker is not None:
            worker.start_load_kv(self.kv_connector.build_connector_meta())
        inputs = self.input_builder.build(scheduler_output)
        copies = self.kv_cache_manager.take_step_copies()
        spec = None if self.spec_config is None else self.input_builder.spec_metadata(
            scheduler_output, inputs, self.spec_config.num_speculative_tokens)
        processing = build_logits_processing(
            scheduler_output, inputs.attention.seq_lens.shape[0],
            1 if spec is None else self.spec_config.num_speculative_tokens + 1, self.runner.vocab_size,
            self.runner.history_width, self.structured_output.fill_bitmask)
        num_steps, num_accepted = 1, None
        if spec is None:
            outputs = None
            if scheduler_output.num_steps > 1 and copies is None and processing is None:
                outputs = self.runner.execute_steps(
                    inputs, self.input_builder.step_slot_mappings(inputs, scheduler_output.num_steps))
                num_steps = 1 if outputs is None else scheduler_output.num_steps
            token_ids, logprobs = outputs or self.runner.execute(inputs, copies, processing=processing)
        else:
            token_ids, logprobs, num_accepted = self.runner.execute(inputs, copies, spec, processing)
        core_outputs = self.scheduler.update_from_output(scheduler_output, token_ids, logprobs, num_accepted,
                                                         num_steps)
        if len(self.structured_output):
            for core in core_outputs:  # the matchers move past what each request kept
                self.structured_output.accept(core.request_id, core.new_token_ids)
                if core.finish_reason is not None:
                    self.structured_output.remove(core.request_id)
        if self.spec_config is not None:
            self._propose(scheduler_output)
        if worker is not None:  # offers of requests that just finished: pullable before anyone learns of them
            worker.start_load_kv(self.kv_connector.build_connector_meta())
        return self._make_outputs(core_outputs), scheduler_output.num_seqs

    def _propose(self, scheduler_output) -> None:
        """Proposals for every decoding request (core/spec_decode.py), at most proposal_budget
        of them: the draft model's passes after this step, or prompt lookup; none while the
        batch is at least disable_by_batch_size."""
        spec = self.spec_config
        enabled = spec.enabled_for(len(self.scheduler.running))
        self.scheduler.spec_stats.num_disabled_steps += not enabled
        if self.drafter is not None:
            self.drafter.propose(scheduler_output, enabled)
        elif enabled:
            max_model_len = self.cache_config.max_model_len
            for request in self.scheduler.running:
                if request.num_tokens - request.num_computed_tokens != 1:
                    continue  # still prefilling
                k = proposal_budget(request, spec.num_speculative_tokens, max_model_len)
                request.spec_token_ids = propose_ngram(request.all_token_ids, k, spec.prompt_lookup_min,
                                                       spec.prompt_lookup_max)
        # Penalties count the output so far, which proposals would change position by position:
        # such requests decode one token a step (exact, and what vLLM's penalties assume).
        for request in self.scheduler.running:
            if request.spec_token_ids and request.sampling_params.has_penalties:
                request.spec_token_ids = []

    def _make_outputs(self, core_outputs) -> list[RequestOutput]:
        now = time.time()
        results = []
        for core in core_outputs:
            request, output = self._live[core.request_id]
            completion = output.outputs[0]
            completion.token_ids.extend(core.new_token_ids)
            if core.new_logprobs is not None:
                completion.logprobs.extend(core.new_logprobs)
            self.num_generated_tokens += len(core.new_token_ids)
            metrics = output.metrics
            if metrics.first_token_time is None:
                metrics.first_token_time = now
                metrics.num_cached_tokens = max(core.num_cached_tokens, 0)
            if core.finish_reason is not None:
                output.kv_transfer_params = core.kv_transfer_params
                completion.finish_reason, completion.stop_reason = core.finish_reason, core.stop_reason
                completion.text = self.tokenizer.decode(completion.token_ids)
                output.finished, metrics.finished_time = True, now
                metrics.num_preemptions = request.num_preemptions
                del self._live[core.request_id]
            results.append(output)
        return results

    def get_stats(self) -> dict:
        """KV usage (now and peak), prefix-cache hit rate, preemptions, compilations, steps.

        A read: calling it changes nothing (the counters are cumulative)."""
        prefix = self.kv_cache_manager.prefix_cache_stats
        return {
            **self.scheduler.get_stats(),
            "prefix_cache_queries": prefix.queries,
            "prefix_cache_hits": prefix.hits,
            "prefix_cache_hit_rate": prefix.hit_rate,
            # the draft model's buckets count too (its runner compiles its own)
            "num_compilations": self.runner.num_compilations + (
                self.drafter.runner.num_compilations if self.drafter is not None else 0),
            "num_generated_tokens": self.num_generated_tokens,
            "num_blocks": self.cache_config.num_blocks,
            "kv_cache_bytes": self.runner.pool.kv_cache_bytes,
            "kv_cache_dtype": self.config.kv_cache_dtype,
            "kv_cache_bytes_per_device": self.runner.pool.kv_cache_bytes_per_device,
            "tensor_parallel_size": self.runner.tensor_parallel_size,
            # >1: tp exceeds the model's KV heads and each is held by this many devices.
            "kv_head_replicas": self.runner.pool.kv_head_replicas,
            "attention_impl": self.runner.attention_impl,
            "backend": jax.default_backend(),
            **self._offload_stats(),
            **self._kv_transfer_stats(),
        }

    def _kv_transfer_stats(self) -> dict:
        """Pulls, pulled tokens and fallbacks (consumer), offers and pinned blocks (producer)."""
        if self.kv_connector is None:
            return {}
        stats = self.kv_connector.stats
        return {
            "kv_role": self.kv_connector.config.kv_role,
            "num_remote_loads": stats.num_remote_loads,
            "num_remote_load_failures": stats.num_remote_load_failures,
            "num_external_tokens": stats.num_external_tokens,
            "num_kv_offers": stats.num_offers,
            "num_kv_pinned_requests": self.kv_connector.num_pinned,
            **self.kv_worker.as_dict(),
        }

    def _offload_stats(self) -> dict:
        """Prefix hits per tier (tokens), swaps and bytes moved; only with an offload tier."""
        if self.offload is None:
            return {}
        stats = self.offload.stats
        return {
            "device_cache_hits": self.kv_cache_manager.prefix_cache_stats.hits,
            "host_cache_hits": stats.host_hit_tokens,
            "disk_cache_hits": stats.disk_hit_tokens,
            "num_swap_outs": stats.num_swap_outs,
            "num_swap_ins": stats.num_swap_ins,
            "num_swap_fallbacks": stats.num_swap_fallbacks,
            "num_host_stores_dropped": stats.num_host_stores_dropped,
            "num_host_evictions": self.offload.host.num_evictions,
            "host_tier_bytes": self.offload.host.num_bytes,
            "bytes_device_to_host": stats.bytes_device_to_host,
            "bytes_host_to_device": stats.bytes_host_to_device,
            "bytes_to_disk": stats.bytes_to_disk,
            "bytes_from_disk": stats.bytes_from_disk,
        }
