"""One engine across two processes (jax.distributed on 127.0.0.1, gloo CPU collectives),
tensor parallelism 2 over their devices, gives the tokens of one process on one device.

Both sides run the documented command (`python -m paged_jax generate ...`, README "Several
devices and hosts"), greedy, with a shared prompt prefix and a pool small enough to preempt.
The test bounds its time and kills every process it started if anything fails.
"""

import json
import os
import socket
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 240
PROMPTS = ["the cat sat on the mat and then the dog came along to see what was going on there",
           "the cat sat on the mat and then the bird flew over the house",
           "hello world",
           "the cat sat on the mat and then the dog came along to say hi to everyone"]
ARGS = ["generate", "--json", "--model", "tiny", "--max-tokens", "48", "--ignore-eos", "--num-blocks", "12",
        "--max-model-len", "128", "--max-num-seqs", "4", "--max-num-batched-tokens", "32", "--warm-up", "none",
        "--no-compile-cache", *[arg for p in PROMPTS for arg in ("--prompt", p)]]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _parse(stdout: str):
    lines = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    return [line["token_ids"] for line in lines if "token_ids" in line], lines[-1]["summary"]


@pytest.mark.slow
def test_two_processes_tp2_match_one_process():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
           "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}  # one CPU device per process
    command = [sys.executable, "-m", "paged_jax", *ARGS]
    address = f"127.0.0.1:{_free_port()}"
    procs = [subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)]
    procs += [subprocess.Popen([*command, "--tensor-parallel-size", "2", "--coordinator-address", address,
                                "--num-processes", "2", "--process-id", str(i)], env=env, cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    try:
        results = []
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
            assert proc.returncode == 0, f"{proc.args[-1]}: exit {proc.returncode}\n{stderr[-3000:]}"
            results.append(_parse(stdout))
    finally:
        for proc in procs:  # on a timeout or a failure, the rest must not linger (or hang on a collective)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    (single, single_summary), (tp0, summary0), (tp1, _) = results
    assert len(single) == len(PROMPTS) and all(len(t) == 48 for t in single)
    assert tp0 == single, "process 0 of the tp=2 pair differs from one process"
    assert tp1 == single, "process 1 of the tp=2 pair differs from one process"
    # The run exercised preemption and prefix hits, identically in both engines.
    assert single_summary["preemptions"] > 0 and single_summary["prefix_hit_rate"] > 0
    assert (summary0["preemptions"], summary0["prefix_hit_rate"]) == (single_summary["preemptions"],
                                                                       single_summary["prefix_hit_rate"])
