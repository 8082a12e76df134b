"""ModelRunner: the weights, the compiled step of each bucket, and one step per call.

A step is three compiled programs per bucket (token count T, sequence count S; the block
table width is fixed): `embed`, one `layer` program of a few consecutive decoder layers
(layers_per_program, up to 6) called once per group of layers, and `head` (final norm,
logits of the sampled rows, sampling). With speculative decoding each bucket also has a
`spec_head`, which a step runs instead of `head` when some sequence brought proposals: the
logits of every scored position (1 + k rows per sequence) and the rejection sampler
(paged_jax/rejection_sampler.py); steps without proposals keep the plain head's cost. Each
head also has a twin that applies a LogitsProcessingMetadata (grammar masks, repetition
penalties) before sampling, which a step runs only when one of its sequences needs it, so
free steps never carry a mask. Compiling a few layers instead of a program with
every layer unrolled is what makes start-up fast; each call costs a little on the host and
in the runtime, so groups are as large as divide the layer count up to 6
(docs/BENCHMARKS.md, section 10, measures both). The exception is a small bucket on the CPU
whose layers are each one native call (cpu_kernels/decoder_layer.py): such a program compiles
in no time whatever its length, so those steps run every layer in one (LayerGroups,
ModelRunner.layer_groups); a bucket of up to decoder_layer.MAX_TOKENS tokens runs them for
steps whose queries are all short (decodes, verification steps, short chunks:
ModelRunner.native_step) and has the XLA layers too, for a step with a longer chunk. A
lax.scan over stacked weights compiled as fast but copied each layer's weights out of the
stack on XLA:CPU, and would put every cache in one buffer that the loop reads while updating
(openxla/xla#45912).

Each layer call takes its layers' caches as donated arguments and returns them, so XLA
updates the caches in place (no second cache-sized buffer; tests check the compiled
executables). StepInputs crosses to the device once per step, packed into one i32 vector
(pack_step_inputs: one host-to-device copy instead of one per field,
scripts/bench_runner_overheads.py; on a CPU device the programs read the host vector in place);
every program unpacks the fields it reads with static slices.

The runner's two collaborators: the KVPool (paged_jax/kv_pool.py: the caches, their groups,
sizing, placement and page copies) and the CompileManager (paged_jax/compile_manager.py:
which buckets are compiled, warm-up in the foreground or on a background thread). The
host's padding depends on the batch alone; while a step's own bucket is still compiling it
runs in the smallest compiled bucket that fits (its inputs padded further by
pad_step_inputs, which changes no real row), and in a multi-process run it waits for its
own bucket, since every process must run the same program.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from cpu_kernels import decoder_layer
from paged_jax.attention import bind_layer, make_attention_backend
from paged_jax.attention.backend import XlaAttention
from paged_jax.attention.xla import token_rows
from paged_jax.compile_manager import CompileManager
from paged_jax.core.batch import pad_step_inputs
from paged_jax.core.step_inputs import (LogitsProcessingMetadata, ModelInputs, SamplingMetadata, SpecDecodeMetadata,
                                       StepAttentionMetadata, StepInputs)
from paged_jax.engine_config import ResolvedConfig
from paged_jax.kv_pool import KVPool
from paged_jax.rejection_sampler import rejection_sample
from paged_jax.sampler import sample
from paged_jax.sharding import (TP_AXIS, ShardedAttention, cache_shardings, check_tensor_parallel, local_value,
                                put_replicated, replicated, shard_params, step_fingerprint)
from pallas_kernels.ragged_batch import ragged_batch

# A CPU step whose sequences have at most this many query tokens each (decodes, verifying k
# proposals, short chunks) runs whole native layers (native_step); a step with a longer chunk
# runs the XLA layers, compiled beside them in such a bucket.
SHORT_QUERY_ROWS = 8


def _default_layers_per_program(num_layers: int) -> int:
    """Consecutive layers one compiled layer program runs: the largest of 6..2 that divides
    num_layers (every call then runs the same program), else 1 (module docstring: the costs)."""
    return next((k for k in (6, 5, 4, 3, 2) if num_layers % k == 0), 1)


class LayerGroups(NamedTuple):
    """The model's layers as consecutive runs of `size`, each run one call of a layer program.

    Runs of the same kind share one compiled program; a model whose layers differ
    (DeepSeek-V2's dense first layers before its MoE ones; a GGUF whose layers mix block
    formats, as Q4_K_M files do) gets one per kind of run. A kind is its layers' graphs,
    weight shapes and dtypes, KV-cache groups (which table each reads) and caches (which of
    the program's caches each writes).
    """

    size: int
    tensors: list[tuple[int, ...]]  # per run: the caches it takes (donated), in order of first use
    kind_of: list[int]              # per run: its kind (an index into kinds)
    kinds: list[tuple]              # the distinct kinds, first seen first
    leaves: list[list]              # per run: its layers' weights, flat
    treedefs: list                  # per kind: the structure of its weights
    layer_inputs: list[dict]        # per run: its slice of the pool's layer inputs (sliced once)

    @classmethod
    def of(cls, graphdefs, layer_params, layer_group, layer_tensor, pool_layer_inputs, first_layer: int,
           size: int) -> LayerGroups:
        """Runs of `size` layers (a divisor of their count). layer_group / layer_tensor: each
        layer's KV-cache group and cache (KVPool); a cache shared by several layers of a run
        is taken once."""
        starts = range(0, len(layer_params), size)
        tensors = [tuple(dict.fromkeys(layer_tensor[i : i + size])) for i in starts]
        weight_types = [tuple((tuple(a.shape), str(a.dtype)) for a in jax.tree.leaves(params))
                        for params in layer_params]
        run_kinds = [(tuple(graphdefs[i : i + size]), tuple(layer_group[i : i + size]),
                      tuple(run.index(t) for t in layer_tensor[i : i + size]), tuple(weight_types[i : i + size]))
                     for i, run in zip(starts, tensors)]
        kinds = list(dict.fromkeys(run_kinds))
        kind_of = [kinds.index(kind) for kind in run_kinds]
        runs = [layer_params[i : i + size] for i in starts]
        return cls(size, tensors, kind_of, kinds, [jax.tree.leaves(run) for run in runs],
                   [jax.tree.structure(runs[kind_of.index(kind)]) for kind in range(len(kinds))],
                   [{name: a[first_layer + i : first_layer + i + size] for name, a in pool_layer_inputs.items()}
                    for i in starts])


class BucketPrograms(NamedTuple):
    """The compiled programs of one bucket (ModelRunner._compile): None where unused.

    layers: one program per kind of run (layer_groups); spec_head, head_processed,
    spec_head_processed: the heads of verification steps and of steps with logits
    processing; long_layers: the XLA layers of a bucket whose short-query steps run native
    ones but whose other steps do not (native_step); steps: num_scheduler_steps decode steps
    in one program, in a bucket a decode-only step lands in (execute_steps).
    """

    embed: object
    layers: tuple
    head: object
    spec_head: object = None
    head_processed: object = None
    spec_head_processed: object = None
    long_layers: tuple | None = None
    steps: object = None


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


class ModelRunner:
    """Holds the weights and the compiled programs on the device and runs one step per call.

    Args:
      model: a registered model (models/registry.py): `embed`, `layers` (modules of one
        graph, each called as layer(x, positions, layer_cache, attn_metadata, attention)),
        `compute_logits` and `kv_cache_specs`; its state is split off once and its graph is
        static.
      config: the ResolvedConfig (EngineConfig.resolve). Its cache part: block_size, num_blocks
        (null block included), max_model_len and the KV-cache groups (each layer reads its
        group's block table and slot mapping); its scheduler part: the step limits, whose
        buckets are the compiled shapes; its engine part, the device-side knobs: dtype
        (compute and KV; None: the model's), kv_cache_dtype / kv_cache_scaling / kv_scales /
        kv_key_offsets (the pool's format and static inputs), attention_impl ("xla", "triton",
        alias "pallas", or None: triton on GPU, xla elsewhere) with interpret, and
        layers_per_program (a divisor of the layer count; None: up to 6; the layer count
        compiles the whole stack into one program).
      mesh: a jax.sharding.Mesh with a "tp" axis (paged_jax/sharding.py): weights and the pool
        are placed split over it, the attention backends run per shard and every step input
        is replicated. None: everything on the default device (the single-device programs).
      pool: a KVPool to run in (a draft model's runner shares the target's); None: a new
        one, of the model's layers (config.engine.kv_cache_specs).
      first_layer: the pool layer of the model's layer 0 (a draft's layers follow the
        target's in the pool: len(target.layers)).

    Attributes:
      pool: the KVPool (the caches and what is known of them).
      compiler: the CompileManager of the bucket programs.
      attention_backends: one per KV-cache group, for its spec; `attention` is the first.
    """

    def __init__(self, model, config: ResolvedConfig, *, mesh=None, pool: KVPool | None = None, first_layer: int = 0,
                 logits_processing: bool = True):
        self.resolved_config = config
        self.cache_config, self.scheduler_config = cache_config, scheduler_config = config.cache, config.scheduler
        engine = config.engine  # the device-side knobs
        self.config = model.config
        self.mesh = mesh
        if mesh is not None:
            check_tensor_parallel(model, mesh.shape[TP_AXIS])
        if pool is None:
            pool = KVPool(engine.kv_cache_specs(model), cache_config, mesh, kv_scales=engine.kv_scales,
                          kv_key_offsets=engine.kv_key_offsets)
        self.pool = pool
        num_layers = len(model.layers)
        if not 0 <= first_layer <= len(pool.specs) - num_layers:
            raise ValueError(f"first_layer={first_layer}: the pool has {len(pool.specs)} layers, the model "
                             f"{num_layers}")
        # This model's layers in the pool: what they read (their group's table) and write.
        layer_group = pool.layer_kv_cache_group[first_layer : first_layer + num_layers]
        layer_tensor = pool.layer_tensor[first_layer : first_layer + num_layers]
        self.tensor_parallel_size = pool.tensor_parallel_size
        # One backend per group (its spec's), the one its layers call.
        self.attention_backends = [make_attention_backend(spec, engine.attention_impl, interpret=engine.interpret)
                                   for spec in pool.group_specs]
        if mesh is not None:
            self.attention_backends = [ShardedAttention(a, mesh, pool.kv_head_replicas)
                                       for a in self.attention_backends]
        self.attention = self.attention_backends[0]  # the first group's (the only one's, for most models)
        self.attention_impl = self.attention.name
        # Whether small buckets may run a layer as one native call (cpu_kernels/decoder_layer.py):
        # one CPU device, the XLA attention of float caches (what that kernel's attention is).
        self._host_is_device = mesh is None and jax.default_backend() == "cpu"
        self._native_layers = (self._host_is_device
                               and all(type(a) is XlaAttention for a in self.attention_backends)
                               and decoder_layer.native_available())
        layers_per_program = engine.layers_per_program
        if layers_per_program is None:
            layers_per_program = _default_layers_per_program(num_layers)
        if not 1 <= layers_per_program <= num_layers or num_layers % layers_per_program:
            raise ValueError(f"layers_per_program={layers_per_program} must divide the model's {num_layers} layers "
                             f"(1..{num_layers}; {num_layers} compiles them all into one program), or be None")
        self.layers_per_program = layers_per_program
        self.graphdef, self._all_layer_params, self.head_params = nnx.split(model, nnx.PathContains("layers"), ...)
        # The layers' weights stay one buffer per layer (no stacked copy).
        self.layer_params = [nnx.state(layer) for layer in model.layers]
        if mesh is not None:
            # New arrays on the mesh (no-ops for weights a loader already placed there); the
            # model object keeps its own, so data-parallel replicas can share one model.
            rules = model.param_partition_rules  # the model family's (models/<family>/model.py)
            self.layer_params = [shard_params(params, mesh, rules) for params in self.layer_params]
            self.head_params = shard_params(self.head_params, mesh, rules)
        # The programs take their weights as flat lists of arrays (unflattened inside, at trace
        # time): flattening nnx States on every call cost ~0.2 ms a program (jax's
        # ParseArguments, docs/BENCHMARKS.md section 18).
        self._head_leaves, self._head_treedef = jax.tree.flatten(self.head_params)
        groups = functools.partial(LayerGroups.of, [nnx.graphdef(layer) for layer in model.layers], self.layer_params,
                                   layer_group, layer_tensor, pool.layer_inputs, first_layer)
        self._groups = groups(layers_per_program)
        # Buckets of whole native layers run every layer in one program: its calls cost no
        # compile time to speak of, and each program call costs ~0.1 ms on the host and in
        # the runtime (docs/BENCHMARKS.md section 18, sixth pass).
        self._native_groups = None
        if self._native_layers and all(
                getattr(layer, "native_weights", lambda cache: None)(pool.abstract_caches[t]) is not None
                for layer, t in zip(model.layers, layer_tensor)):
            self._native_groups = self._groups if layers_per_program == num_layers else groups(num_layers)
        self.num_steps = 0
        self.num_scheduler_steps = scheduler_config.num_scheduler_steps
        # The buckets a decode-only step lands in (one token a sequence): those get the
        # program of num_scheduler_steps steps.
        self._decode_shapes = {scheduler_config.bucket_for(n, n) for n in range(1, scheduler_config.max_num_seqs + 1)
                               if n <= scheduler_config.max_num_batched_tokens}
        spec_config = engine.spec_config
        self.num_spec_tokens = 0 if spec_config is None else spec_config.num_speculative_tokens
        # Heads that apply grammar masks and penalties (a draft model's runner has no use for them).
        self.logits_processing = logits_processing
        self.vocab_size = model.config.vocab_size
        self.history_width = min(cache_config.max_model_len, self.vocab_size)  # distinct ids a sequence can hold
        self.compiler = CompileManager(scheduler_config.bucket_shapes(), self._compile, scheduler_config.bucket_for)

    @property
    def kv_caches(self) -> list:
        """The pool's caches, one per layer unless KV-cache groups share them
        (KVPool.layer_tensor): what every step donates and gets back."""
        return self.pool.kv_caches

    def native_step(self, num_tokens: int, max_query_len: int = 1) -> bool:
        """Whether a step in the token bucket num_tokens whose longest query (a sequence's
        scheduled tokens) is max_query_len runs its layers as native calls where they can be
        (cpu_kernels/decoder_layer.py): on one CPU device, in buckets of at most
        decoder_layer.MAX_TOKENS, when every query is at most SHORT_QUERY_ROWS tokens
        (decodes, verification steps, short chunks). Longer chunks run the XLA layers, whose
        attention on a CPU is the same token rows (attention/xla.py)."""
        return (self._native_layers and num_tokens <= decoder_layer.MAX_TOKENS
                and max_query_len <= SHORT_QUERY_ROWS)

    def layer_groups(self, num_tokens: int, max_query_len: int = 1) -> LayerGroups:
        """How such a step runs the layers: every layer in one program where each is one
        native call (native_step), else runs of layers_per_program."""
        if self._native_groups is not None and self.native_step(num_tokens, max_query_len):
            return self._native_groups
        return self._groups

    @property
    def num_compilations(self) -> int:
        """Buckets compiled (each: an embed, its layer programs and a head program)."""
        return self.compiler.num_compilations

    def bucket_shapes(self) -> list[tuple[int, int]]:
        """Every (token bucket, sequence bucket) a step can land in (SchedulerConfig.bucket_shapes),
        smallest first: the warm-up order."""
        return self.compiler.shapes

    def warm_up(self, progress=None) -> int:
        """Compiles every bucket now, smallest first, and waits for the KV pool (ready means
        nothing is left to build). Returns the number of shapes; `progress` is called after each."""
        n = self.compiler.warm_up(progress)
        self.pool.kv_caches  # noqa: B018
        return n

    def stop(self) -> None:
        """Stops the background work: drops the buckets not compiled yet, waits for the one
        compiling and for the pool's zeroing (before exit: no computation cut off)."""
        self.compiler.stop()
        self.pool.stop()

    def start_warm_up(self, num_first: int = 1, progress=None) -> None:
        """Compiles the smallest num_first buckets now and the others on a background thread
        (CompileManager.start_warm_up)."""
        self.compiler.start_warm_up(num_first, progress)

    def _put(self, packed: np.ndarray):
        """A step's packed inputs where its programs read them: replicated on the mesh, one
        device copy that every program reads, or, on a CPU device, the host array itself (a
        CPU program reads it in place, and jax.device_put there made a decode step ~6% slower:
        docs/BENCHMARKS.md section 18, seventh pass)."""
        if self.mesh is not None:
            return put_replicated(packed, self.mesh)
        return packed if self._host_is_device else jax.device_put(packed)

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

    def _layer_fn(self, layer_params, x, kv_caches, positions, attn_metadata: StepAttentionMetadata, kind,
                  layer_inputs=None, native: bool = False):
        """A run of consecutive layers (LayerGroups): their params are a list, kv_caches the
        caches they keep their pages in (one per layer, or fewer when groups share them); kind
        (static) is their (graphs, KV-cache groups, cache of each, weight types); each layer
        reads its group's view of attn_metadata, calls its group's backend and writes its cache
        (a shared cache passes from layer to layer, updated in place); layer_inputs, a dict of
        arrays with a leading layer axis (the pool's layer inputs sliced), what the attention
        backend binds per layer; native (static): the program of a native_step, whose layers
        that can be one native call are."""
        new_caches = list(kv_caches)
        graphdefs, kv_groups, cache_ids, _ = kind
        views = {g: attn_metadata.for_group(g) for g in set(kv_groups)}
        # A native_step: a layer that can be one native call is one (decoder_layer.py).
        rows = None
        if native:
            rows = {g: token_rows(view.block_tables, ragged_batch(view.seq_lens, view.query_start_loc,
                                                                  jnp.reshape(view.num_seqs, ())), x.shape[0])
                    for g, view in views.items()}
        layers = [nnx.merge(graphdef, params) for graphdef, params in zip(graphdefs, layer_params)]
        for i, (layer, group, c) in enumerate(zip(layers, kv_groups, cache_ids)):
            out = None
            if rows is not None and hasattr(layer, "native_call"):
                # The next layer's, for the call to fetch its first weights ahead.
                following = layers[i + 1] if i + 1 < len(layers) else None
                out = layer.native_call(x, positions, new_caches[c], views[group], rows[group], following)
            if out is None:
                attention = bind_layer(self.attention_backends[group], layer_inputs, i)
                out = layer(x, positions, new_caches[c], views[group], attention)
            x, new_caches[c] = out
        return x, new_caches

    def _head_fn(self, head_params, x, inputs: StepInputs, processing: LogitsProcessingMetadata | None = None):
        logits = self._model(head_params).compute_logits(x, inputs.model)
        return sample(logits, inputs.sampling, processing)

    def _spec_head_fn(self, head_params, x, inputs: StepInputs, spec: SpecDecodeMetadata,
                      processing: LogitsProcessingMetadata | None = None):
        """Logits of every scored position (S x (k + 1) rows) and the rejection sampler:
        (token ids i32[S, k + 1], logprobs f32[S, k + 1], accepted proposals i32[S])."""
        num_seqs, num_positions = spec.logits_indices.shape
        rows = inputs.model._replace(logits_indices=spec.logits_indices.reshape(-1))
        logits = self._model(head_params).compute_logits(x, rows).reshape(num_seqs, num_positions, -1)
        token_ids, num_accepted, logprobs = rejection_sample(logits, spec.draft_token_ids, spec.num_draft_tokens,
                                                             inputs.sampling, processing=processing)
        return token_ids, logprobs, num_accepted

    def dummy_processing(self, num_seqs: int, num_positions: int = 1) -> LogitsProcessingMetadata:
        """Logits processing that changes nothing, for num_seqs sequences of num_positions
        scored positions each (1 + k in a verification step)."""
        words = -(-self.vocab_size // 32)
        h = self.history_width
        return LogitsProcessingMetadata(
            bitmask=np.full((num_seqs * num_positions, words), -1, np.int32),
            penalties=np.tile(np.array([0.0, 0.0, 1.0], np.float32), (num_seqs, 1)),
            history_ids=np.full((num_seqs, h), self.vocab_size, np.int32),
            output_counts=np.zeros((num_seqs, h), np.float32))

    def dummy_spec(self, num_seqs: int) -> SpecDecodeMetadata:
        """Verification inputs of a bucket with num_seqs sequences (no proposals)."""
        k = self.num_spec_tokens
        return SpecDecodeMetadata(draft_token_ids=np.zeros((num_seqs, k), np.int32),
                                  num_draft_tokens=np.zeros(num_seqs, np.int32),
                                  logits_indices=np.zeros((num_seqs, k + 1), np.int32))

    def _abstract(self, tree):
        """tree's arrays as the shapes, dtypes and shardings a program is compiled for."""
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype, sharding=self._sharding(a)), tree)

    def _packed_like(self, tree):
        """The i32 vector pack_step_inputs makes of tree (replicated on a mesh)."""
        return jax.ShapeDtypeStruct((sum(int(np.prod(a.shape)) for a in jax.tree.leaves(tree)),), np.int32,
                                    sharding=None if self.mesh is None else replicated(self.mesh))

    def _compile(self, num_tokens: int, num_seqs: int) -> BucketPrograms:
        """Lowers and compiles the programs of one bucket (from shapes only, so the warm-up
        thread never touches the live, donated caches). Each takes the step's packed inputs
        and unpacks what it reads. On a mesh every argument carries its sharding (weights and
        caches their own, the packed inputs replicated) and the outputs are pinned."""
        abstract = self._abstract
        like = abstract(self.dummy_inputs(num_tokens, num_seqs))
        rep = None if self.mesh is None else replicated(self.mesh)
        packed = self._packed_like(like)

        head_params_of = functools.partial(jax.tree.unflatten, self._head_treedef)

        def embed_fn(head_leaves, packed):
            return self._embed_fn(head_params_of(head_leaves), unpack_step_inputs(packed, like).model.token_ids)

        def layer_fn(layer_leaves, x, kv_caches, packed, layer_inputs, groups, index, native):
            inputs = unpack_step_inputs(packed, like)
            layer_params = jax.tree.unflatten(groups.treedefs[index], layer_leaves)
            return self._layer_fn(layer_params, x, kv_caches, inputs.model.positions, inputs.attention,
                                  groups.kinds[index], layer_inputs, native)

        def head_fn(head_leaves, x, packed):
            return self._head_fn(head_params_of(head_leaves), x, unpack_step_inputs(packed, like))

        head_params = abstract(self._head_leaves)
        embed = self._jit(embed_fn, rep).lower(head_params, packed).compile()
        x = jax.eval_shape(embed_fn, head_params, packed)
        x = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep)

        def compile_layers(max_query_len: int) -> tuple:  # one program per kind of run
            groups = self.layer_groups(num_tokens, max_query_len)
            native = self.native_step(num_tokens, max_query_len)
            layer_inputs = abstract(groups.layer_inputs[0])
            layers = []
            for index in range(len(groups.kinds)):
                run = groups.kind_of.index(index)
                tensors = groups.tensors[run]
                caches_out = None if self.mesh is None else [cache_shardings(self.pool.tensor_specs[t], self.mesh)
                                                             for t in tensors]
                program = self._jit(functools.partial(layer_fn, groups=groups, index=index, native=native),
                                    (rep, caches_out), donate_argnums=(2,))
                # Shapes only: the warm-up thread must not read the live caches the steps donate.
                layers.append(program.lower(abstract(groups.leaves[run]), x,
                                            [self.pool.abstract_caches[t] for t in tensors], packed,
                                            layer_inputs).compile())
            return tuple(layers)

        layers = compile_layers(1)
        # A bucket whose decodes run native layers but which can hold a longer chunk gets the XLA
        # layers for steps with one (execute chooses by the step's longest query).
        long_layers = (compile_layers(num_tokens) if self.native_step(num_tokens) and num_tokens > SHORT_QUERY_ROWS
                       else None)
        head = self._jit(head_fn, (rep, rep)).lower(head_params, x, packed).compile()
        spec_head = None
        if self.num_spec_tokens:
            spec_like = abstract(self.dummy_spec(num_seqs))
            spec_packed = self._packed_like(spec_like)

            def spec_head_fn(head_leaves, x, packed, spec_packed):
                return self._spec_head_fn(head_params_of(head_leaves), x, unpack_step_inputs(packed, like),
                                          unpack_step_inputs(spec_packed, spec_like))

            spec_head = self._jit(spec_head_fn, (rep, rep, rep)).lower(head_params, x, packed, spec_packed).compile()
        head_processed = spec_head_processed = None
        if self.logits_processing:
            proc_like = abstract(self.dummy_processing(num_seqs))

            def head_processed_fn(head_leaves, x, packed, proc_packed):
                return self._head_fn(head_params_of(head_leaves), x, unpack_step_inputs(packed, like),
                                     unpack_step_inputs(proc_packed, proc_like))

            head_processed = self._jit(head_processed_fn, (rep, rep)).lower(
                head_params, x, packed, self._packed_like(proc_like)).compile()
            if self.num_spec_tokens:
                spec_proc_like = abstract(self.dummy_processing(num_seqs, self.num_spec_tokens + 1))

                def spec_head_processed_fn(head_leaves, x, packed, spec_packed, proc_packed):
                    return self._spec_head_fn(head_params_of(head_leaves), x, unpack_step_inputs(packed, like),
                                              unpack_step_inputs(spec_packed, spec_like),
                                              unpack_step_inputs(proc_packed, spec_proc_like))

                spec_head_processed = self._jit(spec_head_processed_fn, (rep, rep, rep)).lower(
                    head_params, x, packed, spec_packed, self._packed_like(spec_proc_like)).compile()
        steps = None
        if self.num_scheduler_steps > 1 and self.mesh is None and (num_tokens, num_seqs) in self._decode_shapes:
            steps = self.compile_steps(num_tokens, num_seqs, self.num_scheduler_steps)
        return BucketPrograms(embed, layers, head, spec_head, head_processed, spec_head_processed, long_layers, steps)

    def compile_steps(self, num_tokens: int, num_seqs: int, k: int) -> tuple:
        """k decode steps of bucket (num_tokens, num_seqs) as one program (execute_steps; one
        device, the bucket's short-query layers): each step embeds the tokens the one before
        sampled, runs the layers at positions + i with step i's slot mapping and its sequences
        one key longer, and samples with each sequence's output number + i (so a seeded draw
        is the one the steps would make one at a time). Returns (program, the pool caches it
        takes, donated, and returns): the program is called as (head leaves, each run's layer
        leaves, those caches, packed step inputs, each run's layer inputs, slot mappings
        i32[k, groups, T]) and returns (token ids i32[S, k], logprobs f32[S, k], the caches)."""
        abstract = self._abstract
        like = abstract(self.dummy_inputs(num_tokens, num_seqs))
        head_params_of = functools.partial(jax.tree.unflatten, self._head_treedef)
        groups = self.layer_groups(num_tokens)
        native = self.native_step(num_tokens)
        used = sorted({t for tensors in groups.tensors for t in tensors})  # the caches the layers write

        def steps_fn(head_leaves, run_leaves, kv_caches, packed, run_inputs, slots):
            inputs = unpack_step_inputs(packed, like)
            head_params = head_params_of(head_leaves)
            model, attention, sampling = inputs.model, inputs.attention, inputs.sampling
            real = attention.seq_lens > 0
            rows = jnp.where(real, model.logits_indices, num_tokens)  # each sequence's token row (padding: none)
            caches = dict(zip(used, kv_caches))
            token_ids, sampled, logprobs = model.token_ids, [], []
            for i in range(k):
                step = inputs._replace(
                    model=model._replace(token_ids=token_ids, positions=model.positions + i),
                    attention=attention._replace(slot_mapping=slots[i],
                                                 seq_lens=jnp.where(real, attention.seq_lens + i, 0)),
                    sampling=sampling._replace(rng_keys=sampling.rng_keys.at[:, 1].add(
                        jnp.where(real, i, 0).astype(sampling.rng_keys.dtype))))
                x = self._embed_fn(head_params, token_ids)
                for run, tensors in enumerate(groups.tensors):
                    kind = groups.kind_of[run]
                    x, new = self._layer_fn(jax.tree.unflatten(groups.treedefs[kind], run_leaves[run]), x,
                                            [caches[t] for t in tensors], step.model.positions, step.attention,
                                            groups.kinds[kind], run_inputs[run], native)
                    caches.update(zip(tensors, new))
                ids, lps = self._head_fn(head_params, x, step)
                sampled.append(ids)
                logprobs.append(lps)
                token_ids = jnp.zeros_like(token_ids).at[rows].set(ids, mode="drop")
            return jnp.stack(sampled, axis=1), jnp.stack(logprobs, axis=1), [caches[t] for t in used]

        slots = jax.ShapeDtypeStruct((k, self.cache_config.num_kv_cache_groups, num_tokens), np.int32)
        program = self._jit(steps_fn, None, donate_argnums=(2,)).lower(
            abstract(self._head_leaves), [abstract(leaves) for leaves in groups.leaves],
            [self.pool.abstract_caches[t] for t in used], self._packed_like(like),
            [abstract(li) for li in groups.layer_inputs],
            slots).compile()
        return program, used

    def _programs_for(self, shape: tuple[int, int]) -> BucketPrograms:
        return self.compiler.programs_for(shape)

    def execute_steps(self, inputs: StepInputs, slot_mappings: np.ndarray) -> tuple | None:
        """Runs num_scheduler_steps decode steps of a decode-only step (SchedulerOutput.num_steps)
        in one program: returns (token ids i32[S, k], their logprobs f32[S, k]) on the host,
        row i sequence i's tokens in order, or None where its bucket has no such program (a
        step padded into another bucket while buckets compile, a mesh): run execute then.
        slot_mappings: i32[k, groups, T], StepInputsBuilder.step_slot_mappings."""
        shape = inputs.model.token_ids.shape[0], inputs.attention.seq_lens.shape[0]
        if self.compiler.choose_shape(*shape) != shape:
            return None
        program = self._programs_for(shape).steps
        if program is None:
            return None
        program, used = program
        groups = self.layer_groups(shape[0])
        kv_caches = self.pool.kv_caches
        token_ids, logprobs, caches = program(self._head_leaves, groups.leaves, [kv_caches[t] for t in used],
                                              self._put(pack_step_inputs(inputs)), groups.layer_inputs,
                                              slot_mappings)
        for t, cache in zip(used, caches):
            kv_caches[t] = cache
        self.num_steps += self.num_scheduler_steps
        return np.asarray(token_ids), np.asarray(logprobs)

    def execute(self, inputs: StepInputs, copies=None, spec: SpecDecodeMetadata | None = None,
                processing: LogitsProcessingMetadata | None = None) -> tuple:
        """Runs one step; returns (sampled token ids i32[S], their logprobs f32[S]) on the host,
        or with `spec` (a verification step: StepInputsBuilder.spec_metadata) (token ids
        i32[S, k + 1], logprobs f32[S, k + 1], accepted proposals i32[S]): row i's tokens are
        its first accepted + 1. `processing` (grammar masks, penalties; shaped for the step's
        sequence bucket, with 1 + k positions per sequence in a verification step) runs the
        bucket's processing head instead.

        Rows past inputs.num_seqs are padding. A step with no sequences (only finished or
        aborted requests to release) runs no model program. `copies` (offload.StepCopies or
        None): pages copied down to the host tier, then up from it, before the step (the
        blocks they leave or fill are reused by this step), and persisted after it.
        """
        if copies is not None:
            if copies.store_block_ids.size:
                copies.store(self.pool.gather_pages(copies.store_block_ids))
            if copies.load_block_ids.size:
                self.pool.put_pages(copies.load_block_ids, copies.load())
        if inputs.num_seqs == 0:
            if spec is not None:
                return np.zeros((0, self.num_spec_tokens + 1), np.int32), np.zeros((0, self.num_spec_tokens + 1),
                                                                                  np.float32), np.zeros(0, np.int32)
            return np.zeros(0, np.int32), np.zeros(0, np.float32)
        shape = inputs.model.token_ids.shape[0], inputs.attention.seq_lens.shape[0]
        run_shape = self.compiler.choose_shape(*shape)
        if run_shape != shape:  # its own bucket is still compiling: a larger compiled one runs it
            inputs = pad_step_inputs(inputs, *run_shape)
            if spec is not None:  # padded sequences have no proposals and score row 0
                spec = SpecDecodeMetadata(*(np.pad(a, [(0, run_shape[1] - shape[1])] + [(0, 0)] * (a.ndim - 1))
                                            for a in spec))
            if processing is not None:  # padded sequences change nothing
                processing = pad_processing(processing, self.dummy_processing(
                    run_shape[1] - shape[1], 1 if spec is None else self.num_spec_tokens + 1))
        embed, layers, head, spec_head, head_processed, spec_head_processed, long_layers, _ = self._programs_for(
            run_shape)
        max_query_len = 1
        if long_layers is not None:  # the bucket's layers for the step's longest query (native_step)
            qsl = inputs.attention.query_start_loc
            max_query_len = int(np.max(qsl[1:] - qsl[:-1]))
            if not self.native_step(run_shape[0], max_query_len):
                layers = long_layers
        packed = pack_step_inputs(inputs)
        if self.mesh is not None and jax.process_count() > 1:
            # Every process must run this very step (paged_jax/multiprocess.py): a diverged
            # scheduler fails here, not in a hung or garbled collective.
            multihost_utils.assert_equal(step_fingerprint(packed), "processes scheduled different steps")
        packed = self._put(packed)
        x = embed(self._head_leaves, packed)
        kv_caches = self.pool.kv_caches
        groups = self.layer_groups(run_shape[0], max_query_len)
        for run, tensors in enumerate(groups.tensors):
            layer = layers[groups.kind_of[run]]  # the program of this run's kind of layers
            x, caches = layer(groups.leaves[run], x, [kv_caches[t] for t in tensors], packed,
                              groups.layer_inputs[run])
            for t, cache in zip(tensors, caches):
                kv_caches[t] = cache
        put = self._put
        proc_packed = None
        if processing is not None:
            assert head_processed is not None, "logits processing given to a runner built without it"
            proc_packed = put(pack_step_inputs(processing))
        if spec is None:
            outputs = (head(self._head_leaves, x, packed) if processing is None
                       else head_processed(self._head_leaves, x, packed, proc_packed))
        else:
            assert spec_head is not None, "proposals given to a runner built without speculative decoding"
            spec_packed = put(pack_step_inputs(spec))
            outputs = (spec_head(self._head_leaves, x, packed, spec_packed) if processing is None
                       else spec_head_processed(self._head_leaves, x, packed, spec_packed, proc_packed))
        self.num_steps += 1
        if copies is not None and copies.persist_block_ids.size:
            copies.persist(self.pool.gather_pages(copies.persist_block_ids))
        if self.mesh is not None:  # replicated; this process's copy (one may not read others')
            return tuple(local_value(a) for a in outputs)
        return tuple(np.asarray(a) for a in outputs)

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
                seq_lens=np.eye(1, s, dtype=np.int32)[0], query_start_loc=query_start_loc,
                num_seqs=np.ones(1, np.int32)),
            # Sampling rows that filter and draw, so the compiled step holds every branch.
            SamplingMetadata(temperature=np.ones(s, np.float32), top_k=np.full(s, 8, np.int32),
                             top_p=np.full(s, 0.9, np.float32), rng_keys=np.zeros((s, 2), np.uint32)),
        )

    def compiled_memory(self, num_tokens: int, num_seqs: int) -> dict:
        """Memory analysis of one bucket's programs (tests use it to show that the donated caches
        are updated in place): {"embed", "layer", "head"} -> CompiledMemoryStats. The layer
        program runs once per run of layers (layer_groups(num_tokens)), on their caches; "layers"
        lists the program of every kind of run (layers of different structure), "layer" is the
        first."""
        embed, layers, head, *_ = self._programs_for((num_tokens, num_seqs))
        return {"embed": embed.memory_analysis(), "layer": layers[0].memory_analysis(),
                "layers": [layer.memory_analysis() for layer in layers], "head": head.memory_analysis()}


def pad_processing(processing: LogitsProcessingMetadata, padding: LogitsProcessingMetadata) -> LogitsProcessingMetadata:
    """processing with padding's rows after its own (a step run in a larger sequence bucket)."""
    return LogitsProcessingMetadata(*(np.concatenate([a, b]) for a, b in zip(processing, padding)))
