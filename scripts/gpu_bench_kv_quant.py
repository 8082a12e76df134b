"""GPU benchmark of decode attention over quantized KV pages (issue 14), run by scripts/gpu_check.sh.

Decode at 64 sequences x 4096 tokens of context, 32 query / 8 KV heads, head_dim 128,
block_size 16, bf16 queries: the Pallas kernel over a bf16 cache against the same kernel
over fp8_e4m3 / fp8_e5m2 / int8 pages with per-token f32 scales (dequantized per tile in
registers). Reported per format: time per call, K/V bytes a step reads (pages + scales),
their effective bandwidth, and the throughput ratio to bf16 (target: >= 1.7x at 4k context).
Every quantized output is checked against the XLA path on the same pages.

    python scripts/gpu_bench_kv_quant.py [--dry-run] [--out DIR]

--dry-run: CPU, interpret mode, tiny shapes (proves the script runs).
"""

from __future__ import annotations

import argparse
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from gpu_bench_attention import time_per_call
from paged_jax.attention.xla import ragged_paged_attention_xla
from paged_jax.core.kv_quant import FORMATS
from pallas_kernels.kv_cache_write import quantize_rows, values_to_pages
from pallas_kernels.paged_attention import ragged_paged_attention

FULL = dict(num_seqs=64, context=4096, num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16)
TINY = dict(num_seqs=4, context=64, num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--out", default="results")
    args = parser.parse_args()
    s = TINY if args.dry_run else FULL
    n, ctx, bs, kh, hd = s["num_seqs"], s["context"], s["block_size"], s["num_kv_heads"], s["head_dim"]
    pages = ctx // bs
    num_blocks = n * pages + 1
    rng = np.random.default_rng(0)
    tables = jnp.asarray((1 + rng.permutation(n * pages)).reshape(n, pages).astype(np.int32))
    seq_lens = jnp.full(n, ctx, jnp.int32)
    qsl = jnp.arange(n + 1, dtype=jnp.int32)
    num_seqs = jnp.int32(n)
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (n, s["num_q_heads"], hd), jnp.bfloat16)
    k = jax.random.normal(keys[1], (num_blocks, bs, kh, hd), jnp.bfloat16)
    v = jax.random.normal(keys[2], (num_blocks, bs, kh, hd), jnp.bfloat16)
    interpret = args.dry_run
    rows = []
    base_s = None
    for name in ("bfloat16", *FORMATS):
        if name == "bfloat16":
            k_pages, v_pages, scales = k, v, {}
        else:
            fmt = FORMATS[name]
            (kq, ks), (vq, vs) = quantize_rows(k, fmt), quantize_rows(v, fmt)
            k_pages, v_pages = values_to_pages(kq, fmt), values_to_pages(vq, fmt)
            scales = dict(k_scale=ks, v_scale=vs, kv_cache_dtype=name)
        fn = jax.jit(functools.partial(ragged_paged_attention, interpret=interpret, **scales))
        args_ = (q, k_pages, v_pages, tables, seq_lens, qsl, num_seqs)
        seconds = time_per_call(fn, *args_, dry=args.dry_run)
        out = fn(*args_)
        ref = jax.jit(functools.partial(ragged_paged_attention_xla, **scales))(*args_)
        err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
        read = n * ctx * kh * (2 * hd * k_pages.dtype.itemsize + (8 if scales else 0))
        base_s = base_s or seconds
        rows.append(dict(kv_cache_dtype=name, us=1e6 * seconds, kv_bytes_read=read, gb_s=read / seconds / 1e9,
                         speedup_vs_bf16=base_s / seconds, max_abs_err_vs_xla=err))
        print("  " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in rows[-1].items()),
              flush=True)
    print(f"\nDecode {n} x {ctx} context, {s['num_q_heads']}/{kh} heads x {hd}, block {bs}, "
          f"{jax.devices()[0].device_kind}{' (dry run)' if args.dry_run else ''}")
    print(f"{'kv_cache_dtype':<14} {'us/call':>9} {'K/V MB read':>12} {'GB/s':>8} {'vs bf16':>8} {'err vs XLA':>10}")
    for r in rows:
        print(f"{r['kv_cache_dtype']:<14} {r['us']:>9.1f} {r['kv_bytes_read'] / 1e6:>12.1f} {r['gb_s']:>8.1f} "
              f"{r['speedup_vs_bf16']:>7.2f}x {r['max_abs_err_vs_xla']:>10.2e}")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "gpu_bench_kv_quant" + (".dryrun" if args.dry_run else "") + ".json")
    with open(path, "w") as fh:
        json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__, shape=s, rows=rows,
                       target_speedup_4k=1.7), fh, indent=2)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
