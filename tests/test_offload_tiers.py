"""The offload tiers one at a time: page codec, host tier (LRU at its cap), disk tier (crash
safety, setup checks), KV event log. Host side only (no jax)."""

import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

from paged_jax.core.disk_tier import DiskKVTier
from paged_jax.core.host_tier import HostKVTier
from paged_jax.core.kv_events import BlockRemoved, BlockStored, KVEventLog
from paged_jax.core.kv_quant import FORMATS
from paged_jax.core.page_codec import STORAGE_DTYPES, PageCodec, PageLeaf

LEAVES = [PageLeaf((16, 2, 8), "float32"), PageLeaf((16, 2, 8), "bfloat16"), PageLeaf((16, 2), "float32")]


def random_pages(n, leaves=LEAVES, seed=0):
    rng = np.random.default_rng(seed)
    pages = []
    for leaf in leaves:
        x = rng.normal(size=(n, *leaf.shape)) * rng.choice([1e-3, 1.0, 300.0], size=(n, *leaf.shape[:-1], 1))
        x[0, 0] = 0.0  # an all-zero row: the smallest scale, not 0
        pages.append(x.astype(np.float32).astype(np.dtype(getattr(ml_dtypes, leaf.dtype, leaf.dtype))))
    return pages


# ---------------------------------------------------------------------------- codec
def test_unquantized_round_trip_is_bit_identical():
    codec = PageCodec(LEAVES)
    pages = random_pages(5)
    buffers = codec.encode(pages)
    assert buffers.shape == (5, codec.nbytes) and codec.nbytes == codec.raw_nbytes == 16 * 16 * (4 + 2) + 16 * 2 * 4
    for a, b in zip(pages, codec.decode(buffers)):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
    # each block's buffer decodes alone to the same pages (blocks are independent rows)
    for a, b in zip(pages, codec.decode(buffers[3:4])):
        assert a[3:4].tobytes() == b.tobytes()


def format_error_bound(x, fmt):
    """What the format promises for one element of a round trip (float64), from its definition:
    int8: relative_error of the row's amax (half a step); fp8: relative_error of |x| in the
    normal range, half the subnormal step (times the row's scale) below it."""
    amax = np.max(np.abs(x), axis=-1, keepdims=True)
    if fmt.is_integer:
        return fmt.relative_error * amax
    scale = amax / fmt.max_value
    return fmt.relative_error * np.abs(x) + 0.5 * float(ml_dtypes.finfo(fmt.storage_dtype).smallest_subnormal) * scale


def test_storage_dtypes_are_the_kv_quant_formats():
    assert STORAGE_DTYPES == (None, "fp8", "fp8_e4m3", "fp8_e5m2", "int8")
    assert PageCodec(LEAVES, "fp8").describe() == PageCodec(LEAVES, "fp8_e4m3").describe()  # one format, one name


@pytest.mark.parametrize("storage", ["int8", "fp8_e4m3", "fp8_e5m2"])
def test_quantized_round_trip_is_within_the_format_error(storage):
    fmt = FORMATS[storage]
    codec = PageCodec(LEAVES, storage)
    pages = random_pages(6)
    decoded = codec.decode(codec.encode(pages))
    worst = 0.0
    for leaf, x, y in zip(LEAVES, pages, decoded):
        x, y = x.astype(np.float64), y.astype(np.float64)
        if len(leaf.shape) < 3:  # not quantized: stored as it is
            assert x.tobytes() == y.tobytes() or np.array_equal(x, y)
            continue
        assert np.all(np.isfinite(y))
        bound = format_error_bound(x, fmt)
        # the cache dtype's own rounding on the way back (bf16: 2**-8 relative)
        bound = bound * (1 + 1e-6) + np.abs(x) * (2.0**-8 if leaf.dtype == "bfloat16" else 1e-7)
        err = np.abs(x - y)
        assert np.all(err <= bound), (leaf, float(np.max(err - bound)))
        if leaf.dtype == "float32":
            worst = max(worst, float(np.max(err / np.max(np.abs(x), axis=-1, keepdims=True).clip(1e-30))))
    # and the bound is nearly reached: a looser rounding (or a wider scale) would show
    assert worst > 0.5 * (fmt.relative_error if not fmt.is_integer else 0.5 / fmt.max_value)
    # a quarter (1 byte + a 4-byte scale per 8 values) of the float32 leaf's bytes
    assert codec.nbytes < 0.6 * codec.raw_nbytes


