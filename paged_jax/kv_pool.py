"""KVPool: the device side of the KV cache (every layer's pages, their sizing and placement).

The host's block manager hands out block ids; the pool holds what a block id means on the
device: its caches (vLLM's KVCacheTensors), each laid out as its layers' spec says
(models/kv_cache_spec.py), [num_blocks, block_size, ...], and updated in place by every step
(the runner donates them). A model of one KV-cache group has one cache per layer; a hybrid
model's groups share them (kv_cache_tensors: cache i holds the pages of the i-th layer of
every group, and a block belongs to one group at a time), so a block costs the same bytes in
any group. It knows the KV-cache groups (which layers read which block table) and so which
spec, and attention backend, each group has; it is sized from a byte budget
(num_blocks_for_budget), split over a tensor-parallel mesh, copies pages to and from the
host for the offload tiers, and carries the per-layer static inputs of a quantized pool
(K/V scales, key offsets) that the layer programs take as runtime inputs.
"""

from __future__ import annotations

import concurrent.futures
import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np

from models.kv_cache_spec import (QuantizedAttentionSpec, check_kv_cache_groups, init_kv_caches,
                                  kv_cache_bytes_per_block, kv_cache_group_specs, kv_cache_tensors)
from paged_jax.compile_manager import track_background_work
from paged_jax.core.config import CacheConfig
from paged_jax.core.single_type_kv_cache_manager import max_blocks_per_request
from paged_jax.core.kv_quant import check_key_offsets, check_scale
from paged_jax.sharding import (SHARDED_CACHE_SPECS, TP_AXIS, cache_shardings, init_sharded_kv_caches,
                                kv_head_replicas, sharded_cache_spec)

# A memory-derived pool never exceeds this many blocks (4M tokens at block_size 16): the
# host keeps one Python object per block, and only tiny models on big GPUs reach it (a
# Llama-3.1-8B in 100 GB of bf16 KV is ~50k blocks).
MAX_AUTO_BLOCKS = 1 << 18

# A pool sized without memory statistics (the CPU) holds at most this many bytes, and at least
# one full-length sequence, as vLLM's CPU backend sizes its pool by VLLM_CPU_KVCACHE_SPACE and
# not by the largest batch: room for every sequence at full length was gigabytes of zeros for
# SmolLM2 (64 x 4096 tokens), zeroed before a one-question `generate` could start.
CPU_KV_CACHE_BYTES = 4 << 30

# Blocks one page-copy program moves at most (a longer copy runs in chunks): 6 compiled sizes.
MAX_PAGE_COPY = 256


