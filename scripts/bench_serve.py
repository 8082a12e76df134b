"""Serving benchmark (vLLM's benchmark_serving shape), loopback only, bounded in count and time.

    python scripts/bench_serve.py [--model tiny] [--rates 2,4,8,inf] [--requests 64] [--quick]

Starts `python -m paged_jax serve` as a subprocess on 127.0.0.1 (a free port), then for
each request rate sends --requests streaming completions with Poisson arrivals
(rate inf: all at once, the saturation point) from a plain streaming HTTP client: prompts
of random token ids (64-256 tokens), --max-tokens new tokens each (ignore_eos, so every
request generates them all), greedy. Per rate it reports TTFT, TPOT (time per output
token after the first) and ITL (gap between streamed tokens) at p50 and p99, and request
and output-token throughput.

Then the server stops and LLM.generate runs the saturation prompts with the same engine
flags in a fresh process: the server's token throughput at saturation must be >= 90% of it. Writes results/bench_serve_<model>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import numpy as np

from _bench_common import REPO, command_line, machine_info, print_table, write_json

TIME_LIMIT_S = 900  # the whole sweep stops by itself past this
OFFLINE = """
import json, sys, time
from paged_jax import LLM, SamplingParams
args = json.loads(sys.argv[1])
flags = dict(zip(args["flags"][::2], args["flags"][1::2]))
llm = LLM(flags["--model"], max_model_len=int(flags["--max-model-len"]), max_num_seqs=int(flags["--max-num-seqs"]),
          max_num_batched_tokens=int(flags["--max-num-batched-tokens"]), dtype=flags["--dtype"], warm_up="full")
