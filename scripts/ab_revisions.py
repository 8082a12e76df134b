"""The engine's throughput (or host overhead) at several git revisions, side by side: which
commit made it slower.

    python scripts/ab_revisions.py [--rounds 4] REV [REV ...] [--layers-per-program N]
    python scripts/ab_revisions.py --host [--rounds 4] REV [REV ...]

Each revision (a commit, or `.` for the working tree) is checked out into a temporary git
worktree and runs in a warm process of its own: `LLM.generate` on bench_throughput's mixed
workload (64 prompts of 64-512 random tokens, 128 new tokens each, greedy, ignore_eos) over
the benchmark model (_bench_common.BENCH_MODEL, float32), with bench_throughput's engine
arguments. The processes take turns, the order reversed every round, so drift on a shared
machine hits every revision alike; medians are printed. `--layers-per-program` adds the
working tree once more with that many layers per compiled program.

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

# Runs inside each revision's worktree: warm up, then one timed generate per line of stdin.
WORKER = """
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
    print(64 * 128 / (time.perf_counter() - start), flush=True)
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("revisions", nargs="+", help="commits to compare; '.' is the working tree")
    parser.add_argument("--rounds", type=int, default=4)
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
        env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
        workers = {}
        try:
            for name, path, lpp in trees:  # one warm-up at a time: they would share the cores
                workers[name] = subprocess.Popen([sys.executable, "-c", WORKER, path, model_dir, json.dumps(lpp)],
                                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
                assert workers[name].stdout.readline().strip() == "ready", f"{name} did not start"
            runs = {name: [] for name in workers}
            for r in range(args.rounds):
                for name, worker in (list(workers.items()) if r % 2 == 0 else list(workers.items())[::-1]):
                    worker.stdin.write("go\n")
                    worker.stdin.flush()
                    runs[name].append(float(worker.stdout.readline()))
                print(f"round {r + 1}: " + ", ".join(f"{n} {v[-1]:.1f}" for n, v in runs.items()), flush=True)
        finally:
            for worker in workers.values():
                worker.stdin.close()
                worker.wait(60)
            for name, path, _ in trees:
                if path != str(REPO):
                    subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", path], check=False)
    print_table(f"mixed workload, LLM.generate tok/s, {args.rounds} alternating rounds",
                ["revision", "median", "runs"],
                [[n, f"{statistics.median(v):.1f}", " ".join(f"{x:.0f}" for x in v)] for n, v in runs.items()])
    return 0


if __name__ == "__main__":
    sys.exit(main())
