"""End to end: generated tokens/s of paged-jax vs HF transformers on the same weights and prompts.

    python scripts/bench_throughput.py [--quick] [--runs 3] [--workloads mixed,shared,varied] [--no-compute]

Model: a random-init HF LlamaForCausalLM (_bench_common.BENCH_MODEL: 8 layers, hidden 512,
intermediate 1408, 8 query / 2 KV heads, vocab 32000, untied head, float32) saved with
save_pretrained; paged-jax loads it with LLMEngine(model=DIR, dtype="float32").

Each engine lives in its own worker process (so its peak RSS is its own, reset before each
run through /proc/self/clear_refs) and both stay up for the whole run; the parent sends the
same token-id prompts to one, then the other, alternating which goes first, `runs` times
per workload, and reports medians. Both are greedy and count only generated tokens.

  mixed   64 prompts of 64-512 random tokens, 128 new tokens each.    target >= 1.5x HF
  shared  the same prompts behind one 1024-token system prompt.       target >= 3x HF
  varied  the same prompts, max_tokens spread evenly over 8..512.     target >= 2x HF

HF: model.generate on one left-padded batch of all 64 prompts (--hf-batch-size to split it),
its default (dynamic) cache, max_new_tokens = the batch's largest max_tokens,
do_sample=False, EOS disabled (paged-jax runs with ignore_eos), torch.set_num_threads(cores);
each row counts only its own max_tokens. paged-jax: LLM.generate with the engine below;
the prefix cache is reset before each run so runs do not feed each other; compilation
happens in warm-up, timed apart, and a counter proves the timed runs compile nothing.
The paged-jax worker also runs bench_compute's measurement (matmul rate, prefill/decode FLOP/s).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from _bench_common import (BENCH_MODEL, command_line, machine_info, make_checkpoint, median, peak_rss_mib,
                           print_table, reset_peak_rss, rss_mib, write_json)

TARGETS = {"mixed": 1.5, "shared": 3.0, "varied": 2.0}
BLOCK_SIZE = 16


def make_workloads(quick: bool, seed: int) -> dict[str, dict]:
    rng = np.random.default_rng(seed)
    n = 16 if quick else 64
    vocab = BENCH_MODEL["vocab_size"]
    prompts = [rng.integers(3, vocab, int(rng.integers(64, 513))).tolist() for _ in range(n)]
    system = rng.integers(3, vocab, 1024).tolist()
    new_tokens = 32 if quick else 128
    varied = np.linspace(8, 64 if quick else 512, n).round().astype(int)
    rng.shuffle(varied)
    return {
        "mixed": {"prompts": prompts, "max_tokens": [new_tokens] * n},
        "shared": {"prompts": [system + p for p in prompts], "max_tokens": [new_tokens] * n, "system_len": 1024},
        "varied": {"prompts": prompts, "max_tokens": varied.tolist()},
    }


def blocks_needed(w: dict) -> int:
    """Blocks for every request at once with no preemption; a shared system prompt counts once."""
    shared = w.get("system_len", 0) // BLOCK_SIZE
    per = [-(-(len(p) + m) // BLOCK_SIZE) - shared for p, m in zip(w["prompts"], w["max_tokens"])]
    return sum(per) + shared


# ---------------------------------------------------------------- workers
def _serve(handle) -> None:
    """Worker loop: one JSON command per stdin line, one JSON reply per line on the real stdout.
    Everything libraries print goes to stderr, so it cannot corrupt the replies."""
    reply = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "quit":
            break
        reply.write(json.dumps(handle(cmd)) + "\n")
        reply.flush()


def hf_worker(model_dir: str) -> None:
    import torch
    from transformers import LlamaForCausalLM

    torch.set_num_threads(os.cpu_count())
    t0 = time.perf_counter()
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # like ignore_eos: every row runs to max_new_tokens
    model.generation_config.pad_token_id = 0
    load_s = time.perf_counter() - t0

    def run(prompts, max_tokens, batch_size):
        outputs, generated = [], 0
        for start in range(0, len(prompts), batch_size):
            batch, wants = prompts[start:start + batch_size], max_tokens[start:start + batch_size]
            width = max(map(len, batch))
            ids = torch.zeros((len(batch), width), dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for i, p in enumerate(batch):  # left padding: every row's last prompt token is aligned
                ids[i, width - len(p):] = torch.tensor(p)
                mask[i, width - len(p):] = 1
            with torch.inference_mode():
                out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(wants), do_sample=False)
            for row, want in zip(out[:, width:].tolist(), wants):
                outputs.append(row[:want])  # tokens past a row's max_tokens are waste, not output
                generated += len(row[:want])
        return outputs, generated

    def handle(cmd):
        if cmd["cmd"] == "info":
            return {"load_s": load_s, "rss_mib": rss_mib(), "threads": torch.get_num_threads()}
        reset_peak_rss()
        t0 = time.perf_counter()
        outputs, generated = run(cmd["prompts"], cmd["max_tokens"], cmd["hf_batch_size"])
        elapsed = time.perf_counter() - t0
        return {"elapsed_s": elapsed, "generated": generated, "peak_rss_mib": peak_rss_mib(),
                "tokens": outputs if cmd["return_tokens"] else None}

    _serve(handle)


def jax_worker(model_dir: str, engine_args: dict, quick: bool) -> None:
    from bench_compute import measure_compute

    from paged_jax import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=model_dir, dtype="float32", warm_up="full", **engine_args)
    load_and_warm_up_s = time.perf_counter() - t0
    engine = llm.engine
    compiled = engine.runner.num_compilations

    def handle(cmd):
        if cmd["cmd"] == "info":
            return {"load_and_warm_up_s": load_and_warm_up_s, "rss_mib": rss_mib(), "compiled_shapes": compiled,
                    "num_blocks": engine.runner.pool.num_blocks, "kv_cache_bytes": engine.runner.pool.kv_cache_bytes,
                    "attention_impl": engine.runner.attention_impl}
        if cmd["cmd"] == "compute":
            return measure_compute(engine, quick=quick)
        assert engine.reset_prefix_cache(), "requests still hold blocks between runs"
        before = engine.get_stats()
        params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in cmd["max_tokens"]]
        reset_peak_rss()
        t0 = time.perf_counter()
        outputs = llm.generate(cmd["prompts"], params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        after = engine.get_stats()
        assert after["num_compilations"] == compiled, "a timed run compiled a new shape"
        queries = after["prefix_cache_queries"] - before["prefix_cache_queries"]
        return {"elapsed_s": elapsed, "generated": sum(len(o.token_ids) for o in outputs),
                "peak_rss_mib": peak_rss_mib(), "steps": after["num_steps"] - before["num_steps"],
                "preemptions": after["num_preemptions"] - before["num_preemptions"],
                "prefix_hit_rate": (after["prefix_cache_hits"] - before["prefix_cache_hits"]) / max(queries, 1),
                "peak_kv_cache_usage": after["peak_kv_cache_usage"],
                "tokens": [o.token_ids for o in outputs] if cmd["return_tokens"] else None}

    _serve(handle)


class Worker:
    def __init__(self, argv: list[str], log_path: str):
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), *argv], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True)

    def call(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            self.log.flush()
            with open(self.log.name) as fh:
                sys.exit(f"worker {self.proc.args[2:4]} died; last log lines:\n" + "".join(fh.readlines()[-30:]))
        return json.loads(line)

    def close(self):
        self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
        self.proc.stdin.close()
        self.proc.wait(timeout=60)
        self.log.close()


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """How often greedy outputs of the two engines agree (float32, different kernels: near-ties
    can flip an argmax, after which a sequence diverges)."""
    same = sum(x == y for x, y in zip(a, b))
    prefix = []
    for x, y in zip(a, b):
        k = next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))
        prefix.append(k / max(len(x), 1))
    return {"identical_requests": same / len(a), "mean_common_prefix": float(np.mean(prefix))}


def main(argv=None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--worker":
        kind, model_dir = sys.argv[2], sys.argv[3]
        if kind == "hf":
            hf_worker(model_dir)
        else:
            jax_worker(model_dir, json.loads(sys.argv[4]), sys.argv[5] == "quick")
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="16 prompts, short outputs, 1 run")
    parser.add_argument("--runs", type=int, default=None, help="runs per engine and workload (default 3; quick 1)")
    parser.add_argument("--workloads", default="mixed,shared,varied")
    parser.add_argument("--no-compute", action="store_true", help="skip the compute-efficiency section")
    parser.add_argument("--hf-batch-size", type=int, default=None, help="default: the whole workload in one batch")
    parser.add_argument("--max-num-batched-tokens", type=int, default=1024)
    parser.add_argument("--model", default=None, help="HF Llama directory (default: make the benchmark model)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="default: results/bench_throughput[_quick].json")
    args = parser.parse_args(argv)
    args.out = args.out or f"results/bench_throughput{'_quick' if args.quick else ''}.json"
    runs = args.runs or (1 if args.quick else 3)
    workloads = make_workloads(args.quick, args.seed)
    names = [w for w in args.workloads.split(",") if w]
    n = len(workloads["mixed"]["prompts"])
    hf_batch = args.hf_batch_size or n

    t_start = time.perf_counter()
    tmp = tempfile.TemporaryDirectory(prefix="paged_jax_bench_")
    model_dir = args.model or os.path.join(tmp.name, "model")
    if args.model is None:
        make_checkpoint(model_dir, seed=args.seed)
    # One engine for every workload: compiled once, sized so no workload preempts.
    engine_args = {"block_size": BLOCK_SIZE, "max_model_len": 2048, "max_num_seqs": min(64, n),
                   "max_num_batched_tokens": args.max_num_batched_tokens,
                   "num_blocks": max(blocks_needed(w) for w in workloads.values()) + 1,
                   "enable_prefix_caching": True, "attention_impl": "xla"}
    hf = Worker(["--worker", "hf", model_dir], os.path.join(tmp.name, "hf.log"))
    pj = Worker(["--worker", "jax", model_dir, json.dumps(engine_args), "quick" if args.quick else "full"],
                os.path.join(tmp.name, "jax.log"))
    info = {"hf": hf.call(cmd="info"), "paged_jax": pj.call(cmd="info")}
    print(f"paged-jax load + warm-up {info['paged_jax']['load_and_warm_up_s']:.0f} s "
          f"({info['paged_jax']['compiled_shapes']} shapes); HF load {info['hf']['load_s']:.1f} s", flush=True)

    def save(compute, complete: bool) -> dict:
        result = {
            "workloads": results, "compute": compute, "startup": info, "paged_jax_engine": engine_args,
            "hf": {"batch_size": hf_batch, "cache": "DynamicCache (default)", "attention": "sdpa (default)",
                   "threads": info["hf"]["threads"]},
            "model": BENCH_MODEL, "runs": runs, "quick": args.quick, "complete": complete,
            "wall_s": time.perf_counter() - t_start, "machine": machine_info(),
            "command": command_line(),
        }
        write_json(args.out, result)
        return result

    results = {}
    for name in names:
        w = workloads[name]
        per = {"hf": [], "paged_jax": []}
        tokens = {}
        for r in range(runs):
            order = [("hf", hf), ("paged_jax", pj)] if r % 2 == 0 else [("paged_jax", pj), ("hf", hf)]
            for engine, worker in order:
                res = worker.call(cmd="run", prompts=w["prompts"], max_tokens=w["max_tokens"],
                                  hf_batch_size=hf_batch, return_tokens=r == 0)
                if r == 0:
                    tokens[engine] = res.pop("tokens")
                res.pop("tokens", None)
                res["tokens_per_s"] = res["generated"] / res["elapsed_s"]
                per[engine].append(res)
                print(f"{name} run {r} {engine}: {res['generated']} tokens in {res['elapsed_s']:.1f} s "
                      f"({res['tokens_per_s']:.0f} tok/s, peak RSS {res['peak_rss_mib']:.0f} MiB)", flush=True)
        assert per["hf"][0]["generated"] == per["paged_jax"][0]["generated"] == sum(w["max_tokens"]), \
            "the engines generated different token counts"
        tps = {e: median([x["tokens_per_s"] for x in per[e]]) for e in per}
        results[name] = {
            "tokens_per_s": tps, "speedup": tps["paged_jax"] / tps["hf"], "target": TARGETS[name],
            "elapsed_s": {e: median([x["elapsed_s"] for x in per[e]]) for e in per},
            "peak_rss_mib": {e: max(x["peak_rss_mib"] for x in per[e]) for e in per},
            "generated_tokens": per["hf"][0]["generated"],
            "prompt_tokens": sum(map(len, w["prompts"])),
            "agreement": agreement(tokens["hf"], tokens["paged_jax"]), "runs": per,
        }
        save(None, complete=False)  # a crash later still leaves the finished workloads on disk
    compute = None if args.no_compute else pj.call(cmd="compute")
    hf.close()
    pj.close()
    tmp.cleanup()
    result = save(compute, complete=True)
    rows = []
    for name, r in results.items():
        rows.append([name, r["generated_tokens"], f"{r['tokens_per_s']['hf']:.0f}", f"{r['tokens_per_s']['paged_jax']:.0f}",
                     f"{r['speedup']:.2f}x", f">= {r['target']}x", f"{r['peak_rss_mib']['hf']:.0f}",
                     f"{r['peak_rss_mib']['paged_jax']:.0f}", f"{100 * r['agreement']['mean_common_prefix']:.0f}%"])
    print_table(f"generated tokens/s, median of {runs} alternating runs (float32, {machine_info()['cores']} cores); "
                f"paged-jax warm-up {info['paged_jax']['load_and_warm_up_s']:.0f} s excluded",
                ["workload", "tokens", "HF tok/s", "paged-jax tok/s", "speedup", "target", "HF peak RSS MiB",
                 "paged-jax peak RSS MiB", "greedy agreement"], rows)
    if compute is not None:
        from bench_compute import COMPUTE_COLUMNS, compute_rows

        print_table("compute efficiency (paged-jax worker, same run)", COMPUTE_COLUMNS, compute_rows(compute))
    print(f"wrote {args.out} ({result['wall_s'] / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
