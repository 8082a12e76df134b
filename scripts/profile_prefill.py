"""Where a real model's prefill (or a batch's decode step) goes on a CPU, by attention path.

    python scripts/profile_prefill.py [--tokens 256 1024 3000] [--attention native blocked]
    python scripts/profile_prefill.py --decode-batch 32

SmolLM2-135M-Instruct's GGUF (models/named_models.py) with int8 activations. Prefill: one
prompt of N random tokens, max_tokens=1, the prefix cache reset before each run, medians of
--runs after two warm runs; then jax's profiler over one more prefill, thunk time by kind
(bench_roofline's names). --attention blocked routes the CPU's attention to the blocked XLA
loop (cpu_kernels.paged_attention.usable -> False, as the tests do), native is the engine's
own path (every query token a row of the native kernel). --decode-batch B instead profiles 4
decode steps of B sequences with 256-token prompts, once every one of them decodes.
"""

from __future__ import annotations

import argparse
import collections
import re
import statistics
import time

import numpy as np

from _bench_common import command_line, machine_info, print_table, write_json
from bench_roofline import MODEL, _thunk_kind, hlo_ops, trace_thunks


def _llm(max_num_seqs: int, max_model_len: int):
    from paged_jax import LLM

    return LLM(MODEL, max_num_seqs=max_num_seqs, max_model_len=max_model_len, warm_up="none",
               activation_dtype="int8")


def _thunks(engine, run, steps: int) -> dict:
    """jax's profiler over run(): thunk ms per step by kind, named from the layer programs' HLO."""
    ops = {}
    for shape in engine.runner.compiler.shapes:
        _, layers, *_ = engine.runner._programs_for(shape)
        for program in layers:
            ops.update(hlo_ops(program.as_text()))
    kinds = collections.Counter()
    for event, self_us in trace_thunks(run):
        module, name = event["args"]["hlo_module"], event["args"].get("hlo_op", event["name"])
        opcode, shape, op_name = ops.get(name, ("", "", "")) if module == "jit_layer_fn" else ("", "", "")
        kind = "head (sampling rows' logits)" if module == "jit_head_fn" else _thunk_kind(op_name, opcode, name, shape)
        if kind.startswith("whole layers") and not re.search(r"\[\d+,\d+,\d+,\d+\]", shape):
            kind = _thunk_kind("", "", "ffi_call", "")  # q/k/v or gate/up as one call: no cache among its outputs
        kinds[kind] += self_us / 1e3 / steps
    return dict(kinds)


def prefill(num_tokens: int, runs: int) -> dict:
    from paged_jax.core.request import SamplingParams

    llm = _llm(1, max(2048, num_tokens + 16))
    engine, rng = llm.engine, np.random.default_rng(num_tokens)

    def once() -> float:
        assert engine.reset_prefix_cache(), "requests still hold blocks"
        engine.add_request(f"prefill-{time.monotonic_ns()}", rng.integers(3, 40000, num_tokens).tolist(),
                           SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        return time.perf_counter() - t0

    once(), once()  # compiles the chunks' buckets
    ms = 1e3 * statistics.median(once() for _ in range(runs))
    return {"ms": ms, "tok_s": num_tokens / ms * 1e3, "thunks_ms": _thunks(engine, once, 1)}


def decode_batch(batch: int) -> dict:
    from paged_jax.core.request import SamplingParams

    llm = _llm(batch, 1024)
    engine, rng = llm.engine, np.random.default_rng(batch)
    for i in range(batch):
        engine.add_request(f"decode-{i}", rng.integers(3, 40000, 256).tolist(),
                           SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
    while not (len(engine.scheduler.running) == batch and
               all(r.num_computed_tokens >= len(r.prompt_token_ids) for r in engine.scheduler.running)):
        engine.step()
    for _ in range(3):  # the decode bucket compiles here
        engine.step()
    times = []
    for _ in range(8):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    thunks = _thunks(engine, lambda: [engine.step() for _ in range(4)], 4)
    return {"ms": 1e3 * statistics.median(times), "thunks_ms": thunks}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--attention", nargs="+", choices=["native", "blocked"], default=["native", "blocked"])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--decode-batch", type=int, default=0, help="profile decode steps of this batch instead")
    parser.add_argument("--out", default="results/profile_prefill.json")
    args = parser.parse_args(argv)
    import jax

    from cpu_kernels import paged_attention as cpu_attention

    result = {"machine": machine_info(), "command": command_line(), "runs": []}
    if args.decode_batch:
        run = {"decode_batch": args.decode_batch, **decode_batch(args.decode_batch)}
        result["runs"].append(run)
        print_table(f"decode step, {args.decode_batch} sequences, 256-token prompts: {run['ms']:.1f} ms (median of 8)",
                    ["thunks", "ms per step"], [[k, f"{v:.1f}"] for k, v in sorted(run["thunks_ms"].items())])
    usable = cpu_attention.usable
    for attention in ([] if args.decode_batch else args.attention):
        cpu_attention.usable = usable if attention == "native" else (lambda k_cache: False)
        jax.clear_caches()  # no trace of the other path is reused
        for num_tokens in args.tokens:
            run = {"attention": attention, "tokens": num_tokens, **prefill(num_tokens, args.runs)}
            result["runs"].append(run)
            print(f"{attention} {num_tokens}: {run['ms']:.0f} ms", flush=True)
    cpu_attention.usable = usable
    prefills = [r for r in result["runs"] if "tokens" in r]
    if prefills:
        kinds = sorted({k for r in prefills for k in r["thunks_ms"]})
        print_table("prefill, one prompt, int8 activations (ms: median; thunks: one profiled prefill)",
                    ["attention", "tokens", "ms", "tok/s", *kinds],
                    [[r["attention"], r["tokens"], f"{r['ms']:.0f}", f"{r['tok_s']:.0f}",
                      *(f"{r['thunks_ms'].get(k, 0.0):.0f}" for k in kinds)] for r in prefills])
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
