"""Prefill/decode disaggregation measured: what long prompts do to short requests' latency
on one engine and on a producer + consumer pair, and the rate KV pages move between them.

Part 1, latency (servers in subprocesses on 127.0.0.1, side by side in one run):
- one: one `serve` pinned to both cores (taskset 0,1);
- disagg: `serve --kv-role producer` pinned to core 0, `serve --kv-role consumer` pinned
  to core 1, and `python -m paged_jax proxy` in front (its process unpinned).
The same workload runs against each: --streams clients each sending short, decode-heavy
streamed requests back to back (a --short-prompt-token prompt, --short-output tokens),
while one more client sends a long prompt (--long-prompt tokens, 8 output tokens) every
--long-every seconds, for --seconds. Reported for the short requests: TTFT and
inter-token latency (gaps between streamed chunks, spread over the tokens a chunk carries),
median and p99, and their output tok/s; for the long ones, TTFT median.

Part 2, transfer rate (in this process): N blocks of the model's pool pulled by a consumer
engine from a producer engine (side channel + jax.experimental.transfer over loopback),
against the same pages gathered and put back locally (KVPool.gather_pages / put_pages: the
offload tiers' copy). MB/s of page bytes, median of --reps.

Usage:
  python scripts/bench_disagg.py [--model smollm2-135m-instruct] [--seconds 60] [--streams 4]
                                 [--quick] [--skip-latency] [--out results/bench_disagg.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench_common import REPO, command_line, machine_info, median, print_table, write_json  # noqa: E402

ENGINE_FLAGS = ["--max-model-len", "2048", "--max-num-seqs", "16", "--max-num-batched-tokens", "512",
                "--hash-seed", "5", "--reserved-cpus", "0"]
START_TIMEOUT = 900.0
VOCAB = {"tiny": 500}  # random prompt ids stay below this (default 20000)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, timeout: float = 5.0) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status
    except OSError:
        return None


class Process:
    """A subprocess pinned to `cpus` (taskset), its output in a log file."""

    def __init__(self, argv: list[str], cpus: str | None, log: str):
        self.log = open(log, "w")
        prefix = ["taskset", "-c", cpus] if cpus else []
        env = os.environ | {"JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
        self.process = subprocess.Popen(prefix + argv, stdout=self.log, stderr=subprocess.STDOUT, cwd=REPO, env=env)
        self.log_path = log

    def wait_ready(self, url: str) -> None:
        deadline = time.time() + START_TIMEOUT
        while get(url) != 200:
            if self.process.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"{self.process.args} did not start; see {self.log_path}")
            time.sleep(0.5)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(30)
        self.log.close()


def serve(model: str, cpus: str, log: str, *extra: str) -> tuple[Process, str]:
    port = free_port()
    argv = [sys.executable, "-m", "paged_jax", "serve", "--model", model, "--host", "127.0.0.1", "--port", str(port),
            *ENGINE_FLAGS, "--warm-up", "full", *extra]
    process = Process(argv, cpus, log)
    url = f"http://127.0.0.1:{port}"
    process.wait_ready(f"{url}/health")
    return process, url


async def one_request(client, url: str, model: str, prompt: list[int], max_tokens: int) -> dict:
    """A streamed greedy completion: TTFT, chunk arrival times and token counts."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    start = time.perf_counter()
    arrivals = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                n = sum(len(c.get("token_ids") or ()) for c in event.get("choices", ()))
                if n:
                    arrivals.append((time.perf_counter(), n))
    ttft = arrivals[0][0] - start
    gaps = []
    for (t0, _), (t1, n) in zip(arrivals, arrivals[1:]):
        gaps += [(t1 - t0) / n] * n
    return {"ttft": ttft, "gaps": gaps, "tokens": sum(n for _, n in arrivals), "end": arrivals[-1][0]}


