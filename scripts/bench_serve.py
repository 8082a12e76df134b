"""Serving benchmark (vLLM's benchmark_serving shape), loopback only, bounded in count and time.

    python scripts/bench_serve.py [--model tiny] [--rates 2,4,8,inf] [--requests 64] [--quick]

Starts `paged_jax serve`'s server in this process on 127.0.0.1 (a free port) over an LLM,
then for each request rate sends --requests streaming completions with Poisson arrivals
(rate inf: all at once, the saturation point) through the official openai client: prompts
of random token ids (64-256 tokens), --max-tokens new tokens each (ignore_eos, so every
request generates them all), greedy. Per rate it reports TTFT, TPOT (time per output
token after the first) and ITL (gap between streamed tokens) at p50 and p99, and request
and output-token throughput.

Then the server stops and LLM.generate runs the saturation prompts on the same engine (its
prefix cache reset, as before every server run): the server's token throughput at
saturation must be >= 90% of it. Writes results/bench_serve_<model>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import sys
import threading
import time

import numpy as np

from _bench_common import REPO, command_line, machine_info, print_table, write_json

TIME_LIMIT_S = 900  # the whole sweep stops by itself past this


def percentile(xs, q):
    return float(np.percentile(xs, q)) if len(xs) else float("nan")


async def run_rate(url: str, model: str, prompts, max_tokens: int, rate: float, seed: int) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", timeout=600, max_retries=0)
    rng = np.random.default_rng(seed)
    records = []

    async def one(prompt):
        sent = time.perf_counter()
        stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True,
                                                                          "return_token_ids": True})
        times, count = [], 0
        async for chunk in stream:
            n = len(chunk.choices[0].model_extra.get("token_ids") or [])
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
    await client.close()
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

    from paged_jax import LLM, SamplingParams
    from paged_jax.server import make_server

    llm = LLM(args.model, max_model_len=1024, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, dtype="float32")
    vocab = llm.engine.model.config.vocab_size
    rng = np.random.default_rng(args.seed)
    prompt_sets = [[rng.integers(3, vocab - 8, int(rng.integers(64, 257))).tolist() for _ in range(args.requests)]
                   for _ in rates]

    server = make_server(llm, model_name=args.model)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    rows = []
    try:
        for rate, prompts in zip(rates, prompt_sets):
            rows.append(asyncio.run(run_rate(url, args.model, prompts, args.max_tokens, rate, args.seed)))
            print(f"rate {rate}: {rows[-1]['output_token_throughput']:.1f} tok/s", flush=True)
    finally:
        server.stop()
        thread.join(60)
        sock.close()
    compiled = llm.stats()["num_compilations"]

    # The offline reference on the same engine and the saturation run's prompts.
    saturation = rows[-1] if not np.isfinite(rows[-1]["rate"]) else max(rows, key=lambda r: r["rate"])
    prompts = prompt_sets[rows.index(saturation)]
    llm.engine.kv_cache_manager.reset_prefix_cache()
    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True), use_tqdm=False)
    offline = len(prompts) * args.max_tokens / (time.perf_counter() - start)
    ratio = saturation["output_token_throughput"] / offline

    print_table(f"serving {args.model}: {args.requests} streaming requests per rate, 64-256 prompt tokens, "
                f"{args.max_tokens} new tokens, loopback",
                ["rate req/s", "req/s", "out tok/s", "TTFT p50/p99 ms", "TPOT p50/p99 ms", "ITL p50/p99 ms"],
                [[f"{r['rate']:g}", f"{r['request_throughput']:.2f}", f"{r['output_token_throughput']:.1f}",
                  f"{r['ttft_ms_p50']:.0f} / {r['ttft_ms_p99']:.0f}", f"{r['tpot_ms_p50']:.1f} / {r['tpot_ms_p99']:.1f}",
                  f"{r['itl_ms_p50']:.1f} / {r['itl_ms_p99']:.1f}"] for r in rows])
    print(f"saturation: server {saturation['output_token_throughput']:.1f} tok/s vs LLM.generate {offline:.1f} tok/s "
          f"on the same prompts = {ratio:.0%} (target >= 90%); compilations after warm-up: "
          f"{llm.stats()['num_compilations'] - compiled}")
    result = {"command": command_line(), "machine": machine_info(), "model": args.model,
              "max_tokens": args.max_tokens, "rows": rows, "offline_tokens_per_s": offline,
              "saturation_vs_offline": ratio}
    write_json(os.path.join(REPO, "results", f"bench_serve_{os.path.basename(args.model)}"
                                             f"{'_quick' if args.quick else ''}.json"), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