def num_blocks_for_budget(specs, block_size: int, *, groups=None, num_blocks=None, kv_cache_memory_bytes=None,
                          gpu_memory_utilization=0.9, max_num_seqs: int, max_model_len: int,
                          max_num_batched_tokens: int | None = None, tensor_parallel_size: int = 1,
                          device=None) -> int:
    """How many KV blocks (null block included) the pool gets.

    Args:
      specs: the model's per-layer cache specs (with the groups, they size a block:
        kv_cache_bytes_per_block).
      groups: the KV-cache groups (kv_cache_group_specs(specs) when None); a full-length
        sequence needs each group's own number of blocks (a sliding-window group's stays
        bounded by its window: max_blocks_per_request).
      max_num_batched_tokens: the largest step's tokens (a sliding group holds its window
        plus one step's new tokens); None: max_model_len.
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
    if groups is None:
        groups = kv_cache_group_specs(specs)
    if tp > 1:
        specs = [sharded_cache_spec(spec, tp) for spec in specs]
    per_block = kv_cache_bytes_per_block(specs, groups, block_size) // tp
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
    per_seq = sum(max_blocks_per_request(group, block_size, max_model_len, max_num_batched_tokens or max_model_len)
                  for group in groups)
    return min(max_num_seqs * per_seq, max(per_seq, CPU_KV_CACHE_BYTES // per_block)) + 1


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


class KVPool:
    """Every layer's KV cache on the device, with what the runner and the tiers need to know of it.

    Args:
      specs: the model's per-layer cache specs (as the model declares them).
      cache_config: block_size, num_blocks (null block included) and the KV-cache groups.
      mesh: a "tp" Mesh the pool is split over (each device holds its KV heads' share of every
        page), or None (the default device).
      kv_scales, kv_key_offsets: a quantized pool's static per-layer inputs (EngineConfig's).

    Attributes:
      specs: per layer, as held (a spec of the tp-local heads on a mesh).
      layer_kv_cache_group: layer -> its group (the block table and slot mapping it reads).
      group_specs: the spec of each group's layers.
      tensor_layers: cache -> the layers that keep their pages in it (kv_cache_tensors).
      layer_tensor: layer -> the index of its cache in kv_caches.
      layer_inputs: backend keyword -> array with a leading layer axis (the static inputs).
      abstract_caches: every cache's shapes (and shardings), known without the pool.
    Every cache keeps a page for every block id; the page of block b in cache i is written
    only by the layer of cache i in b's group. One group: one cache per layer, nothing
    wasted. A hybrid model: its groups have equal layer counts (kv_cache_group_specs), so a
    block wastes nothing in whichever group holds it.
    """

    def __init__(self, specs, cache_config: CacheConfig, mesh=None, *, kv_scales=None, kv_key_offsets=None):
        self.cache_config = cache_config
        self.num_blocks = cache_config.num_blocks
        self.mesh = mesh
        groups = cache_config.kv_cache_groups
        check_kv_cache_groups(groups, specs)
        self.layer_kv_cache_group = [0] * len(specs)
        for group_id, group in enumerate(groups):
            for layer_id in group.layer_ids:
                self.layer_kv_cache_group[layer_id] = group_id
        self.tensor_parallel_size = tp = 1 if mesh is None else mesh.shape[TP_AXIS]
        self.kv_head_replicas = 1
        if mesh is not None:
            bad = next((s for s in specs if type(s) not in SHARDED_CACHE_SPECS), None)
            if bad is not None:
                raise ValueError(f"tensor_parallel_size={tp}: a {type(bad).__name__} cache has no tensor-parallel "
                                 "rules yet; use tensor_parallel_size=1")
            self.kv_head_replicas = kv_head_replicas(specs[0].num_kv_heads, tp)
            specs = tuple(sharded_cache_spec(spec, tp) for spec in specs)
        self.specs = tuple(specs)
        self.group_specs = [self.specs[self.layer_kv_cache_group.index(g)] for g in range(len(groups))]
        self.tensor_layers = kv_cache_tensors(groups, self.specs)
        self.layer_tensor = [0] * len(specs)
        for tensor_id, layer_ids in enumerate(self.tensor_layers):
            for layer_id in layer_ids:
                self.layer_tensor[layer_id] = tensor_id
        # Each cache is allocated (and sharded) as its first layer's spec says: its layers'
        # specs share one page layout (a window is not part of it).
        self.tensor_specs = tuple(self.specs[layer_ids[0]] for layer_ids in self.tensor_layers)
        layer_inputs = (("kv_scales", static_kv_scales(specs[0], kv_scales, len(specs))),
                        ("key_offset", static_key_offsets(specs[0], kv_key_offsets, len(specs))))
        self.layer_inputs = {name: value for name, value in layer_inputs if value is not None}
        abstract = jax.eval_shape(lambda: [spec.allocate(self.num_blocks, cache_config.block_size)
                                           for spec in self.tensor_specs])
        if mesh is not None:  # each leaf as init_sharded_kv_caches places it
            abstract = [jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                                     tuple(cache), cache_shardings(spec, mesh))
                        for cache, spec in zip(abstract, self.tensor_specs)]
        self.abstract_caches = abstract
        self.kv_cache_bytes = sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(abstract))
        # What one device holds (all of it without a mesh).
        self.kv_cache_bytes_per_device = sum(
            int(np.prod(a.sharding.shard_shape(a.shape) if a.sharding else a.shape)) * np.dtype(a.dtype).itemsize
            for a in jax.tree.leaves(abstract))
        # jax zeroes a new buffer before it returns it (scripts/bench_runner_overheads.py times
        # it), so the pool is made on a thread of its own while the first bucket compiles or
        # loads from the compilation cache; the first use of kv_caches waits for it.
        self._kv_caches: list | None = None
        self._kv_caches_ready = concurrent.futures.Future()
        threading.Thread(target=self._allocate, name="paged-jax-kv-pool", daemon=True).start()
        track_background_work(self)
        # Page copies for the offload tiers: a gather and an in-place scatter program per
        # power-of-two block count up to MAX_PAGE_COPY (warm_up_page_copies compiles them).
        self._page_programs: dict[int, tuple] = {}
        self.page_copy_memory_kind: str | None = None  # "pinned_host" or "numpy", set at the first copy

    def _allocate(self) -> None:
        try:
            block_size = self.cache_config.block_size
            if self.mesh is None:
                caches = init_kv_caches(self.tensor_specs, self.num_blocks, block_size)
            else:
                caches = init_sharded_kv_caches(self.tensor_specs, self.num_blocks, block_size, self.mesh)
            self._kv_caches_ready.set_result(caches)
        except BaseException as error:  # raised where the pool is first used
            self._kv_caches_ready.set_exception(error)

    @property
    def kv_caches(self) -> list:
        """The caches (one per layer unless groups share them: layer_tensor), updated in place by every step."""
        if self._kv_caches is None:
            self._kv_caches = self._kv_caches_ready.result()
        return self._kv_caches

    @kv_caches.setter
    def kv_caches(self, caches: list) -> None:
        self._kv_caches = caches

    def stop(self) -> None:
        """Waits for the pool's zeroing (before the process exits: no computation cut off)."""
        concurrent.futures.wait([self._kv_caches_ready])

    # page copies (offload tiers)
    def page_leaves(self) -> list[tuple[tuple[int, ...], str]]:
        """(page shape [block_size, ...], dtype name) of every cache leaf, layer-major: the
        order gather_pages returns and put_pages takes."""
        return [(tuple(leaf.shape[1:]), str(leaf.dtype)) for cache in self.abstract_caches for leaf in cache]

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

    # page arrays (KV transfers between engines, paged_jax/kv_transfer.py)
    def gather_page_arrays(self, block_ids) -> list:
        """The pages of block_ids (at most MAX_PAGE_COPY) as arrays [bucket, block_size, ...]
        per leaf, left where the copy program puts them (no host round trip): rows past
        len(block_ids) hold the null block's page. Waits until they are computed, so a step
        may donate the caches right after."""
        assert 0 < len(block_ids) <= MAX_PAGE_COPY, len(block_ids)
        ids = np.zeros(_page_bucket(len(block_ids)), np.int32)
        ids[: len(block_ids)] = block_ids
        gather, _ = self._page_programs_for(len(ids))
        return jax.block_until_ready(gather(self.kv_caches, ids))

    def page_array_specs(self, num_blocks: int) -> list:
        """What gather_page_arrays returns for num_blocks blocks, as ShapeDtypeStructs with
        the shardings put_page_arrays takes (what a transfer pulls)."""
        bucket = _page_bucket(num_blocks)
        self._page_programs_for(bucket)  # settles page_copy_memory_kind
        leaves = [leaf for cache in self.kv_caches for leaf in cache]
        pinned = self._pinned_page_shardings() if self.page_copy_memory_kind == "pinned_host" else None
        return [jax.ShapeDtypeStruct((bucket, *leaf.shape[1:]), leaf.dtype,
                                     sharding=leaf.sharding if pinned is None else pinned[i])
                for i, leaf in enumerate(leaves)]

    def put_page_arrays(self, block_ids, pages: list) -> None:
        """Writes arrays shaped as page_array_specs(len(block_ids)) into block_ids, in place
        (the caches are donated; padding rows write the null page)."""
        bucket = pages[0].shape[0]
        assert len(block_ids) <= bucket == _page_bucket(len(block_ids)), (len(block_ids), bucket)
        ids = np.zeros(bucket, np.int32)
        ids[: len(block_ids)] = block_ids
        _, put = self._page_programs_for(bucket)
        self.kv_caches = list(put(self.kv_caches, ids, list(pages)))

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
