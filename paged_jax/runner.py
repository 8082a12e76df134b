"""The device side of the engine: weights, KV caches and the compiled step of each bucket.

A step is three compiled programs per bucket (token count T, sequence count S; the block
table width is fixed): `embed`, one `layer` program of a few consecutive decoder layers
(layers_per_program, up to 6) called once per group of layers, and `head` (final norm,
logits of the sampled rows, sampling). Compiling a few layers instead of a program with
every layer unrolled is what makes start-up fast (SmolLM2-135M shape, f32, 2 busy CPU cores:
1.4 s a bucket for 1 layer, 1.5 for 2, 1.7 for 3, 2.0 for 5, 6-7 s for all 30 unrolled).
Each call costs a little on the host and in the runtime, so groups are as large as divide
the layer count up to 6: steps measured against the unrolled program, alternating runs
(decode 8 / decode 32 / mixed): 1 layer a program 1.08 (decode 32); 2 layers 1.03-1.04 /
1.05 / 1.04-1.05; 6 layers 1.00 / 1.05 / 1.01 (this machine's noise is a few percent;
scripts/bench_startup.py --steps keeps measuring it). A lax.scan over stacked weights
compiled as fast but copied each layer's weights out of the stack on XLA:CPU (+30% per
decode step), and would put every cache in one buffer that the loop reads while updating
(openxla/xla#45912).

Each layer call takes its layers' (k_cache, v_cache) pairs as donated arguments and returns
them, so XLA updates the caches in place (no second cache-sized buffer; tests check the
compiled executables). StepInputs crosses to the device once per step, packed into one i32
vector (pack_step_inputs: one host-to-device copy instead of one per field, 38 vs 201 us on
this CPU, scripts/bench_runner_overheads.py); every program unpacks the fields it reads with
static slices.

Compilation (`warm_up`, `start_warm_up`): a bucket's programs are compiled ahead of time,
smallest bucket first; all buckets before serving (warm_up()), or the smallest one now and
the rest on a background thread (start_warm_up()). In the second case the serving thread
never compiles: a step whose bucket is not compiled yet runs in the smallest compiled
bucket that fits (`choose_shape`; its inputs padded further by pad_step_inputs, which
changes no real row), and a step with none waits for the warm-up thread to compile its
bucket next. The host's padding depends on the batch alone; only the program that runs it
depends on timing, and in a multi-process run (where every process must run the same
program) a step always waits for its own bucket. Either way
at most one set of programs per bucket_shapes() entry is ever compiled, which
`num_compilations` counts so a test can prove it.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import functools
import threading
import weakref

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from models.kv_cache_spec import QuantizedAttentionSpec, check_kv_cache_groups, init_kv_caches, kv_cache_bytes_per_token
from paged_jax.attention import bind_layer, make_attention_backend
from paged_jax.core.batch import pad_step_inputs
from paged_jax.core.config import CacheConfig, SchedulerConfig
from paged_jax.core.kv_quant import check_key_offsets, check_scale
from paged_jax.core.step_inputs import ModelInputs, SamplingMetadata, StepAttentionMetadata, StepInputs
from paged_jax.sampler import sample
from paged_jax.sharding import (SHARDED_CACHE_SPECS, TP_AXIS, ShardedAttention, cache_shardings,
                                check_tensor_parallel, init_sharded_kv_caches, kv_head_replicas, local_value,
                                put_replicated, replicated, shard_params, sharded_cache_spec, step_fingerprint)

# A memory-derived pool never exceeds this many blocks (4M tokens at block_size 16): the
# host keeps one Python object per block, and only tiny models on big GPUs reach it (a
# Llama-3.1-8B in 100 GB of bf16 KV is ~50k blocks).
MAX_AUTO_BLOCKS = 1 << 18

# A pool sized without memory statistics (the CPU) holds at most this many bytes, and at least
# one full-length sequence, as vLLM's CPU backend sizes its pool by VLLM_CPU_KVCACHE_SPACE and
# not by the largest batch: room for every sequence at full length was 11 GiB of f32 zeros
# for SmolLM2 (64 x 4096 tokens), 9 s of zeroing before a one-question `generate` could start.
CPU_KV_CACHE_BYTES = 4 << 30


def _default_layers_per_program(num_layers: int) -> int:
    """Consecutive layers one compiled layer program runs: the largest of 6..2 that divides
    num_layers (every call then runs the same program), else 1 (module docstring: the costs)."""
    return next((k for k in (6, 5, 4, 3, 2) if num_layers % k == 0), 1)


def num_blocks_for_budget(specs, block_size: int, *, num_blocks=None, kv_cache_memory_bytes=None,
                          gpu_memory_utilization=0.9, max_num_seqs: int, max_model_len: int,
                          tensor_parallel_size: int = 1, device=None) -> int:
    """How many KV blocks (null block included) the pool gets.

    Args:
      specs: the model's per-layer cache specs (their bytes per token size a block).
      tensor_parallel_size: devices the pool is split over: a block costs each of them the
        bytes of its share of the (replicated up to tp) KV heads, and kv_cache_memory_bytes
        and the memory statistics are per device.
      device: whose memory statistics count (default jax.devices()[0]).
    Precedence: num_blocks, else kv_cache_memory_bytes // bytes per block, else
    gpu_memory_utilization of the device's free memory (at most MAX_AUTO_BLOCKS). Devices
    that report no memory statistics (the CPU) get room for max_num_seqs full-length
    sequences, the most the scheduler can ever hold at once, up to CPU_KV_CACHE_BYTES (and
    never less than one full-length sequence): below that budget nothing is preempted
    unless asked for.
    """
    tp = tensor_parallel_size
    if tp > 1:
        specs = [sharded_cache_spec(spec, tp) for spec in specs]
    per_block = kv_cache_bytes_per_token(specs) * block_size // tp
    if num_blocks is not None:
        return num_blocks
    if kv_cache_memory_bytes is not None:
        n = kv_cache_memory_bytes // per_block
        if n < 2:
            raise ValueError(f"{kv_cache_memory_bytes=} holds {n} blocks of {per_block} bytes; give at least "
                             f"{2 * per_block} bytes (the null block plus one)")
        return int(n)
    stats = (device or jax.devices()[0]).memory_stats() or {}
    if "bytes_limit" in stats:
        free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
        return max(2, min(int(free * gpu_memory_utilization) // per_block, MAX_AUTO_BLOCKS))
    per_seq = -(-max_model_len // block_size)
    return min(max_num_seqs * per_seq, max(per_seq, CPU_KV_CACHE_BYTES // per_block)) + 1


# Blocks one page-copy program moves at most (a longer copy runs in chunks): 6 compiled sizes.
MAX_PAGE_COPY = 256


def _page_bucket(num_blocks: int) -> int:
    """Copies of n blocks run at the next power of two >= max(n, 8): a few compiled shapes."""
    return max(8, 1 << (num_blocks - 1).bit_length())


def _gather_pages_fn(kv_caches, block_ids):
    return [leaf[block_ids] for cache in kv_caches for leaf in cache]


def _put_pages_fn(kv_caches, block_ids, pages, device_shardings=None):
    """device_shardings: the caches' leaves' shardings, when the pages arrive in host memory."""
    if device_shardings is not None:
        pages = [jax.device_put(page, sharding) for page, sharding in zip(pages, device_shardings)]
    pages = iter(pages)
    return [tuple(leaf.at[block_ids].set(next(pages)) for leaf in cache) for cache in kv_caches]


def pack_step_inputs(inputs: StepInputs) -> np.ndarray:
    """The step's arrays back to back as one i32 vector (f32 and u32 fields bit for bit)."""
    return np.concatenate([np.ascontiguousarray(a).view(np.int32).ravel() for a in jax.tree.leaves(inputs)])


