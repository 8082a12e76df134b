"""Prefix cache: time to first token with a shared 2000-token system prompt, warm vs cold vs off.

    python scripts/bench_prefix_cache.py [--quick] [--reps 5] [--model DIR]

Model: the random-init HF Llama of the benchmarks (8 layers, hidden 512, 8/2 heads, vocab
32000, float32; _bench_common.BENCH_MODEL), saved with save_pretrained and loaded by
LLMEngine. Each repetition draws a fresh 2000-token system prompt and two 50-token questions
and sends, one at a time, max_tokens=1 each:

  cold  system + question 1 to the engine with prefix caching on (nothing cached yet)
  warm  system + question 2 to the same engine: 125 blocks (2000 tokens) come from the cache
  off   the same two requests to a second engine with prefix caching off; the second one's
        TTFT is reported (it recomputes everything)

TTFT is the engine's own RequestOutput.metrics.time_to_first_token (arrival at add_request
to the output of the step that sampled the first token: scheduling, hashing, input building,
the jitted step(s), output bookkeeping). Compilation happens in warm-up, before any timed
request, and is reported apart. Buckets: max_num_batched_tokens 1024 (a cold prompt is
chunked 1024 + 1024 + 2), max_num_seqs 8. Target (issue 6): warm <= 0.1 x cold.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

from _bench_common import BENCH_MODEL, bench_model_dir, command_line, machine_info, print_table, write_json

SYSTEM_LEN = 2000
QUESTION_LEN = 50


def measure(args, model_dir: str, reps: int) -> int:
    """TTFT cold, warm and with caching off; prints the table and writes the JSON."""
    from paged_jax.engine import LLMEngine
    from paged_jax.engine_config import EngineConfig
    from paged_jax.core.request import SamplingParams

    engines, warm_up_s = {}, {}
    for name, caching in (("on", True), ("off", False)):
        t0 = time.perf_counter()
        engines[name] = LLMEngine(EngineConfig(
            model=model_dir, dtype="float32", max_model_len=4096, num_blocks=600, block_size=16,
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            enable_prefix_caching=caching, seed=args.seed, warm_up="full"))
        warm_up_s[name] = time.perf_counter() - t0  # load + compile every bucket
    compiled = {name: e.runner.num_compilations for name, e in engines.items()}
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    counter = iter(range(10**9))

    def ttft(engine, prompt) -> tuple[float, int, int]:
        """(TTFT s, prefix-cache hit tokens, steps) of one request sent alone."""
        request_id = f"q{next(counter)}"
        steps0 = engine.runner.num_steps
        engine.add_request(request_id, prompt, params)
        while True:
            for out in engine.step():
                if out.request_id == request_id and out.finished:
                    return out.metrics.time_to_first_token, out.metrics.num_cached_tokens, engine.runner.num_steps - steps0

    rng = np.random.default_rng(args.seed)
    runs = {"cold": [], "warm": [], "off": []}
    hits, steps = {}, {}
    for _ in range(reps):
        system = rng.integers(3, BENCH_MODEL["vocab_size"], SYSTEM_LEN).tolist()
        q1, q2 = (rng.integers(3, BENCH_MODEL["vocab_size"], QUESTION_LEN).tolist() for _ in range(2))
        for case, engine, prompt in (("cold", engines["on"], system + q1), ("warm", engines["on"], system + q2)):
            t, hits[case], steps[case] = ttft(engine, prompt)
            runs[case].append(t)
        ttft(engines["off"], system + q1)
        t, hits["off"], steps["off"] = ttft(engines["off"], system + q2)
        runs["off"].append(t)
    for name, e in engines.items():
        assert e.runner.num_compilations == compiled[name], "a timed request compiled a new shape"
    assert hits["warm"] == SYSTEM_LEN and hits["cold"] == 0 and hits["off"] == 0, f"unexpected prefix hits {hits}"

    med = {case: statistics.median(ts) for case, ts in runs.items()}
    ratio = med["warm"] / med["cold"]
    result = {
        "ttft_s": med, "ttft_s_all": runs, "warm_over_cold": ratio, "warm_over_off": med["warm"] / med["off"],
        "prefix_hit_tokens": hits, "steps_to_first_token": steps, "target_warm_over_cold": 0.1,
        "engine_load_and_warm_up_s": warm_up_s, "compiled_shapes": compiled,
        "config": {"system_len": SYSTEM_LEN, "question_len": QUESTION_LEN, "reps": reps, "block_size": 16,
                   "max_num_batched_tokens": args.max_num_batched_tokens, "max_num_seqs": args.max_num_seqs,
                   "max_model_len": 4096, "dtype": "float32", "model": BENCH_MODEL, "attention_impl": "xla"},
        "machine": machine_info(),
        "command": command_line(),
    }
    ms = lambda s: f"{1e3 * s:.1f} ms"  # noqa: E731
    rows = [
        ["cold (caching on, first request)", ms(med["cold"]), hits["cold"], steps["cold"], "1.00x", ""],
        ["warm (same system prompt)", ms(med["warm"]), hits["warm"], steps["warm"], f"{ratio:.3f}x", "<= 0.1x cold"],
        ["prefix caching off (second request)", ms(med["off"]), hits["off"], steps["off"],
         f"{med['off'] / med['cold']:.3f}x", ""],
    ]
    print_table(f"TTFT, {SYSTEM_LEN}-token system prompt + {QUESTION_LEN}-token question (median of {reps}); "
                f"compile excluded (load + warm-up {warm_up_s['on']:.0f} s / {warm_up_s['off']:.0f} s)",
                ["case", "TTFT", "hit tokens", "steps", "vs cold", "target"], rows)
    write_json(args.out, result)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 repetitions instead of 5")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--model", default=None, help="HF Llama directory (default: make the benchmark model)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=1024)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="default: results/bench_prefix_cache[_quick].json")
    args = parser.parse_args(argv)
    args.out = args.out or f"results/bench_prefix_cache{'_quick' if args.quick else ''}.json"
    reps = args.reps or (2 if args.quick else 5)

    with bench_model_dir(args.model, seed=args.seed) as model_dir:
        return measure(args, model_dir, reps)


if __name__ == "__main__":
    sys.exit(main())