params = SamplingParams(temperature=0, max_tokens=args["max_tokens"], ignore_eos=True)
start = time.perf_counter()
llm.generate(args["prompts"], params, use_tqdm=False)
print(len(args["prompts"]) * args["max_tokens"] / (time.perf_counter() - start))
"""


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def metric(url: str, name: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        for line in response.read().decode().splitlines():
            if line.startswith(name):
                return float(line.rsplit(" ", 1)[1])
    return float("nan")


def offline_vocab(model: str) -> int:
    """The vocabulary size from the tokenizer alone (prompts are random ids below it)."""
    from models.registry import load_tokenizer

    return load_tokenizer(model).vocab_size


def percentile(xs, q):
    return float(np.percentile(xs, q)) if len(xs) else float("nan")


async def run_rate(url: str, model: str, prompts, max_tokens: int, rate: float, seed: int) -> dict:
    # A plain streaming HTTP client, as vLLM's benchmark_serving uses (aiohttp there): the
    # openai client's per-chunk model parsing would cost this 2-core machine more CPU than
    # the server's own work. httpx2 is what the openai client itself is built on.
    import httpx2

    client = httpx2.AsyncClient(timeout=600, limits=httpx2.Limits(max_connections=len(prompts)))
    rng = np.random.default_rng(seed)
    records = []

    async def one(prompt):
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "ignore_eos": True, "return_token_ids": True}
        sent = time.perf_counter()
        times, count = [], 0
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            assert response.status_code == 200, await response.aread()
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                choices = json.loads(line[6:])["choices"]
                n = len(choices[0].get("token_ids") or []) if choices else 0
                if n:
                    times.append(time.perf_counter())
                    count += n
        records.append((sent, times, count))

    start = time.perf_counter()
    tasks = []
    for prompt in prompts:
        tasks.append(asyncio.ensure_future(one(prompt)))
        if np.isfinite(rate):
            await asyncio.sleep(float(rng.exponential(1.0 / rate)))
    await asyncio.wait_for(asyncio.gather(*tasks), TIME_LIMIT_S)
    elapsed = time.perf_counter() - start
    await client.aclose()
    ttft = [times[0] - sent for sent, times, _ in records]
    tpot = [(times[-1] - times[0]) / (count - 1) for _, times, count in records if count > 1]
    itl = [b - a for _, times, _ in records for a, b in zip(times, times[1:])]
    tokens = sum(count for *_, count in records)
    assert all(count == max_tokens for *_, count in records), "a request got fewer tokens than asked"
    return {"rate": rate, "requests": len(records), "elapsed_s": elapsed,
            "request_throughput": len(records) / elapsed, "output_token_throughput": tokens / elapsed,
            **{f"{name}_ms_p{q}": 1e3 * percentile(xs, q) for name, xs in (("ttft", ttft), ("tpot", tpot),
                                                                          ("itl", itl)) for q in (50, 99)}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--rates", default="2,4,8,inf", help="requests per second, comma-separated")
    parser.add_argument("--requests", type=int, default=64, help="requests per rate")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--quick", action="store_true", help="16 requests per rate, rates 4,inf, 32 tokens")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.rates, args.max_tokens = 16, "4,inf", 32
    rates = [float(r) for r in args.rates.split(",")]

    # The server runs as `python -m paged_jax serve` in its own process, as users run it; this
    # process is only the client (the openai client's per-chunk parsing would otherwise share
    # the server's interpreter lock).
    engine_flags = ["--model", args.model, "--max-model-len", "1024", "--max-num-seqs", str(args.max_num_seqs),
                    "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--dtype", "float32"]
    vocab = offline_vocab(args.model)
    rng = np.random.default_rng(args.seed)
    prompt_sets = [[rng.integers(3, vocab - 8, int(rng.integers(64, 257))).tolist() for _ in range(args.requests)]
                   for _ in rates]
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    server = subprocess.Popen([sys.executable, "-m", "paged_jax", "serve", *engine_flags, "--port", str(port)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    rows = []
    try:
        deadline = time.time() + TIME_LIMIT_S
        while not healthy(url):
            if server.poll() is not None or time.time() > deadline:
                raise SystemExit(f"the server did not start:\n{server.stdout.read()}")
            time.sleep(0.5)
        for rate, prompts in zip(rates, prompt_sets):
            rows.append(asyncio.run(run_rate(url, args.model, prompts, args.max_tokens, rate, args.seed)))
            print(f"rate {rate}: {rows[-1]['output_token_throughput']:.1f} tok/s", flush=True)
        compiles = metric(url, "paged_jax:num_compilations")
    finally:
        server.terminate()
        server.wait(60)

    # The offline reference: LLM.generate with the same engine flags on the saturation prompts,
    # in a fresh process of its own (warm-up excluded from the timing).
    saturation = max(rows, key=lambda r: r["rate"])
    prompts = prompt_sets[rows.index(saturation)]
    out = subprocess.run([sys.executable, "-c", OFFLINE, json.dumps({"flags": engine_flags, "prompts": prompts,
                                                                     "max_tokens": args.max_tokens})],
                         env=env, capture_output=True, text=True, check=True)
    offline = float(out.stdout.split()[-1])
    ratio = saturation["output_token_throughput"] / offline

    print_table(f"serving {args.model}: {args.requests} streaming requests per rate, 64-256 prompt tokens, "
                f"{args.max_tokens} new tokens, loopback",
                ["rate req/s", "req/s", "out tok/s", "TTFT p50/p99 ms", "TPOT p50/p99 ms", "ITL p50/p99 ms"],
                [[f"{r['rate']:g}", f"{r['request_throughput']:.2f}", f"{r['output_token_throughput']:.1f}",
                  f"{r['ttft_ms_p50']:.0f} / {r['ttft_ms_p99']:.0f}", f"{r['tpot_ms_p50']:.1f} / {r['tpot_ms_p99']:.1f}",
                  f"{r['itl_ms_p50']:.1f} / {r['itl_ms_p99']:.1f}"] for r in rows])
    print(f"saturation: server {saturation['output_token_throughput']:.1f} tok/s vs LLM.generate {offline:.1f} tok/s "
          f"on the same prompts = {ratio:.0%} (target >= 90%); the server's compilations: {compiles:g}")
    result = {"command": command_line(), "machine": machine_info(), "model": args.model,
              "max_tokens": args.max_tokens, "rows": rows, "offline_tokens_per_s": offline,
              "saturation_vs_offline": ratio}
    write_json(os.path.join(REPO, "results", f"bench_serve_{os.path.basename(args.model)}"
                                             f"{'_quick' if args.quick else ''}.json"), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
