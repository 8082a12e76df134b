"""Chain hashing: hash functions, chain-root seeding, extra keys, incremental block hashes."""

import hashlib
import os
import subprocess
import sys

import cbor2
import pytest
import xxhash

from paged_jax.core import hashing
from paged_jax.core.config import CacheConfig
from paged_jax.core.hashing import (
    BlockHasher,
    generate_block_hash_extra_keys,
    get_hash_fn_by_name,
    hash_block_tokens,
    make_none_hash,
    sha256_cbor,
    xxhash_cbor,
)
from paged_jax.core.kv_cache_manager import KVCacheManager
from paged_jax.core.request import Request

ROOT = make_none_hash(sha256_cbor, seed=0)


def test_hash_fns_are_sha256_and_xxh3_over_canonical_cbor():
    obj = (b"\x00" * 32, (1, 2, 3), ("lora",))
    assert sha256_cbor(obj) == hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()
    assert xxhash_cbor(obj) == xxhash.xxh3_128(cbor2.dumps(obj, canonical=True)).digest()
    assert len(sha256_cbor(obj)) == 32 and len(xxhash_cbor(obj)) == 16
    # canonical: map key order does not matter
    assert sha256_cbor({"a": 1, "b": 2}) == sha256_cbor({"b": 2, "a": 1})
    assert get_hash_fn_by_name("sha256") is sha256_cbor and get_hash_fn_by_name("xxhash") is xxhash_cbor
    with pytest.raises(ValueError, match="use one of"):
        get_hash_fn_by_name("md5")


def test_hash_block_tokens_chains_from_the_root():
    h0 = hash_block_tokens(sha256_cbor, ROOT, [1, 2, 3, 4])
    assert h0 == sha256_cbor((ROOT, (1, 2, 3, 4), None))
    assert h0 == hash_block_tokens(sha256_cbor, ROOT, (1, 2, 3, 4))  # tuple or list
    h1 = hash_block_tokens(sha256_cbor, h0, [5, 6, 7, 8])
    assert h1 == sha256_cbor((h0, (5, 6, 7, 8), None))
    # Same tokens after a different parent -> different hash (the whole prefix matters).
    other_parent = hash_block_tokens(sha256_cbor, ROOT, [1, 2, 3, 9])
    assert hash_block_tokens(sha256_cbor, other_parent, [5, 6, 7, 8]) != h1
    assert hash_block_tokens(sha256_cbor, h0, [5, 6, 7, 8], ("salt",)) != h1
    # A different root changes every hash of the chain.
    assert hash_block_tokens(sha256_cbor, make_none_hash(sha256_cbor, seed=1), [1, 2, 3, 4]) != h0
    for missing in (None, b""):  # block 0 needs its root: no hidden global fills it in
        with pytest.raises(ValueError, match="make_none_hash"):
            hash_block_tokens(sha256_cbor, missing, [1, 2, 3, 4])


