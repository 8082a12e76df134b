"""Tensor parallelism on a jax.sharding Mesh: which axis of each weight and cache is split.

One Mesh axis, "tp", over tensor_parallel_size devices (of one process or of several, after
jax.distributed.initialize). Everything is SPMD: the runner's programs are jitted over the
mesh with the shardings below, XLA inserts the collectives, and the attention backend runs
per shard inside a shard_map (ShardedAttention), so the Pallas kernel and the XLA gather
path see only their device's heads and pages.

Megatron layout (Llama's rules; what each device holds, N query heads, K KV heads, F MLP dim, V vocab):
- q_proj [D, N, H] split on N; o_proj [N, H, D] split on N (its matmul ends in an all-reduce);
- k_proj, v_proj [D, K, H] split on K, or replicated when tp > K (see below);
- gate_proj, up_proj [D, F] split on F (column-parallel); down_proj [F, D] split on F
  (row-parallel: an all-reduce);
- embed_tokens and lm_head [V, D] split on V (vocab-parallel, as vLLM's
  VocabParallelEmbedding): 1/tp of the largest matrices of a small model per device;
  scripts/bench_tensor_parallel.py measures it against replication;
- norms replicated; block tables and every step input replicated.

KV heads: the cache of a FullAttentionSpec is split on its KV-head axis, so a device holds
1/tp of every page. When tp exceeds K, each KV head is replicated tp / K times (vLLM does the
same): the cache then holds tp heads, one per device, and every device still holds 1/tp of
the (replicated) cache; k_proj / v_proj stay whole on every device and their outputs are
repeated before the cache write. get_stats() reports the replication.

Weights split by their family's rules: the model's param_partition_rules (parameter name ->
PartitionSpec), declared next to the family's layers (models/llama/model.py) and carried by its
registry row; the functions below take the rules, so one family's names never split another's
weights. Caches split per cache spec type (CACHE_PARTITION_RULES, SHARDED_CACHE_SPECS): a new
cache spec adds its entries here.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from models.kv_cache_spec import FullAttentionSpec

TP_AXIS = "tp"


def _full_attention_sharded_spec(spec: FullAttentionSpec, tp: int) -> FullAttentionSpec:
    return dataclasses.replace(spec, num_kv_heads=spec.num_kv_heads * kv_head_replicas(spec.num_kv_heads, tp))


# Cache spec type -> the spec the pool holds at tensor parallelism tp (KV heads replicated
# up to tp), and -> the PartitionSpec of each of its leaves (same order as spec.allocate).
SHARDED_CACHE_SPECS = {FullAttentionSpec: _full_attention_sharded_spec}
CACHE_PARTITION_RULES = {
    FullAttentionSpec: lambda spec: (P(None, None, TP_AXIS, None),) * 2,  # k, v: [blocks, block_size, K, H]
}


def kv_head_replicas(num_kv_heads: int, tensor_parallel_size: int) -> int:
    """How many copies of each KV head the mesh keeps: 1 unless tp exceeds the KV heads."""
    return max(1, tensor_parallel_size // num_kv_heads)


def check_tensor_parallel(model, tensor_parallel_size: int) -> None:
    """ValueError unless the model's family has tensor-parallel rules and its heads and MLP
    split evenly over tensor_parallel_size devices."""
    tp, config = tensor_parallel_size, model.config
    if not model.param_partition_rules:
        raise ValueError(f"tensor_parallel_size={tp}: {type(model).__name__} has no tensor-parallel rules yet; "
                         "use tensor_parallel_size=1")
    n, k = config.num_heads, config.num_kv_heads
    if n % tp:
        raise ValueError(f"tensor_parallel_size={tp} must divide the model's {n} query heads; use a divisor of {n}")
    if (k % tp) if tp <= k else (tp % k):
        raise ValueError(f"tensor_parallel_size={tp} must divide the model's {k} KV heads or be a multiple of "
                         f"them (the KV heads are then replicated); use a divisor or a multiple of {k}")
    if config.intermediate_size % tp:
        raise ValueError(f"tensor_parallel_size={tp} must divide the MLP size {config.intermediate_size}")


def make_mesh(tensor_parallel_size: int, devices=None) -> Mesh:
    """A one-axis ("tp") Mesh over the first tensor_parallel_size devices (all processes' devices
    after jax.distributed.initialize), or over `devices`."""
    if devices is None:
        devices = jax.devices()
        if tensor_parallel_size > len(devices):
            raise ValueError(f"tensor_parallel_size={tensor_parallel_size} needs that many devices; "
                             f"jax sees {len(devices)} ({jax.default_backend()})")
        devices = devices[:tensor_parallel_size]
    if len(devices) != tensor_parallel_size:
        raise ValueError(f"got {len(devices)} devices for tensor_parallel_size={tensor_parallel_size}")
    # Auto axes: the partitioner propagates shardings through the layers (newer jax makes
    # abstract meshes Explicit by default, which wants an out_sharding on every sharded dot).
    return Mesh(np.asarray(devices), (TP_AXIS,), axis_types=(AxisType.Auto,))


def sharded_cache_spec(spec, tensor_parallel_size: int):
    """The spec the pool holds per layer at this tp (GQA: KV heads replicated up to tp)."""
    rule = SHARDED_CACHE_SPECS.get(type(spec))
    if rule is None:
        raise ValueError(f"no tensor-parallel rule for a {type(spec).__name__}; add one to SHARDED_CACHE_SPECS")
    return rule(spec, tensor_parallel_size)


def cache_partition_specs(spec) -> tuple[P, ...]:
    """PartitionSpec of each leaf of one layer's cache (leading dims [num_blocks, block_size])."""
    return CACHE_PARTITION_RULES[type(spec)](spec)


