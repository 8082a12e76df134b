"""The packed-weight matmul (cpu_kernels/quant_matmul.py) on a decode-shaped layer stack.

SmolLM2-135M's 30 layers of q/k/v/o/gate/up/down matrices (210 matmuls, 106M weights) in one
jitted program, x of M rows: XLA's f32 dot over float32 weights beside quant_matmul over each
packed format, with exact f32 activations and (q8_0, q4_1) int8 ones (the native kernel on a
CPU; XLA's dequantize + dot on a GPU), and, with --xla-too, the XLA path on the CPU as well. Medians of --repeats runs; GB/s is the bytes of
the weights as stored over the time.

--cached runs every layer on one layer's weights, which stay in the caches: beside a plain run it
says how much of a call's time is the reads. Run:
.venv/bin/python scripts/bench_quant_matmul.py [--rows 1 4 16 64] [--cached] [--quick]
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from _bench_common import command_line, machine_info, median, print_table, write_json  # noqa: E402
from cpu_kernels import quant_matmul as qm  # noqa: E402

D, F, KV = 576, 1536, 192  # SmolLM2-135M
LAYER = [(D, D), (D, KV), (D, KV), (D, D), (D, F), (D, F), (F, D)]  # (inputs, outputs)


def _time(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--xla-too", action="store_true", help="also time the XLA dequantize path on a CPU")
    parser.add_argument("--cached", action="store_true",
                        help="every layer the same 7 weights (one layer's, 2-4 MB as stored: they stay in the "
                             "CPU's caches), so the rows time the loops' arithmetic and the calls, not the reads")
    parser.add_argument("--quick", action="store_true", help="2 layers, rows 1 and 4, 3 repeats (a smoke run)")
    parser.add_argument("--out", default="results")
    args = parser.parse_args()
    if args.quick:
        args.layers, args.rows, args.repeats = 2, [1, 4], 3
    rng = np.random.default_rng(0)
    shapes = LAYER * args.layers
    # --cached: one layer's weights made, and each layer's calls handed that same list
    repeat = args.layers if args.cached else 1
    dense = [jnp.asarray(rng.standard_normal((n, k), np.float32) / np.sqrt(k))
             for k, n in shapes[:len(shapes) // repeat]] * repeat  # [N, K]
    packed = {fmt: [jnp.asarray(qm.pack(np.asarray(w), fmt)) for w in dense[:len(shapes) // repeat]] * repeat
              for fmt in qm.WEIGHT_FORMATS}
    native = jax.default_backend() == "cpu" and qm.native_available()
    impls = [("native" if native else "xla", qm.quant_matmul)]
    if native and args.xla_too:
        impls.append(("xla", functools.partial(qm.quant_matmul, native=None)))
    f32_weights = [w.T for w in dense]  # [K, N]: what the float model's einsum reads
    rows, result = [], {"machine": machine_info(), "command": command_line(), "backend": jax.default_backend(),
                        "layers": args.layers, "cached": args.cached, "cases": []}
    for m in args.rows:
        xs = {k: jnp.asarray(rng.standard_normal((m, k), np.float32)) for k in (D, F)}
        stack = jax.jit(lambda xs, ws: sum((xs[w.shape[0]] @ w).sum() for w in ws))
        ms = _time(stack, xs, f32_weights, repeats=args.repeats)
        nbytes = sum(w.nbytes for w in dense)
        cases = [("float32", "xla dot", ms, nbytes)]
        for fmt, datas in packed.items():
            for activations in qm.ACTIVATIONS:
                if activations == "int8" and fmt not in qm.TILED:
                    continue
                for impl, matmul in impls:
                    fn = jax.jit(lambda xs, ds, matmul=matmul, fmt=fmt, acts=activations: sum(
                        matmul(xs[k], d, fmt, n, acts).sum() for (k, n), d in zip(shapes, ds)))
                    name = fmt if activations == "float32" else f"{fmt}, int8 x"
                    cases.append((name, impl, _time(fn, xs, datas, repeats=args.repeats),
                                  sum(d.nbytes for d in datas)))
        for fmt, impl, t, nb in cases:
            rows.append([m, fmt, impl, f"{nb / 1e6:.1f}", f"{t:.2f}", f"{nb / t / 1e6:.1f}", f"{ms / t:.2f}x"])
            result["cases"].append({"rows": m, "format": fmt, "impl": impl, "bytes": nb, "ms": t})
    what = "one layer's weights read" if args.cached else "layers of matmuls"
    print_table(f"{args.layers} SmolLM2 {what}, {jax.default_backend()} ({result['machine']['cpu']})",
                ["rows", "weights", "matmul", "MB read", "ms (median)", "GB/s", "vs f32"], rows)
    write_json(os.path.join(args.out, "bench_quant_matmul" + ("_cached" if args.cached else "") + ".json"), result)


if __name__ == "__main__":
    main()