def test_make_none_hash_seeding(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert make_none_hash(sha256_cbor, seed=42) == sha256_cbor("42")
    a, b = make_none_hash(sha256_cbor), make_none_hash(sha256_cbor)
    assert a != b and len(a) == 32  # random without a seed
    monkeypatch.setenv("PYTHONHASHSEED", "42")
    assert make_none_hash(sha256_cbor) == sha256_cbor("42")
    assert make_none_hash(xxhash_cbor, seed=0) == xxhash_cbor("0")
    assert not hasattr(hashing, "NONE_HASH"), "the root is owned by each manager, not a module global"


def test_each_manager_owns_its_root(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    config = CacheConfig(block_size=4, num_blocks=11, max_model_len=64)
    a, b = KVCacheManager(config), KVCacheManager(config)
    assert a.block_hasher.none_hash != b.block_hasher.none_hash  # unseeded: unpredictable per engine
    seeded = CacheConfig(block_size=4, num_blocks=11, max_model_len=64, hash_seed=7)
    c, d = KVCacheManager(seeded), KVCacheManager(seeded)
    assert c.block_hasher.none_hash == d.block_hasher.none_hash == sha256_cbor("7")
    tokens = list(range(9))
    assert Request("x", tokens, block_hasher=c.block_hasher).block_hashes == \
        Request("y", tokens, block_hasher=d.block_hasher).block_hashes
    assert Request("x", tokens, block_hasher=a.block_hasher).block_hashes != \
        Request("y", tokens, block_hasher=b.block_hasher).block_hashes


def _none_hash_in_subprocess(env_seed):
    env = dict(os.environ)
    env.pop("PYTHONHASHSEED", None)
    if env_seed is not None:
        env["PYTHONHASHSEED"] = env_seed
    code = ("from paged_jax.core.config import CacheConfig; from paged_jax.core.kv_cache_manager import KVCacheManager; "
            "print(KVCacheManager(CacheConfig(16, 11, 64)).block_hasher.none_hash.hex())")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout


def test_none_hash_random_per_process_unless_seeded():
    # Another tenant (process) cannot predict the chain...
    assert _none_hash_in_subprocess(None) != _none_hash_in_subprocess(None)
    # ...unless the operator pins it for reproducibility.
    assert _none_hash_in_subprocess("7") == _none_hash_in_subprocess("7") == sha256_cbor("7").hex() + "\n"


def test_extra_keys_salt_only_in_block_0_lora_everywhere():
    req = Request("r", list(range(32)), cache_salt="s", lora_name="L")
    assert generate_block_hash_extra_keys(req, 0, 16) == (("L", "s"), 0)
    assert generate_block_hash_extra_keys(req, 16, 32) == (("L",), 0)
    plain = Request("p", list(range(32)))
    assert generate_block_hash_extra_keys(plain, 0, 16) == (None, 0)


def test_extra_keys_multimodal_items_on_overlapping_blocks():
    # image A covers tokens 2..5, image B covers 6..21 (spans blocks 0, 1 and 2 of size 8)
    req = Request("r", list(range(32)), mm_features=[("A", 2, 4), ("B", 6, 16)])
    keys0, idx = generate_block_hash_extra_keys(req, 0, 8, 0)
    assert keys0 == (("A", 2), ("B", 6)) and idx == 1
    keys1, idx = generate_block_hash_extra_keys(req, 8, 16, idx)
    assert keys1 == (("B", 6),) and idx == 1
    keys2, idx = generate_block_hash_extra_keys(req, 16, 24, idx)
    assert keys2 == (("B", 6),) and idx == 2
    assert generate_block_hash_extra_keys(req, 24, 32, idx) == (None, 2)
    # vLLM's negative start index (counted from the end) is accepted.
    assert generate_block_hash_extra_keys(req, 16, 24, -1)[0] == (("B", 6),)


def manual_chain(tokens, block_size, root, request=None):
    """The chain computed block by block with the public pieces."""
    hashes, parent = [], root
    for start in range(0, len(tokens) - block_size + 1, block_size):
        extra = generate_block_hash_extra_keys(request, start, start + block_size, 0)[0] if request else None
        parent = hash_block_tokens(sha256_cbor, parent, tokens[start : start + block_size], extra)
        hashes.append(parent)
    return hashes


@pytest.mark.parametrize("kw", [{}, {"cache_salt": "x", "lora_name": "L", "mm_features": [("img", 5, 20)]}])
def test_block_hasher_matches_manual_chain_and_only_full_blocks(kw):
    tokens = list(range(50))
    req = Request("r", tokens, block_hasher=BlockHasher(16, none_hash=ROOT), **kw)
    assert len(req.block_hashes) == 3  # 50 // 16; the partial block is not hashed
    assert req.block_hashes == manual_chain(tokens, 16, ROOT, req)


def test_append_hashes_incrementally_never_rehashing():
    calls = []

    def counting_sha(obj):
        calls.append(obj[1])
        return sha256_cbor(obj)

    hasher = BlockHasher(4, counting_sha, ROOT)
    req = Request("r", [1, 2, 3, 4, 5], block_hasher=hasher)
    assert len(calls) == 1
    for t in range(6, 40):
        req.append_output_token_ids(t)
    req.append_output_token_ids([40, 41, 42, 43, 44, 45, 46, 47, 48])
    assert req.num_tokens == 48
    # One hash per block, each computed exactly once, in order.
    assert calls == [tuple(range(1 + 4 * i, 5 + 4 * i)) for i in range(12)]
    assert req.block_hashes == [
        h for h in manual_chain(list(range(1, 49)), 4, ROOT)
    ]


def test_disabled_hasher_hashes_nothing():
    req = Request("r", list(range(40)), block_hasher=BlockHasher(16, enabled=False))
    req.append_output_token_ids(list(range(40)))
    assert req.block_hashes == []
