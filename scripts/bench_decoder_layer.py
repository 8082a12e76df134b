"""The one-call decoder layer (cpu_kernels/decoder_layer.py) on a decode-shaped layer stack.

SmolLM2-135M's 30 layers (its shapes; random q4_1 weights, as its GGUF stores them) in one
jitted program, one decoding token over a context of C keys in an f32 paged cache, the caches
donated: the layer kernel's time per layer and the bytes it must read (weights as stored + the
live KV) over that time, for each context and activations mode. Medians of --repeats calls.
This is the kernel alone; scripts/bench_roofline.py takes a whole engine step apart.

Run: .venv/bin/python scripts/bench_decoder_layer.py [--contexts 1 300 1000] [--quick]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

D, F, HQ, HKV, H, LAYERS = 576, 1536, 9, 3, 64, 30  # SmolLM2-135M
BLOCK_SIZE = 16


def _stack(rng, fmt: str):
    import jax.numpy as jnp

    from cpu_kernels import decoder_layer as dl
    from cpu_kernels import quant_matmul as qm

    def weight(n, k):
        return dl.Weight(jnp.asarray(qm.pack((rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32), fmt)), fmt)

    return [dl.LayerWeights(jnp.ones(D), weight(HQ * H, D), weight(HKV * H, D), weight(HKV * H, D), weight(D, HQ * H),
                            jnp.ones(D), weight(F, D), weight(F, D), weight(D, F)) for _ in range(LAYERS)]


def time_stack(layers, context: int, activations: str, repeats: int, evict: np.ndarray | None = None) -> float:
    """Median seconds of one call of the 30-layer program, one token at `context` keys; with
    `evict`, an array read before each call (so the weights come from memory, not the cache)."""
    import jax
    import jax.numpy as jnp

    from cpu_kernels import decoder_layer as dl

    rng = np.random.default_rng(1)
    width = -(-max(context, 1) // BLOCK_SIZE)
    num_blocks = width + 1
    caches = [tuple(jnp.asarray(rng.standard_normal((num_blocks, BLOCK_SIZE, HKV, H)), jnp.float32) for _ in range(2))
              for _ in layers]
    rows = (jnp.arange(1, width + 1, dtype=jnp.int32)[None], jnp.asarray([context], jnp.int32),
            jnp.arange(2, dtype=jnp.int32), jnp.int32(1))
    slots = jnp.asarray([BLOCK_SIZE + context - 1], jnp.int32)
    angles = (context - 1) * (100000.0 ** (-np.arange(0, H, 2) / H))
    cos, sin = jnp.asarray(np.cos(angles)[None], jnp.float32), jnp.asarray(np.sin(angles)[None], jnp.float32)

    @functools.partial(jax.jit, donate_argnums=(1,))
    def step(x, caches):
        out = []
        for weights, (k, v) in zip(layers, caches):
            x, k, v = dl.decoder_layer(x, weights, cos, sin, k, v, slots, rows, eps=1e-5, sm_scale=H ** -0.5,
                                       num_heads=HQ, intermediate_size=F, activations=activations)
            out.append((k, v))
        return x, out

    x = jnp.asarray(rng.standard_normal((1, D)), jnp.float32)
    for _ in range(3):
        y, caches = step(x, caches)
        y.block_until_ready()
    times = []
    for _ in range(repeats):
        if evict is not None:
            evict.sum()
        t = time.perf_counter()
        y, caches = step(x, caches)
        y.block_until_ready()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1, 300, 1000])
    parser.add_argument("--activations", nargs="+", default=["int8", "float32"])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--evict-mb", type=int, default=512,
                        help="the 'cold' rows read an array this large before each call (0: warm rows only)")
    parser.add_argument("--quick", action="store_true", help="one context, 5 repeats (a smoke run)")
    parser.add_argument("--out", default=None, help="default: results/bench_decoder_layer[_quick].json")
    args = parser.parse_args()
    if args.quick:
        args.contexts, args.repeats = [300], 5
    from cpu_kernels import decoder_layer as dl

    if not dl.native_available():
        sys.exit("the native decoder layer is not available here (no C++ compiler, or not x86-64)")
    layers = _stack(np.random.default_rng(0), "q4_1")
    weight_bytes = sum(w.data.nbytes for layer in layers for w in layer if isinstance(w, dl.Weight))
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; {LAYERS} layers, "
          f"{weight_bytes / 1e6:.1f} MB of q4_1 weights")
    # warm: calls back to back, so much of the stack can stay in a large last-level cache;
    # cold: after reading --evict-mb of other memory, as in an engine step (whose head and host
    # work come between two layer passes), the weights come from memory.
    evictions = {"warm": None}
    if args.evict_mb:
        evictions["cold"] = np.ones(args.evict_mb * 2**20 // 4, np.float32)
    print("| context | activations | cache | ms (30 layers) | us a layer | MB read | GB/s |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    for context in args.contexts:
        for activations in args.activations:
            for cache, evict in evictions.items():
                seconds = time_stack(layers, context, activations, args.repeats, evict)
                kv_bytes = LAYERS * context * HKV * H * 4 * 2
                read = weight_bytes + kv_bytes
                rows.append(dict(context=context, activations=activations, cache=cache, ms=seconds * 1e3,
                                 read_mb=read / 1e6, gb_per_s=read / seconds / 1e9))
                print(f"| {context} | {activations} | {cache} | {seconds * 1e3:.2f} | {seconds / LAYERS * 1e6:.0f} | "
                      f"{read / 1e6:.1f} | {read / seconds / 1e9:.1f} |", flush=True)
    out = args.out or os.path.join("results", "bench_decoder_layer" + ("_quick" if args.quick else "") + ".json")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as fh:
        json.dump(dict(rows=rows, weight_mb=weight_bytes / 1e6, repeats=args.repeats, evict_mb=args.evict_mb), fh,
              indent=1)


if __name__ == "__main__":
    main()
