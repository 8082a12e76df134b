"""Cold and warm start-up: how long `LLM(...)` takes before it can produce a token.

For each model (`tiny` with the CLI's defaults, a SmolLM2-135M-shaped and a
Llama-3.2-1B-shaped random checkpoint, or `smollm2-135m-instruct`, the real GGUF, fetched
once), one fresh process per measurement:
- cold: an empty persistent compilation cache directory;
- warm: the same directory again, as the cold run left it.
Each run reports: `LLM(...)` returned (ready), the first token of an 8-token prompt
(ttft, counted from ready), and every bucket compiled (all buckets, counted from the
start); plus how many buckets compiled in that process.

`--steps` also times the steady-state step side by side (one process, alternating runs):
the runner's step (one compiled layer called per layer) against today's reference, the
whole model unrolled into one jitted program, on a decode batch and a mixed batch.

Targets (issue "Cold start", 2 CPU cores): SmolLM2 ready <= 30 s cold and <= 5 s warm,
tiny <= 10 s cold, steps no more than 5% slower than the unrolled program.

Usage:
  python scripts/bench_startup.py [--models tiny smollm2 llama-1b] [--warm-up background]
                                  [--steps] [--out results/bench_startup.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench_common import REPO, command_line, machine_info, median, print_table, write_json  # noqa: E402

# Shapes of the random checkpoints (HF config names), f32 as in the measurement.
SHAPES = {
    "smollm2": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                    num_kv_heads=3, head_dim=64, tie_word_embeddings=True, dtype="float32"),
    "llama-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
                     num_kv_heads=8, head_dim=64, tie_word_embeddings=True, dtype="bfloat16"),
}
# Engine arguments per model: tiny as the README's main job (the CLI's defaults), the others
# as the issue measured SmolLM2.
ENGINE_ARGS = {
    "tiny": dict(max_num_seqs=64, max_num_batched_tokens=512),
    "smollm2": dict(max_model_len=2048, max_num_seqs=32, max_num_batched_tokens=512, dtype="float32"),
    "llama-1b": dict(max_model_len=2048, max_num_seqs=32, max_num_batched_tokens=512, dtype="bfloat16"),  # the preset's
    "smollm2-135m-instruct": dict(max_model_len=2048, max_num_seqs=32, max_num_batched_tokens=512),
}


def make_checkpoint(name: str, path: str) -> None:
    """A random-weight HF directory of one of SHAPES, with the packaged tokenizer."""
    import shutil

    import jax.numpy as jnp  # noqa: F401  (jax loads in this child only)
    from flax import nnx

    from models.llama import PRESETS, LlamaForCausalLM, save_hf_checkpoint

    shape = dict(SHAPES[name])
    dtype = shape.pop("dtype")
    import dataclasses
    config = dataclasses.replace(PRESETS["tiny"], **shape, dtype=dtype, param_dtype=dtype,
                                 max_position_embeddings=8192)
    save_hf_checkpoint(LlamaForCausalLM(config, rngs=nnx.Rngs(0)), path)
    shutil.copy(REPO / "paged_jax" / "core" / "assets" / "tokenizer.json", os.path.join(path, "tokenizer.json"))


def measure_start(model: str, name: str, cache_dir: str, warm_up: str, layers_per_program: int | None = None) -> dict:
    """One start-up, in this (fresh) process."""
    t0 = time.perf_counter()
    from paged_jax import LLM, SamplingParams

    imported = time.perf_counter()
    llm = LLM(model, compile_cache_dir=cache_dir, warm_up=warm_up, layers_per_program=layers_per_program,
              **ENGINE_ARGS[name])
    ready = time.perf_counter()
    llm.generate([[5, 6, 7, 8, 9, 10, 11, 12]], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    first_token = time.perf_counter()
    compiled_by_first_token = llm.engine.runner.num_compilations
    llm.engine.runner.compiler.wait_warm_up()
    if warm_up == "none":
        llm.engine.runner.warm_up()
    done = time.perf_counter()
    return {"import_s": imported - t0, "ready_s": ready - t0, "ttft_after_ready_s": first_token - ready,
            "all_buckets_s": done - t0, "num_buckets": len(llm.engine.runner.bucket_shapes()),
            "compiled_by_first_token": compiled_by_first_token}


def _step_inputs(runner, q_lens, seq_lens, num_tokens, num_seqs):
    """StepInputs of sequences with the given query and context lengths on disjoint pages."""
    import numpy as np

    from paged_jax.core.step_inputs import ModelInputs, SamplingMetadata, StepAttentionMetadata, StepInputs

    bs, width = runner.cache_config.block_size, runner.cache_config.max_blocks_per_seq
    n = len(q_lens)
    tables = np.zeros((num_seqs, width), np.int32)
    per_seq = max(-(-s // bs) for s in seq_lens)
    assert 1 + n * per_seq <= runner.cache_config.num_blocks, "the pool is too small for this batch"
    for i, s in enumerate(seq_lens):
        tables[i, : -(-s // bs)] = 1 + i * per_seq + np.arange(-(-s // bs))
    qsl = np.zeros(num_seqs + 1, np.int32)
    qsl[1 : n + 1] = np.cumsum(q_lens)
    qsl[n + 1 :] = qsl[n]
    positions, slots = np.zeros(num_tokens, np.int32), np.zeros(num_tokens, np.int32)
    t = 0
    for i, (q, s) in enumerate(zip(q_lens, seq_lens)):
        pos = np.arange(s - q, s)
        positions[t : t + q] = pos
        slots[t : t + q] = tables[i, pos // bs] * bs + pos % bs
        t += q
    lens = np.zeros(num_seqs, np.int32)
    lens[:n] = seq_lens
    rng = np.random.default_rng(0)
    logits_indices = np.zeros(num_seqs, np.int32)
    logits_indices[:n] = qsl[1 : n + 1] - 1
    return StepInputs(
        ModelInputs(token_ids=rng.integers(0, 500, num_tokens).astype(np.int32), positions=positions,
                    logits_indices=logits_indices),
        StepAttentionMetadata(slot_mapping=slots[None], block_tables=tables[None], seq_lens=lens,
                              query_start_loc=qsl, num_seqs=np.array([n], np.int32)),
        SamplingMetadata(temperature=np.zeros(num_seqs, np.float32), top_k=np.full(num_seqs, -1, np.int32),
                         top_p=np.ones(num_seqs, np.float32), rng_keys=np.zeros((num_seqs, 2), np.uint32)))


def measure_steps(reps: int, layers_per_program: int | None = None) -> dict:
    """Runner step vs the unrolled one-program step (today's), alternating, same weights."""
    import dataclasses

    import jax
    import numpy as np
    from flax import nnx

    from models.kv_cache_spec import init_kv_caches
    from models.llama import PRESETS, LlamaForCausalLM
    from paged_jax.core.config import CacheConfig, SchedulerConfig
    from paged_jax.engine_config import EngineConfig, ResolvedConfig
    from paged_jax.runner import ModelRunner
    from paged_jax.sampler import sample

    shape = dict(SHAPES["smollm2"])
    dtype = shape.pop("dtype")
    config = dataclasses.replace(PRESETS["tiny"], **shape, dtype=dtype, param_dtype=dtype)
    model = LlamaForCausalLM(config, rngs=nnx.Rngs(0))
    num_blocks = 1 + 32 * 40  # 32 sequences of up to 640 tokens
    runner = ModelRunner(model, ResolvedConfig(EngineConfig(layers_per_program=layers_per_program),
                                               CacheConfig(16, num_blocks, 2048), SchedulerConfig(32, 512, 2048)))
    graphdef, params = nnx.split(model)
    attention = runner.attention

    def unrolled_step(params, kv_caches, inputs):  # the step as it was: every layer in one program
        logits, kv_caches = nnx.merge(graphdef, params)(inputs.model, kv_caches, inputs.attention.for_group(0),
                                                        attention)
        token_ids, logprobs = sample(logits, inputs.sampling)
        return token_ids, logprobs, kv_caches

    unrolled = jax.jit(unrolled_step, donate_argnums=(1,))
    caches = init_kv_caches(model.kv_cache_specs(), num_blocks, 16)
    batches = {
        "decode 8 x 600 ctx": _step_inputs(runner, [1] * 8, [600] * 8, 16, 8),
        "decode 32 x 600 ctx": _step_inputs(runner, [1] * 32, [600] * 32, 32, 32),
        "mixed 448-prefill + 31 decodes": _step_inputs(runner, [448] + [1] * 31, [448] + [600] * 31, 512, 32),
    }
    rows = {}
    for label, inputs in batches.items():
        ref = runner.execute(inputs)
        out = unrolled(params, caches, inputs)
        caches = out[2]
        assert np.array_equal(ref[0][:inputs.num_seqs], np.asarray(out[0])[:inputs.num_seqs]), "steps disagree"
        times = {"runner": [], "unrolled": []}
        for _ in range(reps):
            t = time.perf_counter()
            runner.execute(inputs)
            times["runner"].append(time.perf_counter() - t)
            t = time.perf_counter()
            out = unrolled(params, caches, inputs)
            caches = out[2]
            np.asarray(out[0])
            times["unrolled"].append(time.perf_counter() - t)
        rows[label] = {k: 1e3 * median(v) for k, v in times.items()}
        rows[label]["ratio"] = rows[label]["runner"] / rows[label]["unrolled"]
        rows[label]["runner_all_ms"] = [round(1e3 * x, 1) for x in times["runner"]]
        rows[label]["unrolled_all_ms"] = [round(1e3 * x, 1) for x in times["unrolled"]]
    return rows


def _child(args) -> None:
    if args.child == "checkpoint":
        make_checkpoint(args.model_name, args.model_path)
        return
    if args.child == "steps":
        result = measure_steps(args.reps, args.layers_per_program)
    else:
        result = measure_start(args.model_path, args.model_name, args.cache_dir, args.warm_up, args.layers_per_program)
    print("RESULT " + json.dumps(result))


def _run_child(*argv) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, __file__, *argv], capture_output=True, text=True, env=env, cwd=REPO)
    if proc.returncode != 0:
        sys.exit(f"child {argv} failed:\n{proc.stderr[-3000:]}")
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    return json.loads(lines[-1][len("RESULT "):]) if lines else {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "smollm2", "llama-1b"],
                        choices=list(ENGINE_ARGS))
    parser.add_argument("--warm-up", default="background", choices=["background", "full", "none"])
    parser.add_argument("--steps", action="store_true", help="also time steps against the unrolled program")
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--layers-per-program", type=int, default=None,
                        help="EngineConfig.layers_per_program for the start-up runs and the steps (default: auto)")
    parser.add_argument("--out", default=str(REPO / "results" / "bench_startup.json"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--model-name", help=argparse.SUPPRESS)
    parser.add_argument("--model-path", help=argparse.SUPPRESS)
    parser.add_argument("--cache-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args)
        return

    layers_flag = [] if args.layers_per_program is None else ["--layers-per-program", str(args.layers_per_program)]
    result = {"machine": machine_info(), "command": command_line(), "warm_up": args.warm_up,
              "layers_per_program": args.layers_per_program, "start": {}}
    rows = []
    with tempfile.TemporaryDirectory(prefix="paged_jax_bench_startup_") as tmp:
        for name in args.models:
            path = name  # tiny and the named GGUF load by name
            if name in SHAPES:
                path = os.path.join(tmp, name)
                _run_child("--child", "checkpoint", "--model-name", name, "--model-path", path)
            cache_dir = os.path.join(tmp, f"xla-{name}")
            for phase in ("cold", "warm"):
                r = _run_child("--child", "start", "--model-name", name, "--model-path", path, "--cache-dir",
                               cache_dir, "--warm-up", args.warm_up, *layers_flag)
                result["start"][f"{name}/{phase}"] = r
                rows.append([name, phase, f"{r['ready_s']:.1f}", f"{r['ttft_after_ready_s']:.2f}",
                             f"{r['all_buckets_s']:.1f}", str(r["num_buckets"]), f"{r['import_s']:.1f}"])
                print(f"{name} {phase}: {r}", flush=True)
    print_table(f"start-up, warm_up={args.warm_up!r} (s; ready = LLM(...) returned)",
                ["model", "cache", "ready", "1st token after ready", "all buckets", "buckets", "of which import"],
                rows)
    if args.steps:
        steps = _run_child("--child", "steps", "--reps", str(args.reps), *layers_flag)
        result["steps"] = steps
        print_table("step time, ms (median, alternating runs; SmolLM2-135M shape, f32)",
                    ["batch", "runner (layer-group programs)", "unrolled program", "ratio"],
                    [[k, f"{v['runner']:.1f}", f"{v['unrolled']:.1f}", f"{v['ratio']:.3f}"] for k, v in steps.items()])
    write_json(args.out, result)


if __name__ == "__main__":
    main()
