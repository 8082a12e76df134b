"""DataParallelEngine as an EngineClient, on 2 host CPU devices (in a subprocess: the device
count is fixed before jax is imported; routing and outputs are tests/test_tensor_parallel.py's).

Checked: the LLM facade and the server see one EngineClient; reset_prefix_cache() is every
replica's (False while one still holds blocks); shutdown() stops every replica's warm-up
thread and the step threads, is idempotent, and later requests are refused."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WORKER = r"""
import json, os, threading
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
from paged_jax import LLM, SamplingParams
from paged_jax.engine_client import EngineClient

def warm_up_threads():
    return sum(t.name == "paged-jax-warm-up" for t in threading.enumerate())

llm = LLM("tiny", data_parallel_size=2, max_model_len=128, block_size=16, max_num_seqs=16,
          max_num_batched_tokens=256, warm_up="background", compile_cache_dir=None, hash_seed=0)
engine = llm.engine
out = {"is_client": isinstance(engine, EngineClient), "max_model_len": engine.max_model_len,
       "eos_token_ids": list(engine.eos_token_ids), "warm_up_threads_at_start": warm_up_threads()}
params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
prompt_a, prompt_b = list(range(3, 40)), list(range(100, 137))  # two full blocks each
llm.generate([prompt_a, prompt_b], params, use_tqdm=False)
out["cached_before_reset"] = [o.metrics.num_cached_tokens for o in llm.generate([prompt_a, prompt_b], params,
                                                                                  use_tqdm=False)]
engine.add_request("running", prompt_a, SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
engine.step()
out["reset_while_running"] = llm.reset_prefix_cache()
engine.abort_request("running")
out["reset_when_idle"] = llm.reset_prefix_cache()
out["cached_after_reset"] = [o.metrics.num_cached_tokens for o in llm.generate([prompt_a, prompt_b], params,
                                                                                 use_tqdm=False)]
llm.shutdown()
out["warm_up_threads_after_shutdown"] = warm_up_threads()
out["step_threads_after_shutdown"] = sum(t.name.startswith("paged-jax-dp") for t in threading.enumerate())
llm.shutdown()
try:
    engine.add_request("late", prompt_a, params)
except RuntimeError as error:
    out["late_request"] = str(error)
print(json.dumps(out))
"""


@pytest.mark.slow
def test_data_parallel_engine_is_an_engine_client():
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", WORKER], env=env, capture_output=True, text=True, timeout=600,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["is_client"] and r["max_model_len"] == 128 and r["eos_token_ids"]
    assert r["warm_up_threads_at_start"] == 2, "each replica should still be compiling in the background"
    assert r["cached_before_reset"] == [32, 32]
    assert r["reset_while_running"] is False  # one replica still holds the running request's blocks
    assert r["reset_when_idle"] is True
    assert r["cached_after_reset"] == [0, 0]
    assert r["warm_up_threads_after_shutdown"] == 0 and r["step_threads_after_shutdown"] == 0
    assert "shut down" in r["late_request"]
