"""How long `python -m paged_jax serve` takes to start: process start to /health 200 and to
the first completion answered, with a cold and a warm persistent compilation cache.

scripts/bench_startup.py times `LLM(...)` in-process; this times what an operator waits for
after (re)starting a server, the engine process's spawn and the HTTP side included, and so
also what `serve --restart-engine` costs after an engine process died (a warm start).

One fresh `serve` subprocess per measurement, each on a free loopback port:
- cold: an empty --compile-cache-dir (a new one for each repetition);
- warm: the same directory again, as the cold run left it.
Each run reports: the "serving" banner, /health 200 and the first completion (1 token)
answered, all in seconds since the process started, and the buckets the banner says it
compiled. The table gives the median of --reps runs.

Usage:
  python scripts/bench_serve_startup.py [--model tiny|smollm2-135m-instruct] [--reps 2]
                                        [--warm-up full|background|none] [--out results/x.json]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench_common import REPO, command_line, machine_info, median, print_table, write_json  # noqa: E402

# Engine flags per model: tiny with serve's defaults; SmolLM2 as scripts/bench_startup.py runs it.
SERVE_ARGS = {
    "tiny": [],
    "smollm2-135m-instruct": ["--max-model-len", "2048", "--max-num-seqs", "32", "--max-num-batched-tokens", "512"],
}
TIMEOUT = 1800.0  # seconds one start may take before the run counts as failed


def cpu_model() -> str:
    """lscpu's model name (the /proc/cpuinfo one where lscpu is missing)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        names = [line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name:")]
        if names:
            return names[0]
    except (OSError, subprocess.TimeoutExpired):
        pass
    return machine_info()["cpu"]


def gguf_on_disk(model: str) -> bool:
    """Whether the named model's GGUF is in the library's model cache (nothing is fetched here)."""
    if model == "tiny":
        return True
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return bool(glob.glob(os.path.join(base, "paged-jax", "models", "SmolLM2-135M-Instruct*.gguf")))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def status(url: str, body: dict | None = None) -> int | None:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            response.read()
            return response.status
    except urllib.error.HTTPError as error:
        return error.code
    except OSError:  # not listening yet: the server listens once warm
        return None


def measure(model: str, cache_dir: str, warm_up: str | None) -> dict:
    """One serve start, from Popen to the first completion; the process is stopped after."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "paged_jax", "serve", "--model", model, "--port", str(port),
            "--compile-cache-dir", cache_dir, *SERVE_ARGS[model], *(["--warm-up", warm_up] if warm_up else [])]
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    lines, banner = [], {}

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if "serving" in line and "banner_s" not in banner:
                banner["banner_s"] = time.perf_counter() - t0
                match = re.search(r"warm: (\d+) buckets", line)
                banner["buckets"] = int(match.group(1)) if match else None

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        while status(f"{url}/health") != 200:
            if proc.poll() is not None or time.perf_counter() - t0 > TIMEOUT:
                sys.exit(f"serve did not start ({' '.join(argv)}):\n{''.join(lines)[-3000:]}")
            time.sleep(0.05)
        health = time.perf_counter() - t0
        code = status(f"{url}/v1/completions", {"model": model, "prompt": "Hello", "max_tokens": 1})
        first = time.perf_counter() - t0
        if code != 200:
            sys.exit(f"the first completion got HTTP {code}:\n{''.join(lines)[-3000:]}")
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(60)
        reader.join(10)
    return {"health_s": health, "first_completion_s": first, **banner}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", choices=list(SERVE_ARGS))
    parser.add_argument("--reps", type=int, default=1, help="cold+warm pairs; the table shows medians")
    parser.add_argument("--warm-up", default=None, choices=["full", "background", "none"],
                        help="serve's --warm-up (default: serve's own, full)")
    parser.add_argument("--out", default=None, help="also write the runs and machine facts as JSON here")
    args = parser.parse_args()
    if args.reps < 1:
        parser.error(f"--reps {args.reps} must be >= 1")
    if not gguf_on_disk(args.model):
        print(f"skipped: {args.model}'s GGUF is not in ~/.cache/paged-jax/models (run it once to fetch it)")
        return
    runs: dict[str, list[dict]] = {"cold": [], "warm": []}
    with tempfile.TemporaryDirectory(prefix="paged_jax_bench_serve_startup_") as tmp:
        for rep in range(args.reps):
            cache_dir = os.path.join(tmp, f"xla-{rep}")
            for phase in ("cold", "warm"):
                run = measure(args.model, cache_dir, args.warm_up)
                runs[phase].append(run)
                print(f"{args.model} {phase} #{rep}: {json.dumps(run)}", flush=True)
    rows = [[args.model, phase, f"{median([r['health_s'] for r in rs]):.1f}",
             f"{median([r['first_completion_s'] for r in rs]):.1f}", str(rs[0].get("buckets")), str(len(rs))]
            for phase, rs in runs.items()]
    cpu = cpu_model()
    print_table(f"serve start-up, s since the process started (warm-up {args.warm_up or 'full'}; {cpu}, "
                f"{os.cpu_count()} cores)",
                ["model", "compile cache", "/health 200", "first completion", "buckets", "runs"], rows)
    if args.out:
        write_json(args.out, {"machine": {**machine_info(), "lscpu_model_name": cpu}, "command": command_line(),
                              "model": args.model, "warm_up": args.warm_up, "runs": runs})


if __name__ == "__main__":
    main()