async def workload(url: str, model: str, args) -> dict:
    import httpx2

    rng = np.random.default_rng(0)
    short, long_ = [], []
    stop_at = time.perf_counter() + args.seconds

    async def short_client(i: int):
        while time.perf_counter() < stop_at:
            prompt = rng.integers(100, VOCAB.get(model, 20000), args.short_prompt).tolist()
            short.append(await one_request(client, url, model, prompt, args.short_output))

    async def long_client():
        while time.perf_counter() < stop_at:
            prompt = rng.integers(100, VOCAB.get(model, 20000), args.long_prompt).tolist()
            long_.append(await one_request(client, url, model, prompt, 8))
            await asyncio.sleep(args.long_every)

    timeout = httpx2.Timeout(600.0)
    async with httpx2.AsyncClient(timeout=timeout, limits=httpx2.Limits(max_connections=None)) as client:
        # one warm request first (compiles nothing with --warm-up full; fills caches of the HTTP side)
        await one_request(client, url, model, rng.integers(100, VOCAB.get(model, 20000), 16).tolist(), 4)
        start = time.perf_counter()
        await asyncio.gather(*(short_client(i) for i in range(args.streams)), long_client())
        elapsed = time.perf_counter() - start
    gaps = [g for r in short for g in r["gaps"]]
    return {
        "short_requests": len(short), "long_requests": len(long_),
        "short_ttft_p50_ms": 1e3 * float(np.median([r["ttft"] for r in short])),
        "short_ttft_p99_ms": 1e3 * float(np.percentile([r["ttft"] for r in short], 99)),
        "short_itl_p50_ms": 1e3 * float(np.median(gaps)),
        "short_itl_p99_ms": 1e3 * float(np.percentile(gaps, 99)),
        "short_tok_s": sum(r["tokens"] for r in short) / elapsed,
        "long_ttft_p50_ms": 1e3 * float(np.median([r["ttft"] for r in long_])) if long_ else None,
    }


def latency(args) -> dict:
    logs = os.path.join(REPO, "results", "logs")
    os.makedirs(logs, exist_ok=True)
    results = {}
    # one engine on both cores
    one, url = serve(args.model, "0,1", os.path.join(logs, "disagg_one.log"))
    try:
        results["one engine (cores 0,1)"] = asyncio.run(workload(url, args.model, args))
    finally:
        one.stop()
    # producer on core 0, consumer on core 1, the proxy in front
    kv_port = free_port()
    producer, producer_url = serve(args.model, "0", os.path.join(logs, "disagg_producer.log"), "--kv-role",
                                   "producer", "--kv-port", str(kv_port))
    consumer = proxy = None
    try:
        consumer, consumer_url = serve(args.model, "1", os.path.join(logs, "disagg_consumer.log"), "--kv-role",
                                       "consumer", "--kv-peers", f"127.0.0.1:{kv_port}")
        port = free_port()
        proxy = Process([sys.executable, "-m", "paged_jax", "proxy", "--host", "127.0.0.1", "--port", str(port),
                         "--prefill", producer_url, "--decode", consumer_url], None,
                        os.path.join(logs, "disagg_proxy.log"))
        proxy_url = f"http://127.0.0.1:{port}"
        proxy.wait_ready(f"{proxy_url}/proxy/stats")
        results["producer (core 0) + consumer (core 1)"] = asyncio.run(workload(proxy_url, args.model, args))
        with urllib.request.urlopen(f"{proxy_url}/proxy/stats") as response:
            results["proxy_stats"] = json.load(response)
    finally:
        for process in (proxy, consumer, producer):
            if process is not None:
                process.stop()
    return results