def test_codec_stores_what_the_device_pool_would():
    """The same values and scales as quantize-on-write's rule, computed here independently:
    amax / max_value per row (never below float32's tiny); for fp8 that times the 2**(j/8),
    j < 8, whose rounding leaves the row the least squared error; x / scale rounded and clipped."""
    x = random_pages(3, [PageLeaf((16, 2, 8), "float32")], seed=1)[0]

    def rounded(scale):
        y = np.clip(x / scale[..., None], -fmt.max_value, fmt.max_value)
        return np.rint(y).astype(np.int8) if fmt.is_integer else y.astype(ml_dtypes.float8_e4m3fn)

    for name in ("int8", "fp8_e4m3"):
        fmt = FORMATS[name]
        buffers = PageCodec([PageLeaf((16, 2, 8), "float32")], name).encode([x])
        amax = np.abs(x).max(axis=-1)
        scale = np.maximum(amax / np.float32(fmt.max_value), np.finfo(np.float32).tiny).astype(np.float32)
        stored_scale = buffers[:, 16 * 2 * 8 :].view(np.float32).reshape(scale.shape)
        if not fmt.is_integer:
            candidates = [(scale * np.float32(2.0 ** (j / 8))).astype(np.float32) for j in range(8)]
            errors = [np.sum((rounded(c).astype(np.float64) * c[..., None] - x) ** 2, axis=-1) for c in candidates]
            chosen = np.argmin(np.abs(np.stack(candidates) - stored_scale), axis=0)
            assert np.any(chosen > 0)
            scale = np.take_along_axis(np.stack(candidates), chosen[None], axis=0)[0]
            assert np.all(np.take_along_axis(np.stack(errors), chosen[None], axis=0)[0]
                          <= np.min(errors, axis=0) * (1 + 1e-5))
        assert stored_scale.tobytes() == scale.tobytes()
        assert buffers[:, : 16 * 2 * 8].tobytes() == rounded(scale).view(np.uint8).reshape(3, -1).tobytes()


def test_quantization_saturates_instead_of_overflowing():
    codec = PageCodec([PageLeaf((4, 1, 4), "float32")], "fp8")
    x = np.array([[[[1e30, -1e30, 1.0, 0.0]]] * 4], np.float32)
    y = codec.decode(codec.encode([x]))[0]
    assert np.all(np.isfinite(y)) and np.allclose(y[..., :2], x[..., :2], rtol=FORMATS["fp8_e4m3"].relative_error)


def test_codec_rejects_an_unknown_storage_dtype():
    with pytest.raises(ValueError, match="offload_dtype='int4'"):
        PageCodec(LEAVES, "int4")
    with pytest.raises(ValueError, match="offload_dtype='float8_e4m3fn'.*'fp8_e4m3'"):
        PageCodec(LEAVES, "float8_e4m3fn")  # ml_dtypes' name: offload_dtype speaks kv_cache_dtype's


# ---------------------------------------------------------------------------- host tier
def buf(i, nbytes=8):
    return np.full(nbytes, i, np.uint8)


def test_host_tier_at_its_cap_evicts_lru_and_never_grows():
    events = KVEventLog()
    tier = HostKVTier(capacity_bytes=3 * 8 + 5, entry_nbytes=8, kv_events=events)
    assert tier.max_entries == 3
    for key in (b"a", b"b", b"c"):
        assert tier.reserve(key) and tier.fill(key, buf(key[0]))
    tier.touch(b"a")  # order now b, c, a
    assert tier.reserve(b"d") and tier.fill(b"d", buf(4))
    assert tier.keys() == [b"c", b"a", b"d"] and tier.num_bytes == 24
    tier.pin(b"c")
    assert tier.reserve(b"e") and tier.keys() == [b"c", b"d", b"e"]  # the pinned LRU entry is skipped
    tier.pin(b"d")
    tier.pin(b"e")
    assert not tier.can_reserve(1) and not tier.reserve(b"f"), "every entry is pinned: no room"
    assert tier.keys() == [b"c", b"d", b"e"] and len(tier) == 3
    tier.unpin(b"d")
    assert tier.can_reserve(1) and not tier.can_reserve(2)
    assert not tier.fill(b"zz", buf(0)), "filling an evicted entry stores nothing"
    assert tier.num_evictions == 2
    tier.check_invariants()
    # e was reserved but never filled: no BlockStored for it, no BlockRemoved either
    stored = [k for e in events.get_events() if isinstance(e, BlockStored) for k in e.block_hashes]
    assert stored == [b"a", b"b", b"c", b"d"]


