"""Offload tiers: recompute vs swap vs int8 host tier vs disk after a restart, one workload.

    python scripts/bench_offload.py [--quick] [--rounds 3] [--model DIR]

Model: the random-init HF Llama of the benchmarks (_bench_common.BENCH_MODEL: 8 layers,
2 KV heads x 64, float32: 8 KiB of KV per token, 128 KiB per block of 16). Engine: block 16,
max_num_seqs 8, max_num_batched_tokens 1024, max_model_len 4096, a pool of --num-blocks
(192: 3072 tokens), so the workload runs out of KV memory.

One round, for each engine in turn (the engine order rotates per round; the content is
fresh per round and the same for every engine within it):
  1. a 2000-token conversation, alone, max_tokens 8 (its first visit);
  2. the flood: wave 1 = 16 requests, one of two shared 400-token system prompts + a
     long-tailed user part (lognormal, median 200, <= 1500 tokens), long-tailed max_tokens
     (lognormal, median 64, <= 400: decodes grow past the pool, so running requests are
     preempted); wave 2 = 6 revisits of wave-1 conversations (their
     prompt + 30 new tokens) + 2 new requests. All of a wave is queued at once;
  3. the revisit: the conversation of step 1 + 16 new tokens, alone, max_tokens 1: its TTFT.
Reported per engine (medians over rounds): wall time of steps 1-2 (the workload), tokens
recomputed after preemptions, preemptions, bytes moved device->host / host->device / to
disk, and the revisit's TTFT with its hit tokens per tier.

Engines:
  recompute   no offload tier (the baseline: vLLM V1's policy)
  recompute+host  preemption by recompute over a host tier of --host-mib: evicted cached
              blocks go down to it, lookups (a resumed victim's too) continue into it
  swap        preemption_mode="swap", host tier --host-mib (float32 pages)
  swap-int8   the same with offload_dtype="int8" (3.8x fewer host bytes per block)
  disk        swap + host tier + a disk tier in a temporary directory (hash_seed fixed)
Then a restart: a new process opens the disk directory and sends each round's conversation
(+ 16 other new tokens), interleaved with fresh 2016-token prompts (its recompute baseline in
the same process): the disk tier's TTFT vs recomputing.

Targets (issue 15): revisit from the host tier <= 0.25x the recompute TTFT; after a restart,
from disk <= 0.5x.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from _bench_common import BENCH_MODEL, bench_model_dir, command_line, machine_info, print_table, write_json

CONVERSATION_LEN = 2000
SYSTEM_LEN = 400
ENGINES = ("recompute", "recompute+host", "swap", "swap-int8", "disk")
VOCAB = BENCH_MODEL["vocab_size"]


def engine_config(args, model_dir, name, disk_dir):
    from paged_jax.engine_config import EngineConfig

    offload = {
        "recompute": {},
        "recompute+host": dict(offload_host_bytes=args.host_mib << 20),
        "swap": dict(preemption_mode="swap", offload_host_bytes=args.host_mib << 20),
        "swap-int8": dict(preemption_mode="swap", offload_host_bytes=args.host_mib << 20, offload_dtype="int8"),
        "disk": dict(preemption_mode="swap", offload_host_bytes=args.host_mib << 20, offload_disk_dir=disk_dir,
                     hash_seed=1234),
    }[name]
    return EngineConfig(model=model_dir, dtype="float32", max_model_len=4096, num_blocks=args.num_blocks,
                        block_size=16, max_num_seqs=8, max_num_batched_tokens=1024, seed=args.seed,
                        warm_up="full", **offload)


def tokens(rng, n):
    return rng.integers(3, VOCAB, int(n)).tolist()


def make_round(rng, quick):
    """(conversation, flood waves, revisit suffix) of one round: lists of (prompt, max_tokens)."""
    systems = [tokens(rng, SYSTEM_LEN) for _ in range(2)]
    num = 8 if quick else 16
    user = np.minimum(rng.lognormal(np.log(200), 1.0, num), 1500).astype(int) + 1
    out = np.minimum(rng.lognormal(np.log(64), 0.8, num), 400).astype(int) + 1
    wave1 = [(systems[i % 2] + tokens(rng, user[i]), int(out[i])) for i in range(num)]
    revisits = rng.choice(num, 3 if quick else 6, replace=False)
    wave2 = [(wave1[i][0] + tokens(rng, 30), 16) for i in revisits]
    wave2 += [(systems[i % 2] + tokens(rng, 200), 24) for i in range(2)]
    return tokens(rng, CONVERSATION_LEN), [wave1, wave2], tokens(rng, 16)


class Runner:
    """Sends requests to one engine and reads its counters."""

    def __init__(self, engine):
        self.engine = engine
        self.next_id = 0

    def run(self, batch):
        from paged_jax.core.request import SamplingParams

        ids = []
        for prompt, max_tokens in batch:
            ids.append(f"q{self.next_id}")
            self.next_id += 1
            self.engine.add_request(ids[-1], prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                    ignore_eos=True))
        done = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[i] for i in ids]

    def counters(self):
        s = self.engine.get_stats()
        keys = ("num_recomputed_tokens", "num_preemptions", "num_swap_fallbacks", "bytes_device_to_host",
                "bytes_host_to_device", "bytes_to_disk", "bytes_from_disk", "device_cache_hits", "host_cache_hits",
                "disk_cache_hits", "prefix_cache_hits")
        return {k: s.get(k, 0) for k in keys}

    def ttft(self, prompt):
        """(TTFT s, hit tokens per tier) of one request sent alone."""
        before = self.counters()
        out = self.run([(prompt, 1)])[0]
        after = self.counters()
        hits = {tier: after[f"{tier}_cache_hits"] - before[f"{tier}_cache_hits"] for tier in ("host", "disk")}
        hits["device"] = after["prefix_cache_hits"] - before["prefix_cache_hits"]
        return out.metrics.time_to_first_token, hits


def measure(args, model_dir) -> dict:
    from paged_jax.engine import LLMEngine

    disk_dir = tempfile.mkdtemp(prefix="paged_jax_bench_offload_")
    engines, first = {}, None
    for name in ENGINES:
        config = engine_config(args, model_dir, name, os.path.join(disk_dir, "kv"))
        engine = LLMEngine(config, model=first.model if first else None, tokenizer=first.tokenizer if first else None)
        first = first or engine
        engines[name] = Runner(engine)
    rng = np.random.default_rng(args.seed)
    per_round = {name: [] for name in ENGINES}
    conversations, revisit_suffixes = [], []
    for r in range(args.rounds):
        conversation, waves, suffix = make_round(rng, args.quick)
        conversations.append(conversation)
        revisit_suffixes.append(suffix)
        order = ENGINES[r % len(ENGINES):] + ENGINES[: r % len(ENGINES)]
        for name in order:
            runner = engines[name]
            before = runner.counters()
            t0 = time.perf_counter()
            first_visit = runner.run([(conversation, 8)])[0]
            for wave in waves:
                runner.run(wave)
            workload_s = time.perf_counter() - t0
            after = runner.counters()
            ttft, hits = runner.ttft(conversation + suffix)
            per_round[name].append({
                "workload_s": workload_s, "revisit_ttft_s": ttft, "revisit_hits": hits,
                "first_visit_ttft_s": first_visit.metrics.time_to_first_token,
                **{k: after[k] - before[k] for k in after},
            })
            print(f"round {r} {name}: workload {workload_s:.2f} s, preemptions "
                  f"{after['num_preemptions'] - before['num_preemptions']}, recomputed "
                  f"{after['num_recomputed_tokens'] - before['num_recomputed_tokens']} tokens, "
                  f"revisit TTFT {1e3 * ttft:.1f} ms, hits {hits}", flush=True)
    compiled = {name: runner.engine.runner.num_compilations for name, runner in engines.items()}
    memory_kind = engines["swap"].engine.runner.pool.page_copy_memory_kind
    disk = engines["disk"].engine.offload.disk
    disk.flush()
    disk.close()
    del engines
    restart = run_restart_child(args, model_dir, os.path.join(disk_dir, "kv"), conversations)
    return {"per_round": per_round, "restart": restart, "compiled_shapes": compiled, "disk_dir": disk_dir,
            "page_copy_memory_kind": memory_kind}


def run_restart_child(args, model_dir, disk_dir, conversations) -> dict:
    """A new process over the same disk directory: TTFT from disk vs recompute, interleaved."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        json.dump({"conversations": conversations}, fh)
        spec = fh.name
    cmd = [sys.executable, os.path.abspath(__file__), "--restart-child", spec, "--disk-dir", disk_dir,
           "--model", model_dir, "--num-blocks", str(args.num_blocks), "--host-mib", str(args.host_mib),
           "--seed", str(args.seed)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"restart child failed:\n{proc.stderr[-4000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["child_wall_s"] = time.perf_counter() - t0
    return result


def restart_child(args) -> int:
    from paged_jax.engine import LLMEngine

    with open(args.restart_child) as fh:
        conversations = json.load(fh)["conversations"]
    t0 = time.perf_counter()
    runner = Runner(LLMEngine(engine_config(args, args.model, "disk", args.disk_dir)))
    ready_s = time.perf_counter() - t0
    rng = np.random.default_rng(args.seed + 1)
    disk, recompute, hits = [], [], []
    for conversation in conversations:
        t, h = runner.ttft(conversation + tokens(rng, 16))
        disk.append(t)
        hits.append(h)
        t, h = runner.ttft(tokens(rng, CONVERSATION_LEN + 16))
        assert h["disk"] == h["host"] == 0, f"a fresh prompt hit a tier: {h}"
        recompute.append(t)
    print(json.dumps({"disk_ttft_s": disk, "recompute_ttft_s": recompute, "hits": hits, "ready_s": ready_s}))
    return 0


def report(args, result) -> None:
    med = lambda xs: statistics.median(xs)  # noqa: E731
    rows, summary = [], {}
    base = med([r["revisit_ttft_s"] for r in result["per_round"]["recompute"]])
    for name in ENGINES:
        runs = result["per_round"][name]
        m = {k: med([r[k] for r in runs]) for k in runs[0] if k != "revisit_hits"}
        hits = runs[-1]["revisit_hits"]
        summary[name] = {**m, "revisit_over_recompute": m["revisit_ttft_s"] / base, "revisit_hits_last": hits}
        moved = (m["bytes_device_to_host"] + m["bytes_host_to_device"]) / 2**20
        rows.append([name, f"{m['workload_s']:.2f} s", int(m["num_recomputed_tokens"]), int(m["num_preemptions"]),
                     int(m["num_swap_fallbacks"]), f"{moved:.1f} MiB", f"{m['bytes_to_disk'] / 2**20:.1f} MiB",
                     f"{1e3 * m['revisit_ttft_s']:.1f} ms", f"{m['revisit_ttft_s'] / base:.3f}x",
                     f"{hits['device']}/{hits['host']}/{hits['disk']}"])
    restart = result["restart"]
    disk_s, rec_s = med(restart["disk_ttft_s"]), med(restart["recompute_ttft_s"])
    rows.append(["disk after restart", "", "", "", "", "", "", f"{1e3 * disk_s:.1f} ms",
                 f"{disk_s / rec_s:.3f}x (vs {1e3 * rec_s:.1f} ms)",
                 "/".join(str(restart["hits"][-1][t]) for t in ("device", "host", "disk"))])
    print_table(f"Offload, {args.rounds} rounds (medians): workload = 2000-token conversation + "
                f"{'8+5' if args.quick else '16+8'} requests; revisit = that conversation + 16 tokens",
                ["engine", "workload", "recomputed tok", "preempt", "swap->recompute", "dev<->host",
                 "to disk", "revisit TTFT", "vs recompute", "hits dev/host/disk"], rows)
    summary["disk_after_restart"] = {"ttft_s": disk_s, "recompute_ttft_s": rec_s, "ratio": disk_s / rec_s,
                                     "ready_s": restart["ready_s"]}
    host = summary["swap"]["revisit_over_recompute"]
    both = summary["recompute+host"]["revisit_over_recompute"]
    print(f"host tier revisit: {host:.3f}x recompute (swap), {both:.3f}x "
          f"(recompute+host) (target <= 0.25x: {'met' if host <= 0.25 else 'MISSED'}); "
          f"disk after restart: {disk_s / rec_s:.3f}x (target <= 0.5x: {'met' if disk_s / rec_s <= 0.5 else 'MISSED'})")
    write_json(args.out, {
        "summary": summary, **result,
        "config": {"model": BENCH_MODEL, "num_blocks": args.num_blocks, "host_mib": args.host_mib,
                   "rounds": args.rounds, "quick": args.quick, "block_size": 16, "max_num_seqs": 8,
                   "max_num_batched_tokens": 1024, "dtype": "float32"},
        "targets": {"host_revisit_over_recompute": 0.25, "disk_restart_over_recompute": 0.5},
        "machine": machine_info(), "command": command_line(),
    })


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller waves, 2 rounds")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--model", default=None, help="HF Llama directory (default: make the benchmark model)")
    parser.add_argument("--num-blocks", type=int, default=192)
    parser.add_argument("--host-mib", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="default: results/bench_offload[_quick].json")
    parser.add_argument("--restart-child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--disk-dir", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.restart_child:
        return restart_child(args)
    args.rounds = args.rounds or (2 if args.quick else 3)
    args.out = args.out or f"results/bench_offload{'_quick' if args.quick else ''}.json"
    with bench_model_dir(args.model, seed=args.seed) as model_dir:
        report(args, measure(args, model_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
