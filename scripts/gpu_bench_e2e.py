"""End-to-end row of the GPU check (issue 7): LLM.generate tokens/s on the paged engine.

A Llama-3.2-1B-shaped model with random weights in bf16, 64 prompts of 512 random tokens,
128 new tokens each (greedy, ignore_eos, so every request generates all 128). Buckets
compile lazily: the first generate() pays for compilation and is reported apart; the
second, on the same engine and prompts, is the measured run (the prefix cache is reset
in between, so it does not skip the prefills).

    python scripts/gpu_bench_e2e.py [--dry-run] [--out DIR]

--dry-run: the tiny preset on CPU, 8 prompts of 32 tokens, 8 new tokens, the Pallas kernel in
interpret mode (proves the script runs).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from models.llama import LlamaConfig, LlamaForCausalLM  # noqa: E402
from paged_jax.engine import LLMEngine  # noqa: E402
from paged_jax.engine_config import EngineConfig  # noqa: E402
from paged_jax.core.request import SamplingParams  # noqa: E402
from paged_jax.core.tokenizer import Tokenizer  # noqa: E402

FULL = dict(preset="llama-3.2-1b", num_prompts=64, prompt_len=512, max_tokens=128, max_num_batched_tokens=2048)
TINY = dict(preset="tiny", num_prompts=8, prompt_len=32, max_tokens=8, max_num_batched_tokens=64)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--out", default="results")
    args = parser.parse_args()
    shape = TINY if args.dry_run else FULL

    config = LlamaConfig.from_preset(shape["preset"])
    model = LlamaForCausalLM(config, rngs=nnx.Rngs(0))
    max_model_len = shape["prompt_len"] + shape["max_tokens"]
    blocks_per_seq = -(-max_model_len // 16)
    engine = LLMEngine(
        EngineConfig(model=shape["preset"], block_size=16, num_blocks=shape["num_prompts"] * blocks_per_seq + 1,
                     max_model_len=max_model_len, max_num_seqs=shape["num_prompts"],
                     max_num_batched_tokens=shape["max_num_batched_tokens"], warm_up=False,
                     # The GPU run's kernel; on a CPU dry run, in interpret mode.
                     attention_impl="pallas", interpret=args.dry_run and jax.default_backend() == "cpu"),
        model=model, tokenizer=Tokenizer.from_model("tiny"))  # token-id prompts: the tokenizer only decodes
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, min(config.vocab_size, 32000), shape["prompt_len"]).tolist()
               for _ in range(shape["num_prompts"])]
    params = SamplingParams(max_tokens=shape["max_tokens"], temperature=0.0, ignore_eos=True)

    def run(tag: str) -> float:
        for i, prompt in enumerate(prompts):
            engine.add_request(f"{tag}-{i}", prompt, params)
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        jax.block_until_ready(engine.runner.kv_caches)
        return time.perf_counter() - start

    first_s = run("compile")
    assert engine.reset_prefix_cache(), "blocks still held after every request finished"
    compilations = engine.runner.num_compilations
    measured_s = run("measured")
    generated = shape["num_prompts"] * shape["max_tokens"]
    row = {
        "model": f"{shape['preset']} (random weights, {config.dtype})",
        "backend": jax.default_backend(), "jax": jax.__version__,
        "attention_impl": engine.runner.attention_impl,
        "prompts": shape["num_prompts"], "prompt_len": shape["prompt_len"], "new_tokens": shape["max_tokens"],
        "first_run_s_incl_compile": round(first_s, 3), "compilations": compilations,
        "new_compilations_in_measured_run": engine.runner.num_compilations - compilations,
        "measured_s": round(measured_s, 3), "generated_tok_per_s": round(generated / measured_s, 1),
        "total_tok_per_s": round((generated + shape["num_prompts"] * shape["prompt_len"]) / measured_s, 1),
    }
    width = max(map(len, row))
    print("== end to end: LLM engine ==")
    for key, value in row.items():
        print(f"{key:<{width}}  {value}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_bench_e2e.json"), "w") as f:
        json.dump(row, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