def cache_shardings(spec, mesh: Mesh) -> tuple[NamedSharding, ...]:
    return tuple(NamedSharding(mesh, p) for p in cache_partition_specs(spec))


def init_sharded_kv_caches(specs, num_blocks: int, block_size: int, mesh: Mesh) -> list:
    """One zeroed cache per layer, created sharded: each device allocates only its part."""
    assert num_blocks >= 2, f"{num_blocks=}: the pool needs the null block plus one (see CacheConfig)"
    allocate = {spec: jax.jit(functools.partial(spec.allocate, num_blocks, block_size),
                              out_shardings=cache_shardings(spec, mesh)) for spec in set(specs)}
    return [allocate[spec]() for spec in specs]


def param_partition_spec(name: str, shape: tuple[int, ...], tensor_parallel_size: int, rules: Mapping[str, P]) -> P:
    """How the parameter called `name` (last key of its state path) is split; P() replicates.

    rules: the model family's (model.param_partition_rules); a name missing there is replicated.
    A split axis that tensor_parallel_size does not divide is replicated instead: the K/V
    projections past the KV-head count, a vocabulary of 49152 at tp=5. Correctness never
    depends on it (the attention's shard_map slices whatever it gets); memory does.
    """
    rule = rules.get(name, P())
    assert len(rule) <= len(shape), f"rule {rule} of parameter {name} does not fit its shape {shape}"
    if any(axis == TP_AXIS and dim % tensor_parallel_size for axis, dim in zip(rule, shape)):
        return P()
    return rule


def _name_of(path) -> str:
    keys = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
    return str(keys[-1]) if keys else ""


def param_shardings(state, mesh, rules: Mapping[str, P]):
    """NamedSharding of every parameter of a model state (arrays or ShapeDtypeStructs), by
    name under the family's rules; `mesh` may be an AbstractMesh (lowering without the devices)."""
    tp = mesh.shape[TP_AXIS]
    return jax.tree_util.tree_map_with_path(
        lambda path, x: NamedSharding(mesh, param_partition_spec(_name_of(path), x.shape, tp, rules)), state)


def shard_params(state, mesh: Mesh, rules: Mapping[str, P]):
    """The model state (an nnx.State or any pytree of arrays) placed on the mesh by name under
    the family's rules (model.param_partition_rules)."""
    return jax.device_put(state, param_shardings(state, mesh, rules))


def param_placer(mesh: Mesh):
    """A placer for models.registry.load_model(place=...): placer(rules) -> place(name, host
    array) -> the array on the mesh, split by name under those rules.

    load_model binds the rules of the family it loads, and the family's loader calls place per
    tensor as it reads a checkpoint, so no device ever holds the whole model.
    """
    tp = mesh.shape[TP_AXIS]

    def placer(rules: Mapping[str, P]):
        def place(name: str, value: np.ndarray):
            sharding = NamedSharding(mesh, param_partition_spec(name, value.shape, tp, rules))
            return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])

        return place

    return placer


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def put_replicated(tree, mesh: Mesh):
    """Host numpy arrays -> arrays replicated on every device of the mesh (any number of
    processes: each process fills its own devices from its own copy, which must be equal)."""
    sharding = replicated(mesh)
    return jax.tree.map(lambda a: jax.make_array_from_callback(np.shape(a), sharding, lambda index: a[index]), tree)


def local_value(x) -> np.ndarray:
    """A replicated array's value on this process (np.asarray refuses arrays spanning processes)."""
    return np.asarray(x.addressable_data(0))


def step_fingerprint(inputs) -> np.ndarray:
    """u32[4]: a digest of a step's inputs, compared across processes to catch divergence."""
    digest = hashlib.sha256()
    for a in jax.tree.leaves(inputs):
        digest.update(np.ascontiguousarray(a).tobytes())
    return np.frombuffer(digest.digest()[:16], np.uint32).copy()


@dataclasses.dataclass(frozen=True)
class ShardedAttention:
    """An attention backend run per shard of the "tp" axis (shard_map around its call).

    Each device writes and attends over its own KV heads (its slice of every page) with its
    own query heads: GQA groups never cross devices, since query head n reads KV head
    n // (N / K) and both are split in the same contiguous order. Block tables and the
    rest of the metadata are replicated. The donated caches stay in place per shard.

    Attributes:
      inner: the per-device backend (make_attention_backend's for the sharded spec); `name`
        and `spec` are its (the canonical implementation name, "xla" or "triton").
      mesh: the tp mesh.
      kv_head_replicas: copies of each KV head (tp // K when tp > K, else 1): k and v are
        repeated to the cache's head count before the write.
    """

    inner: object
    mesh: Mesh
    kv_head_replicas: int = 1

    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def spec(self):
        return self.inner.spec

    def __call__(self, q, k, v, kv_cache, attn_metadata, *, sm_scale: float):
        """The inner backend's contract (q [T, N, H], k, v [T, K, H], the layer's cache,
        AttentionMetadata), with q, k, v and the cache split on their head axes."""
        if self.kv_head_replicas > 1:
            k = jnp.repeat(k, self.kv_head_replicas, axis=1)  # head j*r + i is a copy of head j
            v = jnp.repeat(v, self.kv_head_replicas, axis=1)
        heads = P(None, TP_AXIS, None)
        leaves = cache_partition_specs(self.inner.spec)
        # check_vma off: the Pallas call carries no varying-mesh-axis types for the checker.
        per_shard = jax.shard_map(functools.partial(self.inner, sm_scale=sm_scale), mesh=self.mesh,
                                  in_specs=(heads, heads, heads, leaves, P()), out_specs=(heads, leaves),
                                  check_vma=False)
        return per_shard(q, k, v, tuple(kv_cache), attn_metadata)