def transfer_rate(args) -> dict:
    """MB/s of a pull between two engines in this process vs a local gather + put."""
    from models.registry import load_model, load_tokenizer
    from paged_jax.core.request import SamplingParams
    from paged_jax.engine import LLMEngine
    from paged_jax.engine_config import EngineConfig

    model, tokenizer = load_model(args.model), load_tokenizer(args.model)
    config = dict(model=args.model, max_model_len=2048, max_num_seqs=4, max_num_batched_tokens=512, hash_seed=5,
                  warm_up="none", num_blocks=args.blocks + 8)
    producer = LLMEngine(EngineConfig(**config, kv_role="producer"), model=model, tokenizer=tokenizer)
    consumer = LLMEngine(EngineConfig(**config, kv_role="consumer"), model=model, tokenizer=tokenizer)
    bs = producer.cache_config.block_size
    page_bytes = producer.kv_worker._page_bytes
    rows = []

    def finish(engine, request_id, prompt, params):
        engine.add_request(request_id, prompt, params)
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    return output

    pulls, local = [], []
    rng = np.random.default_rng(1)
    for rep in range(args.reps + 1):  # the first compiles the page programs
        prompt = rng.integers(100, VOCAB.get(args.model, 20000), args.blocks * bs + 1).tolist()
        offered = finish(producer, f"p{rep}", prompt, SamplingParams(max_tokens=1, kv_transfer_params={
            "do_remote_decode": True}))
        before = consumer.get_stats()["kv_transfer_pull_seconds"]
        finish(consumer, f"c{rep}", prompt, SamplingParams(max_tokens=1, kv_transfer_params=offered.kv_transfer_params))
        seconds = consumer.get_stats()["kv_transfer_pull_seconds"] - before
        ids = np.arange(1, args.blocks + 1, dtype=np.int32)
        start = time.perf_counter()
        pages = producer.runner.pool.gather_pages(ids)
        consumer.runner.pool.put_pages(ids, pages)
        import jax

        jax.block_until_ready(consumer.runner.pool.kv_caches)
        local_seconds = time.perf_counter() - start
        if rep:
            pulls.append(seconds)
            local.append(local_seconds)
    nbytes = args.blocks * page_bytes
    for name, times in (("pull (side channel + jax transfer)", pulls), ("local gather_pages + put_pages", local)):
        rows.append({"path": name, "blocks": args.blocks, "MB": nbytes / 1e6, "median_s": median(times),
                     "MB_per_s": nbytes / 1e6 / median(times)})
    producer.shutdown()
    consumer.shutdown()
    return {"rows": rows, "page_bytes": page_bytes}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--short-prompt", type=int, default=32)
    parser.add_argument("--short-output", type=int, default=64)
    parser.add_argument("--long-prompt", type=int, default=1024)
    parser.add_argument("--long-every", type=float, default=3.0)
    parser.add_argument("--blocks", type=int, default=64, help="blocks pulled in the transfer-rate part")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="tiny model, 20 s, fewer blocks")
    parser.add_argument("--skip-latency", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.model, args.seconds, args.blocks, args.reps = "tiny", 20, 32, 3
    result = {"machine": machine_info(), "command": command_line(), "model": args.model,
              "workload": {k: getattr(args, k) for k in ("seconds", "streams", "short_prompt", "short_output",
                                                         "long_prompt", "long_every")}}
    if not args.skip_latency:
        result["latency"] = latency(args)
        columns = ["setup", "short TTFT p50 ms", "p99", "short ITL p50 ms", "p99", "short tok/s", "long TTFT p50 ms",
                   "short / long done"]
        rows = [[name, f"{r['short_ttft_p50_ms']:.0f}", f"{r['short_ttft_p99_ms']:.0f}", f"{r['short_itl_p50_ms']:.1f}",
                 f"{r['short_itl_p99_ms']:.1f}", f"{r['short_tok_s']:.1f}",
                 "-" if r["long_ttft_p50_ms"] is None else f"{r['long_ttft_p50_ms']:.0f}",
                 f"{r['short_requests']} / {r['long_requests']}"]
                for name, r in result["latency"].items() if name != "proxy_stats"]
        print_table(f"{args.model}: short streams while long prompts arrive ({args.seconds:.0f} s each)", columns, rows)
    result["transfer"] = transfer_rate(args)
    print_table(f"{args.model}: KV pages between engines ({result['transfer']['page_bytes']} bytes a block)",
                ["path", "blocks", "MB", "median s", "MB/s"],
                [[r["path"], r["blocks"], f"{r['MB']:.1f}", f"{r['median_s']:.4f}", f"{r['MB_per_s']:.0f}"]
                 for r in result["transfer"]["rows"]])
    out = args.out or os.path.join(REPO, "results", f"bench_disagg{'_quick' if args.quick else ''}.json")
    write_json(out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