def unpack_step_inputs(packed, like: StepInputs) -> StepInputs:
    """Inverse of pack_step_inputs inside a program: `like` gives each field's shape and dtype
    (static), so every field is a static slice of `packed`, bitcast back where it is not i32."""
    leaves, treedef = jax.tree.flatten(like)
    fields, offset = [], 0
    for leaf in leaves:
        assert np.dtype(leaf.dtype).itemsize == 4, f"step input fields are 4-byte, got {leaf.dtype}"
        size = int(np.prod(leaf.shape))
        field = packed[offset : offset + size].reshape(leaf.shape)
        if np.dtype(leaf.dtype) != np.int32:
            field = jax.lax.bitcast_convert_type(field, leaf.dtype)
        fields.append(field)
        offset += size
    return jax.tree.unflatten(treedef, fields)


def static_kv_scales(spec, kv_scales, num_layers: int):
    """f32[num_layers, 2] device array of per-layer (k_scale, v_scale) for a per-tensor quantized
    spec (kv_scales: None = 1.0, one pair, or one pair per layer); None for any other spec."""
    if not isinstance(spec, QuantizedAttentionSpec) or spec.per_token_scales:
        if kv_scales is not None:
            raise ValueError("kv_scales (static K/V scales) need kv_cache_scaling='per_tensor' and a quantized "
                             "kv_cache_dtype; drop them or set both")
        return None
    pairs = np.ones((num_layers, 2)) if kv_scales is None else np.array(kv_scales, dtype=object)
    if pairs.shape == (2,):
        pairs = np.array([kv_scales] * num_layers, dtype=object)
    if pairs.shape != (num_layers, 2):
        raise ValueError(f"kv_scales must be one (k_scale, v_scale) pair or {num_layers} of them (one per layer), "
                         f"got shape {pairs.shape}")
    values = [[check_scale(f"kv_scales[{i}][{j}]", s) for j, s in enumerate(pair)] for i, pair in enumerate(pairs)]
    return jnp.asarray(values, jnp.float32)


