"""Serving benchmark (vLLM's benchmark_serving shape), loopback only, bounded in count and time.

    python scripts/bench_serve.py [--model tiny] [--rates 2,4,8,inf] [--requests 64] [--quick]

Starts `python -m paged_jax serve` as a subprocess on 127.0.0.1 (a free port), then for
each request rate sends --requests streaming completions with Poisson arrivals
(rate inf: all at once) from a plain streaming HTTP client: prompts
of random token ids (64-256 tokens), --max-tokens new tokens each (ignore_eos, so every
request generates them all), greedy. Per rate it reports TTFT, TPOT (time per output
token after the first) and ITL (gap between streamed tokens) at p50 and p99, and request
and output-token throughput.

Then, at saturation (--requests requests at once), the server and LLM.generate (same engine
flags, in a warm process of its own) take --saturation-reps turns on the same prompts: the
server's median token throughput must be >= 90% of LLM.generate's.

Constrained decoding's cost (structured outputs): --guided-reps turns at saturation where the
same requests run free, all guided by a regex that never closes (`[a-z ]+`: every step
computes every mask) and all guided by an open JSON array schema, side by side; the table
gives tok/s and ms per step of each against the free turn. Writes
results/bench_serve_<model>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import socket
import subprocess
import sys
import time
import urllib.request

import numpy as np

from _bench_common import REPO, command_line, machine_info, print_table, write_json

TIME_LIMIT_S = 900  # the whole sweep stops by itself past this
# The offline reference: one warm process that times LLM.generate on each JSON line of
# prompts it reads (one run per line), so server and offline runs can alternate.
OFFLINE = """
import json, os, sys, time
args = json.loads(sys.argv[1])
if args["cpus"]:  # before jax starts its CPU client, as the server's engine process does
    os.sched_setaffinity(0, args["cpus"])
from paged_jax import LLM, SamplingParams
flags = dict(zip(args["flags"][::2], args["flags"][1::2]))
llm = LLM(flags["--model"], max_model_len=int(flags["--max-model-len"]), max_num_seqs=int(flags["--max-num-seqs"]),
          max_num_batched_tokens=int(flags["--max-num-batched-tokens"]), dtype=flags["--dtype"], warm_up="full")
params = SamplingParams(temperature=0, max_tokens=args["max_tokens"], ignore_eos=True)
print("ready", flush=True)
for line in sys.stdin:
    prompts = json.loads(line)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    print(len(prompts) * args["max_tokens"] / (time.perf_counter() - start), flush=True)
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


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds a process has used (Linux /proc), 0 where it is not readable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def server_processes(pid: int) -> list[int]:
    """The server process and the processes it spawned (its engine process)."""
    children = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                children += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return [pid, *children]


