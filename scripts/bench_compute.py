"""Compute efficiency: useful model FLOP/s in prefill and decode vs this machine's matmul rate.

    python scripts/bench_compute.py [--quick] [--model DIR]

bench_throughput.py runs the same measurement inside its paged-jax worker (same engine, same
run); this entry point builds its own engine. The machine's rate is a jitted jnp.dot of two
float32 n x n matrices (n = 4096; 2 n^3 FLOPs per product, median of 3 after a warm-up),
measured in the same process right before the engine steps.

Useful FLOPs of a step (_bench_common.useful_flops): 2 x (layer matmul parameters) x tokens
+ 2 x hidden x vocab x sampled rows (lm_head) + 4 x layers x q_heads x head_dim x (sum over
tokens of visible keys); padding, masked keys and unsampled logits are not counted.

  prefill  prompts of 64-512 tokens, max_tokens=1, so every step is prefill only
  decode   64 requests with 256-token prompts; only steps in which all 64 decode count

Each is timed per engine.step() (host work included) and per jitted call alone.
Target (issue 6): prefill >= 60% of the matmul rate.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

from _bench_common import bench_model_dir, command_line, machine_info, print_table, useful_flops, write_json

PREFILL_LEN = (64, 512)
DECODE_PROMPT_LEN = 256


def matmul_rate(n: int, reps: int = 3) -> float:
    """FLOP/s of a jitted float32 n x n @ n x n on the default device."""
    import jax
    import jax.numpy as jnp

    ka, kb = jax.random.split(jax.random.key(0))
    a = jax.random.normal(ka, (n, n), jnp.float32)
    b = jax.random.normal(kb, (n, n), jnp.float32)
    dot = jax.jit(jnp.dot)
    dot(a, b).block_until_ready()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        dot(a, b).block_until_ready()
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / statistics.median(times)


def model_shape(model_config) -> dict:
    """The HF-style shape dict useful_flops takes, from a models.llama.LlamaConfig."""
    c = model_config
    return {"hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size, "vocab_size": c.vocab_size,
            "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
            "num_hidden_layers": c.num_layers}


def timed_steps(engine, prompts, max_tokens: int, keep) -> dict:
    """Runs the prompts to completion; sums useful FLOPs and times over the steps keep(out) accepts."""
    from paged_jax.core.request import SamplingParams

    shape = model_shape(engine.model.config)
    runner, scheduler = engine.runner, engine.scheduler
    real_schedule, real_execute = scheduler.schedule, runner.execute
    captured = {}

    def schedule():
        captured["out"] = real_schedule()
        return captured["out"]

    def execute(inputs, copies=None):
        t0 = time.perf_counter()
        result = real_execute(inputs, copies)  # returns host arrays, so the device work is done
        captured["jit_s"] = time.perf_counter() - t0
        return result

    scheduler.schedule, runner.execute = schedule, execute
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    assert engine.reset_prefix_cache(), "requests still hold blocks"
    for i, prompt in enumerate(prompts):
        engine.add_request(f"compute-{time.monotonic_ns()}-{i}", prompt, params)
    flops = step_s = jit_s = 0.0
    num_steps = num_tokens = 0
    try:
        while engine.has_unfinished_requests():
            t0 = time.perf_counter()
            engine.step()
            dt = time.perf_counter() - t0
            out = captured["out"]
            if not keep(out):
                continue
            sum_context = sum(n * c + n * (n + 1) // 2
                              for c, n in zip(out.num_computed_tokens, out.num_scheduled_tokens))
            flops += useful_flops(shape, out.total_num_scheduled_tokens, sum_context, sum(out.samples))
            step_s += dt
            jit_s += captured["jit_s"]
            num_steps += 1
            num_tokens += out.total_num_scheduled_tokens
    finally:
        del scheduler.schedule, runner.execute  # back to the class methods
    return {"flops": flops, "step_s": step_s, "jit_s": jit_s, "steps": num_steps, "tokens": num_tokens,
            "flops_per_s_step": flops / step_s, "flops_per_s_jit": flops / jit_s}


def measure_compute(engine, *, quick: bool, seed: int = 0) -> dict:
    """Matmul rate, then prefill and decode useful FLOP/s of `engine` (an LLMEngine)."""
    n = 2048 if quick else 4096
    rate = matmul_rate(n)
    rate_small = matmul_rate(1024)
    rng = np.random.default_rng(seed + 1)
    vocab = engine.model.config.vocab_size
    num_prefill = 8 if quick else 32
    prefill_prompts = [rng.integers(3, vocab, int(rng.integers(*PREFILL_LEN))).tolist() for _ in range(num_prefill)]
    prefill = timed_steps(engine, prefill_prompts, 1, keep=lambda out: True)
    num_decode = min(64, engine.config.max_num_seqs)
    decode_prompts = [rng.integers(3, vocab, DECODE_PROMPT_LEN).tolist() for _ in range(num_decode)]
    decode = timed_steps(engine, decode_prompts, 24 if quick else 48,
                         keep=lambda out: out.num_seqs == num_decode and out.total_num_scheduled_tokens == num_decode)
    assert decode["steps"] > 0, "no step had every request decoding; raise max_tokens"
    for part in (prefill, decode):
        part["fraction_of_matmul_step"] = part["flops_per_s_step"] / rate
        part["fraction_of_matmul_jit"] = part["flops_per_s_jit"] / rate
    return {"matmul_n": n, "matmul_flops_per_s": rate, "matmul_1024_flops_per_s": rate_small,
            "prefill": prefill, "decode": decode, "decode_batch": num_decode, "target_prefill_fraction": 0.6,
            "formula": "2*layer_matmul_params*tokens + 2*hidden*vocab*sampled_rows + "
                       "4*layers*q_heads*head_dim*sum(visible keys per token)"}


def compute_rows(c: dict) -> list[list]:
    g = lambda x: f"{x / 1e9:.1f}"  # noqa: E731
    rows = [[f"jnp.dot {c['matmul_n']}^2 float32 (the machine's rate)", g(c["matmul_flops_per_s"]), "", "", ""],
            ["jnp.dot 1024^2 float32", g(c["matmul_1024_flops_per_s"]), "", "", ""]]
    for name, target in (("prefill", ">= 60%"), ("decode", "")):
        p = c[name]
        label = f"{name} ({p['tokens']} tokens, {p['steps']} steps" + (
            f", batch {c['decode_batch']})" if name == "decode" else ")")
        rows.append([label + ", engine.step", g(p["flops_per_s_step"]), f"{100 * p['fraction_of_matmul_step']:.0f}%",
                     f"{1e3 * p['step_s'] / p['steps']:.0f} ms", target])
        rows.append([f"{name}, jitted call only", g(p["flops_per_s_jit"]), f"{100 * p['fraction_of_matmul_jit']:.0f}%",
                     f"{1e3 * p['jit_s'] / p['steps']:.0f} ms", ""])
    return rows


COMPUTE_COLUMNS = ["what", "useful GFLOP/s", "of matmul rate", "per step", "target"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--model", default=None, help="HF Llama directory (default: make the benchmark model)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=1024)
    parser.add_argument("--out", default=None, help="default: results/bench_compute[_quick].json")
    args = parser.parse_args(argv)
    args.out = args.out or f"results/bench_compute{'_quick' if args.quick else ''}.json"
    from paged_jax.engine import LLMEngine
    from paged_jax.engine_config import EngineConfig

    with bench_model_dir(args.model) as model_dir:
        t0 = time.perf_counter()
        engine = LLMEngine(EngineConfig(model=model_dir, dtype="float32", max_model_len=1024, max_num_seqs=64,
                                        max_num_batched_tokens=args.max_num_batched_tokens, num_blocks=64 * 20 + 1, warm_up="full"))
        warm_up_s = time.perf_counter() - t0
        result = measure_compute(engine, quick=args.quick)
    result.update(engine_load_and_warm_up_s=warm_up_s, max_num_batched_tokens=args.max_num_batched_tokens,
                  machine=machine_info(), command=command_line())
    print_table("compute efficiency (float32, CPU, attention_impl=xla)", COMPUTE_COLUMNS, compute_rows(result))
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