def static_key_offsets(spec, key_offsets, num_layers: int):
    """f32[num_layers, num_kv_heads, head_dim] device array of the keys' per-layer offsets for a
    quantized spec (key_offsets: None = zeros; calibrate_key_offsets computes them); None for
    any other spec."""
    if not isinstance(spec, QuantizedAttentionSpec):
        if key_offsets is not None:
            raise ValueError("kv_key_offsets center the keys of a quantized pool; they need a quantized "
                             "kv_cache_dtype ('fp8', 'fp8_e5m2' or 'int8')")
        return None
    shape = (num_layers, spec.num_kv_heads, spec.head_dim)
    offsets = np.zeros(shape, np.float32) if key_offsets is None else check_key_offsets(key_offsets, shape)
    return jnp.asarray(offsets)


# Runners whose background threads (the pool's zeroing, the warm-up) may still run: at exit
# each one finishes what is inside XLA and drops the buckets not started, so the
# interpreter never stops under a running computation (which aborts the process).
_WARMING_UP: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def stop_background_work() -> None:
    """Every runner finishes what its background threads have inside XLA (the pool's zeroing,
    the bucket being compiled) and drops the buckets not started. Runs at exit; tests that
    count compilations call it first, so no other runner's thread compiles during theirs."""
    for runner in list(_WARMING_UP):
        runner.stop_warm_up()


