"""EngineConfig: what the user asks for, validated once in __post_init__, resolved against
the loaded model and device into a CacheConfig and a SchedulerConfig.

Imports no jax (the server's HTTP process and the CLI build configs): what needs the device
(the pool's byte budget) is imported where the config is resolved.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from paged_jax.compile_cache import AUTO_COMPILE_CACHE, WARM_UP_MODES, check_compile_cache_dir
from paged_jax.core.config import CacheConfig, SchedulerConfig, check_int, check_power_of_two
from paged_jax.core.hashing import get_hash_fn_by_name
from paged_jax.core.kv_quant import check_key_offsets, check_kv_cache_scaling, check_scale, get_kv_quant_format
from paged_jax.core.offload import PREEMPTION_MODES, OffloadConfig

# The attention implementations a config may name: paged_jax/attention/registry.py's
# ATTENTION_IMPLS (canonical names, then the old "pallas" for "triton"), repeated here because
# importing paged_jax.attention loads jax; tests/test_engine_validation.py checks they agree.
ATTENTION_IMPLS = ("xla", "triton", "pallas")

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
    attention_impl: str | None = None  # None: "triton" on GPU, "xla" elsewhere
    interpret: bool = False  # Pallas in interpret mode (CPU tests of the kernel path)
    long_prefill_token_threshold: int = 0
    seed: int = 0  # weights of embedded models, and unseeded sampling
    # Decoder layers per compiled program (runner.py): None picks up to 6 (fast start-up; steps
    # measured 1.01-1.03x the unrolled program, docs/BENCHMARKS.md section 10); the layer count
    # compiles them all into one program (several times the compile time per bucket).
    layers_per_program: int | None = None
    warm_up: str | bool = "background"  # one of WARM_UP_MODES (True: "full", False: "none")
    # jax's persistent compilation cache (paged_jax/compile_cache.py): "auto" uses the one the user
    # configured (JAX_COMPILATION_CACHE_DIR), else ~/.cache/paged-jax/xla; a directory; None: off.
    compile_cache_dir: str | None = AUTO_COMPILE_CACHE
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
            raise ValueError(f"attention_impl={self.attention_impl!r} must be one of {ATTENTION_IMPLS} ('pallas' is "
                             "the old name of 'triton'), or None: triton on GPU, xla elsewhere")
        self._check_offload()
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
        from models.kv_cache_spec import kv_cache_group_specs
        from paged_jax.runner import num_blocks_for_budget  # device-side: sizes the pool in bytes

        specs = model.kv_cache_specs(self.dtype, self.kv_cache_dtype, self.kv_cache_scaling)
        num_blocks = num_blocks_for_budget(
            specs, self.block_size, num_blocks=self.num_blocks,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes, gpu_memory_utilization=self.gpu_memory_utilization,
            max_num_seqs=self.max_num_seqs, max_model_len=max_model_len,
            tensor_parallel_size=self.tensor_parallel_size, device=device)
        cache = CacheConfig(self.block_size, num_blocks, max_model_len, self.enable_prefix_caching,
                            self.hash_algo, self.hash_seed, kv_cache_group_specs(specs))
        scheduler = SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens, max_model_len,
                                    self.long_prefill_token_threshold, preemption_mode=self.preemption_mode)
        return cache, scheduler


def _is_ml_float(dtype: np.dtype) -> bool:
    """bfloat16, the float8 formats...: ml_dtypes' floating types."""
    try:
        ml_dtypes.finfo(dtype)
    except ValueError:
        return False
    return True
