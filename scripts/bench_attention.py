"""CPU benchmark: paged attention (the XLA path) vs attention over a contiguous cache.

Same sizes on both sides: decode (32 sequences x 1024 context, one query token each) and a
512-token prefill. The contiguous baseline keeps each sequence's K/V back to back in
[num_seqs, context, num_kv_heads, head_dim], sized exactly to the context (its best case);
the paged side reads through randomly permuted block tables. Target: paged <= 1.3x. The
baseline is plain dense attention (scores for every key, softmax, one einsum each way); the
xla path's chunked online softmax with causal early exit can beat it, so a third column runs
the xla path over consecutive pages and the last one is the cost of paging alone. The
sliding-window rows (Gemma 3's 512) run the same dense baseline with the window masked: the
xla path reads only the window's pages, the baseline every key.

    python scripts/bench_attention.py [--repeats 10] [--out results/bench_attention.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.attention.xla import ragged_paged_attention_xla

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 64, 16  # Llama-3.2-1B attention
MASK_VALUE = -1e30


@functools.partial(jax.jit, static_argnames="sliding_window")
def contiguous_attention(q, k, v, seq_lens, sliding_window=None):
    """Causal attention of each sequence's last q.shape[1] tokens over its contiguous cache
    (with sliding_window: query p sees keys p - sliding_window < k <= p).

    q: [S, Q, Hq, D]; k, v: [S, L, Hkv, D]; seq_lens: i32[S].
    Legend: S sequence, Q query token, L key position, K KV head, G query head in the group.
    """
    num_seqs, num_q, num_q_heads, head_dim = q.shape
    context, num_kv_heads = k.shape[1], k.shape[2]
    q = q.reshape(num_seqs, num_q, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    scores = jnp.einsum("SQKGD,SLKD->SKGQL", q, k) / math.sqrt(head_dim)
    q_pos = seq_lens[:, None] - num_q + jnp.arange(num_q)[None, :]  # [S, Q]
    visible = jnp.arange(context)[None, None, :] <= q_pos[:, :, None]  # [S, Q, L]
    if sliding_window is not None:
        visible = visible & (jnp.arange(context)[None, None, :] > q_pos[:, :, None] - sliding_window)
    weights = jax.nn.softmax(jnp.where(visible[:, None, None], scores, MASK_VALUE), axis=-1)
    return jnp.einsum("SKGQL,SLKD->SQKGD", weights, v).reshape(num_seqs, num_q, num_q_heads, head_dim)


def paged_inputs(rng, q_lens, seq_lens, max_blocks_per_seq, k_contig, v_contig, q_contig, permute=True):
    """Scatter the contiguous K/V into randomly permuted (or consecutive) pages; pack q as a ragged batch."""
    num_seqs = len(seq_lens)
    pages = [-(-n // BLOCK_SIZE) for n in seq_lens]
    num_blocks = 1 + sum(pages)
    page_ids = rng.permutation(np.arange(1, num_blocks)) if permute else np.arange(1, num_blocks)
    block_tables = np.zeros((num_seqs, max_blocks_per_seq), np.int32)
    k_cache = np.zeros((num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM), np.float32)
    v_cache = np.zeros_like(k_cache)
    used = 0
    for i, n in enumerate(seq_lens):
        block_tables[i, : pages[i]] = page_ids[used : used + pages[i]]
        used += pages[i]
        padded = pages[i] * BLOCK_SIZE
        k_pad = np.zeros((padded, NUM_KV_HEADS, HEAD_DIM), np.float32)
        v_pad = np.zeros_like(k_pad)
        k_pad[:n], v_pad[:n] = k_contig[i, :n], v_contig[i, :n]
        k_cache[block_tables[i, : pages[i]]] = k_pad.reshape(pages[i], BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
        v_cache[block_tables[i, : pages[i]]] = v_pad.reshape(pages[i], BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    q = np.concatenate([q_contig[i, : q_lens[i]] for i in range(num_seqs)])
    query_start_loc = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return (jnp.asarray(q), jnp.asarray(k_cache), jnp.asarray(v_cache), jnp.asarray(block_tables),
            jnp.asarray(np.asarray(seq_lens, np.int32)), jnp.asarray(query_start_loc), jnp.int32(num_seqs))


def time_ms(calls, repeats):
    """Median ms of each (fn, args) in `calls`, the calls interleaved so that load from other
    processes on a shared machine hits both sides alike."""
    for fn, args in calls:
        jax.block_until_ready(fn(*args))  # compile and warm up
    samples = [[] for _ in calls]
    for _ in range(repeats):
        for (fn, args), out in zip(calls, samples):
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            out.append((time.perf_counter() - start) * 1e3)
    return [statistics.median(s) for s in samples]


def run_case(name, q_lens, seq_lens, context, max_blocks_per_seq, sliding_window=None, *, repeats, rng):
    num_seqs, num_q = len(seq_lens), max(q_lens)
    k = rng.standard_normal((num_seqs, context, NUM_KV_HEADS, HEAD_DIM), np.float32)
    v = rng.standard_normal((num_seqs, context, NUM_KV_HEADS, HEAD_DIM), np.float32)
    q = rng.standard_normal((num_seqs, num_q, NUM_Q_HEADS, HEAD_DIM), np.float32)
    contiguous_args = (jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(np.asarray(seq_lens, np.int32)))
    paged_args = paged_inputs(rng, q_lens, seq_lens, max_blocks_per_seq, k, v, q)
    contiguous = functools.partial(contiguous_attention, sliding_window=sliding_window)
    paged = functools.partial(ragged_paged_attention_xla, sliding_window=sliding_window)
    expected = np.asarray(contiguous(*contiguous_args))
    got = np.asarray(paged(*paged_args))
    np.testing.assert_allclose(got, expected.reshape(got.shape), atol=1e-4, rtol=1e-4)  # same attention
    # The same xla path over consecutive pages separates the cost of paging from the algorithm.
    consecutive_args = paged_inputs(rng, q_lens, seq_lens, max_blocks_per_seq, k, v, q, permute=False)
    contiguous_ms, paged_ms, consecutive_ms = time_ms(
        [(contiguous, contiguous_args), (paged, paged_args), (paged, consecutive_args)], repeats)
    return dict(case=name, num_seqs=num_seqs, query_tokens=int(sum(q_lens)), context=context,
                sliding_window=sliding_window,
                table_width_tokens=max_blocks_per_seq * BLOCK_SIZE, contiguous_ms=round(contiguous_ms, 3),
                paged_xla_ms=round(paged_ms, 3), ratio=round(paged_ms / contiguous_ms, 3),
                xla_consecutive_pages_ms=round(consecutive_ms, 3),
                paging_overhead=round(paged_ms / consecutive_ms - 1, 3))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", default="results/bench_attention.json")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    cases = [
        # decode: the table is exactly 1024 tokens wide, then as wide as a 4096 max_model_len
        ("decode 32x1024", [1] * 32, [1024] * 32, 1024, 64),
        ("decode 32x1024, table 4096", [1] * 32, [1024] * 32, 1024, 256),
        ("prefill 512", [512], [512], 512, 32),
        ("prefill 512, table 4096", [512], [512], 512, 256),
        # Gemma 3's local layers: a 512-key window on longer contexts, beside the same without one
        ("decode 32x2048", [1] * 32, [2048] * 32, 2048, 256),
        ("decode 32x2048, window 512", [1] * 32, [2048] * 32, 2048, 256, 512),
        ("prefill 1024", [1024], [1024], 1024, 256),
        ("prefill 1024, window 512", [1024], [1024], 1024, 256, 512),
    ]
    rows = [run_case(*case, repeats=args.repeats, rng=rng) for case in cases]
    header = (f"{'case':<28} {'contiguous ms':>14} {'paged xla ms':>13} {'paged/contig':>13} "
              f"{'xla, consecutive pages ms':>26} {'paging overhead':>16}")
    print(f"CPU ({os.cpu_count()} cores), jax {jax.__version__}, f32, {NUM_Q_HEADS}q/{NUM_KV_HEADS}kv heads, "
          f"head_dim {HEAD_DIM}, block_size {BLOCK_SIZE}; target paged/contig <= 1.3")
    print(header)
    print("-" * len(header))
    for row in rows:
        print(f"{row['case']:<28} {row['contiguous_ms']:>14.2f} {row['paged_xla_ms']:>13.2f} {row['ratio']:>13.2f} "
              f"{row['xla_consecutive_pages_ms']:>26.2f} {row['paging_overhead']:>+16.1%}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(machine=platform.processor() or platform.machine(), cpu_count=os.cpu_count(),
                       jax=jax.__version__, dtype="float32", num_q_heads=NUM_Q_HEADS, num_kv_heads=NUM_KV_HEADS,
                       head_dim=HEAD_DIM, block_size=BLOCK_SIZE, rows=rows,
                       gpu=("GPU figures are still unmeasured: scripts/gpu_check.sh writes them to "
                            "results/gpu_bench_attention.json when a GPU run happens")), f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