class ModelRunner:
    """Owns the weights and the KV caches on device and runs one step per call.

    Args:
      model: a registered model (models/registry.py): `embed`, `layers` (modules of one
        graph, each called as layer(x, positions, layer_cache, attn_metadata, attention)) and
        `compute_logits`; its state is split off once and its graph is static.
      cache_config: block_size, num_blocks (null block included), max_model_len, and the KV-cache
        groups (each layer reads its group's block table and slot mapping).
      scheduler_config: the step limits, whose buckets are the compiled shapes.
      attention_impl: "xla", "triton" (alias "pallas") or None (triton on GPU, xla elsewhere);
        interpret runs the Pallas kernel in interpret mode. Turned into one backend per group,
        for its cache spec.
      kv_cache_dtype: defaults to the model's compute dtype.
      kv_cache_quant: "auto" (pages in kv_cache_dtype) or a quantized format ("fp8", "fp8_e4m3",
        "fp8_e5m2", "int8"; paged_jax/core/kv_quant.py), with kv_cache_scaling "per_token" or
        "per_tensor"; kv_scales: the static (k_scale, v_scale) of per-tensor scaling, one pair for
        every layer or one per layer (None: 1.0); kv_key_offsets: f32[num_layers, num_kv_heads,
        head_dim] subtracted from the keys before they are stored (None: zeros). Both are
        runtime inputs of the layer program.
      layers_per_program: decoder layers one compiled program runs (a divisor of the layer
        count); None: _default_layers_per_program(num_layers). The layer count itself compiles the
        whole stack into one program: the old step time, at the old compile time per bucket.
      mesh: a jax.sharding.Mesh with a "tp" axis (paged_jax/sharding.py): weights and the pool
        are placed split over it, the attention backend runs per shard and every step input
        is replicated. None: everything on the default device (the single-device programs).
    """

    def __init__(self, model, cache_config: CacheConfig, scheduler_config: SchedulerConfig, *,
                 attention_impl: str | None = None, interpret: bool = False, kv_cache_dtype=None,
                 layers_per_program: int | None = None, kv_cache_quant: str = "auto",
                 kv_cache_scaling: str = "per_token", kv_scales=None, kv_key_offsets=None, mesh=None):
        self.config = model.config
        self.mesh = mesh
        self.cache_config = cache_config
        self.scheduler_config = scheduler_config
        self.num_blocks = cache_config.num_blocks
        specs = model.kv_cache_specs(kv_cache_dtype, kv_cache_quant, kv_cache_scaling)
        groups = cache_config.kv_cache_groups
        check_kv_cache_groups(groups, specs)
        # layer -> its KV-cache group: the block table and slot mapping its attention reads.
        # Every layer keeps a page for every block id (a block of group g is written by g's
        # layers only), so a pool of one group wastes nothing.
        self.layer_kv_cache_group = [0] * len(specs)
        for group_id, group in enumerate(groups):
            for layer_id in group.layer_ids:
                self.layer_kv_cache_group[layer_id] = group_id
        self.tensor_parallel_size = tp = 1 if mesh is None else mesh.shape[TP_AXIS]
        self.kv_head_replicas = 1
        if mesh is not None:
            if type(specs[0]) not in SHARDED_CACHE_SPECS:
                raise ValueError(f"tensor_parallel_size={tp}: a {type(specs[0]).__name__} cache ({type(model).__name__}"
                                 f"{', kv_cache_dtype=' + kv_cache_quant if kv_cache_quant != 'auto' else ''}) has no "
                                 "tensor-parallel rules yet; use tensor_parallel_size=1")
            check_tensor_parallel(model.config, tp)
            self.kv_head_replicas = kv_head_replicas(model.config.num_kv_heads, tp)
            specs = tuple(sharded_cache_spec(spec, tp) for spec in specs)
        self.kv_cache_specs = specs
        # One backend per group (its spec's), the one its layers call.
        self.attention_backends = [make_attention_backend(specs[self.layer_kv_cache_group.index(g)], attention_impl,
                                                          interpret=interpret) for g in range(len(groups))]
        if mesh is not None:
            self.attention_backends = [ShardedAttention(a, mesh, self.kv_head_replicas)
                                       for a in self.attention_backends]
        self.attention = self.attention_backends[0]  # the first group's (the only one's, for most models)
        self.attention_impl = self.attention.name
        self.kv_scales = static_kv_scales(specs[0], kv_scales, len(specs))
        self.kv_key_offsets = static_key_offsets(specs[0], kv_key_offsets, len(specs))
        # What the attention backend binds per layer (arrays with a leading layer axis, passed
        # to the layer programs as runtime inputs): the quantized pool's static inputs.
        self.layer_inputs = {name: value for name, value in (("kv_scales", self.kv_scales),
                                                             ("key_offset", self.kv_key_offsets)) if value is not None}
        self.token_buckets = scheduler_config.token_buckets
        self.seq_buckets = scheduler_config.seq_buckets
        num_layers = len(model.layers)
        if layers_per_program is None:
            layers_per_program = _default_layers_per_program(num_layers)
        if not 1 <= layers_per_program <= num_layers or num_layers % layers_per_program:
            raise ValueError(f"layers_per_program={layers_per_program} must divide the model's {num_layers} layers "
                             f"(1..{num_layers}; {num_layers} compiles them all into one program), or be None")
        self.layers_per_program = layers_per_program
        # The layers' weights stay one buffer per layer (no stacked copy). Groups of layers
        # with the same graphs share one compiled program; a model whose layers differ
        # (DeepSeek-V2's dense first layers before its MoE ones) gets one per kind of group.
        # A program's kind is its layers' graphs and KV-cache groups (which table each reads).
        graphdefs = [nnx.graphdef(layer) for layer in model.layers]
        kinds = [(tuple(graphdefs[i : i + layers_per_program]), tuple(self.layer_kv_cache_group[i : i + layers_per_program]))
                 for i in range(0, num_layers, layers_per_program)]
        self._group_graphdefs = list(dict.fromkeys(kinds))  # distinct kinds of group, first seen first
        self._group_kind = [self._group_graphdefs.index(kind) for kind in kinds]
        # Each group's layer inputs (quantized pools), sliced once, not per step.
        self._group_layer_inputs = [{name: a[i : i + layers_per_program] for name, a in self.layer_inputs.items()}
                                    for i in range(0, num_layers, layers_per_program)]
        self.layer_params = [nnx.state(layer) for layer in model.layers]
        self.graphdef, self._all_layer_params, self.head_params = nnx.split(model, nnx.PathContains("layers"), ...)
        if mesh is not None:
            # New arrays on the mesh (no-ops for weights a loader already placed there); the
            # model object keeps its own, so data-parallel replicas can share one model.
            rules = model.param_partition_rules  # the model family's (models/<family>/model.py)
            self.layer_params = [shard_params(params, mesh, rules) for params in self.layer_params]
            self.head_params = shard_params(self.head_params, mesh, rules)
        # jax zeroes a new buffer before it returns it (a 2.8 GiB pool: 0.65 s on this idle CPU,
        # scripts/bench_runner_overheads.py), so the pool is made on a thread of its own while
        # the first bucket compiles or loads from the compilation cache; the first use of
        # kv_caches waits for it.
        self._kv_caches: list | None = None
        self._kv_caches_ready = concurrent.futures.Future()
        threading.Thread(target=self._init_kv_caches, name="paged-jax-kv-pool", daemon=True).start()
        _WARMING_UP.add(self)
        abstract_caches = jax.eval_shape(lambda: [spec.allocate(self.num_blocks, cache_config.block_size)
                                                  for spec in specs])
        if mesh is not None:  # each leaf as init_sharded_kv_caches places it
            abstract_caches = [jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                                            tuple(cache), cache_shardings(spec, mesh))
                               for cache, spec in zip(abstract_caches, specs)]
        self.kv_cache_bytes = sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize
                                  for a in jax.tree.leaves(abstract_caches))
        # What one device holds (all of it without a mesh).
        self.kv_cache_bytes_per_device = sum(
            int(np.prod(a.sharding.shard_shape(a.shape) if a.sharding else a.shape)) * np.dtype(a.dtype).itemsize
            for a in jax.tree.leaves(abstract_caches))
        self.num_compilations = 0  # bucket shapes compiled (each: a layer and a head program)
        self.num_steps = 0
        self._programs: dict[tuple[int, int], tuple] = {}  # (T, S) -> (embed, layer, head), all compiled
        self._cond = threading.Condition()
        self._queue: list[tuple[int, int]] = []  # shapes the warm-up thread compiles next, in order
        self._thread: threading.Thread | None = None
        self._warming_up = False  # the warm-up thread takes shapes from _queue (set under _cond)
        self._error: BaseException | None = None
        # Every layer's cache shapes: what programs compile against (the warm-up thread must not
        # read the live caches the steps donate) and the page layout (no wait on the pool).
        self._abstract_pool = abstract_caches
        # Page copies for the offload tiers: a gather and an in-place scatter program per
        # power-of-two block count up to MAX_PAGE_COPY (warm_up_page_copies compiles them).
        self._page_programs: dict[int, tuple] = {}
        self.page_copy_memory_kind: str | None = None  # "pinned_host" or "numpy", set at the first copy

    def _init_kv_caches(self) -> None:
        try:
            if self.mesh is None:
                caches = init_kv_caches(self.kv_cache_specs, self.num_blocks, self.cache_config.block_size)
            else:
                caches = init_sharded_kv_caches(self.kv_cache_specs, self.num_blocks, self.cache_config.block_size,
                                                self.mesh)
            self._kv_caches_ready.set_result(caches)
        except BaseException as error:  # raised where the pool is first used
            self._kv_caches_ready.set_exception(error)

    @property
    def kv_caches(self) -> list:
        """One cache per layer (models/kv_cache_spec.py), updated in place by every step."""
        if self._kv_caches is None:
            self._kv_caches = self._kv_caches_ready.result()
        return self._kv_caches

    @kv_caches.setter
    def kv_caches(self, caches: list) -> None:
        self._kv_caches = caches

    def _sharding(self, a):
        """The sharding a program argument is compiled for: its own (placed arrays), replicated
        (host inputs on a mesh), or None (no mesh: the default device)."""
        if self.mesh is None:
            return None
        return a.sharding if isinstance(a, jax.Array) else replicated(self.mesh)

    def _jit(self, fn, out_shardings, **kwargs):
        # On a mesh the outputs are pinned (replicated activations, caches as they came in),
        # so the next program and the next step get what they were compiled for.
        if self.mesh is None:
            return jax.jit(fn, **kwargs)
        return jax.jit(fn, out_shardings=out_shardings, **kwargs)

    # the three programs of a step (traced once per shape, at compile time)
    def _model(self, head_params):
        # The layers' weights are merged back as concrete arrays the programs never read, so
        # they do not become arguments or constants of the embed and head programs.
        return nnx.merge(self.graphdef, self._all_layer_params, head_params)

    def _embed_fn(self, head_params, token_ids):
        return self._model(head_params).embed(token_ids)

    def _layer_fn(self, layer_params, x, kv_caches, positions, attn_metadata: StepAttentionMetadata, kind=None,
                  layer_inputs=None):
        """layers_per_program consecutive layers: their params and caches are lists; kind
        (static) is their (graphs, KV-cache groups), by default those of the first program;
        each layer reads its group's view of attn_metadata and calls its group's backend;
        layer_inputs, a dict of arrays with a leading layer axis (self.layer_inputs sliced),
        what the attention backend binds per layer."""
        new_caches = []
        graphdefs, kv_groups = kind if kind is not None else self._group_graphdefs[0]
        views = {g: attn_metadata.for_group(g) for g in set(kv_groups)}
        for i, (graphdef, group, params, kv_cache) in enumerate(zip(graphdefs, kv_groups, layer_params, kv_caches)):
            layer = nnx.merge(graphdef, params)
            attention = bind_layer(self.attention_backends[group], layer_inputs, i)
            x, kv_cache = layer(x, positions, kv_cache, views[group], attention)
            new_caches.append(kv_cache)
        return x, new_caches

    def _head_fn(self, head_params, x, inputs: StepInputs):
        logits = self._model(head_params).compute_logits(x, inputs.model)
        return sample(logits, inputs.sampling)

    def _compile(self, num_tokens: int, num_seqs: int) -> tuple:
        """Lowers and compiles the three programs of one bucket (from shapes only, so the
        warm-up thread never touches the live, donated caches). Each takes the step's packed
        inputs and unpacks what it reads. On a mesh every argument carries its sharding
        (weights and caches their own, the packed inputs replicated) and the outputs are pinned."""
        abstract = lambda tree: jax.tree.map(  # noqa: E731
            lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype, sharding=self._sharding(a)), tree)
        like = abstract(self.dummy_inputs(num_tokens, num_seqs))
        rep = None if self.mesh is None else replicated(self.mesh)
        packed = jax.ShapeDtypeStruct((sum(int(np.prod(a.shape)) for a in jax.tree.leaves(like)),), np.int32,
                                      sharding=rep)

        def embed_fn(head_params, packed):
            return self._embed_fn(head_params, unpack_step_inputs(packed, like).model.token_ids)

        def layer_fn(layer_params, x, kv_caches, packed, layer_inputs, kind):
            inputs = unpack_step_inputs(packed, like)
            return self._layer_fn(layer_params, x, kv_caches, inputs.model.positions, inputs.attention, kind,
                                  layer_inputs)

        def head_fn(head_params, x, packed):
            return self._head_fn(head_params, x, unpack_step_inputs(packed, like))

        head_params = abstract(self.head_params)
        embed = self._jit(embed_fn, rep).lower(head_params, packed).compile()
        x = jax.eval_shape(embed_fn, head_params, packed)
        x = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep)
        k = self.layers_per_program
        layer_inputs = abstract(self._group_layer_inputs[0])
        layers = []  # one program per kind of layer group
        for index, kind in enumerate(self._group_graphdefs):
            first = self._group_kind.index(index) * k
            caches_out = None if self.mesh is None else [cache_shardings(spec, self.mesh)
                                                         for spec in self.kv_cache_specs[first : first + k]]
            program = self._jit(functools.partial(layer_fn, kind=kind), (rep, caches_out),
                                donate_argnums=(2,))
            # Shapes only: the warm-up thread must not read the live caches the steps donate.
            layers.append(program.lower(abstract(self.layer_params[first : first + k]), x,
                                        self._abstract_pool[first : first + k], packed, layer_inputs).compile())
        head = self._jit(head_fn, (rep, rep)).lower(head_params, x, packed).compile()
        return embed, tuple(layers), head

    def _programs_for(self, shape: tuple[int, int]) -> tuple:
        """The compiled programs of a shape: ready, compiled by the warm-up thread next (this
        thread waits), or, with no warm-up thread running, compiled here."""
        with self._cond:
            if shape not in self._programs and self._warming_up:
                if shape in self._queue:
                    self._queue.remove(shape)
                self._queue.insert(0, shape)
                self._cond.notify_all()
                while shape not in self._programs and self._error is None and self._warming_up:
                    self._cond.wait()
                if self._error is not None:
                    raise RuntimeError("compiling a bucket on the warm-up thread failed") from self._error
            programs = self._programs.get(shape)
        if programs is None:
            programs = self._add_programs(shape)
        return programs

    def _add_programs(self, shape: tuple[int, int]) -> tuple:
        programs = self._compile(*shape)
        with self._cond:
            if shape not in self._programs:
                self._programs[shape] = programs
                self.num_compilations += 1
            self._cond.notify_all()
            return self._programs[shape]

    def choose_shape(self, num_tokens: int, num_seqs: int) -> tuple[int, int]:
        """The bucket (T, S) that runs a step of num_tokens tokens over num_seqs sequences: the
        smallest compiled bucket that fits (fewest tokens, then fewest sequences), else the
        smallest bucket that fits (whose compilation the step will wait for). Always the
        smallest that fits in a multi-process run: every process must run the same program."""
        t = next(b for b in self.token_buckets if b >= num_tokens)
        s = next(b for b in self.seq_buckets if b >= num_seqs)
        with self._cond:
            if (t, s) in self._programs or jax.process_count() > 1:
                return t, s
            fitting = [shape for shape in self._programs if shape[0] >= num_tokens and shape[1] >= num_seqs]
        return min(fitting) if fitting else (t, s)

    def execute(self, inputs: StepInputs, copies=None) -> tuple[np.ndarray, np.ndarray]:
        """Runs one step; returns (sampled token ids i32[S], their logprobs f32[S]) on the host.

        Rows past inputs.num_seqs are padding. A step with no sequences (only finished or
        aborted requests to release) runs no model program. `copies` (offload.StepCopies or
        None): pages copied down to the host tier, then up from it, before the step (the
        blocks they leave or fill are reused by this step), and persisted after it.
        """
        if copies is not None:
            if copies.store_block_ids.size:
                copies.store(self.gather_pages(copies.store_block_ids))
            if copies.load_block_ids.size:
                self.put_pages(copies.load_block_ids, copies.load())
        if inputs.num_seqs == 0:
            return np.zeros(0, np.int32), np.zeros(0, np.float32)
        shape = inputs.model.token_ids.shape[0], inputs.attention.seq_lens.shape[0]
        run_shape = self.choose_shape(*shape)
        if run_shape != shape:  # its own bucket is still compiling: a larger compiled one runs it
            inputs = pad_step_inputs(inputs, *run_shape)
        embed, layers, head = self._programs_for(run_shape)
        packed = pack_step_inputs(inputs)
        if self.mesh is None:
            packed = jax.device_put(packed)  # once: every program reads this copy
        else:
            if jax.process_count() > 1:
                # Every process must run this very step (paged_jax/multiprocess.py): a
                # diverged scheduler fails here, not in a hung or garbled collective.
                multihost_utils.assert_equal(step_fingerprint(packed), "processes scheduled different steps")
            packed = put_replicated(packed, self.mesh)
        x = embed(self.head_params, packed)
        kv_caches, k = self.kv_caches, self.layers_per_program
        for i in range(0, len(kv_caches), k):
            layer = layers[self._group_kind[i // k]]  # the program of this group's kind of layers
            x, kv_caches[i : i + k] = layer(self.layer_params[i : i + k], x, kv_caches[i : i + k], packed,
                                            self._group_layer_inputs[i // k])
        token_ids, logprobs = head(self.head_params, x, packed)
        self.num_steps += 1
        if copies is not None and copies.persist_block_ids.size:
            copies.persist(self.gather_pages(copies.persist_block_ids))
        if self.mesh is not None:  # replicated; this process's copy (one may not read others')
            return local_value(token_ids), local_value(logprobs)
        return np.asarray(token_ids), np.asarray(logprobs)

    # page copies (offload tiers)
    def page_leaves(self) -> list[tuple[tuple[int, ...], str]]:
        """(page shape [block_size, ...], dtype name) of every cache leaf, layer-major: the
        order gather_pages returns and put_pages takes."""
        return [(tuple(leaf.shape[1:]), str(leaf.dtype)) for cache in self._abstract_pool for leaf in cache]

    def _page_programs_for(self, bucket: int) -> tuple:
        """(gather, put) compiled for `bucket` blocks (put takes the caches donated).

        Where the backend has a pinned host memory kind, gather's outputs and put's page
        inputs live there (the copies are DMA transfers to and from pinned buffers); if that
        fails to compile, both use plain host arrays (page_copy_memory_kind says which)."""
        programs = self._page_programs.get(bucket)
        if programs is None:
            if self.page_copy_memory_kind is None:
                self.page_copy_memory_kind = "pinned_host" if self._pinned_page_shardings() else "numpy"
                try:
                    programs = self._compile_page_programs(bucket, self._pinned_page_shardings())
                except Exception:  # noqa: BLE001 -- a backend without host offloading: plain copies
                    self.page_copy_memory_kind = "numpy"
            if programs is None:
                pinned = self._pinned_page_shardings() if self.page_copy_memory_kind == "pinned_host" else None
                programs = self._compile_page_programs(bucket, pinned)
            self._page_programs[bucket] = programs
        return programs

    def _pinned_page_shardings(self) -> list | None:
        """Every cache leaf's sharding in pinned host memory, or None where there is none."""
        leaves = [leaf for cache in self.kv_caches for leaf in cache]
        device = next(iter(leaves[0].devices()))
        if "pinned_host" not in {memory.kind for memory in device.addressable_memories()}:
            return None
        return [leaf.sharding.with_memory_kind("pinned_host") for leaf in leaves]

    def _compile_page_programs(self, bucket: int, pinned: list | None) -> tuple:
        leaves = [leaf for cache in self.kv_caches for leaf in cache]
        abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), self.kv_caches)
        ids = jax.ShapeDtypeStruct((bucket,), np.int32)
        pages = [jax.ShapeDtypeStruct((bucket, *leaf.shape[1:]), leaf.dtype,
                                      sharding=None if pinned is None else pinned[i]) for i, leaf in enumerate(leaves)]
        if pinned is None:
            return (jax.jit(_gather_pages_fn).lower(abstract, ids).compile(),
                    jax.jit(_put_pages_fn, donate_argnums=(0,)).lower(abstract, ids, pages).compile())
        device = [leaf.sharding for leaf in leaves]
        gather = jax.jit(_gather_pages_fn, out_shardings=pinned).lower(abstract, ids).compile()
        put = jax.jit(functools.partial(_put_pages_fn, device_shardings=device), donate_argnums=(0,),
                      out_shardings=jax.tree.map(lambda a: a.sharding, self.kv_caches)).lower(abstract, ids, pages)
        return gather, put.compile()

    def warm_up_page_copies(self) -> None:
        """Compiles the page-copy programs of every bucket (an engine with an offload tier
        does, so that no step compiles one)."""
        bucket = 8
        while bucket <= MAX_PAGE_COPY:
            self._page_programs_for(bucket)
            bucket *= 2

    def gather_pages(self, block_ids: np.ndarray) -> list[np.ndarray]:
        """Copies the pages of block_ids to the host: one array [n, block_size, ...] per leaf.

        One program reads every layer's pages (the ids padded to a power of two with the null
        block, in chunks of at most MAX_PAGE_COPY), and one device-to-host transfer brings
        each chunk back.
        """
        n = len(block_ids)
        chunks = []
        for start in range(0, n, MAX_PAGE_COPY):
            part = block_ids[start : start + MAX_PAGE_COPY]
            ids = np.zeros(_page_bucket(len(part)), np.int32)
            ids[: len(part)] = part
            gather, _ = self._page_programs_for(len(ids))
            chunks.append([np.asarray(page)[: len(part)] for page in jax.device_get(gather(self.kv_caches, ids))])
        return chunks[0] if len(chunks) == 1 else [np.concatenate(leaf) for leaf in zip(*chunks)]

    def put_pages(self, block_ids: np.ndarray, pages: list[np.ndarray]) -> None:
        """Writes pages (one array [n, block_size, ...] per leaf) into block_ids, in place: the
        caches are donated to the program (padding rows write the null page)."""
        for start in range(0, len(block_ids), MAX_PAGE_COPY):
            part = block_ids[start : start + MAX_PAGE_COPY]
            n, bucket = len(part), _page_bucket(len(part))
            ids = np.zeros(bucket, np.int32)
            ids[:n] = part
            padded = []
            for page in pages:
                full = np.zeros((bucket, *page.shape[1:]), page.dtype)
                full[:n] = page[start : start + n]
                padded.append(full)
            _, put = self._page_programs_for(bucket)
            if self.page_copy_memory_kind == "pinned_host":
                padded = jax.device_put(padded, self._pinned_page_shardings())
            self.kv_caches = list(put(self.kv_caches, ids, padded))

    def bucket_shapes(self) -> list[tuple[int, int]]:
        """Every (token bucket, sequence bucket) a step can land in (SchedulerConfig.bucket_shapes),
        smallest first: the warm-up order."""
        return self.scheduler_config.bucket_shapes()

    def dummy_inputs(self, num_tokens: int, num_seqs: int) -> StepInputs:
        """A padded step of the given bucket whose tokens all write the null block."""
        s = num_seqs
        query_start_loc = np.zeros(s + 1, np.int32)
        query_start_loc[1:] = 1  # sequence 0 has the one real token, the rest are empty
        return StepInputs(
            ModelInputs(token_ids=np.zeros(num_tokens, np.int32), positions=np.zeros(num_tokens, np.int32),
                        logits_indices=np.zeros(s, np.int32)),
            StepAttentionMetadata(
                slot_mapping=np.zeros((self.cache_config.num_kv_cache_groups, num_tokens), np.int32),
                block_tables=np.zeros((self.cache_config.num_kv_cache_groups, s, self.cache_config.max_blocks_per_seq),
                                      np.int32),
                seq_lens=np.eye(1, s, dtype=np.int32)[0], query_start_loc=query_start_loc, num_seqs=np.ones(1, np.int32)),
            # Sampling rows that filter and draw, so the compiled step holds every branch.
            SamplingMetadata(temperature=np.ones(s, np.float32), top_k=np.full(s, 8, np.int32),
                             top_p=np.full(s, 0.9, np.float32), rng_keys=np.zeros((s, 2), np.uint32)),
        )

    # warm-up
    def warm_up(self, progress=None) -> int:
        """Compiles every bucket now, smallest first (waiting for a running warm-up thread),
        and waits for the KV pool.

        Returns the number of shapes. `progress`, if given, is called after each.
        """
        shapes = self.bucket_shapes()
        for shape in shapes:
            self._programs_for(shape)
            if progress is not None:
                progress()
        self.kv_caches  # noqa: B018  (and the pool: ready means nothing is left to build)
        return len(shapes)

    def start_warm_up(self, num_first: int = 1, progress=None) -> None:
        """Compiles the smallest num_first buckets now and the others on a background thread,
        smallest first, while steps run (a step whose bucket is not compiled yet pads up to
        a compiled one, or waits for its own, which is compiled next). `progress`, if given,
        is called after each bucket, from either thread. wait_warm_up() joins the thread.
        """
        shapes = self.bucket_shapes()
        for shape in shapes[:num_first]:
            self._programs_for(shape)
            if progress is not None:
                progress()
        with self._cond:
            self._queue = [shape for shape in shapes if shape not in self._programs]
            if not self._queue or self._warming_up:
                return
            self._warming_up = True
            self._thread = threading.Thread(target=self._warm_up_thread, args=(progress,),
                                            name="paged-jax-warm-up", daemon=True)
            _WARMING_UP.add(self)
            self._thread.start()

    def _warm_up_thread(self, progress) -> None:
        try:
            while True:
                with self._cond:
                    if not self._queue:
                        return
                    shape = self._queue.pop(0)
                    if shape in self._programs:
                        continue
                self._add_programs(shape)
                if progress is not None:
                    progress()
        except BaseException as error:  # handed to the step waiting for a bucket
            with self._cond:
                self._error = error
            raise
        finally:
            # Cleared under the lock before waking waiters, so none waits on a finished thread.
            with self._cond:
                self._warming_up = False
                self._cond.notify_all()

    def wait_warm_up(self) -> None:
        """Returns once the warm-up thread (if any) has compiled every bucket."""
        thread = self._thread
        if thread is not None:
            thread.join()
        if self._error is not None:
            raise RuntimeError("compiling a bucket on the warm-up thread failed") from self._error

    def stop_warm_up(self) -> None:
        """Drops the buckets not compiled yet and waits for the one being compiled and for the
        pool's zeroing (call before exiting the process, so no computation is cut off mid-way)."""
        with self._cond:
            self._queue.clear()
        thread = self._thread
        if thread is not None:
            thread.join()
        concurrent.futures.wait([self._kv_caches_ready])

    @property
    def num_compiled_shapes(self) -> int:
        return len(self._programs)

    def compiled_memory(self, num_tokens: int, num_seqs: int) -> dict:
        """Memory analysis of one bucket's programs (tests use it to show that the donated caches
        are updated in place): {"embed", "layer", "head"} -> CompiledMemoryStats. The layer
        program runs once per group of layers_per_program layers, on their caches; "layers" lists
        the program of every kind of group (layers of different structure), "layer" is the first."""
        embed, layers, head = self._programs_for((num_tokens, num_seqs))
        return {"embed": embed.memory_analysis(), "layer": layers[0].memory_analysis(),
                "layers": [layer.memory_analysis() for layer in layers], "head": head.memory_analysis()}
