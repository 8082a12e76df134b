"""A/B of the XLA attention path: this tree's paged_jax/attention/xla.py against the same
file at another commit (pallas_kernels/paged_attention_xla.py before it moved), both jitted in one process on the same data.

Shapes are the throughput benchmark model's (8 query / 2 KV heads, head_dim 64, block 16,
2176 blocks); a case of n sequences gets the engine's sequence bucket (8, 16, 32 or 64
slots). Each call attends once per layer over 8 layers' caches (285 MiB, like the model's
pool: the caches do not fit in the CPU's caches, so timings are of memory, not of L3), and
each sequence's pages are a run of consecutive block ids, as the free queue hands them out.
Each case prints the median of 15 calls per version, alternating the versions. Figures are
per call (8 layers).

    python scripts/ab_xla_attention.py 18c587d
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import paged_jax.attention.xla as current  # noqa: E402

# Where the XLA path lived: first the current place, then the one before the move.
XLA_PATHS = ("paged_jax/attention/xla.py", "pallas_kernels/paged_attention_xla.py")


def load_at(rev: str):
    for rel in XLA_PATHS:
        shown = subprocess.run(["git", "-C", ROOT, "show", f"{rev}:{rel}"], capture_output=True, text=True)
        if shown.returncode == 0:
            source = shown.stdout
            break
    else:
        sys.exit(f"{rev} has none of {XLA_PATHS}")
    path = os.path.join(tempfile.mkdtemp(), "paged_attention_xla_at_rev.py")
    with open(path, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location("paged_attention_xla_at_rev", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rev", help="the commit to compare against, e.g. 18c587d")
    args = parser.parse_args()
    other = load_at(args.rev)
    rng = np.random.default_rng(0)
    block_size, num_q_heads, num_kv_heads, head_dim, width, num_blocks = 16, 8, 2, 64, 128, 2176
    num_layers = 8
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_caches = [jnp.asarray(rng.standard_normal(cache_shape), jnp.float32) for _ in range(num_layers)]
    v_caches = [jnp.asarray(rng.standard_normal(cache_shape), jnp.float32) for _ in range(num_layers)]

    def case(q_lens, seq_lens, num_tokens):
        n = len(q_lens)
        max_seqs = max(8, 1 << (n - 1).bit_length())  # the engine's sequence bucket: 8, 16, 32, 64
        qsl = np.zeros(max_seqs + 1, np.int32)
        qsl[1:n + 1] = np.cumsum(q_lens)
        qsl[n + 1:] = qsl[n]
        lens = np.zeros(max_seqs, np.int32)
        lens[:n] = seq_lens
        tables = np.zeros((max_seqs, width), np.int32)
        next_block = 1
        for i in rng.permutation(n):  # sequences were admitted in some other order
            pages = -(-lens[i] // block_size)
            tables[i, :pages] = np.arange(next_block, next_block + pages)
            next_block += pages
        assert next_block <= num_blocks, "case does not fit the pool"
        q = jnp.asarray(rng.standard_normal((num_tokens, num_q_heads, head_dim)), jnp.float32)
        return q, jnp.asarray(tables), jnp.asarray(lens), jnp.asarray(qsl), jnp.asarray([n], jnp.int32)

    def all_layers(attention):
        def run(q, tables, lens, qsl, num_seqs):
            out = jnp.zeros_like(q)
            for k_cache, v_cache in zip(k_caches, v_caches):
                out = out + attention(q, k_cache, v_cache, tables, lens, qsl, num_seqs, sm_scale=head_dim ** -0.5)
            return out
        return jax.jit(run)

    def ragged_decode(n, lo, hi):  # decodes of contexts spread over [lo, hi), like a run's tail
        lens = rng.integers(lo, hi, n).tolist()
        return case([1] * n, lens, n)

    cases = {"decode 16 @600": case([1] * 16, [600] * 16, 16), "decode 64 @500": case([1] * 64, [500] * 64, 64),
             "decode 64 @64-600": ragged_decode(64, 64, 600), "decode 48 @300-700": ragged_decode(48, 300, 700),
             "decode 24 @500-1000": ragged_decode(24, 500, 1000), "decode 8 @800-1024": ragged_decode(8, 800, 1024),
             "decode 3 @800-1024": ragged_decode(3, 800, 1024),
             "40 decodes + 300-token chunk": case([1] * 40 + [300], [600] * 40 + [300], 512),
             "prefill 4 x 256": case([256] * 4, [256] * 4, 1024),
             "50-token chunk after 1990": case([50], [2040], 64)}
    print(f"{'case (8 layers)':30s} {args.rev + ' ms':>12s} {'this tree ms':>13s} {'ratio':>6s}")
    versions = {args.rev: all_layers(other.ragged_paged_attention_xla),
                "current": all_layers(current.ragged_paged_attention_xla)}
    for name, call_args in cases.items():
        samples = {tag: [] for tag in versions}
        for f in versions.values():
            f(*call_args).block_until_ready()
        for _ in range(15):  # alternate the versions, so a noisy neighbour hits both alike
            for tag, f in versions.items():
                start = time.perf_counter()
                f(*call_args).block_until_ready()
                samples[tag].append(time.perf_counter() - start)
        times = {tag: 1e3 * float(np.median(v)) for tag, v in samples.items()}
        print(f"{name:30s} {times[args.rev]:12.2f} {times['current']:13.2f} {times['current'] / times[args.rev]:6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
