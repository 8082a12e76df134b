"""Chain hashing of full token blocks: the keys of the prefix cache.

h_i = H((h_{i-1} or the root, tuple(tokens of block i), extra_keys_i)), so a block's hash
names its whole prefix: two requests share block i only if they agree on every token
before it (and on the LoRA adapter, multimodal inputs and cache salt). The root
(vLLM's NONE_HASH) belongs to each KVCacheManager's hasher, never to a module global. Only
full blocks are hashed. H returns bytes: sha256 over canonical CBOR (the default; canonical so equal inputs
give equal bytes everywhere) or xxh3-128 over the same encoding (faster, not
collision-resistant against an adversary). Imports no jax.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Sequence
from typing import Any

import cbor2
import xxhash

BlockHash = bytes
HashFn = Callable[[Any], bytes]


def sha256_cbor(obj: Any) -> bytes:
    """sha256 of the canonical CBOR encoding of obj (32 bytes)."""
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def xxhash_cbor(obj: Any) -> bytes:
    """xxh3-128 of the canonical CBOR encoding of obj (16 bytes)."""
    return xxhash.xxh3_128_digest(cbor2.dumps(obj, canonical=True))


# vLLM's prefix_caching_hash_algo names, plus the short ones.
HASH_FNS: dict[str, HashFn] = {
    "sha256": sha256_cbor,
    "sha256_cbor": sha256_cbor,
    "xxhash": xxhash_cbor,
    "xxhash_cbor": xxhash_cbor,
}


def get_hash_fn_by_name(name: str) -> HashFn:
    try:
        return HASH_FNS[name]
    except (KeyError, TypeError):
        raise ValueError(f"hash_algo={name!r} is unknown; use one of {sorted(HASH_FNS)}") from None


def digest_nbytes(name: str) -> int:
    """Bytes of one hash of the named algorithm (32 for sha256, 16 for xxhash)."""
    return len(get_hash_fn_by_name(name)(None))


def make_none_hash(hash_fn: HashFn = sha256_cbor, seed: int | str | None = None) -> BlockHash:
    """The root of a hash chain (vLLM's NONE_HASH): hash_fn(str(seed)), else random.

    The seed comes from the argument, else PYTHONHASHSEED. Unseeded, the root is random per
    call, so another tenant cannot precompute our chains (and probe the cache for prompts it
    guesses). Each KVCacheManager makes its own (CacheConfig.hash_seed); there is no global.
    str(seed): seed=0 and PYTHONHASHSEED="0" give the same chain.
    """
    if seed is None:
        seed = os.environ.get("PYTHONHASHSEED")
    return os.urandom(32) if seed is None else hash_fn(str(seed))


def hash_block_tokens(
    hash_fn: HashFn,
    parent_block_hash: BlockHash,
    curr_block_token_ids: Sequence[int],
    extra_keys: tuple | None = None,
) -> BlockHash:
    """Hash one full block, chained to its parent.

    Args:
      hash_fn: bytes-returning hash of a CBOR-encodable object (sha256_cbor, xxhash_cbor).
      parent_block_hash: hash of the previous block; for block 0 the chain's root
        (make_none_hash, BlockHasher.none_hash).
      curr_block_token_ids: the block's block_size token ids.
      extra_keys: what else must match for reuse (LoRA name, multimodal ids, cache salt).
    Returns:
      The block hash (bytes).
    """
    if not parent_block_hash:
        raise ValueError("parent_block_hash is empty: pass the previous block's hash, or for block 0 the "
                         "chain's root (make_none_hash(hash_fn, seed) or a BlockHasher's none_hash)")
    return hash_fn((parent_block_hash, tuple(curr_block_token_ids), extra_keys))


def _gen_mm_extra_hash_keys(request, start_token_idx: int, end_token_idx: int, start_mm_idx: int):
    """(identifier, offset) of every multimodal input overlapping [start, end).

    Multimodal inputs are sorted by offset; start_mm_idx is where the previous block stopped
    (negative counts from the end, as in vLLM). Returns (keys, mm index for the next block).
    """
    mm_features = request.mm_features
    keys: list = []
    if not mm_features:
        return keys, start_mm_idx
    last = mm_features[-1]
    if last.offset + last.length <= start_token_idx:  # every input ends before this block
        return keys, start_mm_idx
    if start_mm_idx < 0:
        start_mm_idx = max(len(mm_features) + start_mm_idx, 0)
    curr = start_mm_idx
    while curr < len(mm_features):
        feature = mm_features[curr]
        if end_token_idx <= feature.offset:  # the block ends before this input starts
            break
        if start_token_idx >= feature.offset + feature.length:  # the block starts after it
            curr += 1
            continue
        keys.append((feature.identifier, feature.offset))
        if end_token_idx >= feature.offset + feature.length:
            curr += 1  # input ends inside this block; the next input may start here too
        else:
            break  # input runs on into the next block
    return keys, curr


def generate_block_hash_extra_keys(request, start_token_idx: int, end_token_idx: int, start_mm_idx: int = 0):
    """Extra keys of the block covering tokens [start_token_idx, end_token_idx).

    LoRA name on every block; multimodal (identifier, offset) items overlapping the block;
    cache_salt only in block 0 (it enters the chain there and so changes every later hash).

    Returns:
      (tuple of keys or None, mm index to start from for the next block).
    """
    mm_keys, next_mm_idx = _gen_mm_extra_hash_keys(request, start_token_idx, end_token_idx, start_mm_idx)
    keys: list = []
    if request.lora_name:
        keys.append(request.lora_name)
    keys.extend(mm_keys)
    if start_token_idx == 0 and request.cache_salt:
        keys.append(request.cache_salt)
    return (tuple(keys) if keys else None), next_mm_idx


class BlockHasher:
    """Computes a request's missing block hashes: one per block that is full and unhashed.

    Bound to (block_size, hash_fn, none_hash): a KVCacheManager owns one and attaches it to
    every request it sees. none_hash is the root of every chain (default: make_none_hash(hash_fn),
    random unless PYTHONHASHSEED is set). `enabled=False` (prefix caching off) hashes nothing.
    """

    __slots__ = ("block_size", "hash_fn", "none_hash", "enabled")

    def __init__(self, block_size: int, hash_fn: HashFn = sha256_cbor, none_hash: BlockHash | None = None,
                 enabled: bool = True):
        self.block_size = block_size
        self.hash_fn = hash_fn
        self.none_hash = make_none_hash(hash_fn) if none_hash is None else none_hash
        self.enabled = enabled

    def is_compatible(self, other: BlockHasher | None) -> bool:
        """True when other produces exactly the hashes this one does."""
        return (
            other is not None
            and other.block_size == self.block_size
            and other.hash_fn is self.hash_fn
            and other.none_hash == self.none_hash
            and other.enabled == self.enabled
        )

    def __call__(self, request) -> list[BlockHash]:
        """Hashes of request's full blocks after the len(request.block_hashes) it has."""
        block_size = self.block_size
        tokens = request.all_token_ids
        num_tokens = len(tokens)
        hashes = request.block_hashes
        start = len(hashes) * block_size
        if not self.enabled or start + block_size > num_tokens:
            return []
        hash_fn = self.hash_fn
        prev = hashes[-1] if hashes else self.none_hash
        new_hashes = []
        if not (request.lora_name or request.mm_features or request.cache_salt):
            # common case: no extra keys; one C-level encode + hash per block
            for start in range(start, num_tokens - block_size + 1, block_size):
                prev = hash_fn((prev, tuple(tokens[start : start + block_size]), None))
                new_hashes.append(prev)
            return new_hashes
        # Scan multimodal inputs from the first: vLLM's "-1" shortcut for later calls misses
        # an earlier input that shares the newly full block with the last one.
        mm_idx = 0
        while start + block_size <= num_tokens:
            end = start + block_size
            extra_keys, mm_idx = generate_block_hash_extra_keys(request, start, end, mm_idx)
            prev = hash_fn((prev, tuple(tokens[start:end]), extra_keys))
            new_hashes.append(prev)
            start = end
        return new_hashes
