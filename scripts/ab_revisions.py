"""The engine's throughput (or host overhead) at several git revisions, side by side: which
commit made it slower.

    python scripts/ab_revisions.py [--rounds 4] [--workload W] REV [REV ...] [--layers-per-program N]
    python scripts/ab_revisions.py --host [--rounds 4] REV [REV ...]

Each revision (a commit, or `.` for the working tree) is checked out into a temporary git
worktree and runs in a warm process of its own. The processes take turns, the order reversed
every round, so drift on a shared machine hits every revision alike; medians are printed, and
each revision's median ratio to the first one's, round by round. The workloads (--workload):

- mixed (default): `LLM.generate` on bench_throughput's mixed workload (64 prompts of 64-512
  random tokens, 128 new tokens each, greedy, ignore_eos) over the benchmark model
  (_bench_common.BENCH_MODEL, float32), with bench_throughput's engine arguments.
- stream: SmolLM2-135M-Instruct's GGUF with int8 activations (models/named_models.py, fetched
  once), one request at a time as bench_peers runs it: decode tok/s after the first token from
  a 1-token prompt (128 tokens) and from a 300-token prompt (256 tokens), and the TTFT of a
  300-token prompt the prefix cache has not seen, sent right after them.
- batch: the same model, 32 prompts of 64 random tokens decoding together, 128 tokens each:
  output tok/s of the whole `LLM.generate`.
- layer: the native decoder layer alone, each revision's own scripts/bench_decoder_layer.py
  (SmolLM2-135M's 30 layers with random q4_1 weights in one program, one decoding token): us a
  layer at 1, 300 and 1,000 keys, int8 activations, the weights read cold (after 512 MB of other
  reads, as in an engine step). Each revision builds its own kernels (cpu_kernels/native.py keys
  its cache by the sources), so this is the A/B for a kernel change.

The GGUF workloads also say whether every revision's greedy tokens were the same.
`--layers-per-program` adds the working tree once more with that many layers per compiled program.

`--host` compares the host side instead: each round runs every revision's own
scripts/bench_block_manager.py (decode allocate_slots, the whole trace) and
scripts/bench_host_overhead.py --quick (schedule + build + update of 256 decodes, and
engine.step minus the jitted call) in a fresh process from that revision's tree.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from _bench_common import REPO, make_checkpoint, print_table

# Each worker runs inside a revision's worktree: warm up, print "ready", then one timed round
# per line of stdin, printed as a JSON object {figure: value} ("tokens": a digest of the outputs).
MIXED_WORKER = """
import json, os, sys, time
import numpy as np
repo, model_dir, layers_per_program = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
sys.path.insert(0, repo)
from paged_jax import LLM, SamplingParams
rng = np.random.default_rng(0)
prompts = [rng.integers(3, 32000, int(rng.integers(64, 513))).tolist() for _ in range(64)]
extra = {} if layers_per_program is None else {"layers_per_program": layers_per_program}
llm = LLM(model=model_dir, dtype="float32", warm_up="full", block_size=16, max_model_len=2048, max_num_seqs=64,
          max_num_batched_tokens=1024, num_blocks=sum(-(-(len(p) + 128) // 16) for p in prompts) + 1,
          enable_prefix_caching=True, attention_impl="xla", **extra)
params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
# Revisions before LLM.reset_prefix_cache reach the block manager themselves.
reset_prefix_cache = getattr(llm, "reset_prefix_cache", None) or llm.engine.kv_cache_manager.reset_prefix_cache
print("ready", flush=True)
for _ in sys.stdin:
    reset_prefix_cache()
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    print(json.dumps({"mixed workload, tok/s": 64 * 128 / (time.perf_counter() - start)}), flush=True)
"""

GGUF_WORKER = """
import hashlib, json, sys, time
import numpy as np
repo, workload, layers_per_program = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
sys.path.insert(0, repo)
from paged_jax import LLM, SamplingParams
extra = {} if layers_per_program is None else {"layers_per_program": layers_per_program}
llm = LLM("smollm2-135m-instruct", weight_dtype="auto", activation_dtype="int8", max_model_len=1024,
          max_num_seqs=32 if workload == "batch" else 1, max_num_batched_tokens=512, warm_up="full", **extra)
engine = llm.engine
greedy = lambda n: SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)

def stream(num_prompt, max_tokens, offset=100):
    # one request: (decode tok/s after its first token, its tokens, TTFT in ms)
    start = time.perf_counter()
    engine.add_request(f"r{time.monotonic_ns()}", list(range(offset, offset + num_prompt)), greedy(max_tokens))
    first, tokens = None, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if first is None and out.token_ids:
                first = time.perf_counter()
            if out.finished:
                tokens = list(out.token_ids)
    return (len(tokens) - 1) / (time.perf_counter() - first), tokens, 1e3 * (first - start)

rng = np.random.default_rng(0)
prompts = [rng.integers(100, 10000, 64).tolist() for _ in range(32)]
reset_prefix_cache = getattr(llm, "reset_prefix_cache", None) or llm.engine.kv_cache_manager.reset_prefix_cache
stream(1, 8), stream(300, 8)
print("ready", flush=True)
for round_index, _ in enumerate(sys.stdin):
    if workload == "batch":
        reset_prefix_cache()
        start = time.perf_counter()
        outs = llm.generate(prompts, greedy(128), use_tqdm=False)
        figures = {"32 sequences x 128 tokens, output tok/s": 32 * 128 / (time.perf_counter() - start)}
        tokens = [o.outputs[0].token_ids for o in outs]
    else:
        (short, short_tokens, _), (long, long_tokens, _) = stream(1, 128), stream(300, 256)
        # a prompt the prefix cache has not seen (each round's own), right after a decode
        ttft = stream(300, 1, offset=1000 + 300 * round_index)[2]
        figures = {"1-token prompt, 128 tokens, tok/s": short, "300-token prompt, 256 tokens, tok/s": long,
                   "300-token prompt, TTFT ms": ttft}
        tokens = [short_tokens, long_tokens]
    figures["tokens"] = hashlib.sha1(json.dumps([list(map(int, t)) for t in tokens]).encode()).hexdigest()
    print(json.dumps(figures), flush=True)
"""


LAYER_WORKER = """
import inspect, json, sys
import numpy as np
repo = sys.argv[1]
sys.path[:0] = [repo, repo + "/scripts"]
import bench_decoder_layer as bench
layers = bench._stack(np.random.default_rng(0), "q4_1")
evict = np.ones(512 * 2**18, np.float32)
cold = {"evict": evict} if "evict" in inspect.signature(bench.time_stack).parameters else {}
contexts = (1, 300, 1000)
for context in contexts:  # compiled and warm before the rounds
    bench.time_stack(layers, context, "int8", 2, **cold)
print("ready", flush=True)
for _ in sys.stdin:
    print(json.dumps({f"{c} keys, int8, cold, us a layer": 1e6 * bench.time_stack(layers, c, "int8", 30, **cold)
                      / len(layers) for c in contexts}), flush=True)
"""


# (script and arguments, JSON path of the figure, row name) for --host
HOST_FIGURES = [
    (("bench_block_manager.py", "--repeats", "2"), ("decode_allocate_us",), "decode allocate_slots, us"),
    (("bench_block_manager.py", "--repeats", "2"), ("trace_wall_s",), "block-manager trace wall, s"),
    (("bench_host_overhead.py", "--quick"), ("host_path", "total", "median_us"), "schedule + build + update, us"),
    (("bench_host_overhead.py", "--quick"), ("engine_step_minus_jit", "median_us"), "engine.step minus jit, us"),
]


def host_ab(trees, rounds: int, tmp: str) -> int:
    """Each revision's host benchmarks, in fresh processes from its own tree, taking turns."""
    scripts = list(dict.fromkeys(script for script, _, _ in HOST_FIGURES))
    runs = {(name, label): [] for name, _ in trees for _, _, label in HOST_FIGURES}
    for r in range(rounds):
        for name, path in (trees if r % 2 == 0 else trees[::-1]):
            results = {}
            for script in scripts:
                out = os.path.join(tmp, "result.json")
                env = {**os.environ, "PYTHONPATH": path, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
                subprocess.run([sys.executable, os.path.join(path, "scripts", script[0]), *script[1:], "--out", out],
                               cwd=path, env=env, check=True, stdout=subprocess.DEVNULL)
                with open(out) as f:
                    results[script] = json.load(f)
            for script, keys, label in HOST_FIGURES:
                value = results[script]
                for key in keys:
                    value = value[key]
                runs[(name, label)].append(float(value))
        print(f"round {r + 1} done", flush=True)
    print_table(f"host side, {rounds} alternating rounds (medians)", ["figure", *[n for n, _ in trees]],
                [[label, *[f"{statistics.median(runs[(n, label)]):.2f}" for n, _ in trees]]
                 for _, _, label in HOST_FIGURES])
    return 0


def engine_ab(trees, workload: str, model_dir: str, rounds: int) -> dict[str, list[dict]]:
    """Each revision's warm worker, taking turns for `rounds` rounds: {name: [figures of a round]}."""
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    workers = {}
    try:
        for name, path, lpp in trees:  # one warm-up at a time: they would share the cores
            code, arg = {"mixed": (MIXED_WORKER, model_dir), "layer": (LAYER_WORKER, "")}.get(
                workload, (GGUF_WORKER, workload))
            workers[name] = subprocess.Popen([sys.executable, "-c", code, path, arg, json.dumps(lpp)],
                                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
            if workers[name].stdout.readline().strip() != "ready":
                raise RuntimeError(f"{name}: the worker did not start (its stderr says why)")
        runs = {name: [] for name in workers}
        for r in range(rounds):
            for name, worker in (list(workers.items()) if r % 2 == 0 else list(workers.items())[::-1]):
                worker.stdin.write("go\n")
                worker.stdin.flush()
                runs[name].append(json.loads(worker.stdout.readline()))
            print(f"round {r + 1}: " + "; ".join(f"{n} " + " ".join(f"{v:.1f}" for k, v in rs[-1].items()
                                                                   if k != "tokens") for n, rs in runs.items()),
                  flush=True)
        return runs
    finally:
        for worker in workers.values():
            worker.stdin.close()
            worker.wait(60)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("revisions", nargs="+", help="commits to compare; '.' is the working tree")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--workload", choices=("mixed", "stream", "batch", "layer"), default="mixed",
                        help="what each revision runs (the module docstring says what each is)")
    parser.add_argument("--layers-per-program", type=int, default=None)
    parser.add_argument("--host", action="store_true", help="compare the host-side benchmarks instead")
    args = parser.parse_args()
    if args.host:
        with tempfile.TemporaryDirectory(prefix="paged_jax_ab_") as tmp:
            trees = []
            try:
                for rev in args.revisions:
                    if rev == ".":
                        trees.append(("working tree", str(REPO)))
                        continue
                    path = os.path.join(tmp, rev.replace("/", "_"))
                    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "-q", "--detach", path, rev], check=True)
                    trees.append((rev, path))
                return host_ab(trees, args.rounds, tmp)
            finally:
                for _, path in trees:
                    if path != str(REPO):
                        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", path], check=False)
    with tempfile.TemporaryDirectory(prefix="paged_jax_ab_") as tmp:
        model_dir = os.path.join(tmp, "model")
        if args.workload == "mixed":
            make_checkpoint(model_dir, seed=0)
        trees = []  # (name, repo dir, layers_per_program)
        for rev in args.revisions:
            if rev == ".":
                trees.append(("working tree", str(REPO), None))
                continue
            path = os.path.join(tmp, rev.replace("/", "_"))
            subprocess.run(["git", "-C", str(REPO), "worktree", "add", "-q", "--detach", path, rev], check=True)
            trees.append((rev, path, None))
        if args.layers_per_program is not None:
            trees.append((f"working tree, layers_per_program={args.layers_per_program}", str(REPO),
                          args.layers_per_program))
        try:
            runs = engine_ab(trees, args.workload, model_dir, args.rounds)
        finally:
            for name, path, _ in trees:
                if path != str(REPO):
                    subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", path], check=False)
    names = [name for name, _, _ in trees]
    figures = [f for f in runs[names[0]][0] if f != "tokens"]
    rows = []
    for figure in figures:
        base = [r[figure] for r in runs[names[0]]]
        for name in names:
            values = [r[figure] for r in runs[name]]
            ratio = statistics.median(v / b for v, b in zip(values, base))
            rows.append([figure, name, f"{statistics.median(values):.1f}", f"{ratio:.3f}",
                         " ".join(f"{v:.0f}" for v in values)])
    print_table(f"{args.workload}, {args.rounds} alternating rounds", ["figure", "revision", "median",
                                                                       "ratio to the first", "runs"], rows)
    if "tokens" in runs[names[0]][0]:
        digests = {name: [r["tokens"] for r in runs[name]] for name in names}
        if len({d for ds in digests.values() for d in ds}) == 1:
            print("greedy tokens: the same in every revision and round")
        else:  # within a revision they must not move; between revisions, near-ties may flip
            for name, ds in digests.items():
                print(f"greedy tokens of {name}: " + ("the same in every round" if len(set(ds)) == 1 else
                                                      f"DIFFER between rounds ({len(set(ds))} digests)")
                      + f", {ds[0][:12]}")
    return 0

if __name__ == "__main__":
    sys.exit(main())
