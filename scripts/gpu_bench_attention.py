"""GPU benchmark of the paged-attention kernel (issue 7), run by scripts/gpu_check.sh.

Rows: device-to-device copy bandwidth (the ceiling); decode at 64 sequences x 4096 context
and a ragged variant (lengths uniform in [1, 4096]), 32 query / 8 KV heads, head_dim 128,
block_size 16, bf16, for this kernel (best of a small sweep of its PallasConfig), jax's
own pallas.ops.gpu.paged_attention (best of k_splits x pages_per_compute_block), the same
kernel over a contiguous cache (identity block tables), and XLA attention over a
contiguous [seqs, context, heads, dim] cache; prefill of a 512-token chunk on 4096 cached
tokens in TFLOP/s. Every variant's output is checked against the XLA path on the same data.

    python scripts/gpu_bench_attention.py [--dry-run] [--out DIR] [--budget-s 300]

--dry-run: CPU, interpret mode, tiny shapes, one config per sweep (proves the script runs).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.attention.xla import ragged_paged_attention_xla
from pallas_kernels.paged_attention import PallasConfig, ragged_paged_attention

FULL = dict(num_seqs=64, context=4096, num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16,
            prefill_tokens=512, prefill_context=4096, copy_bytes=2 << 30)
TINY = dict(num_seqs=4, context=64, num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16,
            prefill_tokens=16, prefill_context=48, copy_bytes=1 << 20)


def time_per_call(fn, *args, dry: bool = False) -> float:
    """Seconds per call: async back-to-back launches, median of 3 trials (host overlap hidden)."""
    jax.block_until_ready(fn(*args))  # compile and warm up
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    once = time.perf_counter() - start
    iters = 1 if dry else max(3, min(200, int(0.05 / max(once, 1e-6))))
    trials = []
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        trials.append((time.perf_counter() - start) / iters)
    return float(np.median(trials))


class Bench:
    def __init__(self, args):
        self.dry = args.dry_run
        self.shape = TINY if self.dry else FULL
        self.interpret = self.dry
        self.deadline = time.monotonic() + args.budget_s
        self.rows = []
        self.rng = np.random.default_rng(0)
        self.compiled = {}  # PallasConfig -> jitted entry, so re-timing a config does not recompile

    def ours(self, config):
        if config not in self.compiled:
            self.compiled[config] = jax.jit(functools.partial(
                ragged_paged_attention, interpret=self.interpret, config=config))
        return self.compiled[config]

    def time_s(self, fn, *args):
        return time_per_call(fn, *args, dry=self.dry)

    def over_budget(self):
        return time.monotonic() > self.deadline

    def add(self, **row):
        self.rows.append(row)
        print("  " + ", ".join(f"{k}={v}" for k, v in row.items()), flush=True)

    # inputs

    def paged_batch(self, q_lens, seq_lens, max_len, contiguous_pages=False):
        """Random bf16 K/V scattered into permuted pages (or consecutive ones) plus a ragged q."""
        s = self.shape
        bs, num_seqs = s["block_size"], len(seq_lens)
        width = -(-max_len // bs)  # the block-table width of a max_model_len of max_len
        num_blocks = 1 + num_seqs * width
        ids = np.arange(1, num_blocks) if contiguous_pages else self.rng.permutation(np.arange(1, num_blocks))
        block_tables = np.zeros((num_seqs, width), np.int32)
        for i, n in enumerate(seq_lens):  # sequence i owns width pages; it uses the first cdiv(n, bs)
            block_tables[i, : -(-n // bs)] = ids[i * width : i * width + -(-n // bs)]
        key = jax.random.key(int(self.rng.integers(1 << 30)))
        kk, kv, kq = jax.random.split(key, 3)
        cache_shape = (num_blocks, bs, s["num_kv_heads"], s["head_dim"])
        k_cache = jax.random.normal(kk, cache_shape, jnp.bfloat16)
        v_cache = jax.random.normal(kv, cache_shape, jnp.bfloat16)
        q = jax.random.normal(kq, (sum(q_lens), s["num_q_heads"], s["head_dim"]), jnp.bfloat16)
        qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        return (q, k_cache, v_cache, jnp.asarray(block_tables), jnp.asarray(np.asarray(seq_lens, np.int32)),
                jnp.asarray(qsl), jnp.int32(num_seqs))

    def check(self, out, expected):
        out, expected = np.asarray(out, np.float32), np.asarray(expected, np.float32)
        return float(np.linalg.norm(out - expected) / np.linalg.norm(expected))

    # rows

    def copy_bandwidth(self):
        x = jnp.ones((self.shape["copy_bytes"] // 2,), jnp.bfloat16)
        seconds = self.time_s(jax.jit(jnp.copy), x)
        self.copy_gbs = 2 * x.nbytes / seconds / 1e9  # read + write
        self.add(case="device-to-device copy", us=round(seconds * 1e6, 1), gb_s=round(self.copy_gbs, 1))

    def decode_rows(self, name, seq_lens, sweep):
        """Decode rows; sweep=False reuses the configs the last sweep picked (compiles cost the budget)."""
        s = self.shape
        batch = self.paged_batch([1] * len(seq_lens), seq_lens, s["context"])
        kv_bytes = 2 * sum(seq_lens) * s["num_kv_heads"] * s["head_dim"] * 2  # K and V, bf16, tokens actually read
        expected = ragged_paged_attention_xla(*batch)

        def row(variant, seconds, out, **extra):
            gbs = kv_bytes / seconds / 1e9
            self.add(case=name, variant=variant, us=round(seconds * 1e6, 1), gb_s=round(gbs, 1),
                     frac_copy=round(gbs / self.copy_gbs, 3), rel_err=f"{self.check(out, expected):.1e}", **extra)
            return seconds

        # this kernel: splits x keys per step first, then warps x stages around the best
        best = (math.inf, None)
        sweep1 = [dict(decode_block_k=bk, decode_num_splits=sp) for bk, sp in
                  itertools.product((32, 64, 128), (None, 1, 2, 4, 8))]
        for params in (sweep1[:1] if self.dry else sweep1) if sweep else []:
            best = min(best, self.time_ours(batch, PallasConfig(**params)), key=lambda t: t[0])
        if best[1] is None:  # no sweep, or every config failed
            best = (math.inf, getattr(self, "decode_best", PallasConfig()))
        for warps, stages in [] if self.dry or not sweep else [(4, 3), (8, 2), (8, 3), (4, 4)]:
            params = dict(dataclass_fields(best[1]), decode_num_warps=warps, decode_num_stages=stages)
            best = min(best, self.time_ours(batch, PallasConfig(**params)), key=lambda t: t[0])
        self.decode_best = best[1]
        fn = self.ours(best[1])
        paged_s = row(f"paged pallas ({'best' if sweep else 'config above'})", self.time_s(fn, *batch), fn(*batch),
                      config=config_diff(best[1]))
        fn = self.ours(PallasConfig())
        row("paged pallas (defaults)", self.time_s(fn, *batch), fn(*batch))

        # the same kernel over consecutive pages: what paging costs
        contig = self.paged_batch([1] * len(seq_lens), seq_lens, s["context"], contiguous_pages=True)
        contig = (batch[0],) + contig[1:]
        contig_expected = ragged_paged_attention_xla(*contig)
        fn = self.ours(best[1])
        seconds = self.time_s(fn, *contig)
        self.add(case=name, variant="same kernel, contiguous pages", us=round(seconds * 1e6, 1),
                 gb_s=round(kv_bytes / seconds / 1e9, 1), frac_copy=round(kv_bytes / seconds / 1e9 / self.copy_gbs, 3),
                 rel_err=f"{self.check(fn(*contig), contig_expected):.1e}",
                 paging_overhead=round(paged_s / seconds - 1, 3))

        self.jax_paged_attention(batch, row, sweep)
        self.contiguous_xla(batch, seq_lens, row, paged_s)

    def time_ours(self, batch, config):
        if self.over_budget():
            return math.inf, config
        fn = self.ours(config)
        try:
            return self.time_s(fn, *batch), config
        except Exception as e:  # a config Triton rejects is a finding, not the end of the run
            print(f"  config {config_diff(config)} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
            return math.inf, config

    def jax_paged_attention(self, batch, row, sweep):
        from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged

        q, k_cache, v_cache, block_tables, lengths = batch[:5]
        # jax's kernel applies no softmax scale: fold 1/sqrt(head_dim) into q, untimed.
        q = (q.astype(jnp.float32) / math.sqrt(q.shape[-1])).astype(q.dtype)
        # jax's layout: [num_kv_heads, total_pages, page_size, head_dim]; converted once, untimed.
        k_pages, v_pages = k_cache.transpose(2, 0, 1, 3), v_cache.transpose(2, 0, 1, 3)
        pages_per_seq = block_tables.shape[1]
        best = (math.inf, None, None)
        configs = [(ks, pp) for ks, pp in itertools.product((4, 8, 16, 32), (4, 8, 16))
                   if pages_per_seq % ks == 0 and (pages_per_seq // ks) % min(pp, pages_per_seq // ks) == 0]
        chosen = configs if sweep else [getattr(self, "jax_best", configs[0])]
        for k_splits, ppcb in chosen[:1] if self.dry else chosen:
            if self.over_budget() and best[1] is not None:
                break
            fn = jax.jit(functools.partial(jax_paged.paged_attention, k_splits=k_splits,
                                           pages_per_compute_block=ppcb, interpret=self.interpret))
            try:
                seconds = self.time_s(fn, q, k_pages, v_pages, block_tables, lengths)
            except Exception as e:
                print(f"  jax paged_attention k_splits={k_splits} ppcb={ppcb} failed: {str(e)[:200]}", flush=True)
                continue
            if seconds < best[0]:
                best = (seconds, fn, dict(k_splits=k_splits, pages_per_compute_block=ppcb))
                self.jax_best = (k_splits, ppcb)
        if best[1] is not None:
            variant = f"jax pallas paged_attention ({'best' if sweep else 'config above'})"
            row(variant, best[0], best[1](q, k_pages, v_pages, block_tables, lengths), config=best[2])

    def contiguous_xla(self, batch, seq_lens, row, paged_s):
        q, k_cache, v_cache, block_tables = batch[:4]
        s = self.shape
        # Contiguous [seqs, context, kv_heads, dim] copies of the same K/V (padding past seq_len is masked).
        k = k_cache[block_tables].reshape(len(seq_lens), -1, s["num_kv_heads"], s["head_dim"])
        v = v_cache[block_tables].reshape(len(seq_lens), -1, s["num_kv_heads"], s["head_dim"])
        fn = jax.jit(contiguous_decode)
        seconds = self.time_s(fn, q, k, v, batch[4])
        row("XLA attention, contiguous cache", seconds, fn(q, k, v, batch[4]),
            paged_vs_this=round(paged_s / seconds, 3))

    def prefill_rows(self, num_seqs, sweep):
        s = self.shape
        chunk, cached = s["prefill_tokens"], s["prefill_context"]
        batch = self.paged_batch([chunk] * num_seqs, [cached + chunk] * num_seqs, cached + chunk)
        # causal pairs: query j of the chunk sees cached + j + 1 keys; 2 matmuls x 2 flops per MAC
        flops = num_seqs * s["num_q_heads"] * s["head_dim"] * 4 * sum(cached + j + 1 for j in range(chunk))
        expected = ragged_paged_attention_xla(*batch)
        best = (math.inf, None)
        sweep1 = [dict(prefill_rows=r, prefill_block_k=bk) for r, bk in itertools.product((64, 128), (32, 64, 128))]
        for params in (sweep1[:1] if self.dry else sweep1) if sweep else []:
            best = min(best, self.time_ours(batch, PallasConfig(**params)), key=lambda t: t[0])
        if best[1] is None:  # no sweep, or every config failed
            best = (math.inf, getattr(self, "prefill_best", PallasConfig()))
        for warps, stages in [] if self.dry or not sweep else [(8, 2), (4, 3), (8, 3)]:
            params = dict(dataclass_fields(best[1]), prefill_num_warps=warps, prefill_num_stages=stages)
            best = min(best, self.time_ours(batch, PallasConfig(**params)), key=lambda t: t[0])
        self.prefill_best = best[1]
        label = "best" if sweep else "config above"
        for variant, config in ((f"paged pallas ({label})", best[1]), ("paged pallas (defaults)", PallasConfig())):
            fn = self.ours(config)
            seconds = self.time_s(fn, *batch)
            self.add(case=f"prefill {num_seqs}x{chunk} on {cached} cached", variant=variant,
                     us=round(seconds * 1e6, 1), tflop_s=round(flops / seconds / 1e12, 1),
                     rel_err=f"{self.check(fn(*batch), expected):.1e}", config=config_diff(config))


def dataclass_fields(config):
    return {name: getattr(config, name) for name in PallasConfig.__dataclass_fields__}


def config_diff(config):
    """The fields of a PallasConfig that differ from the defaults."""
    default = PallasConfig()
    return {k: v for k, v in dataclass_fields(config).items() if getattr(default, k) != v}


def contiguous_decode(q, k, v, seq_lens):
    """XLA decode attention over contiguous K/V. Legend: S seq, K kv head, G group, L key, D dim."""
    num_seqs, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    q = q.reshape(num_seqs, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    scores = jnp.einsum("SKGD,SLKD->SKGL", q, k, preferred_element_type=jnp.float32) / math.sqrt(head_dim)
    visible = jnp.arange(k.shape[1])[None, :] < seq_lens[:, None]
    weights = jax.nn.softmax(jnp.where(visible[:, None, None], scores, -1e30), axis=-1)
    out = jnp.einsum("SKGL,SLKD->SKGD", weights.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(num_seqs, num_q_heads, head_dim).astype(q.dtype)


def print_table(rows):
    cols = ["case", "variant", "us", "gb_s", "frac_copy", "tflop_s", "rel_err", "paging_overhead", "paged_vs_this"]
    widths = {c: max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in cols}
    print("  ".join(c.ljust(widths[c]) for c in cols))
    for r in rows:
        print("  ".join(str(r.get(c, "")).ljust(widths[c]) for c in cols))
    for r in rows:
        if r.get("config"):
            print(f"config [{r['case']} | {r.get('variant', '')}]: {r['config']}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, interpret mode, tiny shapes")
    parser.add_argument("--out", default=os.environ.get("OUT") or "results")
    parser.add_argument("--budget-s", type=float, default=300, help="stop sweeping after this many seconds")
    args = parser.parse_args()
    bench = Bench(args)
    s = bench.shape
    device = jax.devices()[0]
    print(f"device: {device.device_kind} ({device.platform}), jax {jax.__version__}, shapes {s}", flush=True)
    if not args.dry_run and device.platform != "gpu":
        sys.exit("no GPU visible: run with --dry-run on a CPU machine")
    bench.copy_bandwidth()
    bench.decode_rows(f"decode {s['num_seqs']}x{s['context']}", [s["context"]] * s["num_seqs"], sweep=True)
    ragged = [int(n) for n in bench.rng.integers(1, s["context"] + 1, s["num_seqs"])]
    bench.decode_rows(f"decode {s['num_seqs']} ragged [1,{s['context']}]", ragged, sweep=False)
    bench.prefill_rows(1, sweep=True)
    bench.prefill_rows(4, sweep=False)
    print_table(bench.rows)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "gpu_bench_attention" + (".dryrun" if args.dry_run else "") + ".json")
    with open(path, "w") as f:
        json.dump(dict(device=device.device_kind, jax=jax.__version__, dry_run=args.dry_run, shapes=s,
                       rows=bench.rows), f, indent=1, default=str)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
