"""End-to-end rows of the GPU check: LLM engine tokens/s on the paged engine, random weights.

Rows (each its own engine; buckets compile lazily, so each row runs twice on the same engine
and prompts and reports the second, with the prefix cache reset in between so the prefills
are not skipped):
  - llama-3.2-1b, bf16, 64 prompts x 512 random tokens, 128 new tokens each (issue 7's row);
  - smollm2-135m (SmolLM2-135M-Instruct's shapes: the GPU machine cannot carry its 93 MB
    GGUF), bf16 weights and int8 (q8_0 blocks, dequantized inside the matmul: issue 26's
    compact weights), at batch 1 and batch 64, 256-token prompts, 128 new tokens.
Greedy with ignore_eos, so every request generates all its tokens. A row reports generated
tokens/s over the whole run, the decode rate after the first token (batch 1: one stream's
tok/s) and the weight bytes a decode step reads, as GB/s against the device's copy bandwidth
(gpu_bench_attention.py measures it). A batch-1 row also takes 31 decode steps apart
(bench_roofline.TimedStep: host work, each compiled program, each synchronised), which says
whether a step's fixed cost is the host's or the device's.

    python scripts/gpu_bench_e2e.py [--dry-run] [--out DIR] [--budget-s S]

--dry-run: the tiny preset on CPU, a few prompts of 32 tokens, 8 new tokens, the Pallas kernel
in interpret mode (proves the script runs). --budget-s: rows not started by then are skipped;
--preset NAME / --batch N / --weight-dtype D: only the rows of that preset / batch size /
weight dtype. XLA_FLAGS in the environment reach the row's programs (gpu_check.sh's cmdbuf
section compares XLA:GPU's command-buffer settings on one row).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _bench_common import tree_nbytes  # noqa: E402
from bench_roofline import TimedStep, decode_run  # noqa: E402
from models.packed_weight import pack_model  # noqa: E402
from models.registry import build_preset  # noqa: E402
from paged_jax.engine import LLMEngine  # noqa: E402
from paged_jax.engine_config import EngineConfig  # noqa: E402
from paged_jax.core.request import SamplingParams  # noqa: E402
from paged_jax.core.tokenizer import Tokenizer  # noqa: E402

ROWS = [
    dict(preset="llama-3.2-1b", weight_dtype="bfloat16", num_prompts=64, prompt_len=512, max_tokens=128,
         max_num_batched_tokens=2048),
    dict(preset="smollm2-135m", weight_dtype="bfloat16", num_prompts=1, prompt_len=256, max_tokens=128,
         max_num_batched_tokens=512),
    dict(preset="smollm2-135m", weight_dtype="int8", num_prompts=1, prompt_len=256, max_tokens=128,
         max_num_batched_tokens=512),
    dict(preset="smollm2-135m", weight_dtype="bfloat16", num_prompts=64, prompt_len=256, max_tokens=128,
         max_num_batched_tokens=2048),
    dict(preset="smollm2-135m", weight_dtype="int8", num_prompts=64, prompt_len=256, max_tokens=128,
         max_num_batched_tokens=2048),
]
DRY_RUN_ROWS = [
    dict(preset="tiny", weight_dtype="float32", num_prompts=4, prompt_len=32, max_tokens=8, max_num_batched_tokens=64),
    dict(preset="tiny", weight_dtype="int8", num_prompts=1, prompt_len=32, max_tokens=8, max_num_batched_tokens=64),
]


def measure_row(shape: dict, interpret: bool) -> dict:
    model = pack_model(build_preset(shape["preset"]), shape["weight_dtype"])
    config = model.config
    max_model_len = shape["prompt_len"] + shape["max_tokens"]
    blocks_per_seq = -(-max_model_len // 16)
    engine = LLMEngine(
        EngineConfig(model=shape["preset"], block_size=16, num_blocks=shape["num_prompts"] * blocks_per_seq + 1,
                     max_model_len=max_model_len, max_num_seqs=shape["num_prompts"],
                     max_num_batched_tokens=shape["max_num_batched_tokens"], warm_up=False,
                     attention_impl="pallas", interpret=interpret),
        model=model, tokenizer=Tokenizer.from_model("tiny"))  # token-id prompts: the tokenizer only decodes
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, min(config.vocab_size, 32000), shape["prompt_len"]).tolist()
               for _ in range(shape["num_prompts"])]
    params = SamplingParams(max_tokens=shape["max_tokens"], temperature=0.0, ignore_eos=True)

    def run(tag: str) -> tuple[float, float, int]:
        """(seconds in all, seconds after every request has its first token, tokens made then)."""
        for i, prompt in enumerate(prompts):
            engine.add_request(f"{tag}-{i}", prompt, params)
        start = time.perf_counter()
        first_done = None
        made_before = 0
        while engine.has_unfinished_requests():
            engine.step()
            if first_done is None and not engine.scheduler.waiting and all(
                    r.num_output_tokens > 0 for r in engine.scheduler.running):
                jax.block_until_ready(engine.runner.kv_caches)
                first_done = time.perf_counter()
                made_before = sum(r.num_output_tokens for r in engine.scheduler.running)
        jax.block_until_ready(engine.runner.kv_caches)
        end = time.perf_counter()
        total = shape["num_prompts"] * shape["max_tokens"]
        return end - start, end - (first_done or start), total - made_before

    first_s, _, _ = run("compile")
    assert engine.reset_prefix_cache(), "blocks still held after every request finished"
    compilations = engine.runner.num_compilations
    measured_s, decode_s, decode_tokens = run("measured")
    generated = shape["num_prompts"] * shape["max_tokens"]
    step_s = decode_s / max(1, decode_tokens / shape["num_prompts"])
    # What a decode step reads of the weights, as bench_roofline counts it (a tied embedding once).
    nbytes = tree_nbytes(engine.runner.layer_params) + tree_nbytes(engine.runner.head_params)
    parts = {}
    if shape["num_prompts"] == 1:  # where a step's time goes: engine.step taken apart, synchronised
        timed = TimedStep(engine)
        decode_run(engine, prompts[0], min(shape["max_tokens"], 32), step=timed)
        parts = {name: round(float(np.median(s)) * 1e3, 3) for name, s in timed.parts.items()}
    return {
        "model": f"{shape['preset']} (random weights)", "weight_dtype": shape["weight_dtype"],
        "weight_mb": round(nbytes / 1e6, 1), "backend": jax.default_backend(), "jax": jax.__version__,
        "attention_impl": engine.runner.attention_impl,
        "prompts": shape["num_prompts"], "prompt_len": shape["prompt_len"], "new_tokens": shape["max_tokens"],
        "first_run_s_incl_compile": round(first_s, 3), "compilations": compilations,
        "new_compilations_in_measured_run": engine.runner.num_compilations - compilations,
        "measured_s": round(measured_s, 3), "generated_tok_per_s": round(generated / measured_s, 1),
        "total_tok_per_s": round((generated + shape["num_prompts"] * shape["prompt_len"]) / measured_s, 1),
        "decode_step_ms": round(step_s * 1e3, 3), "decode_tok_per_s": round(decode_tokens / decode_s, 1),
        "weight_gb_s_in_decode": round(nbytes / step_s / 1e9, 1),
        "decode_step_parts_ms": parts, "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--out", default="results")
    parser.add_argument("--budget-s", type=float, default=1e9)
    parser.add_argument("--preset", default=None, help="only the rows of this preset")
    parser.add_argument("--batch", type=int, default=None, help="only the rows of this batch size")
    parser.add_argument("--weight-dtype", default=None, help="only the rows of this weight dtype")
    args = parser.parse_args()
    start = time.perf_counter()
    interpret = args.dry_run and jax.default_backend() == "cpu"
    results = []
    for shape in DRY_RUN_ROWS if args.dry_run else ROWS:
        if (args.preset is not None and shape["preset"] != args.preset
                or args.batch is not None and shape["num_prompts"] != args.batch
                or args.weight_dtype is not None and shape["weight_dtype"] != args.weight_dtype):
            continue
        if time.perf_counter() - start > args.budget_s:
            print(f"skipped (budget spent): {shape}")
            continue
        try:
            row = measure_row(shape, interpret)
        except Exception as e:  # one row's failure must not cost the others on a leased device
            row = {**shape, "error": f"{type(e).__name__}: {e}"[:2000]}
        results.append(row)
        print(json.dumps(row), flush=True)
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "gpu_bench_e2e.json"), "w") as f:
            json.dump(results, f, indent=2)
    print("== end to end: LLM engine ==")
    print(f"{'model':<14} {'weights':<9} {'batch':>5} {'tok/s':>8} {'decode tok/s':>12} {'step ms':>8} "
          f"{'weight GB/s':>11} {'compiles in run':>15}")
    for r in results:
        if "error" in r:
            print(f"{r['preset']:<14} {r['weight_dtype']:<9} {r['num_prompts']:>5} ERROR {r['error'][:200]}")
            continue
        print(f"{r['model'].split()[0]:<14} {r['weight_dtype']:<9} {r['prompts']:>5} {r['generated_tok_per_s']:>8} "
              f"{r['decode_tok_per_s']:>12} {r['decode_step_ms']:>8} {r['weight_gb_s_in_decode']:>11} "
              f"{r['new_compilations_in_measured_run']:>15}")
    for r in results:
        if r.get("decode_step_parts_ms"):
            print(f"-- a batch-1 decode step of {r['model'].split()[0]} {r['weight_dtype']}, taken apart (median ms, "
                  f"each part synchronised): " + ", ".join(f"{k} {v}" for k, v in r["decode_step_parts_ms"].items()))
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