def test_host_tier_refuses_to_drop_a_pinned_entry():
    tier = HostKVTier(16, 8)
    tier.reserve(b"a")
    tier.pin(b"a")
    with pytest.raises(AssertionError, match="pinned"):
        tier.pop(b"a")


# ---------------------------------------------------------------------------- disk tier
META = {"model": "m1", "block_size": 16, "pages": [[[16, 2, 8], "float32"]], "storage_dtype": None,
        "hash_algo": "sha256", "chain_root": "00"}


def test_disk_tier_round_trip_and_restart(tmp_path):
    disk = DiskKVTier(tmp_path, META, 8)
    disk.put(b"\x01" * 32, buf(1))
    assert b"\x01" * 32 in disk and disk.get(b"\x01" * 32).tolist() == [1] * 8  # readable while queued
    disk.put(b"\x02" * 32, buf(2))
    disk.flush()
    disk.close()
    reopened = DiskKVTier(tmp_path, META, 8)
    assert len(reopened) == 2 and reopened.get(b"\x02" * 32).tolist() == [2] * 8
    assert reopened.get(b"\x03" * 32) is None
    reopened.close()


def test_disk_tier_never_returns_a_torn_or_corrupted_file(tmp_path):
    disk = DiskKVTier(tmp_path, META, 8)
    for i in (1, 2, 3):
        disk.put(bytes([i]) * 32, buf(i))
    disk.flush()
    disk.close()
    paths = {i: tmp_path / f"{(bytes([i]) * 32).hex()}.kv" for i in (1, 2, 3)}
    data = paths[1].read_bytes()
    paths[1].write_bytes(data[:-3])  # torn: the tail never reached the disk
    flipped = bytearray(paths[2].read_bytes())
    flipped[-1] ^= 0xFF  # a corrupted payload byte, right length
    paths[2].write_bytes(bytes(flipped))
    (tmp_path / f"{'04' * 32}.kv.tmp").write_bytes(data[:10])  # a crash mid-write left its temp file
    disk = DiskKVTier(tmp_path, META, 8)
    assert not list(tmp_path.glob("*.tmp")), "a temporary file survived the reopen"
    assert disk.get(bytes([1]) * 32) is None and disk.get(bytes([2]) * 32) is None
    assert not paths[1].exists() and not paths[2].exists(), "a bad file was kept"
    assert disk.get(bytes([3]) * 32).tolist() == [3] * 8
    assert disk.num_corrupt == 2
    disk.close()


def test_disk_tier_refuses_another_setup_naming_the_fields(tmp_path):
    DiskKVTier(tmp_path, META, 8).close()
    with pytest.raises(ValueError, match=r"block_size: 16 in the directory, 32 here.*model: 'm1' in the directory"):
        DiskKVTier(tmp_path, {**META, "block_size": 32, "model": "m2"}, 8)
    with pytest.raises(ValueError, match="chain_root"):
        DiskKVTier(tmp_path, {**META, "chain_root": "01"}, 8)
    DiskKVTier(tmp_path, dict(META), 8).close()  # the same setup opens


def test_disk_tier_cap_deletes_the_oldest(tmp_path):
    events = KVEventLog()
    disk = DiskKVTier(tmp_path, META, 8, capacity_bytes=16, kv_events=events)
    for i in (1, 2, 3):
        disk.put(bytes([i]) * 32, buf(i))
        disk.flush()
    assert bytes([1]) * 32 not in disk and len(disk) == 2
    assert len(list(tmp_path.glob("*.kv"))) == 2
    removed = [k for e in events.get_events() if isinstance(e, BlockRemoved) for k in e.block_hashes]
    assert removed == [bytes([1]) * 32]
    disk.close()


def test_disk_tier_writes_its_queue_before_the_process_exits(tmp_path):
    code = ("import numpy as np, sys\n"
            "from paged_jax.core.disk_tier import DiskKVTier\n"
            f"meta = {META!r}\n"
            "disk = DiskKVTier(sys.argv[1], meta, 1 << 20)\n"
            "for i in range(8):\n"
            "    disk.put(bytes([i]) * 32, np.full(1 << 20, i, np.uint8))\n")  # exits without flush()
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True)
    disk = DiskKVTier(tmp_path, META, 1 << 20)
    assert len(disk) == 8 and disk.get(bytes([7]) * 32)[0] == 7
    disk.close()