def cpu_split(server_pid: int) -> tuple[float, ...]:
    """CPU seconds so far of: the HTTP process, its children (the engine process), this client."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    http, *rest = server_processes(server_pid)
    return process_cpu_s(http), sum(process_cpu_s(c) for c in rest), own.ru_utime + own.ru_stime


def percentile(xs, q):
    return float(np.percentile(xs, q)) if len(xs) else float("nan")


async def stream_completion(host: str, port: int, body: dict, path: str = "/v1/completions") -> tuple[list[float], int]:
    """POSTs one streaming completion over a connection of its own; returns the arrival time of
    each SSE chunk that carried tokens and the number of tokens.

    HTTP/1.1 on asyncio streams, parsing only what a streamed response needs (status line,
    headers, chunked transfer coding, SSE events), as vLLM's benchmark_serving does with
    aiohttp: the client shares this machine with the server, and every microsecond it spends
    per chunk is taken from the server's processes (httpx's per-line iterators cost this
    2-core machine ~0.6 of a core at saturation).

    path: the OpenAI route (events count their choices' token_ids), or llama-server's own
    /completion (events count their `tokens`, with return_tokens in body).
    """
    payload = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(b"POST %s HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\nConnection: close\r\n\r\n" % (path.encode(), host.encode(), port, len(payload))
                     + payload)
        status = await reader.readline()
        headers = (await reader.readuntil(b"\r\n\r\n")).lower()
        if b" 200 " not in status:
            raise AssertionError(f"{status!r}: {await reader.read()!r}")
        if b"transfer-encoding: chunked" not in headers:
            raise AssertionError(f"expected a chunked SSE response, got headers {headers!r}")
        times, count, pending = [], 0, b""
        while size := int((await reader.readline()).split(b";")[0], 16):
            pending += (await reader.readexactly(size + 2))[:-2]  # the chunk and its CRLF
            *events, pending = pending.split(b"\n\n")
            for event in events:
                if event.startswith(b"data: {"):
                    data = json.loads(event[6:])
                    if "choices" in data:
                        n = len(data["choices"][0].get("token_ids") or []) if data["choices"] else 0
                    else:
                        n = len(data.get("tokens") or [])
                    if n:
                        times.append(time.perf_counter())
                        count += n
        return times, count
    finally:
        writer.close()


GUIDED = {  # the extra body fields of each constrained turn (vLLM's names)
    "free": {},
    "regex": {"guided_regex": "[a-z ]+"},
    "json array": {"guided_json": {"type": "array", "items": {"type": "integer"}}},
}


async def run_rate(url: str, model: str, prompts, max_tokens: int, rate: float, seed: int,
                   extra: dict | None = None) -> dict:
    host, port = url.removeprefix("http://").split(":")
    rng = np.random.default_rng(seed)
    records = []

    async def one(prompt):
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "ignore_eos": True, "return_token_ids": True, **(extra or {})}
        sent = time.perf_counter()
        times, count = await stream_completion(host, int(port), body)
        records.append((sent, times, count))

    start = time.perf_counter()
    tasks = []
    for prompt in prompts:
        tasks.append(asyncio.ensure_future(one(prompt)))
        if np.isfinite(rate):
            await asyncio.sleep(float(rng.exponential(1.0 / rate)))
    await asyncio.wait_for(asyncio.gather(*tasks), TIME_LIMIT_S)
    elapsed = time.perf_counter() - start
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
    parser.add_argument("--saturation-requests", type=int, default=None,
                        help="requests of each saturation turn (default --requests); more amortise the ramp-up")
    parser.add_argument("--saturation-reps", type=int, default=3,
                        help="turns of server vs LLM.generate at saturation (medians are compared)")
    parser.add_argument("--reserved-cpus", type=int, default=None,
                        help="the server's --reserved-cpus (default: the server's own, one core while HTTP is busy)")
    parser.add_argument("--quick", action="store_true", help="16 requests per rate, rates 4,inf, 32 tokens")
    parser.add_argument("--guided-reps", type=int, default=2,
                        help="turns of free vs constrained requests at saturation (0 skips them)")
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
    # The offline references, LLM.generate with the same engine flags, each warm in a process of
    # its own: on every core (as a user runs it) and on the cores the server's engine process
    # keeps when it leaves the HTTP process one (--reserved-cpus 1, or the default under load).
    # They and the server take turns on the saturation prompts (the machine is shared).
    allowed = sorted(os.sched_getaffinity(0))
    engine_cpus = allowed[:len(allowed) - (1 if args.reserved_cpus is None else args.reserved_cpus)] or allowed
    offline = {name: subprocess.Popen([sys.executable, "-c", OFFLINE, json.dumps(
        {"flags": engine_flags, "max_tokens": args.max_tokens, "cpus": cpus})], env=env, stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, text=True) for name, cpus in (("all", None), ("engine", engine_cpus))}
    server_flags = [] if args.reserved_cpus is None else ["--reserved-cpus", str(args.reserved_cpus)]
    server = subprocess.Popen([sys.executable, "-m", "paged_jax", "serve", *engine_flags, *server_flags,
                               "--port", str(port)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
    rows, turns, cores, reserved = [], [], [], []
    saturation_prompts = [rng.integers(3, vocab - 8, int(rng.integers(64, 257))).tolist()
                          for _ in range(args.saturation_requests or args.requests)]
    try:
        deadline = time.time() + TIME_LIMIT_S
        while not healthy(url):
            if server.poll() is not None or time.time() > deadline:
                raise SystemExit(f"the server did not start:\n{server.stdout.read()}")
            time.sleep(0.5)
        for process in offline.values():
            assert process.stdout.readline().strip() == "ready", "an offline reference did not start"
        for rate, prompts in zip(rates, prompt_sets):
            rows.append(asyncio.run(run_rate(url, args.model, prompts, args.max_tokens, rate, args.seed)))
            print(f"rate {rate}: {rows[-1]['output_token_throughput']:.1f} tok/s", flush=True)
        for _ in range(args.saturation_reps):
            before, start = cpu_split(server.pid), time.perf_counter()
            served = asyncio.run(run_rate(url, args.model, saturation_prompts, args.max_tokens, float("inf"),
                                          args.seed))["output_token_throughput"]
            # Cores each process kept busy during the server's turn: on a small machine the HTTP
            # process and this client take CPU the engine process then lacks.
            wall = time.perf_counter() - start
            cores.append([(b - a) / wall for a, b in zip(before, cpu_split(server.pid))])
            turn = [served]
            for process in offline.values():
                process.stdin.write(json.dumps(saturation_prompts) + "\n")
                process.stdin.flush()
                turn.append(float(process.stdout.readline()))
            turns.append(tuple(turn))
            reserved.append(metric(url, "paged_jax:engine_reserved_cpus"))
            print(f"saturation: server {turn[0]:.1f} vs LLM.generate {turn[1]:.1f} (all cores), {turn[2]:.1f} "
                  f"(fewer) tok/s; the engine leaves {reserved[-1]:g} core(s) to HTTP", flush=True)
        guided_turns = []
        for _ in range(args.guided_reps):
            turn = {}
            for name, extra in GUIDED.items():
                turn[name] = asyncio.run(run_rate(url, args.model, saturation_prompts, args.max_tokens,
                                                  float("inf"), args.seed, extra))
            guided_turns.append(turn)
            print("constrained: " + ", ".join(f"{name} {r['output_token_throughput']:.1f} tok/s"
                                              for name, r in turn.items()), flush=True)
        compiles = metric(url, "paged_jax:num_compilations")
    finally:
        for process in (server, *offline.values()):
            process.terminate()
            process.wait(60)
    served, generated, generated_pinned = (float(np.median([t[i] for t in turns])) for i in range(3))
    ratio = served / generated

    print_table(f"serving {args.model}: {args.requests} streaming requests per rate, 64-256 prompt tokens, "
                f"{args.max_tokens} new tokens, loopback",
                ["rate req/s", "req/s", "out tok/s", "TTFT p50/p99 ms", "TPOT p50/p99 ms", "ITL p50/p99 ms"],
                [[f"{r['rate']:g}", f"{r['request_throughput']:.2f}", f"{r['output_token_throughput']:.1f}",
                  f"{r['ttft_ms_p50']:.0f} / {r['ttft_ms_p99']:.0f}", f"{r['tpot_ms_p50']:.1f} / {r['tpot_ms_p99']:.1f}",
                  f"{r['itl_ms_p50']:.1f} / {r['itl_ms_p99']:.1f}"] for r in rows])
    cpus = f"cores {engine_cpus[0]}-{engine_cpus[-1]}" if len(engine_cpus) > 1 else f"core {engine_cpus[0]}"
    print_table(f"saturation, {len(saturation_prompts)} requests at once: the server (--reserved-cpus "
                f"{'default' if args.reserved_cpus is None else args.reserved_cpus}) and LLM.generate (same engine "
                f"flags, same prompts, warm; on all {len(allowed)} cores, and on {cpus}) take turns",
                ["turn", "server tok/s", "cores left to HTTP", "LLM.generate tok/s", "ratio",
                 f"LLM.generate on {cpus}", "ratio"],
                [[str(i + 1), f"{a:.1f}", f"{r:g}", f"{b:.1f}", f"{a / b:.0%}", f"{c:.1f}", f"{a / c:.0%}"]
                 for i, ((a, b, c), r) in enumerate(zip(turns, reserved))])
    print_table(f"cores kept busy during the server's saturation turns ({os.cpu_count()} on this machine)",
                ["turn", "HTTP process", "engine process", "benchmark client", "total"],
                [[str(i + 1), *(f"{x:.2f}" for x in c), f"{sum(c):.2f}"] for i, c in enumerate(cores)])
    if guided_turns:
        n = len(saturation_prompts)
        medians = {name: float(np.median([t[name]["output_token_throughput"] for t in guided_turns]))
                   for name in GUIDED}
        tpot = {name: float(np.median([t[name]["tpot_ms_p50"] for t in guided_turns])) for name in GUIDED}
        print_table(f"constrained decoding at saturation, {n} requests at once, medians of {len(guided_turns)} "
                    f"turns (free, then each constrained kind, on the same prompts)",
                    ["requests", "out tok/s", "vs free", "TPOT p50 ms", "extra ms per token"],
                    [[name, f"{medians[name]:.1f}", f"{medians[name] / medians['free']:.0%}", f"{tpot[name]:.1f}",
                      f"{tpot[name] - tpot['free']:+.1f}"] for name in GUIDED])
    print(f"saturation, medians of {len(turns)} turns: server {served:.1f} tok/s vs LLM.generate {generated:.1f} "
          f"tok/s = {ratio:.0%} (target >= 90%); vs LLM.generate on {cpus} {generated_pinned:.1f} tok/s "
          f"= {served / generated_pinned:.0%}; the server's compilations: {compiles:g}")
    result = {"command": command_line(), "machine": machine_info(), "model": args.model,
              "max_tokens": args.max_tokens, "rows": rows, "saturation_turns": turns,
              "saturation_cores_http_engine_client": cores,
              "reserved_cpus_flag": args.reserved_cpus, "engine_reserved_cpus_after_turns": reserved,
              "offline_fewer_cpus": engine_cpus, "server_tokens_per_s": served, "offline_tokens_per_s": generated,
              "saturation_vs_offline": ratio, "offline_engine_cpus_tokens_per_s": generated_pinned,
              "saturation_vs_offline_engine_cpus": served / generated_pinned, "guided_turns": guided_turns}
    suffix = ("" if args.reserved_cpus is None else f"_reserved{args.reserved_cpus}") + ("_quick" if args.quick else "")
    write_json(os.path.join(REPO, "results", f"bench_serve_{os.path.basename(args.model)}{suffix}.json"), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
